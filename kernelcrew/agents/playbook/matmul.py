"""Linear layers and their elementwise epilogue as one Triton matmul kernel (an own kernel).

``residual + gamma * (x @ W^T + b)`` runs in eager as a GEMM and two elementwise kernels, each of
which reads and writes the whole output again; ``silu(x @ Wg^T) * (x @ Wu^T)`` as two GEMMs and two
more passes. :func:`match` takes a forward whose one output is an elementwise function (the IR of
:mod:`.pointwise`: any chain of its ops, with scalars, bias-like ``(N,)`` vectors, per-row
``(..., 1)`` columns and full-size tensors such as a residual) of one or two linear layers of the
same input: ``nn.Linear``/``F.linear`` of the module's own weight (with or without its bias), or
``x @ W`` of a 2-D parameter or of a 2-D argument of forward (``torch.matmul(A, B)``). The kernel
computes each tile of the output in fp32 accumulators (two for a gated pair, which then share each
tile of ``x`` they load), applies the epilogue in registers and stores the output once.

The tile loop is the classic one (``BLOCK_M x BLOCK_N`` tiles over ``BLOCK_K`` steps, tiles
visited in groups of ``GROUP_M`` rows so that neighbouring programs share their weight tiles in L2,
``num_stages`` loads in flight); tuning picks the tile shape, warps and stages per architecture.

Precision: fp16 and bf16 operands go to the tensor cores as they are. A float32 layer keeps float32
accuracy without being computed on the CUDA cores: each operand is split into a TF32 high part and
a TF32 remainder and three tensor-core products are summed (``input_precision="tf32x3"``), which
loses only the remainders' product (2^-22 relative per term, below the error of accumulating in
float32). Plain TF32 would not pass the verifier's float32 thresholds; this does. Under
``TRITON_INTERPRET=1`` the products are NumPy's float32 ones.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.pointwise import (
    CONTAINER_SOURCE,
    Operand,
    PointwisePlan,
    Unsupported,
    _Emitter,
    _forward_param,
    _key,
    _Lowering,
    _operand_expr,
    _reachable,
    _state_lines,
    arch_class,
    single_output,
)

DTYPES = frozenset({"float16", "bfloat16", "float32"})
MAX_LINEARS = 2
LINEAR = "linear"  # the Operand source of an accumulator: computed by the kernel, never loaded
MATMUL_OPS = frozenset({"matmul", "mm"})
#: The smallest tile side of the tuning space, and the fewest such output tiles worth a kernel
#: with no split over K (half an H100's 132 SMs) when the product has ``MIN_SPLIT_FLOP`` or more:
#: below that, a few idle SMs cost microseconds.
MIN_TILE, MIN_TILES, MIN_SPLIT_FLOP = 64, 66, 2**28

# How an epilogue operand is indexed in a [BLOCK_M, BLOCK_N] tile of the [M, N] output.
FULL, COL, ROW, SCALAR = 0, 1, 2, 3

PARAMS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


@dataclass(frozen=True)
class Layer:
    """One linear layer: its weight (state-dict name, or the forward argument's name when
    ``source`` is ``input``), whether it is stored ``[K, N]`` (``x @ W``) rather than ``[N, K]``
    (``F.linear``), and the operand that stands for its accumulator."""

    weight: str
    transposed: bool
    operand: int
    source: str = "parameter"


@dataclass
class MatmulPlan:
    """The layers (one or two, same input and shape), the epilogue over their outputs, the sizes."""

    input: str
    layers: list[Layer]
    epilogue: PointwisePlan
    in_features: int
    out_features: int
    rows: int
    dtype: str

    @property
    def loaded(self) -> list[int]:
        """Indices of the epilogue operands the kernel loads (accumulators are not loaded)."""
        used = {v[1] for s in self.epilogue.steps for v in s.args if v[0] == "in"}
        if self.epilogue.result[0] == "in":
            used.add(self.epilogue.result[1])
        return [i for i in sorted(used) if self.epilogue.operands[i].source != LINEAR]


def operand_mode(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> int | None:
    """FULL, COL, ROW or SCALAR for an operand of ``shape`` broadcast to ``out_shape``; None when it
    broadcasts otherwise (the kernel then reads a materialized copy). Emitted into candidates too."""
    if len(shape) > len(out_shape):
        return None
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    numel = math.prod(padded)
    if numel == 1:
        return SCALAR
    if padded == tuple(out_shape):
        return FULL
    if padded[-1] == out_shape[-1] and numel == out_shape[-1]:
        return COL
    if padded[-1] == 1 and padded[:-1] == tuple(out_shape[:-1]):
        return ROW
    return None


class _MatmulLowering(_Lowering):
    """The pointwise lowering, where a linear layer of the input becomes an accumulator operand."""

    def __init__(self, analysis: TaskAnalysis) -> None:
        super().__init__(analysis)
        self.layers: list[Layer] = []
        self.inputs: set[str] = set()
        self.inputs_as_weights: set[str] = set()
        self.params: dict[str, tuple[str, Any]] = {}

    def visit(self, node: dict[str, Any]) -> None:
        op = node.get("op")
        if node["kind"].startswith("call_") and op == "linear":
            args, kwargs = node.get("args") or [], node.get("kwargs") or {}
            weight = self.as_param(args[1] if len(args) > 1 else kwargs.get("weight"))
            bias = self.as_param(args[2] if len(args) > 2 else kwargs.get("bias"))
            self.layer(node, args[0] if args else kwargs.get("input"), weight, bias, transposed=False)
            return
        if node["kind"].startswith("call_") and op in MATMUL_OPS:
            args = node.get("args") or []
            if len(args) != 2 or node.get("kwargs"):
                raise Unsupported(f"{op} ({node['name']}) with arguments other than two tensors")
            self.layer(node, args[0], self.as_param(args[1]), None, transposed=True, any_weight=True)
            return
        super().visit(node)

    def as_param(self, value: Any) -> Any:
        """``{"param": path}`` for a reference to a parameter's ``get_attr`` node, else ``value``."""
        if isinstance(value, dict) and set(value) == {"ref"}:
            node = self.a.node(value["ref"])
            if node["kind"] == "get_attr" and node["op"] == "parameter":
                return {"param": node["target"]}
        return value

    def param(self, path: str, node: dict[str, Any]) -> dict[str, Any]:
        entry = next((p for p in self.a.state_dict if p["name"] == path), None)
        if entry is None or entry.get("kind") != "parameter":
            raise Unsupported(f"{node['name']}: {path!r} is not a parameter of the module")
        return entry

    def weight_entry(self, layer: Layer, node: dict[str, Any]) -> dict[str, Any]:
        """Shape and dtype of a layer's weight: its state-dict entry or its forward argument."""
        if layer.source == "input":
            return self.a.node(layer.weight)
        return self.param(layer.weight, node)

    def layer(
        self, node: dict[str, Any], x: Any, weight: Any, bias: Any, transposed: bool, any_weight: bool = False
    ) -> None:
        """One layer; ``any_weight``: a forward argument may be the weight (``A @ B``)."""
        name = node["name"]
        if not (isinstance(x, dict) and set(x) == {"ref"}) or self.a.node(x["ref"])["kind"] != "placeholder":
            raise Unsupported(f"{name}: the layer's input is not an argument of forward")
        source = "parameter"
        if (
            any_weight
            and isinstance(weight, dict)
            and set(weight) == {"ref"}
            and self.a.node(weight["ref"])["kind"] == "placeholder"
            and weight["ref"] != x["ref"]
        ):
            weight, source = {"param": weight["ref"]}, "input"
            self.inputs_as_weights.add(weight["param"])
        if not (isinstance(weight, dict) and set(weight) == {"param"}):
            raise Unsupported(
                f"{name}: the weight is not a parameter of the module or an argument of forward"
            )
        if bias is not None and not (isinstance(bias, dict) and set(bias) == {"param"}):
            raise Unsupported(f"{name}: the bias is not a parameter of the module")
        if len(self.layers) == MAX_LINEARS:
            raise Unsupported(f"more than {MAX_LINEARS} linear layers")
        entry = self.weight_entry(Layer(weight["param"], transposed, -1, source), node)
        if len(entry.get("shape") or ()) != 2:
            raise Unsupported(f"{name}: the weight has shape {entry['shape']}, not 2-D")
        self.inputs.add(x["ref"])
        self.operands.append(
            Operand(f"acc{len(self.layers)}", LINEAR, tuple(node.get("shape") or ()), entry["dtype"])
        )
        value = ("in", len(self.operands) - 1)
        self.kinds[_key(value)] = "f"
        self.layers.append(Layer(weight["param"], transposed, value[1], source))
        self.ops.append(node["op"])
        if bias is not None:
            path = bias["param"]
            if path not in self.params:
                b = self.param(path, node)
                self.operands.append(Operand(path, "parameter", tuple(b["shape"]), b["dtype"]))
                self.params[path] = ("in", len(self.operands) - 1)
                self.kinds[_key(self.params[path])] = "f"
            value = self.emit(f"{name}_bias", "add", [value, self.params[path]])
        self.values[name] = value


def _match(a: TaskAnalysis) -> MatmulPlan:
    out = single_output(a)
    lowering = _MatmulLowering(a)
    needed = _reachable(a, out["ref"])
    for node in a.nodes:
        if node["name"] in needed and node["kind"] != "output":
            lowering.visit(node)
    layers = lowering.layers
    if not layers:
        raise Unsupported("the forward has no linear layer or matmul by a parameter")
    if len(lowering.inputs) != 1:
        raise Unsupported("the linear layers take different inputs")
    if lowering.inputs & lowering.inputs_as_weights:
        raise Unsupported("an argument of forward is both a layer's input and a weight")
    if len({layer.transposed for layer in layers}) != 1:  # the kernel walks both weights alike
        raise Unsupported("one layer is F.linear (weight [N, K]), the other x @ W (weight [K, N])")
    x = a.node(next(iter(lowering.inputs)))
    dtype, x_shape = x.get("dtype"), tuple(x.get("shape") or ())
    if dtype not in DTYPES or len(x_shape) < 1:
        raise Unsupported(f"the layers' input is {dtype} of shape {x_shape} (fp16, bf16 or fp32 tensors)")
    shapes = set()
    for layer in layers:
        entry = lowering.weight_entry(layer, x)
        if entry["dtype"] != dtype:
            raise Unsupported(f"weight {layer.weight!r} is {entry['dtype']}, the input {dtype}")
        k, n = entry["shape"] if layer.transposed else entry["shape"][::-1]
        shapes.add((k, n))
    if len(shapes) != 1:
        raise Unsupported(f"the layers' weights differ in shape: {sorted(shapes)}")
    k, n = shapes.pop()
    if k != x_shape[-1]:
        raise Unsupported(f"the input's last dim is {x_shape[-1]}, the weights take {k}")
    out_shape = (*x_shape[:-1], n)
    rows = math.prod(x_shape[:-1])
    few_tiles = math.ceil(rows / MIN_TILE) * math.ceil(n / MIN_TILE) < MIN_TILES
    if few_tiles and 2 * rows * n * k >= MIN_SPLIT_FLOP:
        raise Unsupported(
            f"a {rows} x {n} output has fewer than {MIN_TILES} tiles of {MIN_TILE} x {MIN_TILE}: the "
            "kernel, without a split over K, would leave most of the GPU idle (a matrix-vector "
            "product or a long-K reduction is the library's)"
        )
    if tuple(out.get("shape") or ()) != out_shape or out.get("dtype") not in DTYPES:
        raise Unsupported(
            f"the output ({out.get('dtype')}, {out.get('shape')}) is not elementwise over the layers' "
            f"{list(out_shape)} result"
        )
    result = lowering.values[out["ref"]]
    if result[0] == "c" or lowering.kinds.get(_key(result)) == "b":
        raise Unsupported("the output is a constant or a boolean mask")
    epilogue = PointwisePlan(
        operands=lowering.operands,
        steps=lowering.steps,
        result=result,
        forward_args=a.forward_args,
        out_dtype=out["dtype"],
        out_shape=out_shape,
        ops=lowering.ops,
    )
    plan = MatmulPlan(x["target"], layers, epilogue, k, n, rows, dtype)
    for i in plan.loaded:
        op = epilogue.operands[i]
        if op.dtype == "float64":
            raise Unsupported(f"operand {op.name!r} is float64")
        if operand_mode(op.shape, out_shape) is None:
            raise Unsupported(
                f"operand {op.name!r} {list(op.shape)} broadcasts over the output {list(out_shape)}"
            )
    return plan


def match(analysis: TaskAnalysis) -> tuple[MatmulPlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    try:
        plan = _match(analysis)
    except Unsupported as exc:
        return None, str(exc)
    except (LookupError, TypeError, ValueError) as exc:  # a graph of another shape than expected
        return None, f"not linear layers with an elementwise epilogue ({type(exc).__name__}: {exc})"
    ops = [o for o in dict.fromkeys(plan.epilogue.ops) if o not in MATMUL_OPS | {LINEAR}]
    layers = "a gated pair of linear layers" if len(plan.layers) == 2 else "a linear layer"
    return plan, (
        f"the forward is {layers} ({plan.in_features} -> {plan.out_features}) with an elementwise "
        f"epilogue ({', '.join(ops) or 'none'}): one Triton matmul applies it to each output tile in "
        "registers and writes the output once"
    )


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per architecture class and kind of plan. The
# sm_90 lists are fastest first on the suite's tasks (a measurement, see docs/benchmarks.md);
# sm_80 keeps the classic Ampere tiles (BLOCK_K 32 for 16-bit, 16 for float32).
CONFIGS: dict[tuple[str, str], list[tuple[int, int, int, int, int]]] = {
    ("sm_90", "half"): [
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 32, 4, 4),
        (128, 256, 64, 8, 3),
    ],
    ("sm_90", "dual"): [
        (128, 128, 64, 8, 4),
        (128, 128, 64, 8, 3),
        (128, 128, 32, 8, 5),
        (256, 64, 64, 8, 3),
    ],
    ("sm_90", "tf32x3"): [
        (128, 64, 32, 4, 4),
        (128, 64, 32, 4, 3),
        (64, 128, 32, 4, 4),
        (128, 128, 32, 8, 3),
    ],
    ("sm_80", "half"): [(128, 256, 32, 8, 3), (128, 128, 32, 4, 4), (64, 128, 32, 4, 4)],
    ("sm_80", "dual"): [(128, 128, 32, 8, 3), (64, 128, 32, 4, 4)],
    ("sm_80", "tf32x3"): [(128, 128, 16, 8, 3), (64, 128, 16, 4, 4)],
}


def rank(plan: MatmulPlan) -> int:
    """Where the playbook tries this kernel (measured on an H100, see docs/benchmarks.md):

    * float32 layers first: TF32x3 on the tensor cores runs 1.7x faster than cuBLAS's float32 GEMM;
    * a gated pair of fp16/bf16 layers first: sharing each input tile and never writing the two
      intermediate outputs beats two cuBLAS GEMMs and a fused pointwise kernel (1.03-1.04x);
    * one fp16/bf16 layer after the library and compiler candidates: cuBLAS(Lt) fuses the same
      epilogues and its tile loop runs 1.2-1.3x faster than this one.
    """
    return 2 if plan.dtype != "float32" and len(plan.layers) == 1 else 0


def _kind(plan: MatmulPlan) -> str:
    if plan.dtype == "float32":
        return "tf32x3"
    return "dual" if len(plan.layers) == 2 else "half"


def tuning_space(plan: MatmulPlan, arch: str) -> list[dict[str, int]]:
    """Tile configurations worth timing on ``arch``; those leaving most SMs idle at the task's
    sizes (fewer tiles than a hundred) go last. One small tile for the CPU interpreter."""
    cls = arch_class(arch)
    if cls == "cpu":
        return [dict(zip(PARAMS, (16, 16, 16, 4, 1, 1), strict=True))]
    configs = CONFIGS[("sm_80" if cls == "sm_80" else "sm_90", _kind(plan))]

    def idle(c: tuple[int, ...]) -> bool:
        return math.ceil(plan.rows / c[0]) * math.ceil(plan.out_features / c[1]) < 100

    ordered = sorted(configs, key=idle)
    return [dict(zip(PARAMS, (bm, bn, bk, 8, w, s), strict=True)) for bm, bn, bk, w, s in ordered]


def check_tiles(
    params: dict[str, Any], defaults: dict[str, int], max_block: int = 512, what: str = ""
) -> dict[str, int]:
    """``defaults`` updated with ``params``, each a valid tile parameter (:data:`PARAMS`) of a
    Triton GEMM-shaped kernel (this one, :mod:`.conv`'s); ``what`` names the kernel in errors."""
    merged = {**defaults, **params}
    unknown = set(merged) - set(PARAMS)
    if unknown:
        raise ValueError(f"unknown {what}parameter(s) {sorted(unknown)} ({', '.join(PARAMS)})")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = merged[key]
        if not isinstance(v, int) or v < 16 or v > max_block or v & (v - 1):
            raise ValueError(f"{what}{key} must be a power of two in [16, {max_block}], got {v!r}")
    if not isinstance(merged["GROUP_M"], int) or not 1 <= merged["GROUP_M"] <= 64:
        raise ValueError(f"{what}GROUP_M must be in [1, 64], got {merged['GROUP_M']!r}")
    if merged["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"{what}num_warps must be 1, 2, 4, 8 or 16, got {merged['num_warps']!r}")
    if not isinstance(merged["num_stages"], int) or not 1 <= merged["num_stages"] <= 7:
        raise ValueError(f"{what}num_stages must be in [1, 7], got {merged['num_stages']!r}")
    return merged


def _check_params(params: dict[str, Any]) -> dict[str, int]:
    return check_tiles(params, dict(zip(PARAMS, (64, 64, 32, 8, 4, 3), strict=True)))


def generate(task_source: str, analysis: TaskAnalysis, plan: MatmulPlan, params: dict[str, Any]) -> str:
    """The candidate: ``ModelNew`` (the reference's state dict) calling one matmul-epilogue kernel."""
    del task_source
    p = _check_params(params)
    ep = plan.epilogue
    emitter = _Emitter(ep)
    result = emitter.expression()
    helpers = emitter.helper_source()
    loaded = plan.loaded
    n_layers = len(plan.layers)
    precision = ', input_precision="tf32x3"' if plan.dtype == "float32" else ""

    # --- kernel ---
    body = [
        "pid = tl.program_id(0)",
        "grid_m = tl.cdiv(M, BLOCK_M)",
        "grid_n = tl.cdiv(N, BLOCK_N)",
        "width = GROUP_M * grid_n  # programs of one group of GROUP_M tile rows",
        "first_m = (pid // width) * GROUP_M",
        "group_m = tl.minimum(grid_m - first_m, GROUP_M)",
        "pid_m = first_m + (pid % width) % group_m",
        "pid_n = (pid % width) // group_m",
        "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "rk = tl.arange(0, BLOCK_K)",
        "# rows and columns past the edge read row/column 0 again; their results are not stored",
        "am = rm % M",
        "wn = rn % N",
        "if INDEX64:  # an operand or the output has 2**31 elements or more",
        "    am = am.to(tl.int64)",
        "    wn = wn.to(tl.int64)",
        "a_ptrs = a_ptr + am[:, None] * stride_am + rk[None, :] * stride_ak",
        "w_off = wn[None, :] * stride_wn + rk[:, None] * stride_wk",
    ]
    for j in range(n_layers):
        body += [f"w{j}_ptrs = w{j}_ptr + w_off", f"acc{j} = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)"]
    body += [
        "for k in range(0, tl.cdiv(K, BLOCK_K)):",
        "    if EVEN_K:  # BLOCK_K divides K: no step reads past the end of a row",
        "        a = tl.load(a_ptrs)",
        *(f"        b{j} = tl.load(w{j}_ptrs)" for j in range(n_layers)),
        "    else:",
        "        k_mask = rk < K - k * BLOCK_K",
        "        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)",
        *(f"        b{j} = tl.load(w{j}_ptrs, mask=k_mask[:, None], other=0.0)" for j in range(n_layers)),
    ]
    body += [
        "    if WIDEN:  # the interpreter multiplies bfloat16 as raw bits",
        "        a = a.to(tl.float32)",
        *(f"        b{j} = b{j}.to(tl.float32)" for j in range(n_layers)),
    ]
    for j in range(n_layers):
        body += [f"    acc{j} = tl.dot(a, b{j}, acc{j}{precision})", f"    w{j}_ptrs += BLOCK_K * stride_wk"]
    body += [
        "    a_ptrs += BLOCK_K * stride_ak",
        "# the epilogue, on the fp32 tile",
        "rows = rm.to(tl.int64) if INDEX64 else rm",
        "mask = (rm[:, None] < M) & (rn[None, :] < N)",
    ]
    for j, layer in enumerate(plan.layers):
        body.append(f"v{layer.operand} = acc{j}")
    for i in loaded:
        op = ep.operands[i]
        cast = " != 0" if op.is_bool else ".to(tl.float32)"
        body += [
            f"# operand {i}: {op.source} {op.name} ({op.dtype})",
            f"if MODE{i} == 0:  # FULL",
            f"    v{i} = tl.load(e{i}_ptr + rows[:, None] * N + rn[None, :], mask=mask, other=0){cast}",
            f"elif MODE{i} == 1:  # COL: one value per output column",
            f"    v{i} = tl.load(e{i}_ptr + rn[None, :], mask=rn[None, :] < N, other=0){cast}",
            f"elif MODE{i} == 2:  # ROW: one value per output row",
            f"    v{i} = tl.load(e{i}_ptr + rows[:, None], mask=rm[:, None] < M, other=0){cast}",
            "else:  # SCALAR",
            f"    v{i} = tl.load(e{i}_ptr){cast}",
        ]
    body += emitter.lines
    body.append(
        f"tl.store(out_ptr + rows[:, None] * N + rn[None, :], "
        f"tl.broadcast_to({result}, (BLOCK_M, BLOCK_N)).to(out_ptr.dtype.element_ty), mask=mask)"
    )
    kernel_body = "\n".join(f"    {line}" if line else "" for line in body)
    weights = ", ".join(f"w{j}_ptr" for j in range(n_layers))
    operand_ptrs = "".join(f"e{i}_ptr, " for i in loaded)
    modes = "".join(f"MODE{i}: tl.constexpr, " for i in loaded)

    # --- host ---
    w_args = ", ".join(f"w{j}" for j in range(n_layers))
    e_list = ", ".join(f"e{i}" for i in loaded)
    signature = ", ".join(a for a in ("x", w_args, e_list) if a)
    transposed = plan.layers[0].transposed
    n_expr = "w0.shape[1]" if transposed else "w0.shape[0]"
    stride_wn, stride_wk = ("1", "0") if transposed else ("0", "1")
    mode_args = "".join(f"MODE{i}=modes[{k}], " for k, i in enumerate(loaded))
    ops_desc = ", ".join(o for o in dict.fromkeys(ep.ops) if o not in MATMUL_OPS | {LINEAR}) or "none"
    layers_desc = ", ".join(
        f"{layer.weight} ({'[K, N]' if layer.transposed else '[N, K]'})" for layer in plan.layers
    )
    operand_desc = ", ".join(f"{ep.operands[i].name} ({ep.operands[i].source})" for i in loaded) or "none"
    call_args = ", ".join(
        [plan.input]
        + [
            analysis.node(layer.weight)["target"]
            if layer.source == "input"
            else f"self.get_parameter({layer.weight!r})"
            for layer in plan.layers
        ]
        + [_operand_expr(ep.operands[i]) for i in loaded]
    )
    forward_sig = ", ".join(["self", *(_forward_param(arg) for arg in ep.forward_args)])
    out_dtype = ep.out_dtype
    mode_source = inspect.getsource(operand_mode)
    w_args_numel = ", ".join(f"w{j}.numel()" for j in range(n_layers))
    return f'''"""Matmul with a fused epilogue (kernelcrew playbook, strategy matmul_epilogue).

Layers: {layers_desc}, {plan.dtype}{", products in TF32x3 (float32 accuracy)" if precision else ""}.
Epilogue ops: {ops_desc}. Loaded operands: {operand_desc}. Output: {out_dtype}.
One Triton kernel: fp32 accumulators per output tile, the epilogue in registers, one store.
"""

import math

import torch
import torch.nn as nn
import triton
import triton.language as tl

FULL, COL, ROW, SCALAR = {FULL}, {COL}, {ROW}, {SCALAR}
{helpers}

@triton.jit
def matmul_epilogue_kernel(
    a_ptr, {weights}, {operand_ptrs}out_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk,
    {modes}WIDEN: tl.constexpr, EVEN_K: tl.constexpr, INDEX64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
{kernel_body}


{mode_source}

def matmul_epilogue({signature}):
    """The layers of ``x`` and the epilogue, one kernel; returns a new {out_dtype} tensor."""
    K = x.shape[-1]
    N = {n_expr}
    a = x.reshape(-1, K)  # a view where the strides allow it
    M = a.shape[0]
    out_shape = (*x.shape[:-1], N)
    {w_args} = {", ".join(f"w{j}.contiguous()" for j in range(n_layers))}
    for t in [{", ".join(a for a in (w_args, e_list) if a)}]:
        if t.device != x.device:
            raise ValueError(f"all operands must be on one device, got {{t.device}} and {{x.device}}")
    out = torch.empty(out_shape, dtype=torch.{out_dtype}, device=x.device)
    if out.numel() == 0:
        return out
    ops, modes = [], []
    for t in [{e_list}]:
        mode = operand_mode(tuple(t.shape), out_shape)
        if mode is None:  # another broadcast: read a materialized copy
            t, mode = t.expand(out_shape), FULL
        ops.append(t.contiguous())
        modes.append(mode)
    a_extent = (M - 1) * a.stride(0) + (K - 1) * a.stride(1) + 1  # elements a strided view spans
    grid = (triton.cdiv(M, {p["BLOCK_M"]}) * triton.cdiv(N, {p["BLOCK_N"]}),)
    matmul_epilogue_kernel[grid](
        a, {w_args}, *ops, out,
        M, N, K,
        a.stride(0), a.stride(1), w0.stride({stride_wn}), w0.stride({stride_wk}),
        {mode_args}WIDEN=x.dtype == torch.bfloat16 and x.device.type == "cpu",
        EVEN_K=K % {p["BLOCK_K"]} == 0,
        INDEX64=max(a_extent, {w_args_numel}, out.numel(), *(t.numel() for t in ops)) >= 2**31,
        BLOCK_M={p["BLOCK_M"]}, BLOCK_N={p["BLOCK_N"]}, BLOCK_K={p["BLOCK_K"]}, GROUP_M={p["GROUP_M"]},
        num_warps={p["num_warps"]}, num_stages={p["num_stages"]},
    )
    return out


{CONTAINER_SOURCE}

class ModelNew(nn.Module):
    """The task's module as one matmul-epilogue kernel; same state dict names and shapes."""

    def __init__(self, *args, **kwargs):
        super().__init__(){_state_lines(analysis)}

    def forward({forward_sig}):
        return matmul_epilogue({call_args})
'''


__all__ = ["MatmulPlan", "check_tiles", "generate", "match", "operand_mode", "rank", "tuning_space"]
