"""GPU evidence for the knowledge base: does a second, related task reach its best sooner with it?

Runs ``kernelcrew optimize`` (offline playbook) on task A, then on a related task B with a
knowledge base holding A's wins (exported by ``kernelcrew kb export`` after A, imported by
``kernelcrew kb import`` into B's fresh data directory, so the runs may be split over device
calls with ``--only`` and ``--reuse``), and B again with ``--no-kb``. For each run of B it records
the steps taken, the step and the second at which the final best was found, the wall time and the
knowledge-base hits the planner got. Writes ``NAME.json`` and ``NAME.md`` (``--name``, default
``kb_h100``) to the folder given, each run's folder under ``--runs``.

    python bench/knowledge.py OUT_DIR --first TASK --second TASK [--max-iters N] [--gpus 0,1]

With ``--gpus A,B`` the run without the knowledge base goes on GPU B while the other two run on A.
A task is an example's name or a task file's path. ``--device cpu`` is a smoke test of the script
(CPU timings decide nothing, so there it shows only that the hits arrive).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPILE_MODES = "default"  # the torch.compile baseline; max-autotune adds a minute per run


def own_data_env(data_dir: Path) -> dict[str, str]:
    """This environment with ``data_dir`` as kernelcrew's data directory and its SQLite knowledge
    base: nothing shared with other runs."""
    env = {**os.environ, "KERNELCREW_DATA_DIR": str(data_dir)}
    env.pop("KERNELCREW_DATABASE_URL", None)
    return env


def optimize(
    task: str,
    data_dir: Path,
    out: Path,
    max_iters: int,
    *,
    use_kb: bool,
    device: str,
    reuse: Path | None = None,
    patience: int | None = None,
    gpu: str = "",
) -> dict:
    """One optimize run; with ``reuse``, a run whose report is already there (an earlier shard of a
    10-minute lease) is read instead of run again, its wall time taken from the report."""
    if reuse is not None and (reuse / out.name / "report.json").exists():
        report = json.loads((reuse / out.name / "report.json").read_text())
        return summarize(task, use_kb, report, report.get("elapsed_s"), reused=str(reuse / out.name))
    path = task if task.endswith(".py") else f"examples/{task}.py"
    cmd = [sys.executable, "-m", "kernelcrew", "optimize", path, "--device", device]
    cmd += ["--backend", "playbook", "--max-iters", str(max_iters), "--out", str(out)]
    cmd += ["--compile-modes", COMPILE_MODES]
    cmd += [] if use_kb else ["--no-kb"]
    cmd += ["--patience", str(patience)] if patience else []
    env = own_data_env(data_dir)
    if gpu:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    wall = round(time.monotonic() - started, 1)
    path = out / "report.json"
    if not path.exists():
        return {"task": task, "kb": use_kb, "error": (proc.stderr or proc.stdout)[-1500:], "wall_s": wall}
    return summarize(task, use_kb, json.loads(path.read_text()), wall)


def summarize(task: str, use_kb: bool, report: dict, wall: float | None, reused: str = "") -> dict:
    best = report.get("best") or {}
    steps = report["iterations"]
    best_step = next((s for s in steps if s.get("id") == best.get("id")), {})
    return {
        "task": task,
        "kb": use_kb,
        "status": report["status"],
        "steps": len(steps),
        "best_step": best_step.get("step"),
        "best_at_s": best_step.get("elapsed_s"),
        "best": {k: best.get(k) for k in ("strategy", "params", "kind", "best_ms", "speedup_eager")},
        "tried": [
            {"step": s["step"], "strategy": s.get("strategy"), "params": s.get("params")} for s in steps
        ],
        "kb_hits": [h["line"] for h in (report.get("knowledge_base") or {}).get("hits", [])],
        "kb_recorded": (report.get("knowledge_base") or {}).get("recorded"),
        "wall_s": wall,
        "gpu": report.get("gpu_name"),
        "arch": report.get("arch"),
        **({"reused_from": reused} if reused else {}),
    }


def markdown(data: dict) -> str:
    lines = [
        "# Knowledge base: a related task with and without it",
        "",
        f"Device: {data['gpu']} ({data['arch']}). First task `{data['first']}`, then `{data['second']}` "
        f"(at most {data['max_iters']} steps each). Produced by `{data['command']}`.",
        "",
        "| run | status | steps | best found at step | best found at s | best | vs eager | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in data["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:100]!r} | | | | | | {r['wall_s']} |")
            continue
        b = r["best"]
        gain = f"{b['speedup_eager']:.3g}x" if b.get("speedup_eager") else "-"
        lines.append(
            f"| {name} | {r['status']} | {r['steps']} | {r['best_step']} | {r.get('best_at_s')} | {b.get('strategy')} "
            f"{json.dumps(b.get('params') or {})} | {gain} | {r['wall_s']} |"
        )
    hits = data["runs"].get("second, with the knowledge base", {}).get("kb_hits", [])
    lines += ["", "Hits the planner got for the second task:", ""] + [f"- {h}" for h in hits]
    return "\n".join(lines) + "\n"


RUNS = {
    "first": "first, filling the knowledge base",
    "with_kb": "second, with the knowledge base",
    "without_kb": "second, without (--no-kb)",
}


def kb_cli(data_dir: Path, *args: str) -> None:
    """``kernelcrew kb ...`` on the knowledge base in ``data_dir`` (raises on failure)."""
    subprocess.run(
        [sys.executable, "-m", "kernelcrew", "kb", *args], cwd=ROOT, env=own_data_env(data_dir), check=True
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="bench-out", help="where NAME.json and NAME.md go")
    parser.add_argument("--name", default="kb_h100", help="the result files' name")
    parser.add_argument("--runs", type=Path, help="the runs' folders (default: OUT/kb_runs)")
    parser.add_argument("--first", default="elementwise_chain")
    parser.add_argument("--second", default="swish_residual")
    parser.add_argument("--max-iters", type=int, default=4)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--gpus",
        default="",
        help="Two GPU indices A,B: the first run then the second with the knowledge base on A, the "
        "second without it on B at the same time (default: all three in turn on the visible GPU).",
    )
    parser.add_argument(
        "--reuse", type=Path, help="Read runs whose report is already in this kb_runs folder."
    )
    parser.add_argument(
        "--patience",
        type=int,
        help="--patience of every run (as many as --max-iters: each run tries its whole menu, so the "
        "knowledge base learns the true best rather than the first good one, and the step at which "
        "each second run found its best is comparable).",
    )
    parser.add_argument(
        "--only",
        default=",".join(RUNS),
        help="Comma list of the runs to do now (first, with_kb, without_kb); the others are read "
        "from --reuse. The first run's wins travel to the second by `kernelcrew kb export/import`, "
        "so the runs may be done in separate device calls.",
    )
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_dir = args.runs or out_dir / "kb_runs"
    only = set(args.only.split(","))

    def run(key: str, gpu: str) -> dict | None:
        if key not in only and not (args.reuse and (args.reuse / key / "report.json").exists()):
            return None  # neither asked for now nor done in an earlier shard
        with tempfile.TemporaryDirectory() as data_dir:
            run_dir = runs_dir / key
            if key == "with_kb":
                wins = next(
                    (
                        p
                        for d in (runs_dir, args.reuse)
                        if d and (p := d / "first" / "kb_export.json").exists()
                    ),
                    None,
                )
                if wins is None:
                    raise SystemExit(f"no export of the first run's wins ({runs_dir}/first/kb_export.json)")
                kb_cli(Path(data_dir), "import", str(wins))
            result = optimize(
                args.first if key == "first" else args.second,
                Path(data_dir),
                run_dir,
                args.max_iters,
                use_kb=key != "without_kb",
                device=args.device,
                reuse=None if key in only else args.reuse,
                patience=args.patience,
                gpu=gpu,
            )
            if key == "first" and key in only:
                kb_cli(Path(data_dir), "export", str(run_dir / "kb_export.json"))
            return result

    gpus = [g for g in args.gpus.split(",") if g]
    if len(gpus) == 2:  # the run without the knowledge base needs nothing of the first: in parallel
        with ThreadPoolExecutor(2) as pool:
            without = pool.submit(run, "without_kb", gpus[1])
            done = {key: run(key, gpus[0]) for key in ("first", "with_kb")}
            done["without_kb"] = without.result()
    else:
        done = {key: run(key, "") for key in RUNS}
    runs = {RUNS[key]: r for key, r in done.items() if r is not None}
    first = next((r for r in runs.values() if "gpu" in r), {})
    data = {
        "gpu": first.get("gpu"),
        "arch": first.get("arch"),
        "first": args.first,
        "second": args.second,
        "max_iters": args.max_iters,
        "command": " ".join(["python", "bench/knowledge.py", *sys.argv[1:]]),
        "runs": runs,
    }
    (out_dir / f"{args.name}.json").write_text(json.dumps(data, indent=2))
    (out_dir / f"{args.name}.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
