"""Tuning parameters, the configurations worth timing per architecture, and the paths they select."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kernelcrew.agents.playbook.pointwise import arch_class
from kernelcrew.agents.playbook.rows.ir import MERGEABLE, RowPlan

#: The parameters a candidate is generated with, where a configuration leaves one out.
DEFAULT_PARAMS = {
    "MAX_SINGLE": 8192,
    "CHUNK": 2048,
    "TILE": 2048,
    "num_warps": 4,
    "SPLIT_PER_SM": 4,
    "WAIT_PART": 0,
    "WAIT_LAG": 0,
}

#: Most programs one row is split over.
MAX_SPLITS = 64
#: Examples with at most this many long rows (4 programs per SM on a GPU of 256 SMs) may split them.
FEW_ROWS = 512
#: The most SMs a GPU the candidate runs on may have: whether a split can happen is decided for it.
MAX_SMS = 256


@dataclass(frozen=True)
class Paths:
    """The kernels a candidate carries, chosen from the plan, the parameters and the example's rows.

    ``single``: rows of up to MAX_SINGLE columns in registers, beside the multi-pass loop that every
    candidate keeps for rows of any length (the verifier calls it on other shapes); only where the
    example's rows fit, since for longer rows the loop alone is as fast. ``split``: few long rows
    over several programs in two launches; ``wait``: in one launch of waiting parts instead. Both
    only for splittable plans whose example has long rows few enough to split on a GPU of MAX_SMS
    SMs at SPLIT_PER_SM; other shapes that would split run the multi-pass loop, one program a row.
    """

    single: bool
    split: bool
    wait: bool


def select_paths(plan: RowPlan, params: dict[str, int]) -> Paths:
    """The paths that ``params`` select for ``plan`` (see :class:`Paths`)."""
    long = row_length(plan) > params["MAX_SINGLE"]
    can_split = (
        splittable(plan)
        and long
        and params["SPLIT_PER_SM"] > 0
        and 2 * row_count(plan) <= params["SPLIT_PER_SM"] * MAX_SMS
    )
    part = params["WAIT_PART"]
    parts = 1 << (-(-row_length(plan) // part) - 1).bit_length() if part else 0  # next power of two
    wait = can_split and 1 < parts <= MAX_SPLITS
    return Paths(single=not long, split=can_split and not wait, wait=wait)


def splittable(plan: RowPlan) -> bool:
    """One reduction level whose states merge, and an output per element: a row can be split."""
    return (
        plan.levels == 1
        and plan.result_layout == "row"
        and plan.loss_reduction is None
        and all(s.op in MERGEABLE for s in plan.reductions)
    )


def row_length(plan: RowPlan) -> int:
    """The columns of one row of the task's example: GroupNorm's channels per group times positions."""
    if plan.groups is not None:
        return plan.row_shape[1] // plan.groups * math.prod(plan.row_shape[2:])
    return plan.row_shape[-1]


def row_count(plan: RowPlan) -> int:
    """The rows of the task's example: GroupNorm's samples times groups."""
    if plan.groups is not None:
        return plan.row_shape[0] * plan.groups
    return math.prod(plan.row_shape[:-1])


def tuning_space(plan: RowPlan, arch: str) -> list[dict[str, int]]:
    """MAX_SINGLE x CHUNK x TILE x num_warps (x SPLIT_PER_SM, WAIT_PART, WAIT_LAG) configurations
    worth timing on ``arch``.

    ``MAX_SINGLE``: the longest row kept in registers (single pass); ``CHUNK``: the columns per
    iteration of the multi-pass loop; ``TILE``: the elements one program covers when rows are short
    (``ROWS = TILE // BLOCK_N`` rows per program); ``num_warps``: the warps of a ``TILE``-element
    block (scaled with the block); ``SPLIT_PER_SM``: when a launch of multi-pass rows would have
    fewer programs than this many per SM, each row is split over several (0: never);
    ``WAIT_PART``: the columns of each part of a split row in the one launch of waiting programs
    (0: two launches instead; tried first when the example has few long rows); ``WAIT_LAG``: in
    that launch, how far behind its own part (in % of L2 read since) a program writes one. One
    configuration for the CPU interpreter, where big blocks mean fewer interpreted programs. The
    order is the order the planner tries them in: it depends on the example's row length.
    """
    cls = arch_class(arch)
    if cls == "cpu":
        return [{"MAX_SINGLE": 4096, "CHUNK": 1024, "TILE": 4096, "num_warps": 1}]
    if cls == "sm_80":
        configs = [
            (8192, 2048, 2048, 4),
            (16384, 4096, 4096, 8),
            (4096, 1024, 1024, 4),
            (8192, 4096, 1024, 2),
        ]
    elif cls == "sm_90":
        configs = [
            *((8192, 4096, 2048, 4), (16384, 4096, 4096, 8), (4096, 2048, 1024, 4)),
            *((16384, 8192, 4096, 4), (8192, 2048, 4096, 16)),
        ]
    else:
        configs = [
            *((16384, 4096, 4096, 8), (8192, 4096, 2048, 4), (16384, 8192, 4096, 4)),
            *((4096, 2048, 1024, 4), (16384, 8192, 8192, 16)),
        ]
    if plan.compute_dtype == "float64" or len([x for x in plan.layouts if x == "row"]) > 3:
        configs = [c for c in configs if c[0] <= 8192]  # more live tiles: keep rows shorter in registers
    if row_length(plan) > max(c[0] for c in configs):
        # rows of the multi-pass class: bigger chunks (more loads in flight per program) first
        # (measured on the H100, see docs/benchmarks.md)
        configs.sort(key=lambda c: -c[1])
    space = [{"MAX_SINGLE": s, "CHUNK": c, "TILE": t, "num_warps": w} for s, c, t, w in configs]
    if splittable(plan):  # rows split by default (SPLIT_PER_SM 4); the first config unsplit too
        space.append({**space[0], "SPLIT_PER_SM": 0})
        if row_count(plan) <= FEW_ROWS and row_length(plan) > max(c[0] for c in configs):
            # few long rows, split: first in one launch of waiting parts, read once from DRAM, each
            # program writing a part read 28 % of L2 earlier, in parts of 8192 columns, then 4096
            # (measured on the H100, see docs/benchmarks.md)
            space[:0] = [{**space[0], "WAIT_PART": p, "WAIT_LAG": 28} for p in (8192, 4096)]
    return space


def check_params(params: dict[str, Any] | None) -> dict[str, int]:
    merged = {**DEFAULT_PARAMS, **(params or {})}
    unknown = set(merged) - set(DEFAULT_PARAMS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} ({', '.join(DEFAULT_PARAMS)})")
    for key in ("MAX_SINGLE", "CHUNK", "TILE"):
        value = merged[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < 16
            or value > 65536
            or value & (value - 1)
        ):
            raise ValueError(f"{key} must be a power of two in [16, 65536], got {value!r}")
    split = merged["SPLIT_PER_SM"]
    if isinstance(split, bool) or not isinstance(split, int) or not 0 <= split <= 1024:
        raise ValueError(f"SPLIT_PER_SM must be an integer in [0, 1024], got {split!r}")
    part = merged["WAIT_PART"]
    if (
        isinstance(part, bool)
        or not isinstance(part, int)
        or not (part == 0 or 16 <= part <= 16384)
        or part & (part - 1)
    ):
        raise ValueError(f"WAIT_PART must be 0 or a power of two in [16, 16384], got {part!r}")
    lag = merged["WAIT_LAG"]
    if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= 100:
        raise ValueError(f"WAIT_LAG must be an integer percentage of L2 in [0, 100], got {lag!r}")
    if merged["num_warps"] not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be 1, 2, 4, 8, 16 or 32, got {merged['num_warps']!r}")
    return merged
