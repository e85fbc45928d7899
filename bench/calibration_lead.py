"""The calibration's timed reps with and without a lead: what the host's launch gap cost its figures.

The roofline's calibration (``roofline.calibrate_child``) times each rep of a copy or a matmul by
CUDA events. Version 1 recorded the start event on an idle device and then launched the work, so
each rep also counted the host's launch time. Version 2 (``roofline.timed_reps``) queues a device
spin before the start event, as the timing protocol's lead does. This script times, in one process
and in alternating rounds, a device copy of 1 GiB (the DRAM figure) and 8192^3 matmuls in fp16 and
bf16 both ways, 20 reps each (the calibration's count), and the host's launch time of each rep.
Writes ``calibration_lead.json`` and ``.md``.

    python bench/calibration_lead.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernelcrew.tools.roofline import timed_reps  # noqa: E402

REPS = 20
ROUNDS = 3


def host_us(fn) -> float:
    """Median host time to launch ``fn`` (no synchronize inside), microseconds."""
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench/results"
    out.mkdir(parents=True, exist_ok=True)
    n = (1 << 30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    works = {"copy 1 GiB": (lambda: dst.copy_(src), 2 * n * 4, "GB/s", 1e9)}
    for dtype in (torch.float16, torch.bfloat16):
        a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        works[f"matmul 8192^3 {str(dtype).split('.')[1]}"] = (
            lambda a=a, b=b: a @ b,
            2 * 8192**3,
            "TFLOP/s",
            1e12,
        )
    ways = {
        "without lead (version 1)": lambda fn, r: timed_reps(fn, r, torch.cuda, lead_cycles=0),
        "with lead (version 2)": lambda fn, r: timed_reps(fn, r, torch.cuda),
    }
    rows = []
    for name, (fn, amount, unit, scale) in works.items():
        row = {"work": name, "unit": unit, "host_launch_us": host_us(fn), "rounds": {w: [] for w in ways}}
        for _ in range(ROUNDS):
            for way, timed in ways.items():
                times = timed(fn, REPS)
                row["rounds"][way].append(amount / times[len(times) // 2] / scale)
        rows.append(row)
        print(row, flush=True)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "commit": os.environ.get("KERNELCREW_COMMIT", "unknown"),
        "reps": REPS,
        "rows": rows,
    }
    (out / "calibration_lead.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# The calibration's reps with and without a lead",
        "",
        f"Device: {result['device']}; torch {result['versions']['torch']}; commit {result['commit']}. "
        f"`python bench/calibration_lead.py`: each figure is the median of {REPS} reps (the calibration's "
        f"count), in {ROUNDS} alternating rounds per way; the table gives the median round [min-max]. "
        "Host launch is the median time for the host to launch one rep's work.",
        "",
        "| work | host launch (us) | " + " | ".join(ways) + " | with / without |",
        "|---|---|" + "---|" * len(ways) + "---|",
    ]
    for row in rows:
        cells = [row["work"], f"{row['host_launch_us']:.1f}"]
        medians = []
        for way in ways:
            vals = row["rounds"][way]
            medians.append(statistics.median(vals))
            cells.append(f"{medians[-1]:.0f} [{min(vals):.0f}-{max(vals):.0f}] {row['unit']}")
        cells.append(f"{medians[1] / medians[0]:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    (out / "calibration_lead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
