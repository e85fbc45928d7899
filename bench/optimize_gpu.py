"""GPU evidence for the crew: `kernelcrew optimize` with the offline playbook on the examples.

Runs each example task through the whole workflow (profile, plan, code, verify, profile, decide,
finalize) on the GPU and collects the reports. Writes ``optimize_h100.json`` and
``optimize_h100.md`` to the folder given (default bench/results).

    python bench/optimize_gpu.py [OUT_DIR] [--tasks a,b] [--max-iters N] [--time-budget S]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ["elementwise_chain", "softmax", "layer_norm", "matmul_epilogue", "conv_block"]


def run_task(name: str, out_dir: Path, max_iters: int, budget: float) -> dict:
    run_out = out_dir / name
    cmd = [sys.executable, "-m", "kernelcrew", "optimize", f"examples/{name}.py", "--device", "cuda"]
    cmd += [
        "--backend",
        "playbook",
        "--max-iters",
        str(max_iters),
        "--time-budget",
        str(budget),
        "--out",
        str(run_out),
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget + 400)
    wall = time.monotonic() - started
    report_path = run_out / "report.json"
    if not report_path.exists():
        return {"task": name, "error": (proc.stderr or proc.stdout)[-1500:], "wall_s": round(wall, 1)}
    report = json.loads(report_path.read_text())
    best = report.get("best") or {}
    base = report["baseline"]
    compiled = base.get("compile_ms") or {}
    return {
        "task": name,
        "status": report["status"],
        "stop_reason": report["stop_reason"],
        "eager_ms": best.get("eager_ms") or base.get("eager_ms"),
        "compile_ms": best.get("compile_ms") or compiled,
        "best_ms": best.get("best_ms"),
        "speedup_eager": best.get("speedup_eager"),
        "speedup_eager_ci": best.get("speedup_eager_ci"),
        "speedup_compile": best.get("speedup_compile"),
        "strategy": best.get("strategy"),
        "params": best.get("params"),
        "kind": best.get("kind"),
        "iterations": len(report["iterations"]),
        "steps": [
            {
                k: it.get(k)
                for k in (
                    "step",
                    "strategy",
                    "params",
                    "verdict",
                    "stage",
                    "time_ms",
                    "speedup_eager",
                    "new_best",
                )
            }
            for it in report["iterations"]
        ],
        "wall_s": round(wall, 1),
        "gpu": report.get("gpu_name"),
        "arch": report.get("arch"),
        "versions": report.get("versions"),
        "reproduce": report.get("reproduce"),
    }


def fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {fmt(x)}" for k, x in v.items()) or "-"
    return str(v)


def markdown(data: dict) -> str:
    v = data.get("versions") or {}
    lines = [
        "# kernelcrew optimize on the GPU (offline playbook)",
        "",
        f"Device: {data.get('gpu')} ({data.get('arch')}); torch {v.get('torch')}, Triton {v.get('triton')}, "
        f"CUDA {v.get('cuda')}. Produced by `{data['command']}`.",
        "Final times are medians of one interleaved CUDA-event benchmark of eager, torch.compile and the best "
        "candidate in one process (L2 flushed); speedups carry their 95% interval.",
        "",
        "| task | status | eager ms | torch.compile ms | best ms | vs eager [95% CI] | vs compile | strategy (kind) "
        "| steps | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['task']} | error | | | | | | {r['error'][:120]!r} | | {r['wall_s']} |")
            continue
        ci = r.get("speedup_eager_ci") or [None, None]
        vs = f"{fmt(r['speedup_eager'])} [{fmt(ci[0])}, {fmt(ci[1])}]" if r.get("speedup_eager") else "-"
        lines.append(
            f"| {r['task']} | {r['status']} | {fmt(r['eager_ms'])} | {fmt(r['compile_ms'])} | {fmt(r['best_ms'])} | "
            f"{vs} | {fmt(r['speedup_compile'])} | {r['strategy']} ({r['kind']}) | {r['iterations']} | {r['wall_s']} |"
        )
    lines += ["", "Steps per task:", ""]
    for r in data["rows"]:
        for s in r.get("steps", []):
            lines.append(
                f"- {r['task']} step {s['step']}: {s['strategy']} {json.dumps(s.get('params') or {})}: {s['verdict']} "
                f"({s['stage']}), {fmt(s.get('time_ms'))} ms, {fmt(s.get('speedup_eager'))}x"
                + (" (new best)" if s.get("new_best") else "")
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--max-iters", type=int, default=3)
    parser.add_argument("--time-budget", type=float, default=150.0)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.tasks.split(","):
        row = run_task(name, out_dir / "runs", args.max_iters, args.time_budget)
        rows.append(row)
        print(
            f"{name}: {row.get('status', 'error')} best {fmt(row.get('best_ms'))} ms, {fmt(row.get('speedup_eager'))}x "
            f"eager, {fmt(row.get('speedup_compile'))}x compile, {row.get('strategy')} in {row['wall_s']} s",
            flush=True,
        )
        first = next((r for r in rows if "versions" in r), {})
        data = {
            "gpu": first.get("gpu"),
            "arch": first.get("arch"),
            "versions": first.get("versions"),
            "command": f"python bench/optimize_gpu.py --tasks {args.tasks} --max-iters {args.max_iters} "
            f"--time-budget {args.time_budget:g}",
            "rows": rows,
        }
        (out_dir / "optimize_h100.json").write_text(json.dumps(data, indent=2))
        (out_dir / "optimize_h100.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
