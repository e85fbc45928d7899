"""What the judge costs: wall time of ``kernelcrew verify`` with this tree against a base tree.

    python bench/verify_cost.py --base BASE_DIR --out bench/results --name verify_cost_h100

``BASE_DIR`` holds another version's ``kernelcrew/`` package (for example ``git archive REV
kernelcrew | tar -x -C BASE_DIR``). The two versions run the same verify command in turns (base,
this, base, this, ...), so drift hits both alike; each run is a fresh process, as a user's command
is. Writes ``NAME.json`` (every run: wall seconds, verdict, kind, timed speedup) and ``NAME.md``
(medians and spreads, the overhead of this tree over the base).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(tree: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    cmd = [
        sys.executable,
        "-m",
        "kernelcrew",
        "verify",
        str(Path(args.task).resolve()),
        str(Path(args.candidate).resolve()),
        "--device",
        args.device,
        "--compile-modes",
        args.compile_modes,
        "--json",
    ]
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=tree,  # python -m imports from its working directory first
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.monotonic() - started
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = {"verdict": "error", "message": proc.stderr[-2000:]}
    speedup = report.get("speedup") or {}
    return {
        "wall_s": round(wall, 3),
        "exit": proc.returncode,
        "verdict": report.get("verdict"),
        "kind": report.get("kind"),
        "speedup": speedup.get("median") if isinstance(speedup, dict) else speedup,
        "candidate_ms": report.get("candidate_ms"),
        "baseline_ms": report.get("baseline_ms"),
        "message": report.get("message", "")[:300],
        "phase_s": report.get("phase_s"),
    }


def summary(walls: list[float]) -> dict:
    return {
        "median_s": statistics.median(walls),
        "min_s": min(walls),
        "max_s": max(walls),
        "n": len(walls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", required=True, type=Path, help="folder holding the base version's kernelcrew/"
    )
    parser.add_argument("--task", default="examples/softmax.py")
    parser.add_argument("--candidate", default="examples/softmax_triton.py")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-modes", default="none")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="verify_cost")
    args = parser.parse_args()

    import torch

    runs: dict[str, list[dict]] = {"base": [], "this": []}
    trees = {"base": args.base.resolve(), "this": ROOT}
    one_run(trees["this"], args)  # warm the build caches and the bytecode of both before timing
    one_run(trees["base"], args)
    for _ in range(args.reps):
        for name in ("base", "this"):
            runs[name].append(one_run(trees[name], args))
            print(name, runs[name][-1], flush=True)
    stats = {name: summary([r["wall_s"] for r in rs]) for name, rs in runs.items()}
    overhead = stats["this"]["median_s"] / stats["base"]["median_s"] - 1
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record = {
        "device": device,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "command": f"kernelcrew verify {args.task} {args.candidate} --device {args.device} "
        f"--compile-modes {args.compile_modes} --json",
        "stats": stats,
        "overhead": overhead,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# What the judge costs: `kernelcrew verify` wall time, this version against the base\n",
        f"{device}; Python {record['versions']['python']}, torch {record['versions']['torch']}.\n",
        f"Command: `{record['command']}`, {args.reps} runs of each version in turns after one warm-up run.\n",
        "| version | median s | min s | max s | verdicts | speedups |",
        "|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        s = stats[name]
        verdicts = ", ".join(sorted({f"{r['verdict']} ({r['kind']})" for r in rs}))
        speedups = ", ".join(f"{r['speedup']:.2f}" for r in rs if isinstance(r["speedup"], (int, float)))
        lines.append(
            f"| {name} | {s['median_s']:.1f} | {s['min_s']:.1f} | {s['max_s']:.1f} | {verdicts} | {speedups} |"
        )
    lines.append(f"\nOverhead of this version over the base (medians): {overhead * 100:+.1f} %.")
    phases = [r["phase_s"] for r in runs["this"] if r.get("phase_s")]
    if phases:
        names = list(phases[0])
        medians = {n: statistics.median(p.get(n, 0.0) for p in phases) for n in names}
        lines.append(
            "\nThis version's phases (median s): " + ", ".join(f"{n} {v:.1f}" for n, v in medians.items())
        )
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
