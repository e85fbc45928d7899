"""Split rows: a row over SPLITS programs, a launch that stores partial states, then one that writes."""

from __future__ import annotations

import re

from kernelcrew.agents.playbook.pointwise import Step
from kernelcrew.agents.playbook.rows.ir import REDUCTIONS
from kernelcrew.agents.playbook.rows.kernel import KernelWriter, indent


def split_kernel(w: KernelWriter, name: str) -> list[str]:
    """``name``: each of a row's SPLITS programs reduces one part and stores its partial states
    (PHASE 1); a second launch merges the row's states and writes each part (PHASE 2), walking the
    programs in reverse so that the parts the first launch read last are still in L2."""
    phase1 = reduce_span(w, "lo", "hi", "evict_last") + post_partials(w, "split")
    loop = w.chunk([w.plan.result]) + w.store()
    phase2 = [*merged_stats(w), "for start in range(lo, hi, BLOCK_N):", *indent(loop)]
    body = [
        "pid = tl.program_id(0)",
        "if PHASE == 2:  # walk back: the parts the stats launch read last are still in L2",
        "    pid = tl.num_programs(0) - 1 - pid",
        "split = pid % SPLITS  # a row's parts are neighbouring programs",
        "pid = pid // SPLITS",
        *w.row_header(),
        "span = ((n_cols + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole chunks per part",
        "lo = split * span",
        "hi = tl.minimum(lo + span, n_cols)",
        "if PHASE == 1:",
        *indent(phase1),
        "else:",
        *indent(phase2),
    ]
    return [*w.signature(name, ["ws_ptr"], ["SPLITS", "PHASE"]), *indent(body)]


def n_partials(w: KernelWriter) -> int:
    """How many partial states a part of a row stores (the workspace's first dim)."""
    return sum(len(partials(s)) for s in w.plan.reductions)


def partials(s: Step) -> list[str]:
    """The ``[ROWS, 1]`` state of reduction ``s`` after a loop over part of a row."""
    r = f"r_{s.out}"
    if s.op in ("rsum", "rmean"):
        return [f"tl.sum({r}, axis=1)[:, None]"]
    if s.op in ("rmax", "rmin"):
        return [f"tl.{s.op[1:]}({r}, axis=1)[:, None]"]
    if s.op == "rlse":
        return [f"{r}_m", f"{r}_s"]
    if s.op == "rmoments":
        return [f"{r}_n", f"{r}_mean", f"{r}_m2"]
    raise ValueError(f"no partial state for reduction {s.op!r}")


def merge(w: KernelWriter, s: Step, first: int) -> list[str]:
    """``t_<out>`` of reduction ``s`` from the SPLITS partial states stored from slot ``first`` on."""
    r, o = f"r_{s.out}", f"t_{s.out}"
    count = len(partials(s))
    lines = [
        f"{r}_q{k} = tl.load(ws_ptr + ({first + k} * n_rows + row) * SPLITS + parts)" for k in range(count)
    ]
    if s.op in ("rsum", "rmean"):
        return [*lines, f"{o} = tl.sum({r}_q0)" + (" / n_cols" if s.op == "rmean" else "")]
    if s.op in ("rmax", "rmin"):
        return [*lines, f"{o} = tl.{s.op[1:]}({r}_q0)"]
    if s.op == "rlse":  # each part's sum is relative to its own max (0 where that is -inf)
        return [
            *lines,
            f"{o}_m = tl.max({r}_q0)",
            f'{r}_ms = tl.where({o}_m == float("-inf"), 0.0, {o}_m)',
            f'{r}_qs = tl.where({r}_q0 == float("-inf"), 0.0, {r}_q0)',
            f'{o}_s = tl.sum(tl.where({r}_q0 == float("-inf"), 0.0, {r}_q1 * tl.exp({r}_qs - {r}_ms)))',
        ]
    # rmoments, Chan et al. over the parts: the counts add, the means weigh, the spreads add
    return [
        *lines,
        f"{r}_n = tl.sum({r}_q0)",
        f"{o}_mean = tl.sum({r}_q0 * {r}_q1) / {r}_n",
        f"{r}_d = {r}_q1 - {o}_mean",
        f"{o}_var = tl.sum({r}_q2 + {r}_q0 * {r}_d * {r}_d) / {w.var_divisor(s)}",
    ]


def post_partials(w: KernelWriter, part: str) -> list[str]:
    """Store each reduction's partial states of part ``part`` of the row in its workspace slot."""
    lines, slot = [], 0
    for s in w.plan.reductions:
        for value in partials(s):
            lines.append(
                f"tl.store(ws_ptr + ({slot} * n_rows + rows[:, None]) * SPLITS + {part}, {value}, "
                "mask=rmask[:, None])"
            )
            slot += 1
    return lines


def merged_stats(w: KernelWriter) -> list[str]:
    """The row's statistics, as scalars, from the SPLITS parts' states, and the per-row math on them."""
    return merged_reductions(w) + w.emitter.section(w.per_row_steps(1))


def merged_reductions(w: KernelWriter) -> list[str]:
    """Each reduction's per-row values from the SPLITS parts' states (ROWS is 1, and every program's
    row exists). The states load as one-dimensional ``[SPLITS]`` tensors reduced into scalars:
    loaded as ``[1, SPLITS]`` tiles, every thread would hold every state, and ``[1, 1]`` statistics
    would go through shared memory where scalars broadcast into the output's layout for free."""
    lines, slot = ["parts = tl.arange(0, SPLITS)", "row = tl.sum(rows)  # the one row, a scalar"], 0
    for s in w.plan.reductions:
        lines += merge(w, s, slot)
        slot += len(partials(s))
    return lines


def reduce_span(w: KernelWriter, lo: str, hi: str, evict: str = "", block: str = "BLOCK_N") -> list[str]:
    """Every reduction's state over the columns ``lo`` to ``hi``, in chunks of ``block``."""
    reductions = w.plan.reductions
    lines = [line for s in reductions for line in w.reduce_init(s, block)]
    inner = w.chunk([s.args[0] for s in reductions], evict, block)
    inner += [line for s in reductions for line in w.reduce_update(s, block)]
    return [*lines, f"for start in range({lo}, {hi}, {block}):", *indent(inner)]


def row_reductions(w: KernelWriter, block: str) -> list[str]:
    """Each reduction's per-row values as scalars, reduced by this program over the whole row in
    chunks of ``block`` columns (ROWS is 1): the merge's values, rounded otherwise."""
    reductions = w.plan.reductions
    lines = reduce_span(w, "0", "n_cols", block=block)
    lines += [line for s in reductions for line in w.reduce_final(s)]
    # its states renamed: Triton wants a name both branches of an if assign to keep its type
    outs = "|".join(re.escape(s.out) for s in reductions)
    state = re.compile(rf"\br_({outs})(?=\W|_|$)")
    lines = [state.sub(r"rr_\1", line) for line in lines]
    finals = [f"t_{s.out}{suffix}" for s in reductions for suffix in REDUCTIONS[s.op]]
    return lines + [f"{name} = tl.sum({name})" for name in finals]
