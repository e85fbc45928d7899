"""A reduction over one dim that is not the last (sum, mean, prod, max, min, argmax...) as one Triton kernel.

KernelBench level-1 tasks 47 to 53 reduce a ``(batch, dim1, dim2)`` tensor over dim 1
(``torch.sum(x, dim=1, keepdim=True)``, ``torch.argmax(x, dim=1)``...). The ``row_reduction``
strategy reduces the last dim only, so these had no own kernel. A contiguous tensor reduced over a
middle dim is, viewed as ``(O, R, I)`` (outer, reduced, inner), ``O`` independent ``R x I``
matrices reduced down their columns: the ``I`` elements of one row are consecutive in memory.

Each program of the kernel owns ``BLOCK_I`` consecutive inner positions of one outer index and
loops over the ``R`` rows ``BLOCK_R`` at a time: it loads a ``BLOCK_R x BLOCK_I`` tile (consecutive
addresses along its rows, so the loads coalesce), folds it into a tile of running results
elementwise, and reduces that tile over its rows once at the end. Each element is read once, in
one pass. Sums, means and products accumulate in float32 and are cast once to the input's dtype
(as torch's output dtype: a float16 sum is float16); a mean divides by ``R`` at the end.
Maxima and minima follow torch: a NaN in the reduced slice makes the value NaN, and the index
(``argmax``, ``argmin``, ``torch.max(x, dim)``'s indices, int64) is the first NaN's if there is one,
else the first extreme element's. Offsets are 64-bit where they can reach 2**31. Speed on a GPU:
not measured yet.

:func:`match` takes a forward that is exactly one ``sum``, ``mean``, ``prod``, ``amax``, ``amin``,
``max``/``min`` with a dim (values, indices, or both), ``argmax`` or ``argmin`` of its one input
(float32, float16 or bfloat16) over one dim other than the last, keepdim or not, function or
method spelling. A reduction over the last dim is the ``row_reduction`` strategy's; several dims,
every element (``dim=None``) and ``dtype=`` are refused. The candidate subclasses the reference
(its state dict is the reference's), computes the dim from the input's rank on each call (so the
verifier's other shapes work), and runs the reference's own forward for other dtypes (float64).
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.compiler import REFERENCE_NAME, checked_copy, reference_source
from kernelcrew.agents.playbook.pointwise import HELPERS, arch_class
from kernelcrew.task import parse_python

DTYPES = frozenset({"float32", "float16", "bfloat16"})
#: Reductions that accumulate in float32 (``prod`` multiplies).
ACCUMULATE = frozenset({"sum", "mean", "prod"})
#: Reductions that pick an element: op -> whether it picks the largest.
EXTREME = {"amax": True, "max": True, "argmax": True, "amin": False, "min": False, "argmin": False}
OPS = ACCUMULATE | set(EXTREME)
#: Argument names of each op, in torch's positional order.
SIGNATURES = {
    "sum": ("input", "dim", "keepdim", "dtype"),
    "mean": ("input", "dim", "keepdim", "dtype"),
    "prod": ("input", "dim", "keepdim", "dtype"),
    **{op: ("input", "dim", "keepdim") for op in EXTREME},
}
#: The kernel's parameters.
PARAMS = ("BLOCK_R", "BLOCK_I", "num_warps")
#: (BLOCK_R, BLOCK_I, num_warps) per architecture class, first tried first: estimates, not measured
#: yet. 32 x 128 float32 values are 16 KiB per load: 8 elements per thread with 4 warps. One config
#: for the CPU interpreter, where bigger tiles mean fewer interpreted programs.
CONFIGS = {
    "sm_100": [(32, 128, 4), (16, 256, 4), (64, 64, 4)],
    "sm_90": [(32, 128, 4), (16, 256, 4), (64, 64, 4)],
    "sm_80": [(32, 128, 4), (16, 256, 4), (64, 64, 4)],
    "cpu": [(64, 64, 1)],
}


@dataclass(frozen=True)
class DimReducePlan:
    """The reduction: the input (forward argument), the op, the dim as written (negative allowed),
    keepdim, and what the forward returns: ``results`` names each output (``values``, ``indices``
    or ``pair``, max/min's tuple itself), ``as_tuple`` whether they are returned as a tuple."""

    input: str
    op: str
    dim: int
    keepdim: bool
    results: tuple[str, ...]
    as_tuple: bool
    shape: tuple[int, ...]
    dtype: str

    @property
    def axis(self) -> int:
        """The reduced dim of the example input, counted from 0."""
        return self.dim % len(self.shape)

    @property
    def want(self) -> str:
        """What the kernel computes: ``values``, ``indices`` or ``both``."""
        found = {"indices"} if self.op in ("argmax", "argmin") else set()
        for r in self.results:
            found |= {"values", "indices"} if r == "pair" else {r}
        return "both" if len(found) == 2 else found.pop()


class Unsupported(ValueError):
    pass


def _bind(node: dict[str, Any]) -> dict[str, Any]:
    """The reduction's arguments by name, with torch's defaults."""
    op, name = node["op"], node["name"]
    names = SIGNATURES[op]
    args, kwargs = list(node.get("args") or []), dict(node.get("kwargs") or {})
    if len(args) > len(names):
        raise Unsupported(f"{op} ({name}) has {len(args)} positional arguments")
    bound = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        if key not in names:
            raise Unsupported(f"{op} ({name}) with the argument {key!r} is not supported")
        bound[key] = value
    bound.setdefault("dim", None)
    bound.setdefault("keepdim", False)
    return bound


def _dim(value: Any, rank: int, op: str) -> int:
    """The one reduced dim as written; :class:`Unsupported` for none, several or a computed one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if value is None or value == []:
        raise Unsupported(f"the {op} reduces every element, not one dim")
    if isinstance(value, list):
        raise Unsupported(f"the {op} reduces {len(value)} dims {value}; only one dim is supported")
    if isinstance(value, bool) or not isinstance(value, int):
        raise Unsupported(f"the {op}'s dim {value!r} is not a number known when tracing")
    if not -rank <= value < rank:
        raise Unsupported(f"the {op}'s dim {value} is out of range for a {rank}-d input")
    if value % rank == rank - 1:
        raise Unsupported(
            f"the {op} reduces the last dim: that is the row_reduction strategy's case "
            "(each row contiguous), not a reduction over a middle dim"
        )
    return value


def _result(a: TaskAnalysis, ref: Any, reduction: dict[str, Any]) -> str:
    """What an output is: the reduction's ``values``/``indices``, or its (values, indices) ``pair``."""
    if not isinstance(ref, dict) or set(ref) != {"ref"}:
        raise Unsupported("the forward returns something other than the reduction's result")
    if ref["ref"] == reduction["name"]:
        if reduction["op"] in ("max", "min"):
            return "pair"
        return "indices" if reduction["op"] in ("argmax", "argmin") else "values"
    node = a.node(ref["ref"])
    args = node.get("args") or []
    if node.get("op") not in ("getitem", "getattr") or args[:1] != [{"ref": reduction["name"]}]:
        raise Unsupported("the forward returns something other than the reduction's result")
    index = args[1] if len(args) > 1 else None
    if index in (0, -2, "values"):
        return "values"
    if index in (1, -1, "indices"):
        return "indices"
    raise Unsupported(f"the forward takes item {index!r} of the {reduction['op']}'s (values, indices)")


def _match(a: TaskAnalysis) -> DimReducePlan:
    if not a.traced:
        raise Unsupported(f"the module could not be traced with torch.fx: {a.trace_error}")
    inputs = [n for n in a.nodes if n.get("op") == "input"]
    if len(inputs) != 1 or len(a.forward_args) != 1:
        raise Unsupported("the forward does not take exactly one input")
    x = inputs[0]
    calls = a.call_nodes()
    reductions = [n for n in calls if n.get("op") not in ("getitem", "getattr")]
    if len(reductions) != 1:
        ops = ", ".join(str(n.get("op")) for n in reductions) or "nothing"
        raise Unsupported(f"the forward is not exactly one reduction (it computes {ops})")
    node = reductions[0]
    op = node.get("op")
    if op not in OPS:
        raise Unsupported(f"the forward's op {op!r} is not a reduction this kernel computes")
    if node.get("inplace"):
        raise Unsupported(f"the {op} runs in place")
    b = _bind(node)
    if b.get("input") != {"ref": x["name"]}:
        raise Unsupported(f"the {op} does not reduce the forward's input")
    if b.get("dtype") is not None:
        raise Unsupported(f"the {op} has dtype= (another accumulation and output dtype)")
    shape, dtype = x.get("shape"), x.get("dtype")
    if x.get("kind") != "placeholder" or not shape or dtype not in DTYPES:
        raise Unsupported(
            f"the input is {dtype} {shape}: the kernel reduces float32, float16 or bfloat16 tensors"
        )
    if op in ("max", "min") and b["dim"] is None:
        raise Unsupported(f"the {op} reduces every element, not one dim")
    dim = _dim(b["dim"], len(shape), op)
    if not isinstance(b["keepdim"], bool):
        raise Unsupported(f"the {op}'s keepdim {b['keepdim']!r} is not a bool known when tracing")
    output = next(n for n in a.nodes if n["kind"] == "output")
    for item in calls:
        if item is node:
            continue
        if op not in ("max", "min") or (item.get("args") or [None])[0] != {"ref": node["name"]}:
            raise Unsupported(
                f"the forward indexes a value ({item['name']}) other than max/min's (values, indices)"
            )
        if a.users(item["name"]) != [output["name"]]:
            raise Unsupported(f"the forward computes with the {op}'s result ({item['name']})")
    returned = (output.get("args") or [None])[0]
    as_tuple = isinstance(returned, list)
    results = tuple(_result(a, r, node) for r in (returned if as_tuple else [returned]))
    if not results:
        raise Unsupported("the forward returns nothing")
    return DimReducePlan(x["name"], op, dim, b["keepdim"], results, as_tuple, tuple(shape), dtype)


def match(analysis: TaskAnalysis) -> tuple[DimReducePlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    try:
        plan = _match(analysis)
    except Unsupported as exc:
        return None, str(exc)
    except (LookupError, TypeError, ValueError) as exc:  # a graph of another shape than expected
        return None, f"not one reduction over a dim ({type(exc).__name__}: {exc})"
    shape, axis = plan.shape, plan.axis
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    return plan, (
        f"the forward is one {plan.op} of its {plan.dtype} input {list(shape)} over dim {axis}, not "
        f"the last: viewed as (outer, reduced, inner) = ({outer}, {shape[axis]}, {inner}), one Triton "
        "kernel reads tiles of consecutive inner positions down the reduced dim, each element once"
    )


def tuning_space(plan: DimReducePlan, arch: str) -> list[dict[str, int]]:
    """(BLOCK_R, BLOCK_I, num_warps) configurations worth timing on ``arch`` (estimates, not measured)."""
    del plan
    configs = CONFIGS[arch_class(arch)]
    return [dict(zip(PARAMS, config, strict=True)) for config in configs]


def check_params(params: dict[str, Any]) -> dict[str, int]:
    """``params`` over the first H100 configuration, each checked; ``ValueError`` names a bad key."""
    merged = {**dict(zip(PARAMS, CONFIGS["sm_90"][0], strict=True)), **params}
    unknown = set(merged) - set(PARAMS)
    if unknown:
        raise ValueError(f"unknown dim reduction parameter(s) {sorted(unknown)} ({', '.join(PARAMS)})")
    for key in ("BLOCK_R", "BLOCK_I"):
        block = merged[key]
        if type(block) is not int or not 1 <= block <= 1024 or block & (block - 1):
            raise ValueError(f"{key} must be a power of two in [1, 1024], got {block!r}")
    if merged["BLOCK_R"] * merged["BLOCK_I"] > 16384:
        raise ValueError("BLOCK_R x BLOCK_I must be at most 16384 elements (registers)")
    if type(merged["num_warps"]) is not int or merged["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {merged['num_warps']!r}")
    return merged


def _top_level_names(source: str) -> set[str]:
    """The names a module's top-level statements bind."""
    names: set[str] = set()
    for stmt in parse_python(source).body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in stmt.names}
        else:
            names |= {
                n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
    return names


def generate(task_source: str, analysis: TaskAnalysis, plan: DimReducePlan, params: dict[str, Any]) -> str:
    """The candidate: the reference's parameters, its reduction as one own Triton kernel."""
    del analysis
    p = check_params(params)
    reference = reference_source(task_source)  # it imports torch
    lines = reference.splitlines()
    future = [line for line in lines if line.startswith("from __future__ import")]
    reference = "\n".join(line for line in lines if line not in future).strip()
    clashes = sorted(_top_level_names(reference) & OWN_NAMES)
    if clashes:
        raise ValueError(
            f"the reference defines {', '.join(clashes)}, which the candidate's own code defines too"
        )
    # max/min's (values, indices) as a plain tuple: the verifier compares flattened outputs, and a
    # candidate may not reach torch.return_types
    items = {"values": "values", "indices": "indices", "pair": "(values, indices)"}
    returned = ", ".join(items[r] for r in plan.results)
    if plan.as_tuple:
        returned = f"({returned},)" if len(plan.results) == 1 else f"({returned})"
    source = TEMPLATE.format(
        future="\n".join(future) + "\n\n" if future else "",
        reference=reference,
        name=REFERENCE_NAME,
        op=plan.op,
        dim=plan.dim,
        keepdim=plan.keepdim,
        want=plan.want,
        params={"BLOCK_R": p["BLOCK_R"], "BLOCK_I": p["BLOCK_I"], "num_warps": p["num_warps"]},
        x=plan.input,
        returned=returned,
        helpers=HELPERS["_round_bf16"].strip("\n"),
        kernels=SOURCE.strip("\n"),
    )
    return checked_copy(source)


SOURCE = '''
@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def dim_accumulate_kernel(
    x_ptr, out_ptr,
    # sizes: the input viewed as (O, R, I), reduced over R; blocks of BLOCK_I inner positions per row
    R, I, COL_BLOCKS,
    # meta-parameters
    PROD: tl.constexpr, MEAN: tl.constexpr, ROUND_BF16: tl.constexpr, INDEX64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Sum (product; mean) over R of BLOCK_I consecutive inner positions of one outer index, in
    float32: BLOCK_R rows per step folded into a tile of partial results, reduced once at the end."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    if INDEX64:
        pid = pid.to(tl.int64)
        rows = rows.to(tl.int64)
    o = pid // COL_BLOCKS
    cols = (pid % COL_BLOCKS) * BLOCK_I + tl.arange(0, BLOCK_I)
    col_ok = cols < I
    x_base = x_ptr + o * R * I
    if PROD:
        acc = tl.full((BLOCK_R, BLOCK_I), 1.0, tl.float32)
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_I), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + rows
        mask = (r < R)[:, None] & col_ok[None, :]
        ptrs = x_base + r[:, None] * I + cols[None, :]
        if PROD:
            acc = acc * tl.load(ptrs, mask=mask, other=1.0).to(tl.float32)
        else:
            acc = acc + tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if PROD:
        result = tl.reduce(acc, 0, _mul)
    else:
        result = tl.sum(acc, axis=0)
    if MEAN:
        result = result / R
    if ROUND_BF16:  # round as the GPU does, under the interpreter too
        result = _round_bf16(result)
    tl.store(out_ptr + o * I + cols, result.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def dim_extreme_kernel(
    x_ptr, values_ptr, indices_ptr,
    # sizes: the input viewed as (O, R, I), reduced over R; blocks of BLOCK_I inner positions per row
    R, I, COL_BLOCKS,
    # meta-parameters
    LARGEST: tl.constexpr, WRITE_VALUES: tl.constexpr, WRITE_INDICES: tl.constexpr,
    INDEX64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Max (min) over R of BLOCK_I consecutive inner positions of one outer index, and its index, as
    torch: a NaN wins (the first NaN's index), else the first largest (smallest) element's.

    Row r is lane r % BLOCK_R of the running tile; a lane sees its rows in increasing order, so a
    strict comparison keeps each lane's first extreme. Lanes are merged once at the end: the value,
    then the smallest index among the lanes holding it. A lane's index R means "no row yet"."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    if INDEX64:
        pid = pid.to(tl.int64)
        rows = rows.to(tl.int64)
    o = pid // COL_BLOCKS
    cols = (pid % COL_BLOCKS) * BLOCK_I + tl.arange(0, BLOCK_I)
    col_ok = cols < I
    x_base = x_ptr + o * R * I
    if LARGEST:
        fill = float("-inf")
    else:
        fill = float("inf")
    best = tl.full((BLOCK_R, BLOCK_I), fill, tl.float32)
    best_i = tl.zeros((BLOCK_R, BLOCK_I), rows.dtype) + R
    for r0 in range(0, R, BLOCK_R):
        r = r0 + rows
        mask = (r < R)[:, None] & col_ok[None, :]
        v = tl.load(x_base + r[:, None] * I + cols[None, :], mask=mask, other=fill).to(tl.float32)
        if LARGEST:
            better = v > best
        else:
            better = v < best
        take = mask & (better | ((v != v) & (best == best)) | (best_i == R))
        best = tl.where(take, v, best)
        best_i = tl.where(take, r[:, None], best_i)
    is_nan = best != best
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    if LARGEST:
        extreme = tl.max(tl.where(is_nan, fill, best), axis=0)
    else:
        extreme = tl.min(tl.where(is_nan, fill, best), axis=0)
    out = o * I + cols
    if WRITE_INDICES:
        # the lanes holding the result: the NaN ones where the column has a NaN, else the extreme ones
        hit = (is_nan | (best == extreme[None, :])) & (is_nan == any_nan[None, :]) & (best_i < R)
        index = tl.min(tl.where(hit, best_i, R), axis=0)
        tl.store(indices_ptr + out, index.to(tl.int64), mask=col_ok)
    if WRITE_VALUES:
        value = tl.where(any_nan, float("nan"), extreme)
        tl.store(values_ptr + out, value.to(values_ptr.dtype.element_ty), mask=col_ok)


#: The dtypes the kernels read.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: op -> whether it picks the largest element (max-like) or the smallest; sum, mean and prod add up.
EXTREME = {"amax": True, "max": True, "argmax": True, "amin": False, "min": False, "argmin": False}


def dim_reduce(x, dim, keepdim, op, want, params):
    """torch.<op>(x, dim, keepdim=keepdim) for one dim of a float32, float16 or bfloat16 tensor, as
    one kernel over x viewed as (outer, reduced, inner): ``(values, indices)``, each None unless
    ``want`` (``values``, ``indices`` or ``both``) asks for it."""
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"dim_reduce reads float32, float16 or bfloat16 tensors, got {x.dtype}")
    if op not in EXTREME and op not in ("sum", "mean", "prod"):
        raise ValueError(f"unknown reduction {op!r}")
    if want not in ("values", "indices", "both"):
        raise ValueError(f"want must be values, indices or both, got {want!r}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    x = x.contiguous()
    shape = tuple(x.shape)
    outer, reduced, inner = x.shape[:dim].numel(), shape[dim], x.shape[dim + 1:].numel()
    out_shape = shape[:dim] + ((1,) if keepdim else ()) + shape[dim + 1:]
    values = indices = None
    if want != "indices":
        values = torch.empty((outer, inner), dtype=x.dtype, device=x.device)
    if want != "values":
        indices = torch.empty((outer, inner), dtype=torch.int64, device=x.device)
    if op in EXTREME and reduced == 0:
        raise ValueError(f"{op} over dim {dim} of size 0 (shape {shape}) has no element to pick")
    if outer * inner > 0:
        # narrow inner dims: fewer columns, more rows per tile (the same number of elements)
        block_i = min(params["BLOCK_I"], triton.next_power_of_2(inner))
        block_r = params["BLOCK_R"] * (params["BLOCK_I"] // block_i)
        block_r = max(1, min(block_r, triton.next_power_of_2(max(reduced, 1))))
        col_blocks = triton.cdiv(inner, block_i)
        grid = (outer * col_blocks,)
        index64 = x.numel() + block_r * inner >= 2**31  # masked rows past the end count too
        if op in EXTREME:
            dim_extreme_kernel[grid](
                x, x if values is None else values, x if indices is None else indices,
                reduced, inner, col_blocks,
                LARGEST=EXTREME[op], WRITE_VALUES=values is not None, WRITE_INDICES=indices is not None,
                INDEX64=index64, BLOCK_R=block_r, BLOCK_I=block_i, num_warps=params["num_warps"],
            )
        else:
            dim_accumulate_kernel[grid](
                x, values,
                reduced, inner, col_blocks,
                PROD=op == "prod", MEAN=op == "mean", ROUND_BF16=x.dtype == torch.bfloat16,
                INDEX64=index64, BLOCK_R=block_r, BLOCK_I=block_i, num_warps=params["num_warps"],
            )
    return (
        None if values is None else values.reshape(out_shape),
        None if indices is None else indices.reshape(out_shape),
    )
'''
"""The kernels and their host function ``dim_reduce(x, dim, keepdim, op, want, params)``, emitted
into candidates (they need ``torch``, ``triton``, ``tl`` and ``_round_bf16``)."""


TEMPLATE = '''"""Dim reduction candidate (kernelcrew playbook, strategy dim_reduction): torch.{op} over dim {dim}
(keepdim={keepdim}) as one own Triton kernel over the input viewed as (outer, reduced, inner):
each program reduces BLOCK_I consecutive inner positions down the reduced dim, BLOCK_R rows per
step. The reference is copied as {name}; ModelNew inherits its parameters and buffers.
"""

{future}import triton
import triton.language as tl

{reference}


{helpers}


{kernels}


#: dim_reduce's (dim as written, keepdim, op, what the forward returns: values, indices or both)
REDUCTION = ({dim!r}, {keepdim!r}, {op!r}, {want!r})
REDUCTION_PARAMS = {params!r}


class ModelNew({name}):
    """{name} with its {op} over one dim as one own Triton kernel."""

    def forward(self, {x}):
        if {x}.dtype not in KERNEL_DTYPES:  # float64 and the rest: the reference's own op
            return {name}.forward(self, {x})
        values, indices = dim_reduce({x}, *REDUCTION, REDUCTION_PARAMS)
        return {returned}
'''

#: The names the candidate's own code binds at its top level: a reference defining one is refused.
OWN_NAMES = _top_level_names(SOURCE) | {
    "triton",
    "tl",
    "_round_bf16",
    "REDUCTION",
    "REDUCTION_PARAMS",
    "ModelNew",
}

__all__ = ["CONFIGS", "DimReducePlan", "check_params", "generate", "match", "tuning_space"]
