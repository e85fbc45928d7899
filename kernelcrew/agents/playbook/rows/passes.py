"""One program per block of rows: the whole row in registers (single pass), or a chunk loop per level."""

from __future__ import annotations

from kernelcrew.agents.playbook.pointwise import Step
from kernelcrew.agents.playbook.rows.ir import REDUCTIONS, outs
from kernelcrew.agents.playbook.rows.kernel import KernelWriter, indent


def rows_kernel(w: KernelWriter, name: str, single: bool) -> list[str]:
    """``name``: ROWS rows per program. With ``single``, rows of up to BLOCK_N columns take the
    single pass (SINGLE_PASS) and longer ones the multi-pass loop; without it, the loop alone."""
    early = w.per_row_steps(0)
    body = ["pid = tl.program_id(0)", *w.row_header()]
    if single:
        body += [
            "if SINGLE_PASS:  # the whole row in registers: read once, write once",
            *indent(single_pass(w, early)),
            "else:  # rows longer than one block: one pass per reduction level, then one that writes",
            *indent(multi_pass(w, early)),
        ]
    else:
        body += multi_pass(w, early)
    meta = ["SINGLE_PASS"] if single else []
    return [*w.signature(name, [], meta), *indent(body)]


def single_pass(w: KernelWriter, early: list[Step]) -> list[str]:
    """A row of at most BLOCK_N columns read once into registers, reduced, and written once."""
    plan = w.plan
    lines = ["cols = tl.arange(0, BLOCK_N)", *w.chunk_header("")[1:]]
    for i in range(len(plan.operands)):
        lines += w.load_row(i) if plan.layouts[i] == "row" else []
    for s in plan.steps:
        if s in early:
            continue
        lines += w.reduce_single(s) if s.op in REDUCTIONS else w.emitter.section([s])
    return lines + w.store()


def multi_pass(w: KernelWriter, early: list[Step]) -> list[str]:
    """One loop over BLOCK_N-column chunks per reduction level, then one that writes. Each pass walks
    the other way from the one before, so it starts on the chunks still in L2; the passes before the
    last load with ``evict_last``, the last with ``evict_first``."""
    plan = w.plan
    lines: list[str] = []
    back = False
    for level in range(1, plan.levels + 1):
        reductions = [s for s in plan.reductions if plan.stages[outs(s)[0]] == level]
        lines.append(f"# pass {level}: {', '.join(s.op for s in reductions)}")
        for s in reductions:
            lines += w.reduce_init(s)
        reread = level < plan.levels or plan.result_layout == "row"
        inner = w.chunk([s.args[0] for s in reductions], "evict_last" if reread else "")
        for s in reductions:
            inner += w.reduce_update(s)
        lines += w.column_loop(inner, back)
        back = not back
        for s in reductions:
            lines += w.reduce_final(s)
        lines += w.emitter.section(w.per_row_steps(level))
    if plan.result_layout == "row":
        lines.append(f"# pass {plan.levels + 1}: the output")
        loop = w.chunk([plan.result], "evict_first") + w.store()  # the row's last read
        lines += w.column_loop(loop, back)
    else:
        lines += w.store()
    return lines
