"""Triton lines shared by every row kernel: rows and their offsets, loads, reductions, the store."""

from __future__ import annotations

import math
import re
from typing import Any

from kernelcrew.agents.playbook.pointwise import TRITON_DTYPES, Step, _Emitter, _key
from kernelcrew.agents.playbook.rows import grouped
from kernelcrew.agents.playbook.rows.ir import REDUCTIONS, RowPlan, outs

#: Most leading dims (after coalescing) that the kernel's row -> coordinates indexing handles.
MAX_LEAD = 4
#: Names an operand's pointer and host argument must not take (the kernel's and the host's own).
RESERVED = frozenset(
    {"out", "aux", "ws", "posted", "torch", "triton", "tl", "nn", "math", "ops", "device", "self"}
)


class RowEmitter(_Emitter):
    """The pointwise emitter, with infinite constants."""

    def ref(self, value: tuple[str, Any]) -> str:
        if value[0] == "c" and not math.isfinite(value[1]):
            return 'float("inf")' if value[1] > 0 else 'float("-inf")'
        return super().ref(value)

    def section(self, steps: list[Step]) -> list[str]:
        """The lines of ``steps`` (pointwise ones only)."""
        self.lines = []
        for s in steps:
            self.step(s)
        return self.lines


def operand_names(plan: RowPlan) -> list[str]:
    """An identifier per operand, from its name (``gn.weight`` -> ``gn_weight``), unique."""
    names: list[str] = []
    for op in plan.operands:
        base = re.sub(r"\W", "_", op.name).strip("_").lower() or "operand"
        if base[0].isdigit() or re.match(r"(r|rr|t)_|v\d+$", base):  # the kernels' own value names
            base = f"op_{base}"
        name, k = base, 1
        while name in names or name in RESERVED:
            k += 1
            name = f"{base}{k}"
        names.append(name)
    return names


def indent(lines: list[str], depth: int = 1) -> list[str]:
    """``lines`` indented ``depth`` levels (blank lines stay blank)."""
    pad = "    " * depth
    return [f"{pad}{line}" if line else "" for line in lines]


class KernelWriter:
    """The pieces every row kernel of a plan is made of; the kernels themselves are built by
    :mod:`.passes`, :mod:`.split` and :mod:`.waiting` from them."""

    def __init__(self, plan: RowPlan) -> None:
        self.plan = plan
        self.emitter = RowEmitter(plan)  # type: ignore[arg-type]
        self.acc = TRITON_DTYPES[plan.compute_dtype]
        self.names = operand_names(plan)
        self.grouped = plan.groups is not None
        self.producer: dict[str, Step] = {}
        for s in plan.steps:
            for k in outs(s):
                self.producer[k] = s

    # --- names -----------------------------------------------------------------------------------
    def ptr(self, i: int) -> str:
        return f"{self.names[i]}_ptr"

    def off(self, i: int) -> str:
        return f"off_{self.names[i]}"

    def stride(self, i: int, dim: str) -> str:
        return f"stride_{self.names[i]}{dim}"

    def strides(self, i: int) -> list[str]:
        """Operand ``i``'s stride arguments: (sample, channel, position) for GroupNorm rows, else
        the coalesced leading dims' and the columns'."""
        if self.grouped:
            return [self.stride(i, f"_{d}") for d in ("n", "c", "p")]
        return [*(self.stride(i, str(d)) for d in range(MAX_LEAD)), self.stride(i, "_col")]

    def mode(self, i: int) -> str:
        return f"MODE_{self.names[i].upper()}"

    # --- dependencies ----------------------------------------------------------------------------
    def row_closure(self, values: list[tuple[str, Any]]) -> tuple[list[int], list[Step]]:
        """Per-element operands and steps (program order) needed for ``values``; per-row values are ready."""
        operands: set[int] = set()
        steps: set[str] = set()
        stack = [v for v in values if v[0] != "c"]
        while stack:
            v = stack.pop()
            k = _key(v)
            if self.plan.spaces.get(k) != "row":
                continue
            if v[0] == "in":
                operands.add(v[1])
                continue
            s = self.producer[k]
            if s.out in steps:
                continue
            steps.add(s.out)
            stack.extend(x for x in s.args if x[0] != "c")
        return sorted(operands), [s for s in self.plan.steps if s.out in steps]

    def is_row(self, s: Step) -> bool:
        return s.op not in REDUCTIONS and self.plan.spaces.get(f"t:{s.out}") == "row"

    def per_row_steps(self, level: int) -> list[Step]:
        """The per-row (not per-element) pointwise steps computed once the reductions of ``level``
        are done (level 0: from per-row operands alone, before any pass)."""
        plan = self.plan
        return [
            s
            for s in plan.steps
            if s.op not in REDUCTIONS and not self.is_row(s) and plan.stages[f"t:{s.out}"] == level
        ]

    def chunk(self, values: list[tuple[str, Any]], evict: str = "", block: str = "BLOCK_N") -> list[str]:
        """The body of a column loop over ``start`` up to ``values``: the chunk's ``block`` columns,
        its loads (with L2 eviction hint ``evict``) and the per-element steps that lead to them."""
        operands, steps = self.row_closure(values)
        return (
            self.chunk_header("start", block)
            + [line for i in operands for line in self.load_row(i, evict)]
            + self.emitter.section(steps)
        )

    # --- signature -------------------------------------------------------------------------------
    def signature(self, name: str, extra: list[str], meta: list[str]) -> list[str]:
        """``@triton.jit def name(...)``: operands, outputs, ``extra`` arguments, sizes, strides and
        the meta-parameters (``ROWS``, ``BLOCK_N`` and the layout switches, then ``meta``)."""
        n = len(self.plan.operands)
        outputs = ["out_ptr", *(["aux_ptr"] if self.plan.loss_reduction is not None else [])]
        if self.grouped:
            sizes = "# rows: (sample, group) pairs; dim1 groups of dim2 channels of dim3 positions"
        else:
            sizes = f"# rows: the product of the coalesced leading dims (1..{MAX_LEAD - 1} given, 0 implied)"
        switches = ["FLAT_ROWS"] if not self.grouped else []
        switches += ["EVEN_COLS", "OFF64"]
        if self.grouped:
            switches += [self.mode(i) for i in range(n)] + ["HAS_SPLIT", "WIDE_POSITIONS", "ONE_CHANNEL"]
        lines = [
            "@triton.jit",
            f"def {name}(",
            "    # operands and output",
            f"    {', '.join([*(self.ptr(i) for i in range(n)), *outputs, *extra])},",
            f"    {sizes}",
            "    n_rows,",
            "    n_cols,",
            f"    {', '.join(f'dim{d}' for d in range(1, MAX_LEAD))},",
            "    # per operand: element strides (0 where broadcast)",
            *(f"    {', '.join(self.strides(i))}," for i in range(n)),
            "    # meta-parameters",
            *(f"    {m}: tl.constexpr," for m in ["ROWS", "BLOCK_N", *meta, *switches]),
            "):",
        ]
        return lines

    # --- loads -----------------------------------------------------------------------------------
    def load_row(self, i: int, evict: str = "", cols: str = "cols[None, :]", mask: str = "mask") -> list[str]:
        """Load operand ``i`` per element; ``evict``: ``evict_last`` where a later pass reads the row
        again (keep it in L2), else none. ``cols``/``mask``: other columns (rows' plans only)."""
        op = self.plan.operands[i]
        convert = " != 0" if op.is_bool else f".to({self.acc})"
        hint = f', eviction_policy="{evict}"' if evict else ""
        if self.grouped:
            return grouped.load_row(self, i, hint, convert)
        ptr = f"{self.ptr(i)} + {self.off(i)}[:, None] + {cols} * {self.stride(i, '_col')}"
        return [f"v{i} = tl.load({ptr}, mask={mask}, other=0{hint}){convert}"]

    def load_red(self, i: int) -> str:
        op = self.plan.operands[i]
        load = f"tl.load({self.ptr(i)} + {self.off(i)}[:, None], mask=rmask[:, None], other=0)"
        if i in self.plan.index_operands:
            return f"v{i} = {load}"
        return f"v{i} = {load} != 0" if op.is_bool else f"v{i} = {load}.to({self.acc})"

    # --- reductions ------------------------------------------------------------------------------
    def reduce_single(self, s: Step) -> list[str]:
        """Reduction ``s`` over a row held whole in registers."""
        x = self.emitter.ref(s.args[0])
        o = f"t_{s.out}"
        if s.op in ("rsum", "rmean"):
            div = " / n_cols" if s.op == "rmean" else ""
            return [f"{o} = tl.sum(tl.where(mask, {x}, 0.0), axis=1)[:, None]{div}"]
        if s.op in ("rmax", "rmin"):
            fill, fn = ('float("-inf")', "max") if s.op == "rmax" else ('float("inf")', "min")
            return [f"{o} = tl.{fn}(tl.where(mask, {x}, {fill}), axis=1)[:, None]"]
        if s.op in ("rlse", "rce"):
            m, ms, total = (f"r_{s.out}_m", f"r_{s.out}_ms", f"r_{s.out}_s")
            lines = [
                f'{m} = tl.max(tl.where(mask, {x}, float("-inf")), axis=1)[:, None]',
                f'{ms} = tl.where({m} == float("-inf"), 0.0, {m})  # a fully masked row: no inf - inf',
                f"{total} = tl.sum(tl.where(mask, tl.exp({x} - {ms}), 0.0), axis=1)[:, None]",
            ]
            if s.op == "rlse":
                return [*lines, f"{o}_m = {m}", f"{o}_s = {total}"]
            target = self.emitter.ref(s.args[1])
            picked = f"tl.sum(tl.where(cols[None, :] == {target}, {x}, 0.0), axis=1)[:, None]"
            return [*lines, f"r_{s.out}_p = {picked}", *self.ce_finish(s)]
        if s.op == "rmoments":
            d = f"r_{s.out}_d"
            return [
                f"{o}_mean = tl.sum(tl.where(mask, {x}, 0.0), axis=1)[:, None] / n_cols",
                f"{d} = tl.where(mask, {x} - {o}_mean, 0.0)",
                f"{o}_var = tl.sum({d} * {d}, axis=1)[:, None] / {self.var_divisor(s)}",
            ]
        raise ValueError(f"no Triton code for reduction {s.op!r}")

    @staticmethod
    def var_divisor(s: Step) -> str:
        """``n - correction``: n for the biased variance of the norms, n - 1 for torch.var's default."""
        correction = dict(s.attrs).get("correction", 0)
        return "n_cols" if correction == 0 else f"(n_cols - {correction!r})"

    def ce_finish(self, s: Step) -> list[str]:
        target = self.emitter.ref(s.args[1])
        r, o = f"r_{s.out}", f"t_{s.out}"
        return [
            f"{r}_ok = {target} != {int(s.attr('ignore_index'))}",
            f"{o} = tl.where({r}_ok, {r}_m + tl.log({r}_s) - {r}_p, 0.0)",
            f"{o}_valid = tl.where({r}_ok, 1.0, 0.0)",
        ]

    def reduce_init(self, s: Step, block: str = "BLOCK_N") -> list[str]:
        """The running state of reduction ``s`` before a column loop."""
        r, acc = f"r_{s.out}", self.acc
        if s.op in ("rsum", "rmean"):
            return [f"{r} = tl.zeros([ROWS, {block}], {acc})"]
        if s.op in ("rmax", "rmin"):
            fill = 'float("-inf")' if s.op == "rmax" else 'float("inf")'
            return [f"{r} = tl.full([ROWS, {block}], {fill}, {acc})"]
        if s.op in ("rlse", "rce"):
            return [
                f'{r}_m = tl.full([ROWS, 1], float("-inf"), {acc})',
                f"{r}_s = tl.zeros([ROWS, 1], {acc})",
            ]
        if s.op == "rmoments":
            return [f"{r}_{k} = tl.zeros([ROWS, 1], {acc})" for k in ("n", "mean", "m2")]
        raise ValueError(f"no Triton code for reduction {s.op!r}")

    def ce_pick(self, s: Step) -> list[str]:
        """``r_<out>_p``: each row's logit at its target column, gathered once after the loop (a
        search of every chunk for it would cost a compare, a select and a block reduction per
        element). The logit's per-element steps (a prologue such as a scale) run on the gathered
        values; after the loop, since Triton wants a name's shape unchanged through a loop that
        assigns it."""
        r, target = f"r_{s.out}", self.emitter.ref(s.args[1])
        operands, steps = self.row_closure([s.args[0]])
        lines = [
            f"{r}_tmask = rmask[:, None] & ({target} >= 0) & ({target} < n_cols)",
            f"{r}_tcol = tl.where({r}_tmask, {target}, 0)",
        ]
        for i in operands:
            lines += self.load_row(i, cols=f"{r}_tcol", mask=f"{r}_tmask")
        lines += self.emitter.section(steps)
        return [*lines, f"{r}_p = tl.where({r}_tmask, {self.emitter.ref(s.args[0])}, 0.0)"]

    def reduce_update(self, s: Step, block: str = "BLOCK_N") -> list[str]:
        """Reduction ``s``'s running state updated with one chunk."""
        x = self.emitter.ref(s.args[0])
        r = f"r_{s.out}"
        if s.op in ("rsum", "rmean"):
            return [f"{r} += tl.where(mask, {x}, 0.0)"]
        if s.op in ("rmax", "rmin"):
            fill, fn = ('float("-inf")', "maximum") if s.op == "rmax" else ('float("inf")', "minimum")
            return [f"{r} = tl.{fn}({r}, tl.where(mask, {x}, {fill}))"]
        if s.op in ("rlse", "rce"):
            return [
                f'{r}_new = tl.maximum({r}_m, tl.max(tl.where(mask, {x}, float("-inf")), axis=1)[:, None])',
                f'{r}_ms = tl.where({r}_new == float("-inf"), 0.0, {r}_new)',
                f"{r}_s = {r}_s * tl.exp({r}_m - {r}_ms) + tl.sum(tl.where(mask, tl.exp({x} - {r}_ms), 0.0), axis=1)[:, None]",
                f"{r}_m = {r}_new",
            ]
        if s.op == "rmoments":  # Chan et al.: merge this chunk's count, mean and M2 into the running ones
            return [  # the chunk's columns: cols < n_cols of start + arange(block), and start < n_cols
                f"{r}_cn = tl.minimum(n_cols - start, {block}).to({self.acc})",
                f"{r}_cmean = tl.sum(tl.where(mask, {x}, 0.0), axis=1)[:, None] / {r}_cn",
                f"{r}_d = tl.where(mask, {x} - {r}_cmean, 0.0)",
                f"{r}_tot = {r}_n + {r}_cn",
                f"{r}_delta = {r}_cmean - {r}_mean",
                f"{r}_mean = {r}_mean + {r}_delta * ({r}_cn / {r}_tot)",
                f"{r}_m2 = {r}_m2 + tl.sum({r}_d * {r}_d, axis=1)[:, None] + {r}_delta * {r}_delta * ({r}_n * {r}_cn / {r}_tot)",
                f"{r}_n = {r}_tot",
            ]
        raise ValueError(f"no Triton code for reduction {s.op!r}")

    def reduce_final(self, s: Step) -> list[str]:
        """Reduction ``s``'s per-row values from its running state after the loop."""
        r, o = f"r_{s.out}", f"t_{s.out}"
        if s.op in ("rsum", "rmean"):
            return [f"{o} = tl.sum({r}, axis=1)[:, None]" + (" / n_cols" if s.op == "rmean" else "")]
        if s.op in ("rmax", "rmin"):
            return [f"{o} = tl.{s.op[1:]}({r}, axis=1)[:, None]"]
        if s.op == "rlse":
            return [f"{o}_m = {r}_m", f"{o}_s = {r}_s"]
        if s.op == "rce":
            return self.ce_pick(s) + self.ce_finish(s)
        if s.op == "rmoments":
            return [f"{o}_mean = {r}_mean", f"{o}_var = {r}_m2 / {self.var_divisor(s)}"]
        raise ValueError(f"no Triton code for reduction {s.op!r}")

    # --- the store -------------------------------------------------------------------------------
    def store(self, streaming: bool = False) -> list[str]:
        """The output's store; ``streaming`` (the waiting launch) marks it ``.cs``: data not read again."""
        plan = self.plan
        result = self.emitter.ref(plan.result)
        if plan.loss_reduction is not None:
            loss = f"t_{self.producer[_key(plan.result)].out}"
            return [
                f"tl.store(out_ptr + rows[:, None], {loss}, mask=rmask[:, None])",
                f"tl.store(aux_ptr + rows[:, None], {loss}_valid, mask=rmask[:, None])",
            ]
        if plan.out_dtype == "bfloat16":  # round as the GPU does, under the interpreter too
            self.emitter.helpers.add("_round_bf16")
            result = f"_round_bf16({result})"
        value = f"{result}.to(out_ptr.dtype.element_ty)"
        if plan.result_layout == "row":
            policy = ', cache_modifier=".cs"' if streaming else ""
            return [f"tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], {value}, mask=mask{policy})"]
        return [f"tl.store(out_ptr + rows[:, None], {value}, mask=rmask[:, None])"]

    # --- rows and columns ------------------------------------------------------------------------
    def row_header(self, every_row: bool = False) -> list[str]:
        """Program ``pid``'s rows, each operand's offset of each, its per-row operands and their
        per-row math (stage 0). Offsets in 64 bits only where an operand's reach 2**31 (OFF64).
        ``every_row``: the launch has no program past the last row (no row mask)."""
        plan = self.plan
        n = len(plan.operands)
        lines = [
            "rows32 = pid * ROWS + tl.arange(0, ROWS)  # n_rows < 2**31: 32-bit row coordinates",
            "if OFF64:",
            "    rows = rows32.to(tl.int64)",
            "else:",
            "    rows = rows32",
            "rmask = tl.full([ROWS], 1, tl.int1)" if every_row else "rmask = rows < n_rows",
        ]
        lines += grouped.row_offsets(self) if self.grouped else self.row_offsets()
        red_ops = [i for i in range(n) if plan.layouts[i] != "row"]
        if red_ops:
            lines.append("# per-row operands")
            lines += [self.load_red(i) for i in red_ops]
        # per-row math of operands only (stage 0): computed once, before any pass
        return lines + self.emitter.section(self.per_row_steps(0))

    def row_offsets(self) -> list[str]:
        """Each operand's offset of each row, from the row's coordinates in the coalesced leading dims."""
        n = len(self.plan.operands)
        lines = [
            "# each operand's offset of each row, from the row's coordinates in the coalesced leading dims",
            "if FLAT_ROWS:",
            *(f"    {self.off(i)} = rows * {self.stride(i, str(MAX_LEAD - 1))}" for i in range(n)),
            "else:",
            "    rem = rows32",
        ]
        for d in range(MAX_LEAD - 1, 0, -1):
            lines += [f"    c{d} = (rem % dim{d}).to(rows.dtype)", f"    rem = rem // dim{d}"]
        lines.append("    c0 = rem.to(rows.dtype)")
        lines += [
            f"    {self.off(i)} = " + " + ".join(f"c{d} * {self.stride(i, str(d))}" for d in range(MAX_LEAD))
            for i in range(n)
        ]
        return lines

    def chunk_header(self, start: str, block: str = "BLOCK_N") -> list[str]:
        """A chunk's ``block`` columns from ``start`` on and its masks (``block`` divides BLOCK_N).
        EVEN_COLS: every chunk is whole, and the column mask a constant Triton drops."""
        lines = [
            f"cols = {start} + tl.arange(0, {block})",
            "if EVEN_COLS:",
            f"    cmask = tl.full([{block}], 1, tl.int1)",
            "else:",
            "    cmask = cols < n_cols",
            "mask = rmask[:, None] & cmask[None, :]",
        ]
        return lines + (grouped.column_channels(start) if self.grouped else [])

    @staticmethod
    def column_loop(body: list[str], back: bool) -> list[str]:
        """``body`` over the row's chunks ``start``, the last chunk first if ``back``."""
        if not back:
            return ["for start in range(0, n_cols, BLOCK_N):", *indent(body)]
        return [
            "last = (n_cols - 1) // BLOCK_N * BLOCK_N",
            "for k in range(0, n_cols, BLOCK_N):",
            "    start = last - k",
            *indent(body),
        ]
