"""``kernelcrew bench`` over several GPUs of one host: one shard per GPU, merged into one table.

The suite's tasks are dealt out in turn to the GPUs listed; each GPU runs ``kernelcrew bench`` on its
share (its own data directory, so each knowledge base starts from its seeds, and its own
calibration), all at once. The shards' rows are merged in the suite's order into ``NAME.json`` and
``NAME.md`` in ``--results``; each shard's folder (its table and the per-task runs) stays under
``--out``. Options after ``--`` go to every ``kernelcrew bench``.

    python bench/run_suite.py --gpus 0,1 --name suite_h100 -- --max-iters 2 --compile-modes default
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kernelcrew.benchmark import markdown, suite_tasks, summarize

ROOT = Path(__file__).resolve().parent.parent


def deal(tasks: list[str], shards: int) -> list[list[str]]:
    """Task names dealt out in turn, so every shard gets some of each part of the (sorted) suite."""
    return [tasks[i::shards] for i in range(shards)]


def merge(order: list[str], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One table from the shards' tables: the first shard's header, rows in ``order``, and per shard
    the GPU, its tasks and the peaks its SOL column used."""
    rows = {r["task"]: r for shard in shards for r in shard.get("rows", [])}
    data = {k: v for k, v in shards[0].items() if k not in ("rows", "summary")}
    data["rows"] = [rows[name] for name in order if name in rows]
    data["summary"] = summarize(data["rows"])
    data["shards"] = [
        {"gpu": s.get("gpu"), "tasks": [r["task"] for r in s.get("rows", [])], "peaks": s.get("peaks")}
        for s in shards
    ]
    return data


def launch(
    suite: Path, order: list[str], gpus: list[str], out: Path, extra: list[str], *, device: str = "cuda"
) -> list[tuple[str, Path, subprocess.Popen]]:
    """One resuming ``kernelcrew bench`` per GPU on its dealt share of ``order``, all started at once.

    Each shard is its own process group, so a shard stopped at a deadline takes its children with it.
    Each shard's PyTorch thread pools get an equal share of the cores (``OMP_NUM_THREADS``, unless
    set), so shards do not oversubscribe the machine and skew each other's CPU-side timings.
    """
    procs = []
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // max(1, len(gpus))))
    for gpu, names in zip(gpus, deal(order, len(gpus)), strict=True):
        if not names:  # fewer tasks than GPUs: an empty --tasks would mean all of them
            continue
        shard = out / f"gpu{gpu}"
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": gpu,
            "KERNELCREW_DATA_DIR": str(shard / "data"),
            "OMP_NUM_THREADS": threads,
        }
        cmd = [sys.executable, "-m", "kernelcrew", "bench", str(suite), "--device", device]
        cmd += ["--tasks", ",".join(names), "--out", str(shard), "--resume", *extra]
        procs.append((gpu, shard, subprocess.Popen(cmd, env=env, start_new_session=True)))
    return procs


def _stop(proc: subprocess.Popen) -> None:
    """End a shard's process group: SIGTERM, then SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)


def collect(
    procs: list[tuple[str, Path, subprocess.Popen]], *, deadline: float | None = None
) -> list[dict[str, Any]]:
    """Wait for the shards (until ``deadline``, a ``time.monotonic()`` value, at most: then they are
    stopped) and return the tables they wrote, each with its GPU. An interrupt stops them all."""
    try:
        for gpu, _, proc in procs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                proc.wait(left)
            except subprocess.TimeoutExpired:
                print(f"shard on GPU {gpu} still running at the deadline: stopped", file=sys.stderr)
                _stop(proc)
            if proc.returncode != 0:
                print(f"shard on GPU {gpu} exited with {proc.returncode}", file=sys.stderr)
    finally:
        for _, _, proc in procs:
            _stop(proc)
    shards = []
    for gpu, shard, _ in procs:
        table = shard / "suite.json"
        if table.exists():
            shards.append({**json.loads(table.read_text()), "gpu": gpu})
    return shards


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--suite", type=Path, default=ROOT / "bench" / "suite")
    ap.add_argument("--gpus", default="0,1", help="comma list of CUDA device indices, one shard each")
    ap.add_argument("--out", type=Path, default=Path("bench-out"), help="the shards' folders")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="suite_h100", help="the merged table's file name")
    args = ap.parse_args(ours)
    order = [p.stem for p in suite_tasks(args.suite)]
    gpus = [g for g in args.gpus.split(",") if g]
    shards = collect(launch(args.suite, order, gpus, args.out, extra))
    if not shards:
        raise SystemExit("no shard wrote a table")
    data = merge(order, shards)
    data["command"] = " ".join(["python", "bench/run_suite.py", *argv])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (args.results / f"{args.name}.md").write_text(markdown(data))
    print(markdown(data))
    return data


if __name__ == "__main__":
    main()
