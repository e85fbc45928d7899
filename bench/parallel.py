"""Parallel evaluation's throughput: candidates verified and timed per GPU-minute and per minute of
wall time, one step at a time on one GPU against a round of steps side by side on several.

Each task runs ``kernelcrew optimize`` twice with the same seed, steps and time budget: with
``--parallel 1`` on the first GPU listed, and with ``--parallel N`` on all N GPUs. The one-GPU runs
of two tasks share the host at once (one per GPU), as the N-GPU runs share it between their
evaluations, so both see about the same CPU load. From each run's ``report.json``:

* ``evaluated``: steps whose candidate was verified and timed (a time in its record);
* ``steps_s``: the steps' wall time (from the baseline's end to the last step's; the baseline and the
  final timing run once either way and are left out);
* per GPU-minute = evaluated / (steps_s / 60 x GPUs), per wall-minute = evaluated / (steps_s / 60);
* the answer's speedup over eager and the whole run's wall time.

    python bench/parallel.py bench/suite/rmsnorm_llama_bf16.py ... --gpus 0,1 --name parallel_h200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def optimize(task: Path, out: Path, gpus: str, parallel: int, args: argparse.Namespace) -> dict[str, Any]:
    """One ``kernelcrew optimize`` run on ``gpus``; its row (or its error)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "KERNELCREW_DATA_DIR": str(out / "data")}
    cmd = [
        sys.executable,
        "-m",
        "kernelcrew",
        "optimize",
        str(task),
        "--device",
        args.device,
        "--backend",
        "playbook",
        "--no-kb",
        "--parallel",
        str(parallel),
        "--max-iters",
        str(args.max_iters),
        "--patience",
        str(args.max_iters),
        "--time-budget",
        str(args.time_budget),
        "--seed",
        str(args.seed),
        "--out",
        str(out / "run"),
    ]
    t0 = time.monotonic()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    wall = time.monotonic() - t0
    row: dict[str, Any] = {"task": task.stem, "gpus": len(gpus.split(",")), "parallel": parallel}
    report_path = out / "run" / "report.json"
    if proc.returncode != 0 or not report_path.exists():
        return {**row, "error": f"exit {proc.returncode}", "wall_s": round(wall, 1)}
    report = json.loads(report_path.read_text())
    steps = [r for r in report.get("iterations", []) if not r.get("fallback")]
    budget = report.get("budget") or {}
    evaluated = sum(1 for r in steps if r.get("time_ms") is not None)
    steps_s = float(budget.get("steps_s") or 0.0)
    best = report.get("best") or {}
    return {
        **row,
        "steps": len(steps),
        "evaluated": evaluated,
        "rounds": len({r.get("round", r.get("step")) for r in steps}),
        "steps_s": round(steps_s, 1),
        "per_gpu_minute": round(evaluated / (steps_s / 60 * row["gpus"]), 2) if steps_s else None,
        "per_wall_minute": round(evaluated / (steps_s / 60), 2) if steps_s else None,
        "best_speedup_eager": best.get("speedup_eager"),
        "best_strategy": best.get("strategy"),
        "stop_reason": report.get("stop_reason"),
        "wall_s": round(wall, 1),
    }


def summarize(rows: list[dict[str, Any]], parallel: int) -> dict[str, Any]:
    """Medians and spreads (min, max) per setting, over the tasks both settings ran."""
    ok = {(r["task"], r["parallel"]): r for r in rows if "error" not in r}
    tasks = sorted({t for t, p in ok if (t, 1) in ok and (t, parallel) in ok})
    out: dict[str, Any] = {"tasks": len(tasks)}
    for p in (1, parallel):
        for key in ("per_gpu_minute", "per_wall_minute", "evaluated", "steps_s", "wall_s"):
            values = [ok[(t, p)][key] for t in tasks if ok[(t, p)].get(key) is not None]
            if values:
                out[f"p{p}_{key}"] = {
                    "median": round(statistics.median(values), 2),
                    "min": round(min(values), 2),
                    "max": round(max(values), 2),
                }
    return out


def markdown(data: dict[str, Any]) -> str:
    p = data["settings"]["parallel"]
    lines = [
        f"# Parallel evaluation on {data['device']}",
        "",
        f"torch {data['versions'].get('torch')}, triton {data['versions'].get('triton')}; "
        f"{data['settings']['max_iters']} steps, {data['settings']['time_budget_s']:g} s budget, "
        f"seed {data['settings']['seed']}, playbook. One GPU one step at a time against {p} GPUs "
        f"with {p} steps side by side.",
        "",
        "| task | GPUs | steps | evaluated | rounds | steps s | per GPU-min | per wall-min | best x eager | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['task']} | {r['gpus']} | error: {r['error']} | | | | | | | {r['wall_s']} |")
            continue
        best = f"{r['best_speedup_eager']:.2f}" if r.get("best_speedup_eager") else "-"
        lines.append(
            f"| {r['task']} | {r['gpus']} | {r['steps']} | {r['evaluated']} | {r['rounds']} | "
            f"{r['steps_s']} | {r['per_gpu_minute']} | {r['per_wall_minute']} | {best} | {r['wall_s']} |"
        )
    s = data["summary"]
    lines += ["", f"Summary over {s['tasks']} tasks (median, min-max):", ""]
    for key in ("per_gpu_minute", "per_wall_minute", "steps_s", "wall_s"):
        cells = []
        for q in (1, p):
            v = s.get(f"p{q}_{key}")
            if v:
                cells.append(f"parallel {q}: {v['median']} ({v['min']}-{v['max']})")
        lines.append(f"- {key}: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tasks", nargs="+", type=Path)
    parser.add_argument("--gpus", default="0,1", help="GPUs to use (the first runs the one-GPU runs)")
    parser.add_argument("--max-iters", type=int, default=6)
    parser.add_argument("--time-budget", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    parser.add_argument("--out", type=Path, default=Path("bench-out/parallel"))
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="parallel")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from kernelcrew.tools import hardware

    gpus = [g for g in args.gpus.split(",") if g]
    info = hardware.detect(args.device)
    data: dict[str, Any] = {
        "device": info.name,
        "model": info.model,
        "versions": hardware.versions(),
        "settings": {
            "max_iters": args.max_iters,
            "time_budget_s": args.time_budget,
            "seed": args.seed,
            "parallel": len(gpus),
        },
        "command": " ".join(sys.argv),
        "rows": [],
    }
    args.results.mkdir(parents=True, exist_ok=True)

    lock = threading.Lock()

    def save(row: dict[str, Any]) -> None:  # after every run: a stopped call keeps what ended
        with lock:
            _save(row)

    def _save(row: dict[str, Any]) -> None:
        data["rows"] = sorted([*data["rows"], row], key=lambda r: (r["task"], r["parallel"]))
        data["summary"] = summarize(data["rows"], len(gpus))
        (args.results / f"{args.name}.json").write_text(json.dumps(data, indent=2, default=str))
        (args.results / f"{args.name}.md").write_text(markdown(data))

    # one step at a time: as many tasks at once as GPUs, each GPU its share in turn
    def share(i: int) -> None:
        for task in args.tasks[i :: len(gpus)]:
            save(optimize(task, args.out / f"{task.stem}-p1", gpus[i], 1, args))

    with ThreadPoolExecutor(len(gpus)) as pool:
        list(pool.map(share, range(len(gpus))))
    # side by side: one task at a time on every GPU
    for task in args.tasks:
        save(optimize(task, args.out / f"{task.stem}-p{len(gpus)}", ",".join(gpus), len(gpus), args))
    print(markdown(data))


if __name__ == "__main__":
    main()
