"""Do the playbook's own kernels verify across KernelBench? Measured on a CPU (Triton's interpreter).

    python bench/playbook_cpu.py [--root ../shared/kernelbench] [--counts 20 30 10] [--seed 31]
                                 [--jobs 1] [--timeout 120] [--tasks NAME ...] [--name playbook_cpu]

``bench/coverage.py`` counts the tasks a strategy *generates* a candidate for; this counts the
candidates that *verify*. For the seeded stratified sample of ``bench/kernelbench.py`` (same
``sample``/``stratum``), each task is copied, shrunk (below), into a temporary folder; the
playbook analyses the shrunk task, and every applicable own-kernel strategy (``source_kind``
``kernel``: the candidate's verdict says ``kernel`` or ``hybrid``) generates its candidate with the
first configuration of its tuning space for ``--arch`` (default ``sm_90``: what an H100 run tries
first). The candidate goes through the whole verification protocol
(:func:`kernelcrew.tools.correctness.verify`, one golden per task) on the CPU, where Triton runs
in its interpreter. Writes ``bench/results/<name>.json`` and ``.md``: a row per task and
candidate, the counts by level and stratum, and the failures grouped by strategy and stage.

Shrinking. KernelBench's shapes are sized for a GPU; the interpreter runs a kernel's every
program in Python. Module-level integer constants (``name = <int>``, chained ``a = b = <int>``,
tuple unpacking ``h, w = 32, 32``, arithmetic of literals ``2048 * 2``, and tuples of literals
``input_shape = (32768,)``) are rewritten:

* a value below 16, and any constant named like a kernel size, stride, padding, dilation or group
  count, stays as it is;
* another value ``v`` becomes ``max(4, v // F)``, or ``max(4, v // F**2)`` from 16384 up (batch
  times a 393216-wide row is still too much at ``v // F``);
* where one original constant divides another, the shrunk multiple is rounded up to a multiple
  of the shrunk divisor (channels stay divisible by groups and heads, a dim by its chunk size);
  a batch size (named so) is neither the multiple nor the divisor (1024 rows are a multiple of
  512 groups by chance, 240 channels of a batch of 10);
* a multiple of 4 stays one (a bottleneck's ``out_channels // 4`` is written in the module).

``F`` is 16, then 4 where the model or its inputs fail to build or run at ``F = 16`` (a deep
network whose poolings need room); a task that fails at both is reported as "shrink failed" and
not counted. Odd sizes stay odd more often than not (``4095 // 16 = 255``), so masking is still
exercised. The task files are trusted here (they are built in this process to check the shrink):
point ``--root`` only at a KernelBench checkout.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kernelbench import DEFAULT_COUNTS, DEFAULT_SEED, sample  # noqa: E402

#: Constants left as they are whatever their value: the geometry of a window, not a size.
KEEP = re.compile(r"kernel|stride|pad|dilation|group", re.IGNORECASE)
#: Constants neither rounded up for divisibility nor rounded to: a batch size divides nothing.
BATCH = re.compile(r"batch", re.IGNORECASE)
#: A constant that was a multiple of this stays one: modules divide channels by 2 or 4 in code.
ALIGN = 4
#: Shrink factors tried in turn.
FACTORS = (16, 4)
#: Values below this stay as they are.
SMALL = 16
#: From this value up, a constant is divided by the factor squared.
LARGE = 16384
#: Seconds to build a shrunk model and run its forward once.
CHECK_TIMEOUT_S = 60


# ----------------------------------------------------------------------------------------------
# The shrink rewrite
# ----------------------------------------------------------------------------------------------


def _int_value(node: ast.AST) -> int | None:
    """The value of an integer literal or of arithmetic on integer literals; None otherwise."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_value(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp):
        left, right = _int_value(node.left), _int_value(node.right)
        if left is None or right is None:
            return None
        ops = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right, ast.Mult: lambda: left * right}
        if type(node.op) in ops:
            return ops[type(node.op)]()
        if isinstance(node.op, ast.FloorDiv) and right:
            return left // right
        if isinstance(node.op, ast.Pow) and 0 <= right <= 64:
            return left**right
    return None


def _sites(tree: ast.Module) -> list[tuple[str, ast.AST, int]]:
    """``(name, value node, value)`` of every module-level integer constant (see the docstring)."""
    found = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assign):
            continue
        for target in stmt.targets:
            if isinstance(target, ast.Name):
                value = _int_value(stmt.value)
                if value is not None:
                    found.append((target.id, stmt.value, value))
                elif isinstance(stmt.value, ast.Tuple):  # a shape: each element on its own
                    for i, elt in enumerate(stmt.value.elts):
                        v = _int_value(elt)
                        if v is not None:
                            found.append((f"{target.id}[{i}]", elt, v))
            elif isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                for t, elt in zip(target.elts, stmt.value.elts, strict=False):
                    v = _int_value(elt)
                    if isinstance(t, ast.Name) and v is not None:
                        found.append((t.id, elt, v))
    return found


class _Replace(ast.NodeTransformer):
    """Puts a new integer literal in place of each value node named in ``values`` (by id)."""

    def __init__(self, values: dict[int, int]) -> None:
        self.values = values

    def visit(self, node: ast.AST) -> ast.AST:
        if id(node) in self.values:
            return ast.copy_location(ast.Constant(self.values[id(node)]), node)
        return super().visit(node)


def shrunk_value(name: str, value: int, factor: int) -> int:
    """One constant's new value before divisibility is restored."""
    if value < SMALL or KEEP.search(name):
        return value
    return max(4, value // (factor * factor if value >= LARGE else factor))


def shrink(source: str, factor: int = FACTORS[0]) -> tuple[str, dict[str, list[int]]]:
    """The task source with its integer constants shrunk by ``factor``, and ``{name: [old, new]}``
    of those that changed."""
    tree = ast.parse(source)
    sites = _sites(tree)
    originals = {}
    for name, _, value in sites:  # the last assignment of a name wins, as when the file runs
        originals[name] = value
    new = {n: shrunk_value(n, v, factor) for n, v in originals.items()}
    # Restore divisibility from the smallest constant up, so every divisor is final when used.
    for name in sorted(originals, key=lambda n: (originals[n], n)):
        old = originals[name]
        if new[name] == old or BATCH.search(name):
            continue
        step = ALIGN if old % ALIGN == 0 else 1
        for other, v in originals.items():
            if other != name and 1 < v < old and old % v == 0 and new[other] > 1 and not BATCH.search(other):
                step = math.lcm(step, new[other])
        if step > 1:
            new[name] = -(-new[name] // step) * step
    replace = {id(node): new[name] for name, node, value in sites if originals[name] == value}
    tree = _Replace(replace).visit(tree)
    ast.fix_missing_locations(tree)
    changed = {n: [originals[n], new[n]] for n in originals if new[n] != originals[n]}
    return ast.unparse(tree) + "\n", changed


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def check_shrunk(source: str, path: str) -> str:
    """Empty when the shrunk task builds its model and inputs and runs its forward; else why not."""
    import torch

    from kernelcrew.task import load_task

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CHECK_TIMEOUT_S)
    try:
        task = load_task(source, path=path)
        torch.manual_seed(0)
        model = task.model_cls(*task.get_init_inputs()).eval()
        inputs = task.get_inputs()
        with torch.no_grad():
            model(*inputs)
    except _Timeout:
        return f"forward took over {CHECK_TIMEOUT_S} s"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        signal.alarm(0)
    return ""


# ----------------------------------------------------------------------------------------------
# One task
# ----------------------------------------------------------------------------------------------


def _first_line(text: str) -> str:
    return next((line for line in str(text).splitlines() if line.strip()), "")[:240]


def run_task(entry: dict[str, Any], root: Path, work: Path, arch: str, timeout_s: float) -> dict[str, Any]:
    """One task's row: the shrink, the analysis, each own-kernel candidate and its verdict."""
    from kernelcrew.agents import playbook
    from kernelcrew.config import Settings
    from kernelcrew.task import TaskError
    from kernelcrew.tools.correctness import make_golden, verify

    started = time.monotonic()
    row: dict[str, Any] = {**entry, "status": "", "candidates": []}
    source = (root / entry["file"]).read_text()
    path = work / f"{entry['task']}.py"
    why = ""
    for factor in FACTORS:
        shrunk, changed = shrink(source, factor)
        path.write_text(shrunk)
        why = check_shrunk(shrunk, str(path))
        if not why:
            row.update(factor=factor, changed=changed)
            break
    else:
        row.update(status="shrink failed", message=why, seconds=round(time.monotonic() - started, 1))
        return row

    settings = Settings(sandbox_timeout_s=timeout_s)
    try:
        analysis = playbook.analyze(shrunk, str(path), settings=settings)
    except TaskError as exc:
        row.update(status="analysis failed", message=_first_line(exc))
        row["seconds"] = round(time.monotonic() - started, 1)
        return row
    found = [s for s, _ in playbook.applicable(analysis)]
    own = [s for s in found if s.source_kind == "kernel"]
    row["applicable"] = [s.name for s in found]
    if not own:
        rejected = playbook.rejected(analysis)
        row.update(status="no own-kernel strategy", message=_first_line(rejected.get("anchored_fusion", "")))
        row["seconds"] = round(time.monotonic() - started, 1)
        return row

    golden = None
    try:
        for strategy in own:
            t0 = time.monotonic()
            cand: dict[str, Any] = {"strategy": strategy.name, "generated": False}
            row["candidates"].append(cand)
            try:
                params = playbook.tuning_space(strategy.name, analysis, arch)[0]
                cand["params"] = params
                text = playbook.generate(strategy.name, shrunk, analysis, params)
            except Exception as exc:  # a generator that raises is a finding of this bench: a row
                cand.update(
                    why=f"{type(exc).__name__}: {_first_line(exc)}", seconds=round(time.monotonic() - t0, 1)
                )
                continue
            cand["generated"] = True
            if golden is None:  # one per task, made only where a candidate needs it
                try:
                    golden = make_golden(shrunk, device="cpu", seed=0, task_path=str(path), settings=settings)
                except TaskError as exc:  # the task's reference, not a candidate
                    row.update(status="golden failed", message=_first_line(exc))
                    break
            cand_path = work / f"{entry['task']}_{strategy.name}.py"
            cand_path.write_text(text)
            try:
                v = verify(
                    shrunk,
                    text,
                    golden=golden,
                    task_path=str(path),
                    candidate_path=str(cand_path),
                    settings=settings,
                )
                cand.update(verdict=v.verdict, stage=v.stage, message=_first_line(v.message), kind=v.kind)
            except Exception as exc:  # the judge could not judge (a row too, never the end of the run)
                cand.update(
                    verdict="error", stage="harness", message=f"{type(exc).__name__}: {_first_line(exc)}"
                )
            cand["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        if golden is not None:
            golden.cleanup()
    if not row["status"]:
        row["status"] = (
            "verified"
            if any(c.get("verdict") == "pass" for c in row["candidates"])
            else ("generated" if any(c["generated"] for c in row["candidates"]) else "not generated")
        )
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


# ----------------------------------------------------------------------------------------------
# Summary and tables
# ----------------------------------------------------------------------------------------------


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counted = [r for r in rows if r["status"] != "shrink failed"]
    return {
        "tasks": len(rows),
        "shrink_failed": len(rows) - len(counted),
        "own_kernel_applicable": sum(bool(r["candidates"]) for r in counted),
        "generated": sum(any(c["generated"] for c in r["candidates"]) for r in counted),
        "verified": sum(r["status"] == "verified" for r in counted),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_level: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_stratum: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_level[f"level{r['level']}"].append(r)
        by_stratum[f"level{r['level']}/{r['stratum']}"].append(r)
    failures: dict[str, dict[str, Any]] = {}
    for r in rows:
        for c in r["candidates"]:
            if c.get("verdict") == "pass":
                continue
            key = f"{c['strategy']} / {c.get('stage') or 'not generated'}"
            slot = failures.setdefault(key, {"count": 0, "tasks": [], "example": ""})
            slot["count"] += 1
            slot["tasks"].append(r["task"])
            slot["example"] = slot["example"] or c.get("message") or c.get("why", "")
    per_strategy: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        for c in r["candidates"]:
            s = per_strategy[c["strategy"]]
            s["applicable"] += 1
            s["generated"] += c["generated"]
            s["verified"] += c.get("verdict") == "pass"
    return {
        "all": _counts(rows),
        "by_level": {k: _counts(v) for k, v in sorted(by_level.items())},
        "by_stratum": {k: _counts(v) for k, v in sorted(by_stratum.items())},
        "by_strategy": {k: dict(v) for k, v in sorted(per_strategy.items())},
        "failures": dict(sorted(failures.items(), key=lambda kv: -kv[1]["count"])),
        "statuses": dict(Counter(r["status"] for r in rows).most_common()),
    }


def markdown(data: dict[str, Any]) -> str:
    s = data["summary"]
    head = "| | tasks | shrink failed | own kernel applicable | generated | verified |"
    rule = "|---|---|---|---|---|---|"

    def line(name: str, c: dict[str, int]) -> str:
        cols = ("tasks", "shrink_failed", "own_kernel_applicable", "generated", "verified")
        return f"| {name} | " + " | ".join(str(c[k]) for k in cols) + " |"

    out = [
        "# Do the playbook's own kernels verify? KernelBench on a CPU",
        "",
        f"`{data['command']}`: {data['device']}; torch {data['versions'].get('torch')}, Triton "
        f"{data['versions'].get('triton')}; tuning space of {data['arch']} (first configuration); "
        f"sample seed {data['seed']}, counts {data['counts']}; {data['wall_s']:.0f} s in all.",
        "",
        "Each task shrunk (module docstring of `bench/playbook_cpu.py`), analysed by the playbook; every "
        "applicable own-kernel strategy's candidate verified by the full protocol on the CPU (Triton "
        "interpreter). A shrunk task that fails to build is not counted.",
        "",
        "## Summary",
        "",
        head,
        rule,
        line("all", s["all"]),
        *(line(k, v) for k, v in s["by_level"].items()),
        "",
        "By strategy (candidates): "
        + "; ".join(
            f"{k}: applicable {v.get('applicable', 0)}, generated {v.get('generated', 0)}, "
            f"verified {v.get('verified', 0)}"
            for k, v in s["by_strategy"].items()
        ),
        "",
        "Task statuses: " + ", ".join(f"{k} {v}" for k, v in s["statuses"].items()),
        "",
        "## Failures by strategy and stage",
        "",
        "| strategy / stage | count | example message | tasks |",
        "|---|---|---|---|",
    ]
    for key, f in s["failures"].items():
        msg = f["example"].replace("|", "\\|")[:160]
        out.append(f"| {key} | {f['count']} | {msg} | {', '.join(f['tasks'][:6])} |")
    out += ["", "## By stratum", "", head, rule, *(line(k, v) for k, v in s["by_stratum"].items())]
    out += [
        "",
        "## Tasks",
        "",
        "| task | stratum | F | status | strategy: verdict (stage) s | message |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        cands = "; ".join(
            f"{c['strategy']}: "
            + (
                f"{c.get('verdict')} ({c.get('stage') or '-'}) {c.get('seconds', 0):.0f}"
                if c["generated"]
                else "not generated"
            )
            for c in r["candidates"]
        )
        msg = next(
            (c.get("message") or c.get("why", "") for c in r["candidates"] if c.get("verdict") != "pass"),
            r.get("message", ""),
        )
        msg = (msg or "").replace("|", "\\|")[:120]
        out.append(
            f"| {r['task']} | {r['stratum']} | {r.get('factor', '-')} | {r['status']} | {cands or '-'} | {msg} |"
        )
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _worker(args: tuple[dict[str, Any], Path, Path, str, float]) -> dict[str, Any]:
    return run_task(*args)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    roots = [ROOT.parent / "shared" / "kernelbench", ROOT.parents[1] / "shared" / "kernelbench"]
    ap.add_argument("--root", type=Path, default=next((r for r in roots if r.is_dir()), roots[0]))
    ap.add_argument("--counts", type=int, nargs=3, default=list(DEFAULT_COUNTS), help="tasks per level 1-3")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--arch", default="sm_90", help="the tuning space whose first configuration is used")
    ap.add_argument("--jobs", type=int, default=1, help="tasks at once (each verifies in its own children)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per sandbox child (a candidate)")
    ap.add_argument("--tasks", nargs="*", default=None, help="only these sample tasks (l1_19_ReLU ...)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="playbook_cpu")
    args = ap.parse_args(argv)

    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kernelcrew.tools import hardware

    torch.set_num_threads(1)
    entries = sample(args.root, tuple(args.counts), args.seed)
    if args.tasks:
        entries = [e for e in entries if e["task"] in set(args.tasks)]
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kc-playbook-cpu-") as tmp:
        jobs = [(e, args.root, Path(tmp), args.arch, args.timeout) for e in entries]
        if args.jobs > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(args.jobs) as pool:
                results = pool.map(_worker, jobs)
                for row in results:
                    rows.append(row)
                    print(_progress(row), flush=True)
        else:
            for job in jobs:
                rows.append(_worker(job))
                print(_progress(rows[-1]), flush=True)
    info = hardware.detect("cpu")
    data = {
        "command": " ".join(
            ["python", "bench/playbook_cpu.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "device": info.name,
        "versions": hardware.versions(),
        "arch": args.arch,
        "seed": args.seed,
        "counts": args.counts,
        "wall_s": round(time.monotonic() - t0, 1),
        "summary": summarize(rows),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(data))
    print(json.dumps(data["summary"]["all"]))
    return data


def _progress(row: dict[str, Any]) -> str:
    cands = ", ".join(f"{c['strategy']}={c.get('verdict', 'not generated')}" for c in row["candidates"])
    return f"{row['task']}: {row['status']} {row.get('seconds', 0)} s {cands} {row.get('message', '')[:100]}"


if __name__ == "__main__":
    main()
