"""Is the SOL figure's bandwidth consistent with how the crew times a call? The L2 flush's dirty lines.

The crew's timing (``kernelcrew.tools.timing``) flushes L2 before every timed call by writing a
buffer twice its size (``zero_``), as ``triton.testing.do_bench`` does. That leaves L2 full of
dirty lines, which the timed call writes back to DRAM as it evicts them, while it leaves its own
last writes dirty in L2, uncharged. The SOL figure divides the DRAM floor (the task's bytes over
the calibrated bandwidth) by that time, and the calibration (``roofline.calibrate_child``) times
back-to-back copies of 1 GiB, each one also writing back the dirty lines that the one before it
left. So both pay for about one L2 of someone else's write-back and leave one of their own.

This script checks that the two agree, and what flushing by reading instead (clean lines, nothing
to write back) would change: in one process it calibrates the GPU as the crew does, then times, with
the crew's ``measure``, once with the crew's flush and once with a read of the same buffer,

* plain copies (``clone``) of 32 MiB, of the task's input and of 1 GiB, each moving twice its size;
* the task's eager module, ``torch.compile`` (default mode) and the playbook's row candidate of the
  first configuration of its ``sm_90`` tuning space (what the suite's run kept), checked against a
  float64 reference on inputs the timing never sees.

Each time is also given as bandwidth (the bytes of the DRAM floor over the time) and as a share of
the calibrated one, which is the SOL figure for the task's own callables. Writes
``flush_protocol.json`` and ``.md``.

    python bench/flush_protocol.py OUT_DIR [TASK.py ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import build_candidate, rel_error, row_setup, run_suite  # noqa: E402

from kernelcrew.agents.playbook import rows as rowwise  # noqa: E402
from kernelcrew.tools import timing  # noqa: E402
from kernelcrew.tools.roofline import calibrate_child  # noqa: E402

TASKS = [ROOT / "bench/suite/groupnorm_silu_fp16.py"]
TIMING = timing.TimingConfig(min_reps=60, max_reps=300, max_time_s=60.0)
COPY_MIB = (32, 1024)  # besides a copy of the task's input


def read_flush(self: timing._Timer) -> None:
    """The alternative flush: read the flush buffer (it evicts L2 and leaves it clean)."""
    if self.flush_buffer is not None:
        self.flush_buffer.view(torch.int32).sum()


FLUSHES = {"write (the crew's)": timing._Timer.flush, "read": read_flush}


def run_task(path: Path, sms: int) -> dict:
    del sms
    with tempfile.TemporaryDirectory() as tmp:
        dram_gbs = calibrate_child({}, Path(tmp))["measured"]["dram_gbs"]
    analysis, plan, task, model, ref64, inputs, fresh = row_setup(path)
    params = rowwise.tuning_space(plan, "sm_90")[0]
    with torch.no_grad():
        golden = ref64(*[t.double() if t.is_floating_point() else t for t in fresh])
        out = model(*inputs)
        task_bytes = sum(t.numel() * t.element_size() for t in inputs) + out.numel() * out.element_size()
        task_bytes += sum(p.numel() * p.element_size() for p in model.parameters())
        compiled = torch.compile(model)
        compiled(*inputs)
        text = rowwise.generate_rowwise(analysis, plan, params)
        _, new = build_candidate(text, f"flush_{path.stem}", task, model)
        moved = {"eager": task_bytes, "compile": task_bytes, "candidate": task_bytes}
        callables = {"eager": lambda xs: model(*xs), "compile": lambda xs: compiled(*xs)}
        callables["candidate"] = lambda xs: new(*xs)
        copies = {
            f"copy {mib} MiB": torch.empty(mib << 20, dtype=torch.uint8, device="cuda") for mib in COPY_MIB
        }
        copies[f"copy of the input ({inputs[0].nbytes >> 20} MiB)"] = inputs[0]
        for name, src in copies.items():
            moved[name] = 2 * src.nbytes
            callables[name] = lambda xs, src=src: src.clone()
        row = {
            "task": path.stem,
            "dram_gbs": dram_gbs,
            "params": params,
            "rel_error": rel_error(new(*fresh), golden),
            "bytes": moved,
            "flushes": {},
        }
        saved = timing._Timer.flush
        try:
            for flush_name, flush in FLUSHES.items():
                timing._Timer.flush = flush
                results = timing.measure(callables, [inputs], device="cuda", config=TIMING)["results"]
                row["flushes"][flush_name] = {
                    k: {x: v[x] for x in ("median_ms", "p10_ms", "p90_ms", "reps")}
                    for k, v in results.items()
                }
        finally:
            timing._Timer.flush = saved
    return row


def markdown(result: dict) -> str:
    lines = [
        "# The timing's L2 flush against the calibrated bandwidth",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result['commit']}. `python bench/flush_protocol.py`: "
        "each callable timed by the crew's `measure` (interleaved rounds, CUDA events; ms is the median "
        "[p10-p90]), once flushing L2 as the crew does (writing a buffer of twice its size) and once "
        "reading that buffer instead. GB/s is the bytes of the DRAM floor (a copy: read and written) over "
        "the time; % is that over the bandwidth the crew calibrated in the same process (back-to-back "
        "copies of 1 GiB, median of 20).",
        "",
    ]
    for row in result["rows"]:
        names = list(row["flushes"])
        lines += [
            f"## {row['task']}: calibrated {row['dram_gbs']:.0f} GB/s",
            "",
            f"Candidate: {row['params']}, relative error {row['rel_error']:.1e} on fresh inputs.",
            "",
            "| callable | MB moved | " + " | ".join(f"{n}: ms [p10-p90] | GB/s | %" for n in names) + " |",
            "|---|---|" + "---|---|---|" * len(names),
        ]
        for key, nbytes in row["bytes"].items():
            cells = [key, f"{nbytes / 1e6:.0f}"]
            for n in names:
                t = row["flushes"][n][key]
                gbs = nbytes / t["median_ms"] / 1e6
                cells += [
                    f"{t['median_ms']:.4f} [{t['p10_ms']:.4f}-{t['p90_ms']:.4f}]",
                    f"{gbs:.0f}",
                    f"{100 * gbs / row['dram_gbs']:.0f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    run_suite(
        "flush_protocol", TASKS, run_task, markdown, commit=os.environ.get("KERNELCREW_COMMIT", "unknown")
    )


if __name__ == "__main__":
    main()
