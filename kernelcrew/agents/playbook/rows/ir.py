"""The row IR: the reductions, the per-row values each defines, and the plan the kernels are made from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernelcrew.agents.playbook.pointwise import Operand, Step

#: IR reductions and the suffixes of the per-row values each one defines.
REDUCTIONS: dict[str, tuple[str, ...]] = {
    "rsum": ("",),
    "rmean": ("",),
    "rmax": ("",),
    "rmin": ("",),
    "rlse": ("_m", "_s"),
    "rmoments": ("_mean", "_var"),
    "rce": ("", "_valid"),
}

#: Reductions whose state over part of a row merges with the other parts' (a row split over programs).
MERGEABLE = frozenset({"rsum", "rmean", "rmax", "rmin", "rlse", "rmoments"})
#: Most programs one row is split over.


@dataclass
class RowPlan:
    """What the row kernel computes: operands (each loaded per element or per row), the IR, the output."""

    operands: list[Operand]
    #: Per operand: ``row`` (broadcast to the rows), ``kd`` (to ``lead + (1,)``) or ``flat`` (to ``lead``).
    layouts: list[str]
    #: Per operand: ``None``, ``rows`` (``reshape(-1, n)`` first) or ``flat`` (``reshape(-1)`` first).
    reshapes: list[str | None]
    #: Integer operands read as indices (cross-entropy targets), never converted to floats.
    index_operands: frozenset[int]
    steps: list[Step]
    result: tuple[str, Any]
    #: ``row`` (the output has the rows' shape), ``kd`` (``lead + (1,)``) or ``flat`` (``lead``).
    result_layout: str
    #: Where each IR value is computed: ``row`` or ``red``.
    spaces: dict[str, str]
    #: How many reductions each value depends on, one after another (the multi-pass loop count).
    stages: dict[str, int]
    forward_args: list[dict[str, Any]]
    out_dtype: str
    out_shape: tuple[int, ...]
    row_shape: tuple[int, ...]
    compute_dtype: str = "float32"
    #: Cross-entropy's ``reduction`` when the output is the mean or sum of per-row losses, else None.
    loss_reduction: str | None = None
    #: GroupNorm's number of groups: the rows are then (sample, group) pairs of an (N, C, *) tensor.
    groups: int | None = None
    ops: list[str] = field(default_factory=list)

    @property
    def reductions(self) -> list[Step]:
        return [s for s in self.steps if s.op in REDUCTIONS]

    @property
    def levels(self) -> int:
        return max((self.stages[f"t:{s.out}{REDUCTIONS[s.op][0]}"] for s in self.reductions), default=0)


def outs(s: Step) -> list[str]:
    """The value keys a step defines."""
    if s.op in REDUCTIONS:
        return [f"t:{s.out}{suffix}" for suffix in REDUCTIONS[s.op]]
    return [f"t:{s.out}"]
