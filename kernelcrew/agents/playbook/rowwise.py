"""Row reduction strategy: softmax, log-softmax, norms, sums and cross-entropy over the last dim, one kernel.

:func:`match` lowers the traced graph to the pointwise IR of :mod:`.pointwise` extended with *row
reductions* over the last dim (``rsum``, ``rmean``, ``rmax``, ``rmin``; ``rlse``: running max and
sum of ``exp(x - max)``; ``rmoments``: mean and biased variance; ``rce``: the cross-entropy of each
row). Library ops become IR: ``softmax`` is ``exp(x - m) / s`` over an ``rlse``, ``layer_norm`` is
``(x - mean) * rsqrt(var + eps) * w + b`` over an ``rmoments``, ``F.normalize`` and ``x.norm()``
are a square root of an ``rsum``; hand-written spellings (RMSNorm as
``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``, ``x - x.max(-1, keepdim=True)[0]``)
are lowered op by op, so any elementwise prologue (scale, additive or ``masked_fill`` mask, residual
add, casts) and epilogue (affine weights, activation, scale) fuses into the same kernel.

Every IR value lives in one of two *spaces*: per element of a row (``row``: ``[ROWS, BLOCK_N]``
tiles) or per row (``red``: ``[ROWS, 1]``, the reductions and what is computed from them; with
``keepdim`` or without it, which decides how operands broadcast against it). Operands are loaded in
the space they are used in, broadcast by per-dimension strides of the coalesced leading dims, so a
``(S, S)`` attention mask next to ``(B, H, S, S)`` scores is read in place, never expanded.

One program handles ``ROWS`` rows. The host (the generated ``row_reduction``) picks the path from
the row length at run time: a **single pass** when a row fits in ``MAX_SINGLE`` columns (the row
stays in registers: read once, written once, several short rows per program), otherwise a
**multi-pass** loop over ``CHUNK``-column blocks: one pass per reduction level (softmax's max and
sum together, online; LayerNorm's mean and variance together, by Chan's merge of per-chunk moments;
a hand-written ``x - x.mean()`` then ``.pow(2).mean()`` takes two), then one pass that writes.
Each pass walks the other way from the one before, so it starts on the chunks still in L2; the
passes before the last load with ``evict_last``, the last with ``evict_first``. On the H100 the two
took ``log_softmax`` over 32000 columns from 0.2191 to 0.2020 ms (``bench/results/long_rows_walk.md``).
Accumulation is fp32 (fp64 when the module computes in float64), the output is stored once in the
reference's dtype. Only core ``tl.*`` math is used, so the kernels run under ``TRITON_INTERPRET=1``.

GroupNorm (``nn.GroupNorm``/``F.group_norm``, any rank, channels-last too) uses the same kernel
with another row indexing: each (sample, group) of an ``(N, C, *)`` input is a row of
``C/G * prod(*)`` columns; operands are read through (sample, channel, position) strides, as one
flat run when their channels and positions are contiguous together (the input), else by channel and
position (the ``(C,)`` weights, a per-channel ``(N, C, 1, 1)`` embedding), so a SiLU, a residual
or a time-embedding add fuse around it.

Cross-entropy (``F.cross_entropy``, ``(N, C)`` logits, integer targets, ``ignore_index``,
reduction ``mean``/``sum``/``none``): the row kernel writes each row's loss and whether it counts;
``mean``/``sum`` then run a one-program kernel that adds them in a fixed order, so the loss is
bitwise deterministic (no atomics). What does not apply says why: reductions over another dim than
the last, matmuls, tuple outputs, class weights, label smoothing...

Few long rows (GroupNorm at large resolutions, a handful of vocab-sized rows) would leave most SMs
idle with one program per row. When a multi-pass launch would have fewer than ``SPLIT_PER_SM``
programs per SM, and the plan has one reduction level whose states merge (sums, max/min, online
log-sum-exp, Chan's moments) and an output per element, each row is split over a power of two of
programs: a first launch reduces each part and stores its partial states, a second merges a row's
states and writes each part, walking the programs in reverse so that the parts read last are still
in L2. Cross-entropy and two-level plans keep one program per row. The default, 4 programs per SM,
was the best that ``bench/split_rows.py`` measured on the H100 (``bench/results/split_rows.md``),
when 8 or 32 parts per row were 2.7x and 9x slower than unsplit. Since the output launch takes a
row's statistics as scalars (``bench/results/split_rows_ncu/`` says why it mattered) and GroupNorm's
per-channel operands load two values per block, ``bench/results/long_rows.md`` measures GroupNorm's
256 rows of 262144 elements at 0.154 ms in 2 parts (the default), 0.152 ms in 8, 0.161 ms unsplit.
The output launch walks each part forward, unhinted: walked back with ``evict_first``, as one-program
rows are, GroupNorm's best configuration ran 0.1602 ms against 0.1539 (``long_rows_walk.md``).

Those two launches read each element twice from DRAM, which caps them near two thirds of the DRAM
floor. A third way reads it once (``WAIT_PART``; the tuning space tries it first when the example
has few long rows): one launch, a row in up to ``MAX_SPLITS`` parts of at most ``WAIT_PART``
columns, one per program, which reduces its part, stores its partial states and counts itself in a
per-row counter (kept between calls: no memset launch); and writes a part, reading it again from L2,
once that part's row has been counted whole. With ``WAIT_LAG`` 0 that is its own part, after the
row's other parts (its neighbours, which a GPU starts together) have posted: every program waits for
its row's slowest part with nothing in flight. With ``WAIT_LAG`` (tried first) program i first
writes part i - lag, the lag sized so that the parts read in between span that share of L2 (and at
least a row's parts): its row was read by programs started well before, so it rarely waits, and only
for programs started before it. A program that has polled ``SPIN_POLLS`` times reduces the whole row
itself, in small chunks, for itself alone, so no schedule deadlocks; the CPU interpreter runs one
program at a time, in order. On the H100 (``bench/results/waiting_counters.md``) GroupNorm's rows
ran in 0.1085 ms lagged (28 % of L2, parts of 8192 columns, 48 registers a thread) against 0.1266 ms
unlagged, 0.153 ms in two launches and 0.185 ms for ``torch.compile``: 82 % of the calibrated copy
bandwidth in the suite's run (``suite_h100.md``, where L2 is at 91 % of its peak). Rows kept on chip
instead ran slower: a CUDA C++ thread-block cluster per row, its statistics merged through
distributed shared memory, 1.10x at best (``cluster_rows.md``). Where every chunk
is whole (``EVEN_COLS``) the kernels drop the column mask, where a GroupNorm block never straddles
two channels (``ONE_CHANNEL``) the per-column channel select, and where no operand reaches 2**31
elements (``OFF64`` false) they compute offsets in 32 bits: together with the fallback's smaller
chunks, that took GroupNorm's parts of 8192 columns from 108-110 registers to 48.

Known limits: max/min reductions do not propagate NaN as ``torch.amax`` does; an operand needed both
per element and per row (a scalar weight used on both sides of a reduction) is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.pointwise import (
    CONTAINER_SOURCE,
    FLOAT_DTYPES,
    INT_DTYPES,
    SUPPORTED_OPS,
    TRITON_DTYPES,
    Operand,
    Step,
    Unsupported,
    _Emitter,
    _forward_param,
    _key,
    _Lowering,
    _operand_expr,
    _reachable,
    _simple_literal,
    _state_lines,
    arch_class,
)

#: Most leading dims (after coalescing) that the kernel's row -> coordinates indexing handles.
MAX_LEAD = 4
DEFAULT_PARAMS = {
    "MAX_SINGLE": 8192,
    "CHUNK": 2048,
    "TILE": 2048,
    "num_warps": 4,
    "SPLIT_PER_SM": 4,
    "WAIT_PART": 0,
    "WAIT_LAG": 0,
}

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
MAX_SPLITS = 64
#: Polls of its row's count before a waiting program stops waiting and reduces the row itself.
SPIN_POLLS = 20000
#: Examples with at most this many long rows (4 programs per SM on a GPU of 256 SMs) may split them.
FEW_ROWS = 512

#: Torch-level ops this strategy handles besides the pointwise ones.
ROW_OPS = frozenset(
    {
        *("softmax", "log_softmax", "logsumexp", "layer_norm", "rms_norm", "normalize", "norm"),
        *("linalg_vector_norm", "sum", "mean", "amax", "amin", "max", "min", "cross_entropy"),
        *("masked_fill", "group_norm", "var", "std"),
    }
)
RESHAPE_OPS = frozenset({"view", "reshape", "flatten"})
#: Ops that read a tensor's metadata (shape arguments of a reshape), never its values.
META_OPS = frozenset({"size", "dim", "numel", "getattr", "getitem"})

_REQUIRED = object()
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "softmax": (("input", _REQUIRED), ("dim", None), ("_stacklevel", 3), ("dtype", None)),
    "layer_norm": (
        *(("input", _REQUIRED), ("normalized_shape", _REQUIRED), ("weight", None), ("bias", None)),
        *(("eps", 1e-5), ("cudnn_enable", True)),
    ),
    "rms_norm": (("input", _REQUIRED), ("normalized_shape", _REQUIRED), ("weight", None), ("eps", None)),
    "normalize": (("input", _REQUIRED), ("p", 2.0), ("dim", 1), ("eps", 1e-12), ("out", None)),
    "norm": (
        *(("input", _REQUIRED), ("p", "fro"), ("dim", None), ("keepdim", False)),
        *(("out", None), ("dtype", None)),
    ),
    "linalg_vector_norm": (
        *(("input", _REQUIRED), ("ord", 2), ("dim", None), ("keepdim", False)),
        *(("dtype", None), ("out", None)),
    ),
    "sum": (("input", _REQUIRED), ("dim", None), ("keepdim", False), ("dtype", None), ("out", None)),
    "amax": (("input", _REQUIRED), ("dim", ()), ("keepdim", False), ("out", None)),
    "max": (("input", _REQUIRED), ("dim", None), ("keepdim", False), ("out", None)),
    "logsumexp": (("input", _REQUIRED), ("dim", _REQUIRED), ("keepdim", False), ("out", None)),
    # torch.var(x, dim, unbiased, keepdim) or torch.var(x, dim, *, correction=, keepdim=)
    "var": (
        *(("input", _REQUIRED), ("dim", None), ("unbiased", None), ("keepdim", False)),
        *(("correction", None), ("out", None)),
    ),
    "cross_entropy": (
        *(("input", _REQUIRED), ("target", _REQUIRED), ("weight", None), ("size_average", None)),
        *(("ignore_index", -100), ("reduce", None), ("reduction", "mean"), ("label_smoothing", 0.0)),
    ),
    "masked_fill": (("input", _REQUIRED), ("mask", _REQUIRED), ("value", _REQUIRED)),
    "group_norm": (
        *(("input", _REQUIRED), ("num_groups", _REQUIRED), ("weight", None), ("bias", None)),
        *(("eps", 1e-5), ("cudnn_enabled", True)),
    ),
}
SIGNATURES["log_softmax"] = SIGNATURES["softmax"]
SIGNATURES["mean"] = SIGNATURES["sum"]
SIGNATURES["amin"] = SIGNATURES["amax"]
SIGNATURES["min"] = SIGNATURES["max"]
SIGNATURES["std"] = SIGNATURES["var"]

#: ``torch.finfo(dtype).eps``: what ``F.rms_norm`` uses when ``eps`` is None.
FINFO_EPS = {
    "float16": 0.0009765625,
    "bfloat16": 0.0078125,
    "float32": 1.1920928955078125e-07,
    "float64": 2.220446049250313e-16,
}


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


# ----------------------------------------------------------------------------------------------
# Matching: the traced graph -> the IR
# ----------------------------------------------------------------------------------------------


def match(analysis: TaskAnalysis) -> tuple[RowPlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    try:
        plan = _match(analysis)
    except Unsupported as exc:
        return None, str(exc)
    kinds = ", ".join(dict.fromkeys(op for op in plan.ops if op in ROW_OPS and op != "masked_fill"))
    fused = ", ".join(dict.fromkeys(op for op in plan.ops if op not in ROW_OPS)) or "nothing else"
    passes = plan.levels + (1 if plan.result_layout == "row" else 0)
    rows = (
        f"normalizes {plan.groups} groups of channels of each sample"
        if plan.groups is not None
        else "reduces each row of its last dim"
    )
    return plan, (
        f"the forward {rows} ({kinds}; fused with it: {fused}): one kernel, "
        f"one pass in registers when a row fits, {passes} pass(es) over longer rows, "
        f"fp32 accumulation, one {plan.out_dtype} output"
    )


def _match(a: TaskAnalysis) -> RowPlan:
    if not a.traced:
        raise Unsupported(f"the module could not be traced with torch.fx: {a.trace_error}")
    outputs = a.outputs
    if len(outputs) != 1 or outputs[0].get("ref") is None:
        raise Unsupported(f"the forward must return one tensor (it returns {len(outputs)} values)")
    out = outputs[0]
    if out.get("dtype") not in FLOAT_DTYPES:
        raise Unsupported(f"the output dtype is {out.get('dtype')}; only floating-point outputs are handled")
    if any(e.get("kind") == "extra_state" for e in a.state_dict):
        raise Unsupported("the module has extra state in its state dict")
    for arg in a.forward_args:
        if not arg["name"].isidentifier():
            raise Unsupported(f"forward argument {arg['name']!r} (varargs are not supported)")
        if "default" in arg and not _simple_literal(arg["default"]):
            raise Unsupported(f"forward argument {arg['name']!r} has a default that is not a literal")
    needed = _reachable(a, out["ref"])
    lowering = _RowLowering(a)
    for node in a.nodes:
        if node["name"] in needed and node["kind"] != "output":
            lowering.visit(node)
    result = lowering.values[out["ref"]]
    if result[0] not in ("t", "in"):
        raise Unsupported("the output is not a tensor computed from the inputs")
    if not lowering.row_shapes:
        raise Unsupported("no reduction over the last dim: the forward is elementwise (see fused_pointwise)")
    if any(shape and shape[-1] == 1 for shape in lowering.row_shapes):
        raise Unsupported("rows of length 1 in the example inputs: per-element and per-row values look alike")
    if lowering.loss is not None and result != lowering.loss[0]:
        raise Unsupported("ops after cross_entropy are not supported: the loss must be the output")

    operands, steps, result, reshapes, index_ops = _prune(lowering, result)
    spaces, layouts, result_layout = _place(operands, steps, result, index_ops)
    if lowering.groups is not None and (result_layout != "row" or set(layouts) != {"row"}):
        raise Unsupported("group_norm with per-row operands or a per-group output")
    row_shape = _row_shape(a, lowering, operands, layouts)
    lead = row_shape[:-1]
    for i, op in enumerate(operands):
        target = {"row": row_shape, "kd": (*lead, 1), "flat": lead}[layouts[i]]
        if _broadcast(op.shape, target) != target:
            raise Unsupported(
                f"operand {op.name} {list(op.shape)} does not broadcast to the "
                f"{'rows' if layouts[i] == 'row' else 'per-row values'} {list(target)}"
            )
    loss_reduction = None
    if lowering.loss is not None and lowering.loss[1] != "none":
        loss_reduction = lowering.loss[1]
        expected: tuple[int, ...] = ()
    else:
        expected = {"row": row_shape, "kd": (*lead, 1), "flat": lead}[result_layout]
    if tuple(out.get("shape") or ()) != expected:
        raise Unsupported(
            f"the output {out.get('shape')} is not the rows {list(row_shape)} or one value per row: "
            "an operand broadcasts the result beyond the reduced rows"
        )
    wide = any(o.dtype == "float64" for o in operands) or any(
        a.node(n).get("dtype") == "float64" for n in needed if a.node(n)["kind"] != "output"
    )
    return RowPlan(
        operands=operands,
        layouts=layouts,
        reshapes=reshapes,
        index_operands=frozenset(index_ops),
        steps=steps,
        result=result,
        result_layout=result_layout,
        spaces=spaces,
        stages=_stages(steps),
        forward_args=a.forward_args,
        out_dtype=out["dtype"],
        out_shape=tuple(out.get("shape") or ()),
        row_shape=row_shape,
        compute_dtype="float64" if wide else "float32",
        loss_reduction=loss_reduction,
        groups=lowering.groups,
        ops=lowering.ops,
    )


def _broadcast(*shapes: tuple[int, ...] | list[int]) -> tuple[int, ...] | None:
    """NumPy broadcasting of ``shapes``; None when they do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _row_shape(
    a: TaskAnalysis, lowering: _RowLowering, operands: list[Operand], layouts: list[str]
) -> tuple[int, ...]:
    """The rows every reduction reduces, checked to be the broadcast of the per-element operands."""
    shapes = {tuple(s) for s in lowering.row_shapes}
    if len(shapes) != 1:
        raise Unsupported(f"the reductions reduce rows of different shapes {sorted(shapes)}")
    row_shape = shapes.pop()
    if not row_shape:
        raise Unsupported("a reduction of a 0-d tensor")
    per_element = [op.shape for op, layout in zip(operands, layouts, strict=True) if layout == "row"]
    if _broadcast(*per_element) != row_shape:
        raise Unsupported(
            f"the reduced rows {list(row_shape)} are not the broadcast of the per-element operands "
            f"{[list(s) for s in per_element]}"
        )
    return row_shape


def _prune(
    lowering: _RowLowering, result: tuple[str, Any]
) -> tuple[list[Operand], list[Step], tuple[str, Any], list[str | None], set[int]]:
    """Drop the operands nothing reads (an input only read through a reshape) and renumber the rest."""
    used: list[int] = []
    for s in lowering.steps:
        for arg in s.args:
            if arg[0] == "in" and arg[1] not in used:
                used.append(arg[1])
    if result[0] == "in" and result[1] not in used:
        used.append(result[1])
    used.sort()
    new = {old: i for i, old in enumerate(used)}

    def remap(v: tuple[str, Any]) -> tuple[str, Any]:
        return ("in", new[v[1]]) if v[0] == "in" else v

    steps = [Step(s.out, s.op, tuple(remap(x) for x in s.args), s.attrs) for s in lowering.steps]
    operands = [lowering.operands[i] for i in used]
    reshapes = [lowering.reshapes.get(i) for i in used]
    index_ops = {new[i] for i in lowering.index_operands if i in new}
    return operands, steps, remap(result), reshapes, index_ops


def _outs(s: Step) -> list[str]:
    """The value keys a step defines."""
    if s.op in REDUCTIONS:
        return [f"t:{s.out}{suffix}" for suffix in REDUCTIONS[s.op]]
    return [f"t:{s.out}"]


def _place(
    operands: list[Operand], steps: list[Step], result: tuple[str, Any], index_ops: set[int]
) -> tuple[dict[str, str], list[str], str]:
    """Where each value is computed (``row``/``red``), each operand's layout and the result's.

    A value computed from operands and constants only (``w * 2``) is *free*: it is computed where
    its users need it, and must not be needed both per element and per row. A free value meeting a
    per-row value with keepdim is per element when its last dim is longer than 1 (``y - s``, ``y``
    of the rows' shape), per row otherwise (``s + b``, ``b`` of shape ``(B, 1)`` or a scalar).
    """
    where: dict[str, tuple[str, str | None] | None] = {f"in:{i}": None for i in range(len(operands))}
    free_shape: dict[str, tuple[int, ...]] = {f"in:{i}": op.shape for i, op in enumerate(operands)}
    for s in steps:
        keys = [_key(v) for v in s.args if v[0] != "c"]
        if s.op in REDUCTIONS:
            if s.args[0][0] == "c":
                raise Unsupported(f"{s.out} reduces a constant")
            source = where[keys[0]]
            if source is not None and source[0] == "red":
                raise Unsupported(f"{s.out} reduces a value that is already one per row")
            for k in _outs(s):
                where[k] = ("red", s.attr("form"))
            continue
        found = {where[k] for k in keys} - {None}
        free = [free_shape[k] for k in keys if where[k] is None]
        if not found:
            where[f"t:{s.out}"] = None
            free_shape[f"t:{s.out}"] = _broadcast(*free) or ()
            continue
        if ("red", "kd") in found and any(shape and shape[-1] > 1 for shape in free):
            found.add(("row", None))
        if ("row", None) in found:
            if ("red", "flat") in found:
                raise Unsupported(
                    f"{s.out} combines the rows with a per-row value reduced without keepdim "
                    "(it broadcasts along the columns, not per row)"
                )
            where[f"t:{s.out}"] = ("row", None)
        else:
            forms = {f for _, f in found}
            if len(forms) > 1:
                raise Unsupported(f"{s.out} mixes per-row values with and without keepdim")
            where[f"t:{s.out}"] = ("red", forms.pop())
    res_key = _key(result)
    if where[res_key] is None:
        raise Unsupported("the output does not depend on a reduction")

    need: dict[str, set[tuple[str, str | None]]] = {}

    def demand(value: tuple[str, Any], ctx: tuple[str, str | None]) -> None:
        if value[0] != "c" and where[_key(value)] is None:
            need.setdefault(_key(value), set()).add(ctx)

    for s in reversed(steps):
        if s.op in REDUCTIONS:
            demand(s.args[0], ("row", None))
            for extra in s.args[1:]:
                demand(extra, ("red", "flat"))
            continue
        ctx = where[f"t:{s.out}"]
        if ctx is None:
            wanted = need.get(f"t:{s.out}", set())
            if len(wanted) > 1:
                raise Unsupported(f"{s.out} is needed both per element and per row")
            if not wanted:
                continue
            ctx = next(iter(wanted))
            where[f"t:{s.out}"] = ctx
        for arg in s.args:
            demand(arg, ctx)
    layouts = []
    for i, op in enumerate(operands):
        wanted = need.get(f"in:{i}", set())
        if len(wanted) != 1:
            raise Unsupported(f"operand {op.name} is used both per element and per row")
        space, form = next(iter(wanted))
        layouts.append("row" if space == "row" else str(form))
        where[f"in:{i}"] = (space, form)
    for s in steps:
        if s.op not in REDUCTIONS and any(v[0] == "in" and v[1] in index_ops for v in s.args):
            raise Unsupported(f"{s.out} computes with the integer targets of cross_entropy")
    spaces = {k: v[0] for k, v in where.items() if v is not None}
    space, form = where[res_key] or ("row", None)
    return spaces, layouts, "row" if space == "row" else str(form)


def _stages(steps: list[Step]) -> dict[str, int]:
    """How many reductions, one after another, each value needs (0 for operands and their math)."""
    stage: dict[str, int] = {}

    def of(v: tuple[str, Any]) -> int:
        return 0 if v[0] == "c" else stage.get(_key(v), 0)

    for s in steps:
        level = max((of(v) for v in s.args), default=0)
        for k in _outs(s):
            stage[k] = level + 1 if s.op in REDUCTIONS else level
    return stage


class _RowLowering(_Lowering):
    """The pointwise lowering plus row reductions, reshapes of inputs and shape metadata."""

    def __init__(self, analysis: TaskAnalysis) -> None:
        super().__init__(analysis)
        self.row_shapes: list[list[int]] = []
        self.tuples: dict[str, tuple[str, Any]] = {}
        self.reshapes: dict[int, str] = {}
        self.index_operands: set[int] = set()
        self.weights: dict[str, tuple[str, Any]] = {}
        self.loss: tuple[tuple[str, Any], str] | None = None
        self.groups: int | None = None

    # --- values --------------------------------------------------------------------------------
    def arg(self, value: Any, node: dict[str, Any]) -> tuple[str, Any]:
        if isinstance(value, dict) and set(value) == {"float"}:  # inf / nan constants
            number = float(value["float"])
            if math.isnan(number):
                raise Unsupported(f"{node['name']} ({node['op']}): a NaN constant")
            return ("c", number)
        if isinstance(value, dict) and set(value) == {"ref"}:
            found = self.values[value["ref"]]
            if found[0] in ("meta", "tuple"):
                raise Unsupported(
                    f"{node['name']} ({node['op']}) computes with {value['ref']}, which is not a tensor"
                )
            return found
        return super().arg(value, node)

    def weight(self, value: Any, node: dict[str, Any]) -> tuple[str, Any] | None:
        """A weight argument: None, a module's own parameter (``{"param": path}``) or a graph value."""
        if value is None:
            return None
        if isinstance(value, dict) and set(value) == {"param"}:
            path = value["param"]
            if path not in self.weights:
                entry = next((p for p in self.a.state_dict if p["name"] == path), None)
                if entry is None or entry.get("kind") == "extra_state":
                    raise Unsupported(f"{node['name']}: weight {path!r} is not in the state dict")
                if entry["dtype"] not in FLOAT_DTYPES:
                    raise Unsupported(f"{node['name']}: weight {path!r} has dtype {entry['dtype']}")
                self.operands.append(Operand(path, entry["kind"], tuple(entry["shape"]), entry["dtype"]))
                self.weights[path] = ("in", len(self.operands) - 1)
                self.kinds[_key(self.weights[path])] = "f"
            return self.weights[path]
        return self.num(self.arg(value, node), node["name"])

    def reduce(
        self, name: str, op: str, x: tuple[str, Any], keepdim: bool, extra: tuple[Any, ...] = (), **attrs: Any
    ) -> list[tuple[str, Any]]:
        """Emit a row reduction of ``x``; returns the values it defines."""
        attrs["form"] = "kd" if keepdim else "flat"
        self.steps.append(Step(name, op, (x, *extra), tuple(sorted(attrs.items()))))
        values = [("t", f"{name}{suffix}") for suffix in REDUCTIONS[op]]
        for v in values:
            self.kinds[_key(v)] = "f"
        return values

    # --- nodes ---------------------------------------------------------------------------------
    def visit(self, node: dict[str, Any]) -> None:
        kind, op, name = node["kind"], node["op"], node["name"]
        if not kind.startswith("call_"):
            super().visit(node)
            return
        args = node["args"]
        first = args[0].get("ref") if args and isinstance(args[0], dict) else None
        if op in ("getitem", "getattr") and first in self.tuples:
            index = args[1] if len(args) > 1 else None
            if index not in (0, "values"):
                raise Unsupported(f"{name}: the indices of {first} (argmax/argmin) are not supported")
            self.values[name] = self.tuples[first]
            return
        if node.get("shape") is None and op in META_OPS:
            self.values[name] = ("meta", name)
            return
        if op in RESHAPE_OPS:
            self.ops.append(op)
            self.reshape(node)
            return
        if op in ROW_OPS:
            if node.get("inplace"):
                raise Unsupported(f"{op} ({name}) in place")
            self.ops.append(op)
            getattr(self, f"lower_{op}")(node, self.bind_row(node, op))
            return
        if op not in SUPPORTED_OPS:
            where = (
                f"{node['module_type'].rsplit('.', 1)[-1]} at {node['target']!r}"
                if "module_type" in node
                else node["target"]
            )
            raise Unsupported(f"op {op!r} ({where}) is neither pointwise nor a row reduction")
        super().visit(node)

    def bind_row(self, node: dict[str, Any], op: str) -> dict[str, Any]:
        sig = SIGNATURES[op]
        names = [n for n, _ in sig]
        args, kwargs = list(node["args"]), dict(node["kwargs"])
        if op in ("softmax", "log_softmax") and len(args) == 3 and isinstance(args[2], dict):
            kwargs["dtype"] = args.pop()  # torch.softmax(x, dim, dtype): no _stacklevel
        if len(args) > len(sig):
            raise Unsupported(f"{op} ({node['name']}): {len(args)} positional arguments")
        bound = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names:
                raise Unsupported(f"{op} ({node['name']}): argument {key!r} is not supported")
            bound[key] = value
        for key, default in sig:
            if key not in bound:
                if default is _REQUIRED:
                    raise Unsupported(f"{op} ({node['name']}): missing argument {key!r}")
                bound[key] = default
        if bound.get("out") is not None:
            raise Unsupported(f"{op} ({node['name']}) with out=")
        return bound

    def row_input(self, node: dict[str, Any], b: dict[str, Any], dim: Any, what: str) -> tuple[str, Any]:
        """The reduced input as a number, after checking that ``dim`` is its last dim."""
        if self.groups is not None:
            raise Unsupported(f"{node['op']} ({node['name']}) next to group_norm (its rows are groups)")
        ref = b["input"].get("ref") if isinstance(b["input"], dict) else None
        if ref is None:
            raise Unsupported(f"{what} ({node['name']}) of a constant")
        shape = self.a.node(ref).get("shape")
        if shape is None or self.a.node(ref).get("dtype") not in FLOAT_DTYPES:
            raise Unsupported(f"{what} ({node['name']}) of a non-floating-point value")
        _check_last_dim(dim, len(shape), f"{what} ({node['name']})")
        self.row_shapes.append(shape)
        x = self.num(self.arg(b["input"], node), node["name"])
        dtype = b.get("dtype")
        if dtype is not None:  # computes in that dtype: the input is cast first
            x = self.cast({"name": f"{node['name']}_in", "dtype": dtype["dtype"]}, x)
        return x

    def lower_softmax(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        name = node["name"]
        x = self.row_input(node, b, b["dim"], node["op"])
        m, s = self.reduce(f"{name}_lse", "rlse", x, keepdim=True)
        shifted = self.emit(f"{name}_shift", "sub", [x, m])
        if node["op"] == "softmax":
            e = self.emit(f"{name}_exp", "exp", [shifted])
            self.values[name] = self.emit(name, "div", [e, s])
        else:
            log_s = self.emit(f"{name}_logs", "log", [s])
            self.values[name] = self.emit(name, "sub", [shifted, log_s])

    lower_log_softmax = lower_softmax

    def lower_logsumexp(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        name = node["name"]
        x = self.row_input(node, b, b["dim"], "logsumexp")
        m, s = self.reduce(f"{name}_lse", "rlse", x, keepdim=bool(b["keepdim"]))
        # m + log(s), with m of a fully -inf row replaced by 0 (as torch.logsumexp: -inf, not NaN)
        safe = self.emit(
            f"{name}_safe",
            "where",
            [self.emit(f"{name}_fin", "ne", [m, ("c", -math.inf)], kind="b"), m, ("c", 0.0)],
        )
        log_s = self.emit(f"{name}_logs", "log", [s])
        self.values[name] = self.emit(name, "add", [safe, log_s])

    def lower_layer_norm(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        name = node["name"]
        _normalized_shape(b["normalized_shape"], node)
        x = self.row_input(node, b, -1, "layer_norm")
        eps = _number(b["eps"], node, "eps")
        mean, var = self.reduce(f"{name}_mom", "rmoments", x, keepdim=True)
        centered = self.emit(f"{name}_c", "sub", [x, mean])
        rstd = self.emit(f"{name}_rstd", "rsqrt", [self.emit(f"{name}_ve", "add", [var, ("c", eps)])])
        y = self.emit(f"{name}_n", "mul", [centered, rstd])
        w, bias = self.weight(b["weight"], node), self.weight(b["bias"], node)
        if w is not None:
            y = self.emit(f"{name}_w", "mul", [y, w])
        if bias is not None:
            y = self.emit(f"{name}_b", "add", [y, bias])
        self.values[name] = y

    def lower_group_norm(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        """GroupNorm: each (sample, group) of an (N, C, *) tensor is a contiguous row of C/G * prod(*)."""
        name = node["name"]
        ref = b["input"].get("ref") if isinstance(b["input"], dict) else None
        shape = self.a.node(ref).get("shape") if ref else None
        if shape is None or len(shape) < 2 or self.a.node(ref).get("dtype") not in FLOAT_DTYPES:
            raise Unsupported(f"group_norm ({name}) of an input that is not an (N, C, *) float tensor")
        groups = b["num_groups"]
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or shape[1] % groups:
            raise Unsupported(f"group_norm ({name}) with num_groups={groups!r} for {shape[1]} channels")
        if self.row_shapes:
            raise Unsupported(f"group_norm ({name}) next to another reduction")
        self.groups = groups
        self.row_shapes.append(shape)
        x = self.num(self.arg(b["input"], node), name)
        eps = _number(b["eps"], node, "eps")
        mean, var = self.reduce(f"{name}_mom", "rmoments", x, keepdim=True)
        centered = self.emit(f"{name}_c", "sub", [x, mean])
        rstd = self.emit(f"{name}_rstd", "rsqrt", [self.emit(f"{name}_ve", "add", [var, ("c", eps)])])
        y = self.emit(f"{name}_n", "mul", [centered, rstd])
        for key, op in (("weight", "mul"), ("bias", "add")):
            w = self.channel_weight(b[key], node, len(shape) - 2)
            if w is not None:
                y = self.emit(f"{name}_{key}", op, [y, w])
        self.values[name] = y

    def channel_weight(self, value: Any, node: dict[str, Any], spatial: int) -> tuple[str, Any] | None:
        """A per-channel (C,) weight, read as (C, 1, ...) so it broadcasts along dim 1 as GroupNorm applies it."""
        w = self.weight(value, node)
        if w is None:
            return None
        if w[0] != "in" or len(self.operands[w[1]].shape) != 1:
            raise Unsupported(f"{node['op']} ({node['name']}): a weight that is not a (C,) tensor")
        source = self.operands[w[1]]
        shape = (source.shape[0], *([1] * spatial))
        self.operands.append(Operand(source.name, source.source, shape, source.dtype))
        value_ = ("in", len(self.operands) - 1)
        self.reshapes[value_[1]] = "channel"
        self.kinds[_key(value_)] = "f"
        return value_

    def lower_rms_norm(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        name = node["name"]
        _normalized_shape(b["normalized_shape"], node)
        x = self.row_input(node, b, -1, "rms_norm")
        dtype = self.a.node(b["input"]["ref"]).get("dtype")
        eps = (
            FINFO_EPS.get(str(dtype), FINFO_EPS["float32"])
            if b["eps"] is None
            else _number(b["eps"], node, "eps")
        )
        (ms,) = self.reduce(f"{name}_ms", "rmean", self.emit(f"{name}_sq", "mul", [x, x]), keepdim=True)
        rms = self.emit(f"{name}_r", "rsqrt", [self.emit(f"{name}_me", "add", [ms, ("c", eps)])])
        y = self.emit(f"{name}_n", "mul", [x, rms])
        w = self.weight(b["weight"], node)
        self.values[name] = y if w is None else self.emit(f"{name}_w", "mul", [y, w])

    def norm_of(self, node: dict[str, Any], x: tuple[str, Any], p: Any, keepdim: bool) -> tuple[str, Any]:
        """The p-norm of each row: p = 2 ('fro'), 1 or inf."""
        name = node["name"]
        if p in (2, 2.0, "fro"):
            (ss,) = self.reduce(f"{name}_ss", "rsum", self.emit(f"{name}_sq", "mul", [x, x]), keepdim)
            return self.emit(f"{name}_norm", "sqrt", [ss])
        if p in (1, 1.0):
            return self.reduce(f"{name}_l1", "rsum", self.emit(f"{name}_abs", "abs", [x]), keepdim)[0]
        if isinstance(p, dict) and p.get("float") == "inf":
            return self.reduce(f"{name}_linf", "rmax", self.emit(f"{name}_abs", "abs", [x]), keepdim)[0]
        raise Unsupported(f"{node['op']} ({name}) with p={p!r} (2, 'fro', 1 and inf are supported)")

    def lower_normalize(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        x = self.row_input(node, b, b["dim"], "normalize")
        norm = self.norm_of(node, x, b["p"], keepdim=True)
        denom = self.emit(
            f"{node['name']}_den",
            "clamp",
            [norm, ("c", _number(b["eps"], node, "eps"))],
            has_min=True,
            has_max=False,
        )
        self.values[node["name"]] = self.emit(node["name"], "div", [x, denom])

    def lower_norm(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        x = self.row_input(node, b, b["dim"], node["op"])
        self.values[node["name"]] = self.norm_of(node, x, b.get("p", b.get("ord")), bool(b["keepdim"]))

    def lower_linalg_vector_norm(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        b["p"] = b["ord"]
        self.lower_norm(node, b)

    def lower_sum(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        x = self.row_input(node, b, b["dim"], node["op"])
        op = {"sum": "rsum", "mean": "rmean", "amax": "rmax", "amin": "rmin", "max": "rmax", "min": "rmin"}
        self.values[node["name"]] = self.reduce(node["name"], op[node["op"]], x, bool(b["keepdim"]))[0]

    lower_mean = lower_amax = lower_amin = lower_sum

    def lower_max(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        if b["dim"] is None:
            raise Unsupported(
                f"{node['op']} ({node['name']}) over every element (only the last dim is supported)"
            )
        self.lower_sum(node, b)
        self.tuples[node["name"]] = self.values.pop(node["name"])
        self.values[node["name"]] = ("tuple", node["name"])

    lower_min = lower_max

    def lower_var(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        """torch.var / torch.std: the moments' M2 over n - correction (1 unless unbiased=False)."""
        name = node["name"]
        if b["unbiased"] is not None and b["correction"] is not None:
            raise Unsupported(f"{node['op']} ({name}) with both unbiased= and correction=")
        if b["correction"] is not None:
            correction = _number(b["correction"], node, "correction")
        else:
            correction = 0.0 if b["unbiased"] is False else 1.0
        x = self.row_input(node, b, b["dim"], node["op"])
        _, var = self.reduce(f"{name}_mom", "rmoments", x, bool(b["keepdim"]), correction=correction)
        self.values[name] = var if node["op"] == "var" else self.emit(name, "sqrt", [var])

    lower_std = lower_var

    def lower_masked_fill(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        name = node["name"]
        x = self.num(self.arg(b["input"], node), name)
        mask = self.mask(self.arg(b["mask"], node), f"masked_fill ({name})'s mask")
        value = self.num(self.arg(b["value"], node), name)
        self.values[name] = self.emit(name, "where", [mask, value, x])

    def lower_cross_entropy(self, node: dict[str, Any], b: dict[str, Any]) -> None:
        name = node["name"]
        for key, default in (("weight", None), ("size_average", None), ("reduce", None)):
            if b[key] is not default:
                raise Unsupported(f"cross_entropy ({name}) with {key}= (class weights, legacy flags)")
        if b["label_smoothing"] not in (0, 0.0):
            raise Unsupported(f"cross_entropy ({name}) with label_smoothing={b['label_smoothing']}")
        if b["reduction"] not in ("mean", "sum", "none"):
            raise Unsupported(f"cross_entropy ({name}) with reduction={b['reduction']!r}")
        ignore = b["ignore_index"]
        if isinstance(ignore, bool) or not isinstance(ignore, int):
            raise Unsupported(f"cross_entropy ({name}) with ignore_index={ignore!r}")
        ref = b["input"].get("ref") if isinstance(b["input"], dict) else None
        shape = self.a.node(ref).get("shape") if ref else None
        if shape is None or len(shape) != 2:
            dims = "?" if shape is None else len(shape)
            raise Unsupported(
                f"cross_entropy ({name}) of rank-{dims} logits: the classes are dim 1, a reduction over "
                "dim 1; only (N, C) logits are supported (flatten the rest first)"
            )
        target = self.arg(b["target"], node) if isinstance(b["target"], dict) else None
        if target is None or target[0] != "in" or self.operands[target[1]].dtype not in INT_DTYPES:
            raise Unsupported(f"cross_entropy ({name}): the target must be an integer input (class indices)")
        if len(self.operands[target[1]].shape) != 1:
            raise Unsupported(
                f"cross_entropy ({name}): targets of shape {list(self.operands[target[1]].shape)}"
            )
        self.index_operands.add(target[1])
        x = self.row_input(node, b, -1, "cross_entropy")
        loss, _ = self.reduce(name, "rce", x, keepdim=False, extra=(target,), ignore_index=ignore)
        self.values[name] = loss
        self.loss = (loss, b["reduction"])

    def reshape(self, node: dict[str, Any]) -> None:
        """view/reshape/flatten of a forward input that only merges its leading dims (or all, for targets)."""
        name = node["name"]
        ref = node["args"][0].get("ref") if node["args"] and isinstance(node["args"][0], dict) else None
        if ref is None:
            raise Unsupported(f"{node['op']} ({name}) of a constant")
        source = self.a.node(ref)
        before, after = source.get("shape"), node.get("shape")
        if before is None or after is None:
            raise Unsupported(f"{node['op']} ({name}) of a non-tensor")
        if before == after:
            self.values[name] = self.values[ref]
            return
        if source["kind"] != "placeholder":
            raise Unsupported(
                f"{node['op']} ({name}) of a computed value {before} -> {after}: only forward inputs may be reshaped"
            )
        if len(after) == 2 and len(before) >= 2 and after[-1] == before[-1]:
            mode = "rows"
        elif len(after) == 1 and source.get("dtype") in INT_DTYPES:
            mode = "flat"
        else:
            raise Unsupported(
                f"{node['op']} ({name}) reshapes {before} to {after}: only merging the leading dims is supported"
            )
        self.operands.append(Operand(source["target"], "input", tuple(after), source["dtype"]))
        value = ("in", len(self.operands) - 1)
        self.reshapes[value[1]] = mode
        self.kinds[_key(value)] = "f"
        self.values[name] = value


def _check_last_dim(dim: Any, rank: int, what: str) -> None:
    if isinstance(dim, list | tuple):
        if len(dim) != 1:
            raise Unsupported(
                f"{what} reduces over dims {list(dim) or 'all'}; only the last dim alone is supported"
            )
        dim = dim[0]
    if dim is None:
        raise Unsupported(
            f"{what} reduces over every element; only a reduction over the last dim is supported"
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise Unsupported(f"{what} with dim={dim!r}")
    if rank == 0 or not -rank <= dim < rank:
        raise Unsupported(f"{what}: dim {dim} of a rank-{rank} tensor")
    if dim % rank != rank - 1:
        raise Unsupported(
            f"reduction over dim {dim} (not the last of a rank-{rank} tensor) in {what}: "
            "only reductions over the last dim are supported"
        )


def _normalized_shape(value: Any, node: dict[str, Any]) -> None:
    """Check that a norm normalizes the last dim alone (its size is the input's: torch checks it)."""
    if isinstance(value, dict):  # a shape computed in the forward (x.shape[-2:]): its length is unknown
        raise Unsupported(f"{node['op']} ({node['name']}) over a normalized shape computed at run time")
    shape = value if isinstance(value, list) else [value]
    if len(shape) != 1:
        raise Unsupported(
            f"{node['op']} ({node['name']}) over the last {len(shape)} dims: only the last dim is supported"
        )


def _number(value: Any, node: dict[str, Any], what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Unsupported(f"{node['op']} ({node['name']}): {what} must be a finite number, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------


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
        # rows of the multi-pass class: bigger chunks (more loads in flight per program) first, as
        # bench/results/long_rows.md measured on the H100 (log_softmax 0.219 ms at 8192 against 0.252
        # at 4096; GroupNorm 0.154 against 0.170; cross-entropy even). It measured (16384, 8192, 2048,
        # 2), whose multi-pass launches (8 warps, one row per program) are the same as (16384, 8192,
        # 4096, 4): 4 warps are within the knowledge base's seed advice, 2 were not, which put it last.
        configs.sort(key=lambda c: -c[1])
    space = [{"MAX_SINGLE": s, "CHUNK": c, "TILE": t, "num_warps": w} for s, c, t, w in configs]
    if splittable(plan):  # rows split by default (SPLIT_PER_SM 4); the first config unsplit too
        space.append({**space[0], "SPLIT_PER_SM": 0})
        if row_count(plan) <= FEW_ROWS and row_length(plan) > max(c[0] for c in configs):
            # few long rows, split: first in one launch of waiting parts, read once from DRAM, each
            # program writing a part read 28 % of L2 earlier, in parts of 8192 columns, then 4096
            # (bench/results/waiting_rows.md, GroupNorm on the H100: 0.109 and 0.113 ms; 0.129 with
            # each program writing its own part, 0.153 in two launches)
            space[:0] = [{**space[0], "WAIT_PART": p, "WAIT_LAG": 28} for p in (8192, 4096)]
    return space


def _check_params(params: dict[str, Any] | None) -> dict[str, int]:
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


# ----------------------------------------------------------------------------------------------
# Code generation
# ----------------------------------------------------------------------------------------------


class _RowEmitter(_Emitter):
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


class _KernelWriter:
    """The body of ``row_reduction_kernel`` for a plan: single pass and multi-pass branches."""

    def __init__(self, plan: RowPlan) -> None:
        self.plan = plan
        self.emitter = _RowEmitter(plan)  # type: ignore[arg-type]
        self.acc = TRITON_DTYPES[plan.compute_dtype]
        self.producer: dict[str, Step] = {}
        for s in plan.steps:
            for k in _outs(s):
                self.producer[k] = s

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

    # --- pieces ----------------------------------------------------------------------------------
    def load_row(self, i: int, evict: str = "", cols: str = "cols[None, :]", mask: str = "mask") -> list[str]:
        """Load operand ``i`` per element; ``evict``: ``evict_last`` where a later pass reads the row
        again (keep it in L2), else none. ``cols``/``mask``: other columns (rows' plans only)."""
        op = self.plan.operands[i]
        convert = " != 0" if op.is_bool else f".to({self.acc})"
        hint = f', eviction_policy="{evict}"' if evict else ""
        if self.plan.groups is None:
            ptr = f"in{i}_ptr + off{i}[:, None] + {cols} * in{i}_sc"
            return [f"v{i} = tl.load({ptr}, mask={mask}, other=0{hint}){convert}"]
        # GroupNorm rows: the columns are (channel, position) pairs; MODE 0 walks them flat, MODE 2
        # is one value per channel (weights): where a block spans at most two channels, two loads
        flat = f"in{i}_ptr + off{i}[:, None] + cols[None, :] * in{i}_s2"
        split = f"in{i}_ptr + off{i}[:, None] + ch[None, :] * in{i}_s1 + sp[None, :] * in{i}_s2"
        first = f"in{i}_ptr + off{i}[:, None] + ch0 * in{i}_s1"
        second = f"in{i}_ptr + off{i}[:, None] + tl.minimum(ch0 + 1, dim2 - 1) * in{i}_s1"
        return [
            f"if MODE{i} == 0:",
            f"    v{i} = tl.load({flat}, mask=mask, other=0{hint}){convert}",
            f"elif MODE{i} == 2 and WIDE_POSITIONS:",
            f"    v{i}_a = tl.load({first}, mask=rmask[:, None], other=0)",
            "    if ONE_CHANNEL:",
            f"        v{i} = v{i}_a{convert}",
            "    else:",
            f"        v{i}_b = tl.load({second}, mask=rmask[:, None], other=0)",
            f"        v{i} = tl.where(ch[None, :] == ch0, v{i}_a, v{i}_b){convert}",
            "else:",
            f"    v{i} = tl.load({split}, mask=mask, other=0{hint}){convert}",
        ]

    def load_red(self, i: int) -> str:
        op = self.plan.operands[i]
        load = f"tl.load(in{i}_ptr + off{i}[:, None], mask=rmask[:, None], other=0)"
        if i in self.plan.index_operands:
            return f"v{i} = {load}"
        return f"v{i} = {load} != 0" if op.is_bool else f"v{i} = {load}.to({self.acc})"

    def reduce_single(self, s: Step) -> list[str]:
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
        r, acc = f"r_{s.out}", self.acc
        if s.op in ("rsum", "rmean"):
            return [f"{r} = tl.zeros([ROWS, {block}], {acc})"]
        if s.op in ("rmax", "rmin"):
            fill = 'float("-inf")' if s.op == "rmax" else 'float("inf")'
            return [f"{r} = tl.full([ROWS, {block}], {fill}, {acc})"]
        if s.op in ("rlse", "rce"):
            lines = [
                f'{r}_m = tl.full([ROWS, 1], float("-inf"), {acc})',
                f"{r}_s = tl.zeros([ROWS, 1], {acc})",
            ]
            return lines
        if s.op == "rmoments":
            return [f"{r}_{k} = tl.zeros([ROWS, 1], {acc})" for k in ("n", "mean", "m2")]
        raise ValueError(f"no Triton code for reduction {s.op!r}")

    def ce_pick(self, s: Step) -> list[str]:
        """``r_<out>_p``: each row's logit at its target column, gathered once after the loop (a
        search of every chunk for it cost a compare, a select and a block reduction per element).
        The logit's per-element steps (a prologue such as a scale) run on the gathered values; after
        the loop, since Triton wants a name's shape unchanged through a loop that assigns it."""
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
        x = self.emitter.ref(s.args[0])
        r = f"r_{s.out}"
        if s.op in ("rsum", "rmean"):
            return [f"{r} += tl.where(mask, {x}, 0.0)"]
        if s.op in ("rmax", "rmin"):
            fill, fn = ('float("-inf")', "maximum") if s.op == "rmax" else ('float("inf")', "minimum")
            return [f"{r} = tl.{fn}({r}, tl.where(mask, {x}, {fill}))"]
        if s.op in ("rlse", "rce"):
            lines = [
                f'{r}_new = tl.maximum({r}_m, tl.max(tl.where(mask, {x}, float("-inf")), axis=1)[:, None])',
                f'{r}_ms = tl.where({r}_new == float("-inf"), 0.0, {r}_new)',
                f"{r}_s = {r}_s * tl.exp({r}_m - {r}_ms) + tl.sum(tl.where(mask, tl.exp({x} - {r}_ms), 0.0), axis=1)[:, None]",
                f"{r}_m = {r}_new",
            ]
            return lines
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

    @property
    def splittable(self) -> bool:
        return splittable(self.plan)

    def partials(self, s: Step) -> list[str]:
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

    def merge(self, s: Step, first: int) -> list[str]:
        """``t_<out>`` of reduction ``s`` from the SPLITS partial states stored from slot ``first`` on."""
        r, o = f"r_{s.out}", f"t_{s.out}"
        count = len(self.partials(s))
        lines = [
            f"{r}_q{k} = tl.load(ws_ptr + ({first + k} * n_rows + row) * SPLITS + parts)"
            for k in range(count)
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
            f"{o}_var = tl.sum({r}_q2 + {r}_q0 * {r}_d * {r}_d) / {self.var_divisor(s)}",
        ]

    def reduce_final(self, s: Step) -> list[str]:
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

    def store(self, streaming: bool = False) -> list[str]:
        """The output's store; ``streaming`` (the waiting launch) marks it ``.cs``, data not read
        again, which ran faster there than an ``evict_first`` hint in scratch runs
        (bench/results/waiting_counters.md times it with the rest of 0cd2017's changes)."""
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

    # --- the body --------------------------------------------------------------------------------
    def body(self) -> list[str]:
        header = self.row_header()
        early = self.per_row_steps(0)
        lines = ["if SINGLE_PASS:  # the whole row in registers: read once, write once"]
        lines += [f"    {line}" for line in self.single_pass(early)]
        lines.append(
            "else:  # rows longer than one block: one pass per reduction level, then one that writes"
        )
        if not self.splittable:
            return [
                "pid = tl.program_id(0)",
                *header,
                *lines,
                *(f"    {line}" for line in self.multi_pass(early)),
            ]
        lines += [
            "    if PHASE == 0:  # one program per row",
            *(f"        {line}" for line in self.multi_pass(early)),
            "    else:  # SPLITS programs per row, each on one part: its stats (1), then its output (2)",
            *(f"        {line}" for line in self.split_pass()),
        ]
        others = [
            "if PHASE == 2:  # walk back: the parts the stats phase read last are still in L2",
            "    pid = tl.num_programs(0) - 1 - pid",
            "if SPLITS > 1:  # a row's parts are neighbouring programs",
            "    split = pid % SPLITS",
            "    pid = pid // SPLITS",
            *header,
            *lines,
        ]
        return [
            "pid = tl.program_id(0)",
            "if PHASE == 3:  # SPLITS programs per row in one launch, each part read once from DRAM",
            *(f"    {line}" for line in self.waiting_pass(self.row_header(every_row=True))),
            "else:",
            *(f"    {line}" for line in others),
        ]

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
        if plan.groups is not None:
            lines += [
                "# row = (sample, group): dim1 groups of dim2 channels of dim3 positions",
                "n_idx = (rows32 // dim1).to(rows.dtype)",
                "g_idx = rows - n_idx * dim1",
                *(f"off{i} = n_idx * in{i}_s0 + g_idx * dim2 * in{i}_s1" for i in range(n)),
            ]
        else:
            lines += self.row_offsets()
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
            *(f"    off{i} = rows * in{i}_s{MAX_LEAD - 1}" for i in range(n)),
            "else:",
            "    rem = rows32",
        ]
        for d in range(MAX_LEAD - 1, 0, -1):
            lines += [f"    c{d} = (rem % dim{d}).to(rows.dtype)", f"    rem = rem // dim{d}"]
        lines.append("    c0 = rem.to(rows.dtype)")
        lines += [
            f"    off{i} = " + " + ".join(f"c{d} * in{i}_s{d}" for d in range(MAX_LEAD)) for i in range(n)
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
        if self.plan.groups is not None:  # channel and position of each column (dim3: positions)
            lines += [
                "if HAS_SPLIT:",
                "    if WIDE_POSITIONS:  # a block spans at most two channels: a compare, not a division",
                f"        ch0 = ({start or '0'}) // dim3",
                "        if ONE_CHANNEL:  # blocks never straddle two: one channel",
                "            ch = ch0 + tl.zeros_like(cols)",
                "        else:",
                "            ch = ch0 + (cols >= (ch0 + 1) * dim3).to(tl.int32)",
                "    else:",
                "        ch = cols // dim3",
                "    sp = cols - ch * dim3",
            ]
        return lines

    def single_pass(self, early: list[Step]) -> list[str]:
        plan = self.plan
        lines = ["cols = tl.arange(0, BLOCK_N)", *self.chunk_header("")[1:]]
        for i in range(len(plan.operands)):
            lines += self.load_row(i) if plan.layouts[i] == "row" else []
        for s in plan.steps:
            if s in early:
                continue
            lines += self.reduce_single(s) if s.op in REDUCTIONS else self.emitter.section([s])
        return lines + self.store()

    def multi_pass(self, early: list[Step]) -> list[str]:
        plan = self.plan
        lines: list[str] = []
        back = False  # each pass walks the other way: it starts on the chunks the last one read last
        for level in range(1, plan.levels + 1):
            reductions = [s for s in plan.reductions if plan.stages[_outs(s)[0]] == level]
            lines.append(f"# pass {level}: {', '.join(s.op for s in reductions)}")
            for s in reductions:
                lines += self.reduce_init(s)
            reread = level < plan.levels or plan.result_layout == "row"
            inner = self.chunk([s.args[0] for s in reductions], "evict_last" if reread else "")
            for s in reductions:
                inner += self.reduce_update(s)
            lines += self.column_loop(inner, back)
            back = not back
            for s in reductions:
                lines += self.reduce_final(s)
            lines += self.emitter.section(self.per_row_steps(level))
        if plan.result_layout == "row":
            lines.append(f"# pass {plan.levels + 1}: the output")
            loop = self.chunk([plan.result], "evict_first") + self.store()  # the row's last read
            lines += self.column_loop(loop, back)
        else:
            lines += self.store()
        return lines

    @staticmethod
    def column_loop(body: list[str], back: bool) -> list[str]:
        """``body`` over the row's chunks ``start``, the last chunk first if ``back``."""
        if not back:
            return ["for start in range(0, n_cols, BLOCK_N):", *(f"    {line}" for line in body)]
        return [
            "last = (n_cols - 1) // BLOCK_N * BLOCK_N",
            "for k in range(0, n_cols, BLOCK_N):",
            "    start = last - k",
            *(f"    {line}" for line in body),
        ]

    def post_partials(self, part: str) -> list[str]:
        """Store each reduction's partial states of part ``part`` of the row in its workspace slot."""
        lines, slot = [], 0
        for s in self.plan.reductions:
            for value in self.partials(s):
                lines.append(
                    f"tl.store(ws_ptr + ({slot} * n_rows + rows[:, None]) * SPLITS + {part}, {value}, "
                    "mask=rmask[:, None])"
                )
                slot += 1
        return lines

    def merged_stats(self) -> list[str]:
        """The row's statistics, as scalars, from the SPLITS parts' states (ROWS is 1, and every
        program's row exists: the launch has n_rows * SPLITS programs).

        Loaded as [1, SPLITS] tensors and reduced along axis 1, Triton 3.6 gave them a layout that
        put all SPLITS states in every thread: 3 x 64 registers for GroupNorm's 64 parts, 254 in
        all, and the waiting launch ran 2.5x slower than the two launches (bench/results/
        waiting_rows.md). One-dimensional, they spread over the threads; scalars also broadcast
        for free where [1, 1] tensors went through shared memory (bench/results/split_rows_ncu)."""
        return self.merged_reductions() + self.emitter.section(self.per_row_steps(1))

    def merged_reductions(self) -> list[str]:
        """Each reduction's per-row values from the SPLITS parts' states (see ``merged_stats``)."""
        lines, slot = ["parts = tl.arange(0, SPLITS)", "row = tl.sum(rows)  # the one row, a scalar"], 0
        for s in self.plan.reductions:
            lines += self.merge(s, slot)
            slot += len(self.partials(s))
        return lines

    def reduce_span(self, lo: str, hi: str, evict: str = "", block: str = "BLOCK_N") -> list[str]:
        """Every reduction's state over the columns ``lo`` to ``hi``, in chunks of ``block``."""
        reductions = self.plan.reductions
        lines = [line for s in reductions for line in self.reduce_init(s, block)]
        inner = self.chunk([s.args[0] for s in reductions], evict, block)
        inner += [line for s in reductions for line in self.reduce_update(s, block)]
        return [*lines, f"for start in range({lo}, {hi}, {block}):", *(f"    {line}" for line in inner)]

    def row_reductions(self, block: str) -> list[str]:
        """Each reduction's per-row values as scalars, reduced by this program over the whole row in
        chunks of ``block`` columns (ROWS is 1): the merge's values, rounded otherwise."""
        reductions = self.plan.reductions
        lines = self.reduce_span("0", "n_cols", block=block)
        lines += [line for s in reductions for line in self.reduce_final(s)]
        # its states renamed: Triton wants a name both branches of an if assign to keep its type
        lines = [re.sub(r"\br_(?=\w)", "rr_", line) for line in lines]
        finals = [f"t_{s.out}{suffix}" for s in reductions for suffix in REDUCTIONS[s.op]]
        return lines + [f"{name} = tl.sum({name})" for name in finals]

    def waiting_pass(self, header: list[str]) -> list[str]:
        """Few long rows in one launch (PHASE 3), each element read once from DRAM. Program ``flat``
        reduces part ``flat`` (one BLOCK_N part of a row, its loads hinted ``evict_last``), stores
        its partial states and counts itself in its row's ``posted`` (a release: the states are
        visible before the count); and it writes part ``flat - lag``: it polls that part's row
        until all its parts have posted (acquires), merges their states and reads the part again,
        from L2 (hinted ``evict_first``), and stores it streaming (``.cs``). The hints are the L1
        eviction priorities Triton emits: loading with ``.cg`` (no L1) instead ran much slower in
        a scratch run.

        The counters are kept between calls (``_posted``), so no launch zeroes them first: each
        call adds SPLITS to every row's, and a row is whole when its count reaches ``target``, the
        next multiple of SPLITS above what it held before the call. A lagged program, which writes
        before it posts, reads that from its own row's count first (below ``target`` then), an
        unlagged one from the count its post returns; the lag's trailing programs, which own no
        part, count themselves in one more counter, which each call adds ``lag`` to.

        With ``lag`` 0 a program writes its own part, after reducing it, once the row's other
        parts (its neighbours) have posted: every program waits for its row's slowest part with
        none of its loads in flight. Lagged (``lag`` sized so that the parts read in between span
        WAIT_LAG % of L2, and at least a row's parts), a program first writes a part whose row was
        read by programs started well before it, then reduces its own: it rarely waits, and only
        for programs started before it (bench/results/waiting_rows.md; writing after reducing ran
        slower in a scratch prototype). Holding a part in registers across the wait instead
        (persistent programs that write each part one step after reading it) took 66-124
        registers a thread and ran 1.40x slower at best (bench/results/held_parts.md).

        After ``spin`` polls a program reduces the whole row itself, in chunks of an eighth of a
        part, so no order of execution deadlocks; the CPU interpreter, which runs programs one at
        a time in order, passes 0. It keeps those statistics to itself. The fallback of 4b90449
        reduced and posted whole parts: with it, parts of 8192 columns held 108-110 registers a
        thread, against 48 now (bench/results/waiting_rows.md, which also counts 2557263's other
        changes to the kernel: its column masks, channel selects and offsets)."""
        reductions = self.plan.reductions
        red_args = [s.args[0] for s in reductions]
        reduce = [line for s in reductions for line in self.reduce_init(s)]
        reduce += ["if start < n_cols:  # a row's last parts may be empty"]
        reduce += [f"    {line}" for s in reductions for line in self.reduce_update(s)]

        def part(flat: str) -> list[str]:
            return [
                f"split = {flat} % SPLITS",
                f"pid = {flat} // SPLITS",
                *header,
                "lo = split * BLOCK_N",
                "start = lo",
            ]

        post = [*part("flat"), *self.chunk(red_args, "evict_last"), *reduce, *self.post_partials("split")]
        post.append('old = tl.atomic_add(posted_ptr + pid, 1, sem="release")  # after its states')
        write = [
            *part("(flat - lag)"),
            'seen = tl.atomic_add(posted_ptr + pid, 0, sem="acquire")',
            "polls = tl.zeros_like(seen)",
            "while (seen < target) & (polls < spin):",
            '    seen = tl.atomic_add(posted_ptr + pid, 0, sem="acquire")',
            "    polls += 1",
            "if seen < target:  # not all posted after spin polls: reduce the whole row here",
            *(f"    {line}" for line in self.row_reductions("(BLOCK_N // 8)")),
            "else:",
            *(f"    {line}" for line in self.merged_reductions()),
            *self.emitter.section(self.per_row_steps(1)),
            "start = lo",
            *self.chunk([self.plan.result], "evict_first"),
            *self.store(streaming=True),
        ]
        return [
            "flat = pid",
            "# Counters are kept between calls: each call adds SPLITS to every row's, so a row is",
            "# whole at target, the next multiple of SPLITS above its count before the call.",
            "if LAGGED:  # it writes first",
            "    if flat < n_rows * SPLITS:  # its row's count, read before it posts: below target",
            '        epoch = tl.atomic_add(posted_ptr + flat // SPLITS, 0, sem="relaxed") // SPLITS',
            "    else:  # the last lag programs only write: they count themselves after the rows",
            '        epoch = tl.atomic_add(posted_ptr + n_rows, 1, sem="relaxed") // lag',
            "    target = (epoch + 1) * SPLITS",
            "else:  # it posts first: the count before its own",
            "    target = tl.full([], 0, tl.int64)",
            "for step in tl.static_range(2):  # lagged: write, then reduce; else reduce, then write",
            "    if (step == 0) == LAGGED:",
            "        if flat >= lag:  # write part flat - lag once its row's parts have posted",
            *(f"            {line}" for line in write),
            "    elif flat < n_rows * SPLITS:  # reduce part flat and post its states",
            *(f"        {line}" for line in post),
            "        if not LAGGED:",
            "            target = (old // SPLITS + 1) * SPLITS",
        ]

    def split_pass(self) -> list[str]:
        """Few long rows: each of SPLITS programs reduces one part of a row and stores its partial
        states (PHASE 1); a second launch merges a row's states and writes each part (PHASE 2)."""
        phase1 = self.reduce_span("lo", "hi", "evict_last") + self.post_partials("split")
        loop = self.chunk([self.plan.result]) + self.store()
        phase2 = [*self.merged_stats(), "for start in range(lo, hi, BLOCK_N):"]
        phase2 += [f"    {line}" for line in loop]
        return [
            "span = ((n_cols + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole chunks per part",
            "lo = split * span",
            "hi = tl.minimum(lo + span, n_cols)",
            "if PHASE == 1:",
            *(f"    {line}" for line in phase1),
            "else:",
            *(f"    {line}" for line in phase2),
        ]

    def n_partials(self) -> int:
        return sum(len(self.partials(s)) for s in self.plan.reductions)


def generate(task_source: str, analysis: TaskAnalysis, plan: RowPlan, params: dict[str, Any]) -> str:
    """The playbook's strategy protocol: the candidate source for ``plan``."""
    del task_source
    return generate_rowwise(analysis, plan, params)


#: The host helper that picks how many programs share a row (emitted only for splittable plans).
SPLIT_HELPER = '''def _splits(n_rows, n_cols, block, device):
    """Programs per row: 1 when the rows alone fill the GPU, else a power of two of whole chunks."""
    target = SPLIT_TARGET
    if target is None:
        if device.type != "cuda":
            return 1
        target = SPLIT_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    if 2 * n_rows > target:
        return 1
    return _pow2_at_most(min(target // n_rows, triton.cdiv(n_cols, block)), MAX_SPLITS)


def _wait_lag(programs, parts, part_bytes, device):
    """How many parts behind its own a waiting program writes: enough that the part's row was read
    by programs started well before it (it rarely waits), few enough that the part is still in L2
    (the parts read in between span WAIT_LAG % of it). At least a row's parts, so that a program
    waits only for programs started before it; at most every part."""
    if not WAIT_LAG:
        return 0
    lag = WAIT_LAG_PARTS
    if lag is None:
        lag = parts
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            lag = int(WAIT_LAG / 100 * l2) // max(1, part_bytes)
    return min(max(lag, parts), programs)


#: The waiting launch's per-row counters, one set per device, stream and shape, kept between calls.
_POSTED = {}


def _posted(n_rows, parts, lag, device):
    """Row counters for a waiting launch, without a memset per call: each launch adds ``parts`` to
    every row's, so each call's count starts at a multiple of it. A stream keeps its own, so that
    no two launches use one at once. While a CUDA graph is being captured they are new zeros each
    call (the memset is captured with the launch, so every replay starts from zero)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n_rows + 1, dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, n_rows, parts, lag)
    posted = _POSTED.get(key)
    if posted is None:
        posted = _POSTED.setdefault(key, torch.zeros(n_rows + 1, dtype=torch.int64, device=device))
    return posted


'''


def generate_rowwise(analysis: TaskAnalysis, plan: RowPlan, params: dict[str, Any] | None = None) -> str:
    """A complete candidate source (``ModelNew`` + ``row_reduction_kernel``) for ``plan``."""
    p = _check_params(params)
    writer = _KernelWriter(plan)
    body = writer.body()
    helpers = writer.emitter.helper_source()
    kernel_body = "\n".join(f"    {line}" if line else "" for line in body)
    n = len(plan.operands)
    has_aux = plan.loss_reduction is not None

    split = writer.splittable
    ptrs = ", ".join(
        [
            *(f"in{i}_ptr" for i in range(n)),
            "out_ptr",
            *(["aux_ptr"] if has_aux else []),
            *(["ws_ptr", "posted_ptr", "spin", "lag"] if split else []),
        ]
    )
    dims = ", ".join(f"dim{d}" for d in range(1, MAX_LEAD))
    strides = "\n".join(
        f"    {', '.join([*(f'in{i}_s{d}' for d in range(MAX_LEAD)), f'in{i}_sc'])}," for i in range(n)
    )

    # --- host ---
    args = [f"in{i}" for i in range(n)]
    prepare = ", ".join(f"_prepare(in{i}, {plan.reshapes[i]!r})" for i in range(n))
    row_ops = [i for i in range(n) if plan.layouts[i] == "row"]
    view_exprs = []
    for i in range(n):
        layout = plan.layouts[i]
        if layout == "row":
            view_exprs.append(f"torch.broadcast_to(ops[{i}], row_shape)")
        elif layout == "kd":
            view_exprs.append(f"torch.broadcast_to(ops[{i}], lead + (1,))")
        else:
            view_exprs.append(f"torch.broadcast_to(ops[{i}], lead).unsqueeze(-1)")
    if plan.loss_reduction is not None:
        out_alloc = "torch.empty(lead, dtype=torch.float32, device=device)"
    else:
        out_alloc = {
            "row": "torch.empty(row_shape, dtype=DTYPE, device=device)",
            "kd": "torch.empty(lead + (1,), dtype=DTYPE, device=device)",
            "flat": "torch.empty(lead, dtype=DTYPE, device=device)",
        }[plan.result_layout]
    if has_aux:
        finish = f"""
    loss = torch.empty((), dtype=DTYPE, device=device)
    loss_reduce_kernel[(1,)](out, valid, loss, n_rows, MEAN={plan.loss_reduction == "mean"}, BLOCK=1024)
    return loss"""
        valid_alloc = "\n    valid = torch.empty(lead, dtype=torch.float32, device=device)"
        reduce_kernel = """

@triton.jit
def loss_reduce_kernel(loss_ptr, valid_ptr, out_ptr, n_rows, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    # One program adds the per-row losses (and counts the rows not ignored) in a fixed order:
    # the same inputs give the same bits, unlike atomic adds.
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.load(loss_ptr + offs, mask=offs < n_rows, other=0.0)
        count += tl.load(valid_ptr + offs, mask=offs < n_rows, other=0.0)
    result = tl.sum(total, axis=0)
    if MEAN:
        result = result / tl.sum(count, axis=0)
    tl.store(out_ptr, result.to(out_ptr.dtype.element_ty))
"""
    else:
        finish = "\n    return out"
        valid_alloc = ""
        reduce_kernel = ""

    # nothing to compute for an empty output; a loss over no rows (or reductions of empty rows) raises
    empty = "" if has_aux else "\n    if out.numel() == 0:\n        return out"
    grouped = plan.groups is not None
    chunk = "_grouped_chunk(positions, modes)" if grouped else "CHUNK"  # the multi-pass block
    column_bytes = (  # read per column of a row: what a waiting program reads again, from L2
        "sum(v.element_size() for v, mode in zip(views, modes) if mode != 2)"
        if grouped
        else "sum(v.element_size() for v in views if v.shape[-1] > 1 and v.stride(-1) != 0)"
    )
    per_column = (  # blocks that would gather per-channel weights read them as columns instead
        "    if any(modes) and positions < block and _per_column(views, strides, modes, shape, positions) and not single:\n"
        "        block = _grouped_chunk(positions, modes)  # for what is left to gather, if anything\n"
        if grouped
        else ""
    )

    def gather_warps(rows: str, indent: str) -> str:  # chunks that gather: more warps, fewer registers
        if not grouped:
            return ""
        return (
            f"{indent}if not single and any(modes) and positions < block:  # GATHER_PER_THREAD columns a thread\n"
            f"{indent}    warps = max(warps, _pow2_at_most({rows} * block // (32 * GATHER_PER_THREAD), 16))\n"
        )

    shapes = ", ".join(f"ops[{i}].shape" for i in row_ops)
    if grouped:
        channel = [plan.reshapes[i] == "channel" for i in range(n)]
        layout_block = f"""    # (C,) weights apply along dim 1, whatever the input's rank
    channel = {channel}
    shape = torch.broadcast_shapes(*[t.shape for t, c in zip(ops, channel) if not c])
    ops = [t.reshape(-1, *([1] * (len(shape) - 2))) if c else t for t, c in zip(ops, channel)]
    shape = tuple(torch.broadcast_shapes(*[t.shape for t in ops]))
    if len(shape) < 2 or shape[1] % GROUPS:
        raise ValueError(f"group_norm needs an (N, C, *) input with C divisible by {{GROUPS}}, got {{shape}}")
    positions = math.prod(shape[2:])
    n_rows = shape[0] * GROUPS
    n_cols = shape[1] // GROUPS * positions
    out = torch.empty(shape, dtype=DTYPE, device=device)
    if out.numel() == 0:
        return out
    dims = [1, GROUPS, shape[1] // GROUPS, positions]
    views, strides, modes = [], [], []
    for t in ops:
        v, s, mode = _grouped(torch.broadcast_to(t, shape), positions)
        views.append(v)
        strides += [*s, 0, 0]
        modes.append(mode)
    flat = False"""
        grouped_helper = '''def _grouped(v, positions):
    """An operand broadcast to (N, C, *): itself (or a contiguous copy), its (sample, channel, position)
    strides, and mode 0 when its channels and positions are one flat run (x itself), 2 when it has one
    value per channel (weights), 1 otherwise."""
    kept = [(size, stride) for size, stride in zip(v.shape[2:], v.stride()[2:]) if size != 1]
    if any(kept[i][1] != kept[i + 1][1] * kept[i + 1][0] for i in range(len(kept) - 1)):
        v = v.contiguous()
        kept = [(size, stride) for size, stride in zip(v.shape[2:], v.stride()[2:]) if size != 1]
    if positions == 1:  # no positions: a column is a channel
        return v, (v.stride(0), v.stride(1), v.stride(1)), 0
    position_stride = kept[-1][1] if kept else 0
    mode = 0 if v.stride(1) == positions * position_stride else 2 if position_stride == 0 else 1
    return v, (v.stride(0), v.stride(1), position_stride), mode


#: Chunks of grouped rows (see _grouped_chunk): the fewest columns one shrinks to within a channel,
#: the most columns of one that spans channels, and its columns per thread.
MIN_GROUPED_CHUNK = 1024
MAX_GATHER_CHUNK = 4096
GATHER_PER_THREAD = 16


def _grouped_chunk(positions, modes):
    """CHUNK, unless a CHUNK-column block would span more than two channels while an operand is not
    one flat run (weights: a value per channel): such a block gathers that operand column by column,
    dividing each column by the channel's positions (on the H100, 186 registers per thread at 8192
    columns: row_configs.md). Then the largest power of two within a channel, if at least
    MIN_GROUPED_CHUNK; else at most MAX_GATHER_CHUNK columns, and GATHER_PER_THREAD a thread
    (see the launch)."""
    if positions >= CHUNK or not any(modes):
        return CHUNK
    if positions >= MIN_GROUPED_CHUNK:
        return _pow2_at_most(positions, CHUNK)
    return min(CHUNK, MAX_GATHER_CHUNK)


#: Samples per operand read as columns (see _per_column): its copy is at most 1/8 of the input.
PER_COLUMN_SAMPLES = 8


def _per_column(views, strides, modes, shape, positions):
    """Operands with one value per channel, the same for every sample (weights), copied to one
    value per column of a sample and read like the input, where blocks would gather them: no
    gather and no division by the positions (row_configs.md: GroupNorm over channels of 256
    positions on the H100). Only where the batch has PER_COLUMN_SAMPLES samples per copied
    operand: each call makes the copies. Whether it copied any."""
    copied = [i for i, (v, mode) in enumerate(zip(views, modes)) if mode == 2 and v.stride(0) == 0]
    if not copied or len(copied) * PER_COLUMN_SAMPLES > shape[0]:
        return False
    for i in copied:
        columns = views[i][0].contiguous().unsqueeze(0).expand(shape)
        views[i], sample_channel_position, modes[i] = _grouped(columns, positions)
        strides[5 * i : 5 * i + 3] = sample_channel_position
    return True


'''
        mode_args = (
            "".join(f"\n    MODE{i}: tl.constexpr," for i in range(n))
            + "\n    HAS_SPLIT: tl.constexpr,\n    WIDE_POSITIONS: tl.constexpr,\n    ONE_CHANNEL: tl.constexpr,"
        )
    else:
        layout_block = f"""    row_shape = tuple(torch.broadcast_shapes({shapes}))
    if not row_shape:
        raise ValueError("a row reduction needs at least one dim")
    lead = row_shape[:-1]
    n_cols = row_shape[-1]
    n_rows = math.prod(lead)
    out = {out_alloc}{valid_alloc}{empty}
    if n_rows == 0 or n_cols == 0:
        raise ValueError(f"empty rows: shape {{row_shape}}")
    views = [{", ".join(view_exprs)}]
    layout = _coalesce(lead, [v.stride()[:-1] for v in views])
    if layout is None:  # too many distinct broadcast dims: materialize the operands
        views = [v.contiguous() for v in views]
        layout = _coalesce(lead, [v.stride()[:-1] for v in views])
    dims, lead_strides, flat = layout
    strides = []
    for v, s in zip(views, lead_strides):
        strides += [*s, v.stride(-1)]"""
        grouped_helper = ""
        mode_args = ""
    launch_args = [
        "*views",
        "out",
        *(["valid"] if has_aux else []),
        "n_rows",
        "n_cols",
        "*dims[1:]",
        "*strides",
    ]
    sizes = ", ".join(launch_args[-4:])  # after the pointers (the workspace's goes between)
    meta = [
        "BLOCK_N=block",
        "SINGLE_PASS=single",
        "FLAT_ROWS=flat",
        "EVEN_COLS=n_cols % block == 0",
        "OFF64=off64",
        *(
            [f"MODE{i}=modes[{i}]" for i in range(n)]
            + [
                "HAS_SPLIT=any(modes)",
                "WIDE_POSITIONS=positions >= block",
                "ONE_CHANNEL=positions % block == 0",
            ]
            if grouped
            else []
        ),
    ]
    if split:
        split_args = "\n    SPLITS: tl.constexpr,\n    PHASE: tl.constexpr,\n    LAGGED: tl.constexpr,"
        launch = f"""    sizes = ({sizes})
    meta = dict({", ".join(meta)})
    splits = 1 if single else _splits(n_rows, n_cols, block, device)
    parts = triton.next_power_of_2(triton.cdiv(n_cols, WAIT_PART)) if WAIT_PART else 0
    if splits == 1:
        grid = (triton.cdiv(n_rows, rows_per_program),)
        row_reduction_kernel[grid](*views, out, out, out, 0, 0, *sizes, ROWS=rows_per_program, SPLITS=1, PHASE=0, LAGGED=False, num_warps=warps, **meta)
    elif 1 < parts <= MAX_SPLITS:  # few long rows: a part per program, one launch, one read
        block = triton.next_power_of_2(triton.cdiv(n_cols, parts))
        meta = dict({", ".join(meta)})
        meta["EVEN_COLS"] = parts * block == n_cols  # and no part empty
        ws = torch.empty(({writer.n_partials()}, n_rows, parts), dtype=WS_DTYPE, device=device)
        spin = SPIN_POLLS if device.type == "cuda" else 0  # the interpreter runs one program at a time
        lag = _wait_lag(n_rows * parts, parts, block * {column_bytes}, device)
        posted = _posted(n_rows, parts, lag, device)
        row_reduction_kernel[(n_rows * parts + lag,)](*views, out, ws, posted, spin, lag, *sizes, ROWS=1, SPLITS=parts, PHASE=3, LAGGED=lag > 0, num_warps=_pow2_at_most(block // 1024, 16), **meta)  # a warp per 1024 columns
    else:  # few long rows: SPLITS programs per row, a stats launch then an output launch
        ws = torch.empty(({writer.n_partials()}, n_rows, splits), dtype=WS_DTYPE, device=device)
        warps = _pow2_at_most(NUM_WARPS * block // TILE, 16) if block > TILE else NUM_WARPS
{gather_warps("1", "        ")}        for phase in (1, 2):
            row_reduction_kernel[(n_rows * splits,)](*views, out, ws, out, 0, 0, *sizes, ROWS=1, SPLITS=splits, PHASE=phase, LAGGED=False, num_warps=warps, **meta)"""
        split_helper = SPLIT_HELPER
        split_doc = (
            "\nFew long rows are split over programs: a launch that stores each part's partial states, then one"
            "\nthat merges them and writes each part; or (WAIT_PART) one launch whose programs each reduce a"
            "\npart and write one (an earlier one, first, with WAIT_LAG) once its row's states have posted."
        )
        split_consts = f"""
#: Few long rows are split over programs when a launch would have fewer than SPLIT_TARGET programs;
#: None: SPLIT_PER_SM per SM on a GPU (0: never), never on the CPU.
SPLIT_TARGET = None
SPLIT_PER_SM = {p["SPLIT_PER_SM"]}
MAX_SPLITS = {MAX_SPLITS}
#: Split rows in parts of at most WAIT_PART columns (up to MAX_SPLITS of them), one per program, in
#: one launch whose programs wait for the row's statistics: one read (0: two launches, two reads).
WAIT_PART = {p["WAIT_PART"]}
#: Program i writes part i - lag: lag parts read span WAIT_LAG % of the GPU's L2 (0: its own part);
#: WAIT_LAG_PARTS, if set, is the lag (on the CPU: one row's parts).
WAIT_LAG = {p["WAIT_LAG"]}
WAIT_LAG_PARTS = None
SPIN_POLLS = {SPIN_POLLS}
WS_DTYPE = torch.{"float64" if plan.compute_dtype == "float64" else "float32"}"""
    else:
        split_args = split_helper = split_consts = split_doc = ""
        launch = f"""    grid = (triton.cdiv(n_rows, rows_per_program),)
    row_reduction_kernel[grid]({", ".join(launch_args)}, ROWS=rows_per_program, {", ".join(meta)}, num_warps=warps)"""
    groups_const = f"\nGROUPS = {plan.groups}" if grouped else ""
    kinds = ", ".join(dict.fromkeys(s.op for s in plan.reductions))
    ops_desc = ", ".join(dict.fromkeys(plan.ops))
    operand_desc = ", ".join(
        f"{o.name} ({o.source}, {o.dtype}, {'per element' if plan.layouts[i] == 'row' else 'per row'})"
        for i, o in enumerate(plan.operands)
    )
    init_lines = _state_lines(analysis)
    forward_sig = ", ".join(["self", *(_forward_param(a) for a in plan.forward_args)])
    call_args = ", ".join(_operand_expr(o) for o in plan.operands)
    out_desc = (
        "the loss"
        if has_aux
        else {"row": "the rows", "kd": "one value per row (keepdim)", "flat": "one value per row"}[
            plan.result_layout
        ]
    )

    return f'''"""Row reduction candidate (kernelcrew playbook, strategy row_reduction).

Ops: {ops_desc}; row reductions: {kinds} ({plan.levels} level(s)); output: {out_desc}, {plan.out_dtype}.
Operands: {operand_desc}.
One program per ROWS rows: the whole row in registers when it fits in MAX_SINGLE columns, else one
CHUNK-column loop per reduction level (online max/sum, merged moments) and one that writes.{split_doc}
Accumulation in {plan.compute_dtype}; every size is read at run time.
"""

import math

import torch
import torch.nn as nn
import triton
import triton.language as tl

MAX_LEAD = {MAX_LEAD}
MAX_SINGLE = {p["MAX_SINGLE"]}
CHUNK = {p["CHUNK"]}
TILE = {p["TILE"]}
NUM_WARPS = {p["num_warps"]}
DTYPE = torch.{plan.out_dtype}{groups_const}{split_consts}
{helpers}

@triton.jit
def row_reduction_kernel(
    # operands and output
    {ptrs},
    # sizes: rows (the product of the leading dims) and columns (the reduced last dim)
    n_rows,
    n_cols,
    # coalesced leading dims 1..{MAX_LEAD - 1} (dim 0 is implied by n_rows)
    {dims},
    # per operand: element strides of the leading dims and of the columns (0 where broadcast)
{strides}
    # meta-parameters
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    FLAT_ROWS: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    OFF64: tl.constexpr,{mode_args}{split_args}
):
{kernel_body}
{reduce_kernel}

def _prepare(t, reshape):
    """The operand with its last dim contiguous (a copy otherwise), leading dims merged if asked."""
    if reshape == "rows":
        t = t.reshape(-1, t.shape[-1])
    elif reshape == "flat":
        t = t.reshape(-1)
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _coalesce(lead, strides):
    """Merge adjacent leading dims that every operand walks alike; None if more than MAX_LEAD remain."""
    keep = [i for i in range(len(lead)) if lead[i] != 1]
    dims = [lead[i] for i in keep]
    strides = [[s[i] for i in keep] for s in strides]
    i = len(dims) - 1
    while i > 0:
        if all(s[i - 1] == s[i] * dims[i] for s in strides):
            dims[i - 1] *= dims[i]
            for s in strides:
                s[i - 1] = s[i]
                del s[i]
            del dims[i]
        i -= 1
    if len(dims) > MAX_LEAD:
        return None
    pad = MAX_LEAD - len(dims)
    return [1] * pad + dims, [[0] * pad + s for s in strides], len(dims) <= 1


def _off64(tensors):
    """Whether an element offset of any of ``tensors`` reaches 2**31: the kernel's offsets are 64-bit
    then, else 32-bit (fewer registers and instructions a column)."""
    return any(sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n) >= 2**31 for t in tensors)


{grouped_helper}{split_helper}def _pow2_at_most(x, cap):
    return max(1, min(cap, 1 << (max(1, int(x)).bit_length() - 1)))


def row_reduction({", ".join(args)}):
    """{ops_desc} over the last dim, in one kernel; returns a new {plan.out_dtype} tensor."""
    ops = [{prepare}]
    device = ops[0].device
    for t in ops:
        if t.device != device:
            raise ValueError(f"all operands must be on one device, got {{t.device}} and {{device}}")
{layout_block}
    if n_rows >= 2**31:
        raise ValueError(f"{{n_rows}} rows: at most 2**31 - 1 are supported")
    single = n_cols <= MAX_SINGLE
    block = max(16, triton.next_power_of_2(n_cols)) if single else {chunk}
{per_column}    off64 = _off64([*views, out])
    rows_per_program = _pow2_at_most(TILE // block, triton.next_power_of_2(n_rows))
    warps = _pow2_at_most(NUM_WARPS * rows_per_program * block // TILE, 16) if rows_per_program * block > TILE else NUM_WARPS
{gather_warps("rows_per_program", "    ")}{launch}{finish}


{CONTAINER_SOURCE}

class ModelNew(nn.Module):
    """The task's module as one row reduction kernel; same state dict names and shapes."""

    def __init__(self, *args, **kwargs):
        super().__init__(){init_lines}

    def forward({forward_sig}):
        return row_reduction({call_args})
'''


__all__ = [
    "DEFAULT_PARAMS",
    "REDUCTIONS",
    "ROW_OPS",
    "RowPlan",
    "generate",
    "generate_rowwise",
    "match",
    "row_length",
    "tuning_space",
]
