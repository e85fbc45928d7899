"""The adversarial corpus (tests/fixtures/cheats) as a result file: every cheat, caught or not and by what.

    python bench/cheats.py --device cuda --jobs 4 --name cheats_h100
    python bench/cheats.py --device cuda --jobs 4 --no-static --name cheats_nostatic_h100

The rules of "caught" are tests/unit/test_cheats.py's (``Judge.catch``); the honest controls must pass
with the right kind (``check_honest``). On cuda every cheat runs (the CPU ones too); on cpu only the
CPU ones. ``--no-static`` switches the static rules off in the judge (``static_check`` finds nothing),
to show what the dynamic checks catch by themselves: a cheat that only a static rule stops shows up
as got through. Candidates are handed one at a time to ``--jobs`` worker processes (each keeps the goldens of the
tasks it met), so the timed cheats of one worker share the device with the others' work: the speed and baseline verdicts
compare paired ratios within one benchmark, which that load moves together.

Writes ``OUT/NAME.json`` (every cheat: caught, by, how) and ``OUT/NAME.md`` (counts and the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def caught_by(caught: bool, how: str) -> str:
    """Which layer of the judge stopped a cheat, from ``Judge.catch``'s account of it."""
    if not caught:
        return "got through"
    if how.startswith("verify failed at static"):
        return "static rules"
    if how.startswith("verify failed"):
        return "verification"
    if how.startswith("benchmark failed"):
        return "timing"
    if how.startswith("kind is"):
        return "kind profile"
    if how.startswith("passed, flagged"):
        return "flagged in the verdict"
    return "claim not realized"


_JUDGE: dict[str, Any] = {}


def _start_worker(device: str, no_static: bool) -> None:
    """A worker process's one Judge (its goldens are reused by the candidates of a task it gets)."""
    from multiprocessing.util import Finalize

    if no_static:
        from kernelcrew.tools import correctness

        correctness.static_check = lambda source, path="candidate.py": []
    from tests.unit.test_cheats import Judge

    _JUDGE["judge"] = judge = Judge(device)
    Finalize(judge, judge.cleanup, exitpriority=10)


def _judge_one(raw: str, stop_at: float | None) -> dict[str, Any]:
    """One candidate: a cheat caught or not and by what, or an honest control passed or not; none is
    started after the wall-clock time ``stop_at``."""
    from tests.unit.test_cheats import check_honest, label

    judge = _JUDGE["judge"]
    path = Path(raw)
    started = time.monotonic()
    row: dict[str, Any] = {"name": label(path), "honest": path.parent.name == "honest"}
    if stop_at is not None and time.time() > stop_at:
        return {**row, "caught": False, "passed": False, "by": "not run", "how": "out of time", "wall_s": 0}
    try:
        if row["honest"]:
            check_honest(judge, path)
            row.update(passed=True, how="passed with the right kind")
        else:
            caught, how = judge.catch(path)
            row.update(caught=caught, by=caught_by(caught, how), how=how[:400])
    except AssertionError as exc:  # an honest control that did not pass
        row.update(passed=False, how=str(exc)[:400])
    except Exception as exc:  # the judge itself broke: reported, never counted as caught
        row.update(caught=False, passed=False, by="judge error", how=f"{type(exc).__name__}: {exc}"[:400])
    row["wall_s"] = round(time.monotonic() - started, 1)
    print(f"{row['name']}: {row.get('by', row.get('passed'))} ({row['wall_s']} s)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--no-static", action="store_true", help="switch the static rules off")
    parser.add_argument(
        "--wall-limit", type=float, help="seconds after which no candidate starts (the rest: not run)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="cheats")
    args = parser.parse_args()

    import torch
    import triton

    from tests.unit.test_cheats import cheat_files, cheat_meta, honest_files

    devices = None if args.device == "cuda" else args.device
    files = cheat_files(devices) + honest_files(devices)
    # A task's candidates in a row, slowest tasks first, handed out one at a time: a worker that
    # takes the next candidate of a task it has seen reuses that task's golden.
    by_task: dict[str, list[str]] = {}
    for path in files:
        by_task.setdefault(cheat_meta(path)["TASK"], []).append(str(path))
    queue = [p for _task, group in sorted(by_task.items(), key=lambda kv: -len(kv[1])) for p in group]
    started = time.monotonic()
    stop_at = None if args.wall_limit is None else time.time() + args.wall_limit
    with ProcessPoolExecutor(
        max(1, args.jobs), initializer=_start_worker, initargs=(args.device, args.no_static)
    ) as pool:
        futures = [pool.submit(_judge_one, p, stop_at) for p in queue]
        rows = sorted((f.result() for f in futures), key=lambda r: r["name"])
    cheats = [r for r in rows if not r["honest"]]
    honest = [r for r in rows if r["honest"]]
    counts = Counter(r["by"] for r in cheats)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    record = {
        "device": device,
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "command": " ".join(["python", "bench/cheats.py", *sys.argv[1:]]),
        "static_rules": not args.no_static,
        "cheats": len(cheats),
        "caught": sum(1 for r in cheats if r["caught"]),
        "caught_by": dict(counts),
        "honest_controls": {"passed": sum(1 for r in honest if r["passed"]), "of": len(honest)},
        "wall_s": round(time.monotonic() - started, 1),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    rules = "on" if record["static_rules"] else "off (`--no-static`: what the dynamic checks catch alone)"
    lines = [
        f"# The adversarial corpus on {args.device} (bench/cheats.py)\n",
        f"{device}; Python {record['versions']['python']}, torch {record['versions']['torch']}, "
        f"Triton {record['versions']['triton']}. Static rules: {rules}.\n",
        f"Command: `{record['command']}` ({record['wall_s']:.0f} s).\n",
        f"{record['caught']} of {record['cheats']} cheats caught. Honest controls: "
        f"{record['honest_controls']['passed']} of {record['honest_controls']['of']} passed.\n",
        "What caught them: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()) + ".\n",
        "| candidate | result | how |",
        "|---|---|---|",
    ]
    for r in rows:
        result = ("passed" if r["passed"] else "FAILED") if r["honest"] else r["by"]
        how = r["how"].replace("|", "/").replace("\n", " ")[:160]
        lines.append(f"| `{r['name']}` | {result} | {how} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))


if __name__ == "__main__":
    main()
