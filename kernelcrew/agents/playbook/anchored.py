"""Anchored fusion strategy: library anchors kept as they are, the regions between them fused into own kernels.

Real modules are a few library ops (convolutions, matmuls, pooling, recurrent cells, attention,
embeddings) with elementwise math and reductions around them: no whole-module strategy matches
them. :func:`match` walks the traced graph in order and splits it into

* *anchors*: every op the generators cannot lower, kept as the same torch call of the same
  module (their parameters are the reference's own);
* *regions*: maximal runs of ops between anchors that :mod:`.pointwise` (elementwise DAGs) or
  :mod:`.rows` (reductions, softmax, norms, with their elementwise neighbours) lowers to one Triton
  kernel. Each run is cut greedily from its start into the longest pieces that lower, with one
  value used after the piece; an op that lowers in no piece stays a torch op (``left``).
* *GEMM heads*: a float32 linear layer or matmul by a parameter (or by another argument) starts a
  run of its own: :mod:`.matmul` lowers it with the longest elementwise piece after it into one
  own Triton GEMM that applies that piece in its epilogue and multiplies in TF32x3 (float32
  accuracy on the tensor cores, 1.7x cuBLAS's float32 GEMM on an H100: docs/benchmarks.md). A
  head that does not lower (half-precision layers, where cuBLAS is faster; a GEMV) stays an anchor.
* *float32 convolutions* (``nn.Conv1d/2d/3d`` that :func:`.conv.eligible` gives the kernel: enough
  channels per group and output tiles) run as :mod:`.conv`'s own implicit-GEMM kernel in TF32x3
  (parameter ``conv``; ``"library"`` keeps cuDNN's): each such module call of the traced graph
  calls the kernel instead. The other convolutions stay cuDNN's, in the reference's memory format
  (channels-last timed slower than contiguous on the float32 convolution tasks tried on an H100,
  see docs/playbook.md). A convolution left to the library whose output only the region after it
  reads runs without its bias, and that region adds it as its first op (:func:`_fold_conv_bias`).

The generators are reused on a *sub-analysis*: a copy of the piece's nodes whose outside values
are placeholders (weights stay the module's own). A reduction over other dims than the last
(``mean(x, dim=(2, 3))`` of an anchor's output, ``sum(x, dim=1)`` without keepdim) is turned into
one over the last dim by a view of its input (``flatten``, or ``movedim`` then ``flatten``) done in
the region's wrapper, so the kernel's output has the reference's shape.

The candidate copies the reference (as :mod:`.compiler` does), traces its forward with ``torch.fx``
on the first call of each input signature, exactly as the analysis did (node names match), replaces
each region's nodes by one call of its kernel's wrapper and runs that graph. Each region's kernel
source is the generator's own, its top-level names prefixed ``r<i>_`` so that regions never clash.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any

from kernelcrew.agents.playbook import conv, depthwise, matmul, pointwise, rows
from kernelcrew.agents.playbook.analysis import TaskAnalysis, refs_of
from kernelcrew.agents.playbook.compiler import REFERENCE_NAME, checked_copy, reference_source
from kernelcrew.agents.playbook.rows.lowering import ROW_OPS
from kernelcrew.agents.playbook.rows.lowering import SIGNATURES as ROW_SIGNATURES
from kernelcrew.task import parse_python

#: Ops a region may hold: what the pointwise and row generators lower.
FUSIBLE = pointwise.SUPPORTED_OPS | ROW_OPS
#: Row ops that reduce (a piece with one of them is the row generator's, else the pointwise one's).
REDUCING = ROW_OPS - {"masked_fill"}
#: Reductions whose ``dim`` may name other dims than the last: turned into one over the last dim.
MOVABLE = frozenset({"sum", "mean", "amax", "amin", "logsumexp", "var", "std", "norm", "linalg_vector_norm"})
#: Whole-module own-kernel strategies: where one applies, the module is not split into parts.
WHOLE_MODULE = ("fused_pointwise", "row_reduction", "dim_reduction", "matmul_epilogue")
#: The longest run of fusible ops cut into pieces at once (the cut tries O(n^2) pieces).
MAX_RUN = 48
#: Ops kept as they are that only reshape or describe a tensor (not reported as anchors).
VIEW_OPS = frozenset(
    {
        *("view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "squeeze", "unsqueeze"),
        *("expand", "size", "dim", "numel", "getattr", "getitem", "contiguous", "chunk", "split"),
    }
)
#: Ops that start a GEMM head (float32 only: see the module docstring).
GEMM_OPS = frozenset({"linear"}) | matmul.MATMUL_OPS
PARAM_KEYS = ("pointwise", "rows", "matmul", "conv", "direct")
ROW_PARAM_KEYS = ("MAX_SINGLE", "CHUNK", "TILE", "num_warps")


class Unsupported(ValueError):
    """The module cannot be optimized by its parts; the message says why."""


@dataclass
class Region:
    """One piece of the graph lowered to one kernel: the nodes it replaces, the value it computes,
    the generator that lowered it and how its wrapper's arguments come from the graph."""

    nodes: tuple[str, ...]
    out: str
    generator: str
    #: Per kernel operand: ``("node", name)`` (a value of the graph) or ``("parameter"|"buffer", target)``.
    args: tuple[tuple[str, str], ...]
    #: Per kernel operand: None, ``("flatten", start, ones)`` or ``("movedim", dims)`` (done first).
    preps: tuple[Any, ...]
    analysis: TaskAnalysis = field(repr=False)
    plan: Any = field(repr=False)

    @property
    def ops(self) -> list[str]:
        return [self.analysis.node(n)["op"] for n in self.nodes]


@dataclass
class AnchoredPlan:
    """The regions to fuse, the fusible ops left to torch and the anchors kept, in graph order."""

    regions: list[Region]
    left: list[str]
    anchors: list[str]
    traced_at_shapes: bool = False
    #: Module paths of the float32 convolutions the own convolution kernel may run.
    convs: list[str] = field(default_factory=list)
    #: Module paths of the float32 convolutions with few channels per group (depthwise) that the
    #: own direct convolution kernel may run.
    directs: list[str] = field(default_factory=list)
    #: Library convolutions whose bias the region after them adds (graph node -> (module path,
    #: spatial dims)): the library's convolution then runs without it, which saves the separate pass
    #: over its output that PyTorch's convolutions spend on the bias.
    bias_folds: dict[str, tuple[str, int]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Matching
# ----------------------------------------------------------------------------------------------


def match(analysis: TaskAnalysis) -> tuple[AnchoredPlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    try:
        plan = _match(analysis)
    except Unsupported as exc:
        return None, str(exc)
    by_generator: dict[str, list[str]] = {}
    for r in plan.regions:
        by_generator.setdefault(r.generator, []).extend(r.ops)
    ops = "; ".join(f"{g}: {', '.join(dict.fromkeys(o))}" for g, o in by_generator.items())
    anchors = ", ".join(dict.fromkeys(plan.anchors)) or "none"
    left = f"; left to torch: {', '.join(plan.left)}" if plan.left else ""
    convs = f"; {len(plan.convs)} float32 convolution(s) as own TF32x3 kernels" if plan.convs else ""
    if plan.directs:
        convs += f"; {len(plan.directs)} depthwise convolution(s) as own direct kernels"
    if plan.bias_folds:
        convs += f"; the bias of {len(plan.bias_folds)} library convolution(s) added in the region after it"
    return plan, (
        f"library anchors ({anchors}) kept; {len(plan.regions)} region(s) between them fused into "
        f"own kernels ({ops}){left}{convs}"
    )


#: A plan of more kernels than this (regions and own convolutions) goes after the library and
#: compiler candidates: each is a Triton launch whose host cost exceeds the ATen launches it
#: replaces, and a network of many small kernels is bound by its launches. On an H100 the anchored
#: candidate of ResNet101 (101 regions, 53 own convolutions) ran at 0.44x eager, where CUDA graphs
#: of DenseNet201 (104 regions) ran 1.37x faster than eager (bench/results/kernelbench_h100.json);
#: the sample's level-2 plans have at most a few kernels.
MANY_KERNELS = 32


def rank(plan: AnchoredPlan) -> int:
    """Where the playbook tries this plan: with the own kernels, or after the library and compiler
    candidates where it launches more than :data:`MANY_KERNELS` kernels."""
    return 2 if len(plan.regions) + len(plan.convs) + len(plan.directs) > MANY_KERNELS else 0


def _match(a: TaskAnalysis) -> AnchoredPlan:
    if a.traced_at_shapes:
        raise Unsupported(
            "the forward computes from its inputs' shapes (traced at the example's shapes only): "
            "constants of the graph would be baked into the region kernels"
        )
    if not a.traced:
        raise Unsupported(f"the module could not be traced with torch.fx: {a.trace_error}")
    if any(e.get("kind") == "extra_state" for e in a.state_dict):
        raise Unsupported("the module has extra state in its state dict")
    whole = _whole_module(a)
    if whole:
        raise Unsupported(f"a whole-module strategy applies ({whole}): it fuses more than parts can")
    plan = partition(a)
    if not plan.regions and not plan.convs and not plan.directs:
        raise Unsupported(
            "no region between the anchors lowers to an own kernel, and no convolution is one of the "
            "own convolution kernels'"
        )
    if a.task_source:
        try:
            _check_forward(a.task_source)
            reference_source(a.task_source)
        except (ValueError, SyntaxError, StopIteration) as exc:
            raise Unsupported(f"the reference cannot be copied into a candidate: {exc}") from exc
    return plan


def _whole_module(a: TaskAnalysis) -> str:
    """The first whole-module own-kernel strategy that applies ('' when none does)."""
    from kernelcrew.agents.playbook import STRATEGIES

    for name in WHOLE_MODULE:
        strategy = STRATEGIES.get(name)
        if strategy is not None and strategy.match(a)[0] is not None:
            return name
    return ""


def partition(a: TaskAnalysis) -> AnchoredPlan:
    """Anchors, regions and ops left to torch of the traced graph (see the module docstring)."""
    users: dict[str, list[str]] = {n["name"]: [] for n in a.nodes}
    for node in a.nodes:
        for ref in dict.fromkeys(refs_of(node)):
            users.setdefault(ref, []).append(node["name"])
    runs: list[list[dict[str, Any]]] = [[]]
    anchors: list[str] = []
    for node in a.nodes:
        if node["kind"] in ("placeholder", "get_attr"):
            continue
        if node["kind"] != "output" and _gemm_head(node):
            runs.append([node])  # a run of its own, whose first node is the head
            continue
        if node["kind"] != "output" and _fusible(node):
            runs[-1].append(node)
            if len(runs[-1]) >= MAX_RUN:
                runs.append([])
            continue
        if node["kind"] != "output" and node["op"] not in VIEW_OPS:
            anchors.append(node["op"])
        if runs[-1]:
            runs.append([])
    regions: list[Region] = []
    left: list[str] = []
    for run in runs:
        i = 0
        while i < len(run):
            for j in range(len(run), i, -1):
                region = _lower(a, run[i:j]) if _closed(run[i:j], users) else None
                if region is not None:
                    regions.append(region)
                    i = j
                    break
            else:
                if _gemm_head(run[i]):  # only ever a run's first node: a GEMM that did not lower
                    anchors.append(run[i]["op"])
                else:
                    left.append(run[i]["name"])
                i += 1
    convs = list(dict.fromkeys(n["target"] for n in a.nodes if conv.eligible(a, n)[0]))
    directs = list(dict.fromkeys(n["target"] for n in a.nodes if depthwise.eligible(a, n)[0]))
    folds: dict[str, tuple[str, int]] = {}
    for k, region in enumerate(regions):
        folded = _fold_conv_bias(a, region, users, {*convs, *directs})
        if folded is not None:
            regions[k], (node, target, nd) = folded
            folds[node] = (target, nd)
    return AnchoredPlan(
        regions,
        left,
        anchors,
        traced_at_shapes=a.traced_at_shapes,
        convs=convs,
        directs=directs,
        bias_folds=folds,
    )


def _fold_conv_bias(
    a: TaskAnalysis, region: Region, users: dict[str, list[str]], own: set[str]
) -> tuple[Region, tuple[str, str, int]] | None:
    """``region`` lowered again with the bias of the library convolution it reads added as its
    first op (and that convolution's node and module), or None: the region reads no such
    convolution, something else reads the convolution's output, or the region then lowers nowhere.

    PyTorch's convolutions add their bias in a separate pass over the output (``output.add_``
    after cuDNN's call), which the region's kernel does for free as it reads that output."""
    if region.generator not in ("pointwise", "rows"):
        return None
    for kind, name in region.args:
        if kind != "node":
            continue
        source = a.node(name)
        bias = (source.get("kwargs") or {}).get("bias")
        if (
            source.get("kind") != "call_module"
            or source.get("module_type") not in conv.MODULES
            or source["target"] in own
            or len(source.get("args") or []) != 1
            or not isinstance(bias, dict)
            or "param" not in bias
            or not source.get("shape")
            or any(u not in region.nodes for u in users.get(name, []))
        ):
            continue
        weight, _, _ = conv.float32_weight(a, source)
        rank, nd = len(source["shape"]), len(weight) - 2
        if nd < 1 or rank not in (nd + 1, nd + 2):
            continue
        channels = source["shape"][1 if rank == nd + 2 else 0]
        holder = {
            "name": f"{name}_bias", "kind": "placeholder", "op": "input", "target": f"{name}_bias",
            "args": [], "kwargs": {}, "shape": [channels] + [1] * nd, "dtype": source.get("dtype"),
        }  # fmt: skip
        add = {
            "name": f"{name}_biased", "kind": "call_function", "target": "operator.add", "op": "add",
            "args": [{"ref": name}, {"ref": holder["name"]}], "kwargs": {},
            "shape": source["shape"], "dtype": source.get("dtype"),
        }  # fmt: skip
        piece = [add] + [_renamed(a.node(n), name, add["name"]) for n in region.nodes]
        widened = TaskAnalysis({**a.data, "nodes": [*a.data["nodes"], holder, add]})
        lowered = _lower(widened, piece)
        if lowered is None:
            return None
        lowered.nodes = region.nodes  # the graph's own nodes: the add is the kernel's
        return lowered, (name, source["target"], nd)
    return None


def _renamed(node: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """A copy of ``node`` whose arguments read ``new`` where they read ``old``."""

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            return {"ref": new} if value == {"ref": old} else {k: swap(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(swap(v) for v in value)
        return value

    return {**node, "args": swap(node["args"]), "kwargs": swap(node["kwargs"])}


def _gemm_head(node: dict[str, Any]) -> bool:
    return node["kind"].startswith("call_") and node["op"] in GEMM_OPS and node.get("dtype") == "float32"


def _fusible(node: dict[str, Any]) -> bool:
    return node["op"] in FUSIBLE and node.get("shape") is not None and node.get("dtype") is not None


def _closed(piece: list[dict[str, Any]], users: dict[str, list[str]]) -> bool:
    """Whether ``piece`` can be one kernel: only its last value is used after it, and what its
    in-place ops change is read nowhere else."""
    names = {n["name"] for n in piece}
    for node in piece[:-1]:
        if any(u not in names for u in users[node["name"]]):
            return False
    for node in piece:
        if node.get("inplace"):
            first = node["args"][0] if node["args"] else None
            ref = first.get("ref") if isinstance(first, dict) else None
            if ref is None or any(u not in names for u in users.get(ref, [])):
                return False
    return True


def sub_analysis(a: TaskAnalysis, piece: list[dict[str, Any]]) -> TaskAnalysis:
    """The piece as a module of its own: its outside values are its forward's arguments, weights
    stay the module's (``get_attr`` and ``{"param": ...}`` arguments against its state dict)."""
    names = {n["name"] for n in piece}
    outside: list[str] = []
    for node in piece:
        for ref in refs_of(node):
            if ref not in names and ref not in outside:
                outside.append(ref)
    nodes: list[dict[str, Any]] = []
    for ref in outside:
        source = a.node(ref)
        if source["kind"] == "get_attr":
            nodes.append(dict(source))
        else:
            nodes.append(
                {
                    "name": ref,
                    "kind": "placeholder",
                    "op": "input",
                    "target": ref,
                    "args": [],
                    "kwargs": {},
                    "shape": source.get("shape"),
                    "dtype": source.get("dtype"),
                }
            )
    nodes += [dict(n) for n in piece]
    last = piece[-1]
    out = {"ref": last["name"], "shape": last.get("shape"), "dtype": last.get("dtype")}
    nodes.append(
        {
            "name": "output",
            "kind": "output",
            "op": "output",
            "target": "output",
            "args": [{"ref": last["name"]}],
            "kwargs": {},
            "shape": out["shape"],
            "dtype": out["dtype"],
        }
    )
    placeholders = [n for n in nodes if n["kind"] == "placeholder"]
    data = {
        "traced": True,
        "nodes": nodes,
        "outputs": [out],
        "forward_args": [{"name": n["name"]} for n in placeholders],
        "inputs": [
            {"index": i, "name": n["name"], "kind": "tensor", "shape": n["shape"], "dtype": n["dtype"]}
            for i, n in enumerate(placeholders)
        ],
        "state_dict": a.state_dict,
        "parameters": a.parameters,
        "buffers": a.buffers,
        "op_sequence": [n["op"] for n in piece],
    }
    return TaskAnalysis(data)


def _lower(a: TaskAnalysis, piece: list[dict[str, Any]]) -> Region | None:
    """The region of ``piece`` when a generator lowers it, else None."""
    sub = sub_analysis(a, piece)
    if _gemm_head(piece[0]):
        plan, _ = matmul.match(sub)
        if plan is None:
            return None
        args = [("node", plan.input)]
        args += [("node" if layer.source == "input" else "parameter", layer.weight) for layer in plan.layers]
        args += [_arg(plan.epilogue.operands[i]) for i in plan.loaded]
        return Region(
            nodes=tuple(n["name"] for n in piece),
            out=piece[-1]["name"],
            generator="matmul",
            args=tuple(args),
            preps=(None,) * len(args),
            analysis=sub,
            plan=plan,
        )
    preps = _last_dim_reductions(sub)
    if any(n["op"] in REDUCING for n in piece):
        generator, (plan, _) = "rows", rows.match(sub)
    else:
        generator, (plan, _) = "pointwise", pointwise.match(sub)
    if plan is None or (generator == "pointwise" and not plan.steps):
        return None  # nothing lowers, or a copy: no kernel for it
    args = [_arg(operand) for operand in plan.operands]
    return Region(
        nodes=tuple(n["name"] for n in piece),
        out=piece[-1]["name"],
        generator=generator,
        args=tuple(args),
        preps=tuple(preps.get(name) if kind == "node" else None for kind, name in args),
        analysis=sub,
        plan=plan,
    )


def _arg(operand: Any) -> tuple[str, str]:
    """How a kernel operand comes from the graph: a value (``node``) or a weight."""
    return ("node", operand.name) if operand.source == "input" else (operand.source, operand.name)


def _bound(node: dict[str, Any]) -> dict[str, Any] | None:
    """A reduction's arguments by name (as given: defaults left out); None when they do not bind."""
    names = [n for n, _ in ROW_SIGNATURES[node["op"]]]
    if len(node["args"]) > len(names):
        return None
    bound = dict(zip(names, node["args"], strict=False))
    for key, value in node["kwargs"].items():
        if key not in names or key in bound:
            return None
        bound[key] = value
    return bound


def _reduced_dims(bound: dict[str, Any], rank: int) -> tuple[tuple[int, ...], bool] | None:
    """(sorted dims reduced, keepdim) of a bound reduction of a rank-``rank`` tensor."""
    dim = bound.get("dim")
    keepdim = bound.get("keepdim", False)
    if not isinstance(keepdim, bool):
        return None
    if dim is None or dim == [] or dim == ():
        dims = list(range(rank))
    elif isinstance(dim, int) and not isinstance(dim, bool):
        dims = [dim]
    elif isinstance(dim, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in dim):
        dims = list(dim)
    else:
        return None
    if rank == 0 or any(not -rank <= d < rank for d in dims):
        return None
    normalized = tuple(sorted({d % rank for d in dims}))
    if len(normalized) != len(dims):
        return None
    return normalized, keepdim


def _last_dim_reductions(sub: TaskAnalysis) -> dict[str, Any]:
    """Turn reductions of a placeholder over other dims into reductions over its last dim.

    The placeholder's shape becomes that of the view its region's wrapper passes (the reduced dims
    flattened into the last one, after the kept ones), so the reduction's output keeps its shape:
    with keepdim, trailing dims flatten to ``lead + (1,) * (k - 1) + (prod,)``; without, any dims
    move to the end and flatten to ``kept + (prod,)``. Every user of the placeholder must be such a
    reduction over the same dims. Returns the wrapper's view per placeholder; rewrites ``sub``.
    """
    preps: dict[str, Any] = {}
    nodes = sub.data["nodes"]
    for holder in [n for n in nodes if n["kind"] == "placeholder" and n.get("shape") is not None]:
        shape = list(holder["shape"])
        rank = len(shape)
        readers = [n for n in nodes if holder["name"] in refs_of(n)]
        if not readers or any(n["op"] not in MOVABLE for n in readers):
            continue
        binds = [_bound(n) for n in readers]
        if any(b is None or b.get("input") != {"ref": holder["name"]} for b in binds):
            continue
        specs = {_reduced_dims(b, rank) for b in binds if b is not None}
        if len(specs) != 1 or None in specs:
            continue
        dims, keepdim = specs.pop()  # type: ignore[misc]
        if dims == (rank - 1,):
            continue
        size = math.prod(shape[d] for d in dims)
        if dims == tuple(range(rank - len(dims), rank)):
            start = rank - len(dims)
            ones = len(dims) - 1 if keepdim else 0
            holder["shape"] = [*shape[:start], *([1] * ones), size]
            preps[holder["name"]] = ("flatten", start, ones)
        elif not keepdim:
            holder["shape"] = [*(shape[d] for d in range(rank) if d not in dims), size]
            preps[holder["name"]] = ("movedim", list(dims))
        else:
            continue
        for node, bound in zip(readers, binds, strict=True):
            assert bound is not None
            kwargs = {k: v for k, v in bound.items() if k != "input"}
            kwargs["dim"] = -1
            node["args"], node["kwargs"] = [bound["input"]], kwargs
    sub.__post_init__()
    return preps


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------


def tuning_space(plan: AnchoredPlan, arch: str) -> list[dict[str, Any]]:
    """Block sizes of the pointwise, row and matmul kernels worth timing on ``arch``, tried
    together: configuration i takes each generator's i-th (its last when it has fewer)."""
    pw = [r.plan for r in plan.regions if r.generator == "pointwise"]
    rw = [r.plan for r in plan.regions if r.generator == "rows"]
    mm = [r.plan for r in plan.regions if r.generator == "matmul"]
    cv_space = conv.tuning_space(pointwise.arch_class(arch)) if plan.convs else [{}]
    dw_space = depthwise.tuning_space(pointwise.arch_class(arch)) if plan.directs else [{}]
    # the largest product's tiles: it takes most of the time
    mm_space = (
        matmul.tuning_space(max(mm, key=lambda m: m.rows * m.out_features * m.in_features), arch)
        if mm
        else [{}]
    )
    pw_space = pointwise.tuning_space(pw[0], arch) if pw else [dict(pointwise.DEFAULT_PARAMS)]
    if rw:
        longest = max(rw, key=rows.row_length)
        rw_space = [{k: c[k] for k in ROW_PARAM_KEYS} for c in rows.tuning_space(longest, arch)]
    else:
        rw_space = [{k: rows.DEFAULT_PARAMS[k] for k in ROW_PARAM_KEYS}]
    space: list[dict[str, Any]] = []
    for i in range(max(len(pw_space), len(rw_space), len(mm_space), len(cv_space), len(dw_space))):
        config: dict[str, Any] = {
            "pointwise": pw_space[min(i, len(pw_space) - 1)],
            "rows": rw_space[min(i, len(rw_space) - 1)],
        }
        if mm:
            config["matmul"] = mm_space[min(i, len(mm_space) - 1)]
        if plan.convs:
            config["conv"] = cv_space[min(i, len(cv_space) - 1)]
        if plan.directs:
            config["direct"] = dw_space[min(i, len(dw_space) - 1)]
        if config not in space:
            space.append(config)
    if (plan.convs or plan.directs) and plan.regions and arch != "cpu":
        space.append({**space[0], "conv": "library"})  # the regions alone, cuDNN's convolutions
    return space


def _check_params(params: dict[str, Any]) -> dict[str, Any]:
    unknown = set(params) - set(PARAM_KEYS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} ({', '.join(PARAM_KEYS)})")
    tiles = params.get("conv", "library")
    if tiles != "library" and not isinstance(tiles, dict):
        raise ValueError(f"conv must be 'library' or the kernel's tile parameters, got {tiles!r}")
    checked = conv.check_params(tiles) if isinstance(tiles, dict) else tiles
    out = {key: dict(params.get(key) or {}) for key in PARAM_KEYS if key not in ("conv", "direct")}
    # conv="library": every convolution cuDNN's, the depthwise ones too
    direct = (
        "library"
        if tiles == "library" and "conv" in params
        else depthwise.check_params(dict(params.get("direct") or {}))
    )
    return {**out, "conv": checked, "direct": direct}


# ----------------------------------------------------------------------------------------------
# Code generation
# ----------------------------------------------------------------------------------------------


def generate(task_source: str, analysis: TaskAnalysis, plan: AnchoredPlan, params: dict[str, Any]) -> str:
    """The candidate: the reference's own graph with each region replaced by its kernel's wrapper."""
    p = _check_params(params)
    own_convs = p["conv"] != "library"
    reference = reference_source(task_source)
    signature, names = _check_forward(task_source)
    sections, table = [], []
    weights = list(dict.fromkeys(arg for r in plan.regions for arg in r.args if arg[0] != "node"))
    convs, directs = {}, {}
    for target in [*(plan.convs if own_convs else []), *(plan.directs if p["direct"] != "library" else [])]:
        node = next(n for n in analysis.nodes if n["kind"] == "call_module" and n["target"] == target)
        indices = []
        for key in ("weight", "bias"):
            ref = node["kwargs"].get(key)
            if ref is None:
                indices.append(None)
                continue
            entry = ("parameter", ref["param"])
            if entry not in weights:
                weights.append(entry)
            indices.append(weights.index(entry))
        (convs if target in plan.convs else directs)[target] = tuple(indices)
    folds = {}
    for node_name, (target, nd) in plan.bias_folds.items():
        entries = [("parameter", f"{target}.weight"), ("parameter", f"{target}.bias")]
        weights += [e for e in entries if e not in weights]
        folds[node_name] = (target, *(weights.index(e) for e in entries), nd)
    for i, region in enumerate(plan.regions):
        if region.generator == "pointwise":
            source = pointwise.generate_pointwise(region.analysis, region.plan, p["pointwise"])
            entry = "fused_pointwise"
        elif region.generator == "matmul":
            source = matmul.generate("", region.analysis, region.plan, p["matmul"])
            entry = "matmul_epilogue"
        else:
            source = rows.generate_rowwise(region.analysis, region.plan, p["rows"])
            entry = rows.host.op_name(region.plan)
        prefix = f"r{i}_"
        sections.append(_prefixed(source, prefix))
        sections.append(_wrapper(i, region, prefix + entry))
        args = [["node", x[1]] if x[0] == "node" else ["weight", weights.index(x)] for x in region.args]
        table.append({"fn": f"region{i}", "nodes": list(region.nodes), "out": region.out, "args": args})
    tracer = "trace_at_shapes(self, list(args))" if plan.traced_at_shapes else "_trace(self)"
    summary = "\n".join(
        f"  region{i} ({r.generator}): {', '.join(r.ops)}" for i, r in enumerate(plan.regions)
    )
    source = TEMPLATE.format(
        summary=summary,
        anchors=", ".join(dict.fromkeys(plan.anchors)) or "none",
        left=", ".join(plan.left) or "none",
        name=REFERENCE_NAME,
        reference=reference,
        kernels="\n\n\n".join(s.strip("\n") for s in sections),
        regions=_pretty(table),
        weights=_pretty([list(w) for w in weights]),
        functions=", ".join(f'"region{i}": region{i}' for i in range(len(plan.regions))),
        signature=signature,
        call=", ".join(names),
        tracer=tracer,
        arg_names=names,
        convs=_pretty_dict(convs),
        conv_note=", ".join(plan.convs) if own_convs and plan.convs else "none",
        direct_note=", ".join(directs) or "none",
        conv_params=repr(p["conv"] if own_convs else {}),
        directs=_pretty_dict(directs),
        bias_folds=_pretty_dict(folds),
        direct_params=repr(p["direct"] if directs else {}),
        conv_source=conv.SOURCE.strip("\n") + ("\n\n" + depthwise.SOURCE.strip("\n") if directs else ""),
    )
    return checked_copy(source)


def _check_forward(task_source: str) -> tuple[str, list[str]]:
    from kernelcrew.agents.playbook.attention import _forward_signature

    return _forward_signature(task_source)


def _pretty_dict(items: dict[str, Any]) -> str:
    return "{" + "".join(f"\n    {k!r}: {v!r}," for k, v in items.items()) + ("\n}" if items else "}")


def _pretty(table: list[dict[str, Any]]) -> str:
    return "[\n" + "".join(f"    {row!r},\n" for row in table) + "]"


def _wrapper(i: int, region: Region, entry: str) -> str:
    """``region<i>``: the views its reductions need, then the kernel's wrapper."""
    params = [f"a{k}" for k in range(len(region.args))]
    lines = [
        f"def region{i}({', '.join(params)}):",
        f'    """{", ".join(dict.fromkeys(region.ops))} ({region.generator} kernel) in place of '
        f'{", ".join(region.nodes)}."""',
    ]
    for name, prep in zip(params, region.preps, strict=True):
        if prep is None:
            continue
        if prep[0] == "flatten":
            _, start, ones = prep
            lines.append(f"    {name} = {name}.flatten({start})")
            lines += [f"    {name} = {name}.unsqueeze({start})" for _ in range(ones)]
        else:
            dims = prep[1]
            lines.append(
                f"    {name} = {name}.movedim({dims!r}, list(range({name}.dim() - {len(dims)}, {name}.dim())))"
            )
            lines.append(f"    {name} = {name}.flatten({name}.dim() - {len(dims)})")
    lines.append(f"    return {entry}({', '.join(params)})")
    return "\n".join(lines)


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


class _Prefix(ast.NodeTransformer):
    """Prefix the module-level names of a generated source (uses in functions that do not bind
    the same name themselves included)."""

    def __init__(self, names: set[str], prefix: str) -> None:
        self.names, self.prefix = names, prefix
        self.bound: list[set[str]] = [set()]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        if len(self.bound) == 1 and node.name in self.names:
            node.name = self.prefix + node.name
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.args = self.visit(node.args)
        local = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        for sub in ast.walk(node):
            if sub is node:
                continue
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                local.add(sub.id)
            elif isinstance(sub, ast.arg):
                local.add(sub.arg)
            elif isinstance(sub, ast.FunctionDef):
                local.add(sub.name)
        self.bound.append(self.bound[-1] | local)
        node.body = [self.visit(s) for s in node.body]
        self.bound.pop()
        return node

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.names and node.id not in self.bound[-1]:
            node.id = self.prefix + node.id
        return node


def _prefixed(source: str, prefix: str) -> str:
    """A generated candidate's kernels and helpers, without its docstring, imports, ``ModelNew``
    and ``_container``, every module-level name prefixed with ``prefix``."""
    tree = parse_python(source)
    body = [
        s
        for s in tree.body
        if not isinstance(s, ast.Import | ast.ImportFrom)
        and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
        and not (isinstance(s, ast.ClassDef) and s.name == "ModelNew")
        and not (isinstance(s, ast.FunctionDef) and s.name == "_container")
    ]
    renamer = _Prefix(_top_level_names(body), prefix)
    return "\n\n\n".join(ast.unparse(ast.fix_missing_locations(renamer.visit(s))) for s in body)


TEMPLATE = '''"""Anchored fusion (kernelcrew playbook): library anchors kept, the regions between them fused.

The reference is copied as {name}; ModelNew inherits its parameters and buffers, traces its
forward with torch.fx per input signature and runs that graph with each region's nodes replaced
by one call of the region's own Triton kernel:
{summary}
Anchors kept as torch calls: {anchors}. Fusible ops left to torch: {left}.
Float32 convolutions run by the own implicit-GEMM kernel in TF32x3: {conv_note}.
Depthwise convolutions run by the own direct kernel: {direct_note}.
"""

import math

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

{reference}


{kernels}


REGIONS = {regions}
#: The weights the kernels read: (parameter | buffer, target), passed to the graph as extra inputs.
WEIGHTS = {weights}
REGION_FUNCTIONS = {{{functions}}}
ARG_NAMES = {arg_names!r}  # the forward's parameters after self
#: The float32 convolutions that run as the own kernel (module path -> WEIGHTS' indices of its
#: weight and bias), and the kernel's tiles.
CONVS = {convs}
CONV_PARAMS = {conv_params}
#: The same for the depthwise convolutions that run as the own direct kernel.
DIRECT_CONVS = {directs}
DIRECT_PARAMS = {direct_params}
#: Library convolutions that run without their bias, the region after each adding it (its operand
#: ``<node>_bias``): graph node -> (module path, WEIGHTS' indices of its weight and bias, spatial dims).
BIAS_FOLDS = {bias_folds}


{conv_source}


def _own_convs(root, graph, weights):
    """Each one-argument call of a module of CONVS (DIRECT_CONVS) becomes a call of the own
    implicit-GEMM (direct) kernel on the module's weight and bias (extra inputs, as the regions'
    weights) with its settings as constants."""
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        if node.target in CONVS:
            (w, b), kernel, params = CONVS[node.target], conv_tf32x3, CONV_PARAMS
        elif node.target in DIRECT_CONVS:
            (w, b), kernel, params = DIRECT_CONVS[node.target], conv_direct, DIRECT_PARAMS
        else:
            continue
        with graph.inserting_before(node):
            args = (node.args[0], weights[w], None if b is None else weights[b])
            settings = conv_spec(root.get_submodule(node.target))
            call = graph.call_function(kernel, (*args, settings, params))
        node.replace_all_uses_with(call)
        graph.erase_node(node)


def _per_channel(bias, nd):
    """A convolution's bias as a (C, 1, ..., 1) tensor: it broadcasts over the output's channels."""
    return bias.view(-1, *[1] * nd)


def _fold_biases(root, graph, nodes, weights):
    """Each convolution of BIAS_FOLDS called without its bias (the library's call of the module's
    own settings), and its bias viewed per channel as a value of the graph (``<node>_bias``) for the
    region that adds it."""
    for name, (target, w, b, nd) in BIAS_FOLDS.items():
        node = nodes.get(name)
        if node is None or node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            raise RuntimeError(f"the traced graph has no one-argument call {{name}} of {{target}}")
        settings = conv_spec(root.get_submodule(target))
        with graph.inserting_before(node):
            plain = graph.call_function(library_conv, (node.args[0], weights[w], None, settings))
            nodes[f"{{name}}_bias"] = graph.call_function(_per_channel, (weights[b], nd))
        node.replace_all_uses_with(plain)
        graph.erase_node(node)
        nodes[name] = plain


def _trace(module):
    """The forward's graph as the analysis traced it: buffers as graph inputs."""
    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True
    return tracer.trace(module)


def trace_at_shapes(module, args):
    """The forward traced on meta tensors of ``args``' shapes: sizes are constants, so a graph per
    input signature (the analysis traced the task this way too)."""
    from torch.fx.experimental.meta_tracer import MetaTracer

    names = ARG_NAMES[: len(args)]
    meta = {{n: a.to("meta") for n, a in zip(names, args) if torch.is_tensor(a)}}
    concrete = {{n: a for n, a in zip(names, args) if not torch.is_tensor(a)}}
    tracer = MetaTracer()
    tracer.proxy_buffer_attributes = True
    return tracer.trace(module, meta_args=meta, concrete_args=concrete or None)


def _rewrite(graph, root):
    """Replace each region's nodes by one call of its wrapper and each convolution of CONVS by the
    own kernel's; the weights become extra inputs."""
    nodes = {{node.name: node for node in graph.nodes}}
    holders = [node for node in graph.nodes if node.op == "placeholder"]
    weights, last = [], holders[-1] if holders else None
    for k in range(len(WEIGHTS)):  # after the forward's own inputs, in order
        with graph.inserting_after(last) if last is not None else graph.inserting_before(None):
            last = graph.placeholder(f"_weight{{k}}", default_value=None)
        weights.append(last)
    _fold_biases(root, graph, nodes, weights)
    for region in REGIONS:
        missing = [n for n in [*region["nodes"], *(a for k, a in region["args"] if k == "node")] if n not in nodes]
        if missing:
            raise RuntimeError(f"the traced graph has no node(s) {{missing}}: the regions do not apply")
        out = nodes[region["out"]]
        with graph.inserting_before(out):
            args = [nodes[a] if k == "node" else weights[a] for k, a in region["args"]]
            fused = graph.call_function(REGION_FUNCTIONS[region["fn"]], tuple(args))
        out.replace_all_uses_with(fused)
        for name in reversed(region["nodes"]):
            graph.erase_node(nodes[name])
        nodes[region["out"]] = fused  # a later region may read this one's value by its old name
    _own_convs(root, graph, weights)
    graph.lint()
    return graph


class ModelNew({name}):
    """{name} whose forward runs its own graph with the regions fused into own kernels."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tracing = False
        self._graphs = {{}}

    def _graph(self, args):
        # The graph module holds the anchors' submodules and parameters themselves, but a buffer
        # that .to() replaced would be stale in it: buffers are part of the key.
        key = tuple((tuple(a.shape), a.dtype, a.device) if torch.is_tensor(a) else repr(a) for a in args)
        key = (key, tuple(b.data_ptr() for b in self.buffers()))
        if key not in self._graphs:
            self._tracing = True
            try:
                graph = {tracer}
            finally:
                self._tracing = False
            self._graphs[key] = torch.fx.GraphModule(self, _rewrite(graph, self))
        return self._graphs[key]

    def _weights(self):
        return [self.get_parameter(t) if kind == "parameter" else self.get_buffer(t) for kind, t in WEIGHTS]

    def forward({signature}):
        if self._tracing:
            return {name}.forward(self, {call})
        return self._graph(({call},))({call}, *self._weights())
'''

__all__ = [
    "AnchoredPlan",
    "Region",
    "generate",
    "match",
    "partition",
    "sub_analysis",
    "tuning_space",
]
