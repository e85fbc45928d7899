"""Every tuning configuration of a row task on a GPU, timed, with its kernel's registers.

The planner tries the row_reduction strategy's tuning space in order and keeps the fastest within
the task's budget, so a configuration that comes first and runs slow costs a run its time. For
each task this script builds the candidate of every ``sm_90`` configuration (with this checkout's
generator and, with ``--generator FILE``, an older copy of ``rowwise.py`` too, labelled
``--label``), checks it against a float64 reference on inputs the timing never saw, reads each
compiled kernel's registers and spills from Triton, and times all of them with eager and
``torch.compile`` (default mode) in one interleaved ``measure`` call. Writes ``row_configs.json``
and ``row_configs.md``.

    python bench/row_configs.py OUT_DIR [--generator OLD_ROWWISE.py --label OLD] [TASK.py ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from waiting_rows import main_for  # noqa: E402

TASKS = [ROOT / f"bench/kb/groupnorm_silu_{name}_bf16.py" for name in ("unet", "narrow", "deep")]


def config_label(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def every_config(gen, plan) -> dict[str, dict]:
    """Every sm_90 configuration, named by the place the planner tries it in."""
    return {str(i): params for i, params in enumerate(gen.tuning_space(plan, "sm_90"))}


def markdown(result: dict) -> str:
    lines = [
        "# Row tasks: every tuning configuration, with its kernel's registers",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result['commit']}"
        + (f", against `{result['old']}`" if result.get("old") else "")
        + ". `python bench/row_configs.py`, timed by the crew's protocol (`kernelcrew.tools.timing.measure`: "
        "every candidate of a task interleaved, L2 flushed before each call, CUDA events; ms is the median "
        "[p10-p90]). `order` is the place the planner tries the configuration in. TB/s counts each input "
        "read once and the output written once (the DRAM floor's traffic). Registers per thread and "
        "spills are Triton's, per compiled kernel.",
        "",
    ]
    for row in result["rows"]:
        gb = row["bytes"] / 1e9
        compile_ms = row["compile"]["median_ms"]
        lines += [
            f"## {row['task']} ({row['bytes'] / 1e6:.0f} MB moved at least)",
            "",
            f"eager {row['eager']['median_ms']:.4f} ms, torch.compile {compile_ms:.4f} ms ({gb / compile_ms:.2f} TB/s)",
            "",
            "| generator | order | configuration | ms [p10-p90] | TB/s | vs compile | registers (spills) | warps | rel. error |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, c in row["candidates"].items():
            label, order = key.split("/", 1)
            regs = ", ".join(f"{k['regs']} ({k['spills']})" for k in c["kernels"])
            warps = ", ".join(str(k["num_warps"]) for k in c["kernels"])
            lines.append(
                f"| {label} | {order} | {config_label(c['params'])} | "
                f"{c['median_ms']:.4f} [{c['p10_ms']:.4f}-{c['p90_ms']:.4f}] | {gb / c['median_ms']:.2f} | "
                f"{compile_ms / c['median_ms']:.2f}x | {regs} | {warps} | {c['rel_error']:.1e} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    main_for("row_configs", TASKS, every_config, markdown)


if __name__ == "__main__":
    main()
