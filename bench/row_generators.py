"""The suite's row-reduction tasks with this checkout's generator against an older one.

A generator change reaches every row kernel, not only the task it was made for. For each task of
``bench/suite`` that the row_reduction strategy takes, this script builds the candidate of the
first configuration of its ``sm_90`` tuning space with the generator of this checkout and with
``--generator FILE`` (an older ``rowwise.py``, its rows labelled ``--label``), checks each against a
float64 reference on inputs the timing never saw, and times both, eager and ``torch.compile``
(default mode) in one interleaved ``measure`` call per task (``waiting_rows.time_generated``).
Writes ``row_generators.json`` and ``row_generators.md``.

    python bench/row_generators.py OUT_DIR --generator OLD_ROWWISE.py --label OLD [TASK.py ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from waiting_rows import candidates_markdown, main_for  # noqa: E402

TASKS = [
    ROOT / "bench/suite" / f"{name}.py"
    for name in (
        "absmax_scales_bf16",
        "attention_softmax_fp16",
        "cross_entropy_llm_vocab_bf16",
        "groupnorm_silu_fp16",
        "l2norm_embeddings_fp32",
        "layernorm_residual_fp32",
        "log_softmax_vocab_bf16",
        "rmsnorm_llama_bf16",
    )
]


def first_config(gen, plan) -> dict[str, dict]:
    return {"first": gen.tuning_space(plan, "sm_90")[0]}


def markdown(result: dict) -> str:
    return candidates_markdown(
        result,
        "The suite's row tasks: this generator against an older one",
        "row_generators.py",
        "TB/s counts each input read once and the output written once. Registers per thread and "
        "spills are Triton's, per compiled kernel. Each generator's first tuning configuration.",
        ["configuration"],
        lambda name, c: [", ".join(f"{k} {v}" for k, v in c["params"].items())],
    )


if __name__ == "__main__":
    main_for("row_generators", TASKS, first_config, markdown)
