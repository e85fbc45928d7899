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

from waiting_rows import candidates_markdown, main_for  # noqa: E402

TASKS = [ROOT / f"bench/kb/groupnorm_silu_{name}_bf16.py" for name in ("unet", "narrow", "deep")]


def config_label(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def every_config(gen, plan) -> dict[str, dict]:
    """Every sm_90 configuration, named by the place the planner tries it in."""
    return {str(i): params for i, params in enumerate(gen.tuning_space(plan, "sm_90"))}


def markdown(result: dict) -> str:
    return candidates_markdown(
        result,
        "Row tasks: every tuning configuration, with its kernel's registers",
        "row_configs.py",
        "`order` is the place the planner tries the configuration in. TB/s counts each input read once "
        "and the output written once (the DRAM floor's traffic). Registers per thread and spills are "
        "Triton's, per compiled kernel.",
        ["order", "configuration"],
        lambda order, c: [order, config_label(c["params"])],
    )


def main() -> None:
    main_for("row_configs", TASKS, every_config, markdown)


if __name__ == "__main__":
    main()
