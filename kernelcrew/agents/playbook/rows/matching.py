"""The strategy's match: lower the traced graph, place each value per element or per row, plan the kernel."""

from __future__ import annotations

from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.pointwise import (
    Operand,
    Step,
    Unsupported,
    _key,
    _reachable,
    _simple_literal,
    check_float_output,
    single_output,
)
from kernelcrew.agents.playbook.rows.ir import REDUCTIONS, RowPlan, outs
from kernelcrew.agents.playbook.rows.lowering import ROW_OPS, _RowLowering


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
    out = single_output(a)
    check_float_output(a, out, "handled")
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
            for k in outs(s):
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
        for k in outs(s):
            stage[k] = level + 1 if s.op in REDUCTIONS else level
    return stage
