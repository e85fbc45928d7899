"""The offline optimizer's menu: strategies that turn an analysed task into candidate sources, no LLM.

Each strategy is one module with the same three functions:

* ``match(analysis, **options) -> (plan | None, reason)``: whether it applies, and why (not);
* ``generate(task_source, analysis, plan, params) -> str``: a complete candidate source;
* ``tuning_space(plan, arch) -> list[dict]``: the ``params`` worth timing on an architecture class;
* optionally ``rank(plan) -> int``: where the playbook tries it (lower first). Without it own
  kernels rank 0, library and compiler candidates 1.

:data:`STRATEGIES` names each strategy with its module and options; adding one (reductions,
matmul epilogues, attention...) is a new module and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis, analyze


@dataclass(frozen=True)
class Strategy:
    """One entry of the menu: ``source_kind`` is ``kernel``, ``compiler`` or ``library``; ``cost``:
    how long a step of it takes against the run's longest step so far (the planner starts no step
    that would end past the time budget)."""

    name: str
    source_kind: str
    description: str
    module: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    cost: float = 1.0

    def implementation(self) -> ModuleType:
        """The module with ``match``/``generate``/``tuning_space``."""
        return importlib.import_module(self.module)

    def match(self, analysis: TaskAnalysis) -> tuple[Any, str]:
        """``(plan, reason)``; the plan is None when the strategy does not apply."""
        return self.implementation().match(analysis, **dict(self.options))

    def tuning_space(self, plan: Any, arch: str) -> list[dict[str, Any]]:
        return self.implementation().tuning_space(plan, arch)

    def rank(self, plan: Any) -> int:
        """Where the playbook tries this strategy for ``plan``, lower first."""
        module = self.implementation()
        if hasattr(module, "rank"):
            return module.rank(plan)
        return 0 if self.source_kind == "kernel" else 1


_PKG = __name__

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "fused_pointwise",
            "kernel",
            "The whole forward is elementwise: one Triton kernel loads each operand once (any "
            "NumPy broadcast), computes the chain in fp32 registers and stores once.",
            module=f"{_PKG}.pointwise",
        ),
        Strategy(
            "row_reduction",
            "kernel",
            "The forward reduces each row of its last dim (softmax, log-softmax, layer/RMS/L2 norm, "
            "sum/mean/max, cross-entropy) between elementwise ops: one Triton kernel per block of rows, "
            "single pass in registers when a row fits, online multi-pass otherwise.",
            module=f"{_PKG}.rows",
        ),
        Strategy(
            "dim_reduction",
            "kernel",
            "The forward is one reduction (sum, mean, prod, amax/amin, max/min with a dim, "
            "argmax/argmin) of its input over one dim other than the last: one Triton kernel views "
            "the input as (outer, reduced, inner) and reduces tiles of consecutive inner positions "
            "down the reduced dim, reading each element once (fp32 accumulation, torch's NaN and "
            "first-index rules).",
            module=f"{_PKG}.dimreduce",
        ),
        Strategy(
            "matmul_epilogue",
            "kernel",
            "One or two linear layers of the same input (a gated pair: two accumulators sharing each "
            "input tile) and any elementwise epilogue (bias, activation, scale, residual add): one "
            "Triton matmul applies the epilogue to each output tile in registers and writes it once; "
            "float32 layers multiply in TF32x3 on the tensor cores, at float32 accuracy.",
            module=f"{_PKG}.matmul",
        ),
        Strategy(
            "anchored_fusion",
            "kernel",
            "The module by its parts: library anchors (convolutions, matmuls, pooling, recurrent "
            "cells, attention) kept as the same torch calls, each region between them (elementwise "
            "chains, reductions over any dims, softmax, norms) fused into one own Triton kernel; "
            "kernel or hybrid by where the time goes. Tried where no whole-module strategy applies.",
            module=f"{_PKG}.anchored",
        ),
        Strategy(
            "sdpa_attention",
            "library",
            "The forward spells attention out (softmax(q @ k^T * scale + bias) @ v): its own graph "
            "runs with each such site replaced by scaled_dot_product_attention, which never writes "
            "the score matrix to memory.",
            module=f"{_PKG}.attention",
        ),
        Strategy(
            "cublaslt_epilogue",
            "library",
            "A linear layer with bias followed by ReLU or tanh-GELU: one cuBLASLt GEMM applies the "
            "bias and the activation in its epilogue (torch._addmm_activation), writing the output once.",
            module=f"{_PKG}.epilogue",
        ),
        Strategy(
            "cuda_graphs",
            "library",
            "The reference's own kernels replayed as one CUDA graph per input signature: the host "
            "launches a whole forward at once, which saves the time a launch-bound module's GPU "
            "sits idle between small kernels (recurrent steps, mobile CNNs, small transformers).",
            module=f"{_PKG}.graphs",
        ),
        Strategy(
            "torch_compile",
            "compiler",
            "The task's own module through torch.compile (Inductor, mode='default', dynamic=False).",
            module=f"{_PKG}.compiler",
            options=(("mode", "default"),),
        ),
        Strategy(
            "torch_compile_max_autotune",
            "compiler",
            "The task's own module through torch.compile with mode='max-autotune-no-cudagraphs' "
            "(autotuned Triton templates, longer compile), dynamic=False.",
            module=f"{_PKG}.compiler",
            options=(("mode", "max-autotune-no-cudagraphs"),),
            # its autotuning runs inside the step, up to 1.7x a default-mode step's time (a
            # measurement, see docs/benchmarks.md)
            cost=1.7,
        ),
    )
}


def applicable(analysis: TaskAnalysis) -> list[tuple[Strategy, str]]:
    """Every strategy that applies to the analysed task, with the reason it applies, in the order
    the playbook tries them: by :meth:`Strategy.rank`, then menu order."""
    found = []
    for strategy in STRATEGIES.values():
        plan, reason = strategy.match(analysis)
        if plan is not None:
            found.append((strategy.rank(plan), len(found), strategy, reason))
    return [(strategy, reason) for _, _, strategy, reason in sorted(found)]


def rejected(analysis: TaskAnalysis) -> dict[str, str]:
    """Why each strategy that does not apply was turned down."""
    out = {}
    for strategy in STRATEGIES.values():
        plan, reason = strategy.match(analysis)
        if plan is None:
            out[strategy.name] = reason
    return out


def get_strategy(name: str) -> Strategy:
    """The menu entry called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})") from None


def generate(
    strategy: str, task_source: str, analysis: TaskAnalysis, params: dict[str, Any] | None = None
) -> str:
    """The candidate source of ``strategy`` for the task; ``ValueError`` if unknown or inapplicable."""
    entry = get_strategy(strategy)
    plan, reason = entry.match(analysis)
    if plan is None:
        raise ValueError(f"strategy {strategy!r} does not apply: {reason}")
    return entry.implementation().generate(task_source, analysis, plan, dict(params or {}))


def tuning_space(strategy: str, analysis: TaskAnalysis, arch: str) -> list[dict[str, Any]]:
    """The ``params`` of ``strategy`` worth timing on ``arch`` (``sm_80``, ``sm_90``, ``sm_100``, ``cpu``)."""
    entry = get_strategy(strategy)
    plan, reason = entry.match(analysis)
    if plan is None:
        raise ValueError(f"strategy {strategy!r} does not apply: {reason}")
    return entry.tuning_space(plan, arch)


__all__ = [
    "STRATEGIES",
    "Strategy",
    "TaskAnalysis",
    "analyze",
    "applicable",
    "generate",
    "get_strategy",
    "rejected",
    "tuning_space",
]
