"""What a task's module is: its inputs, weights and traced graph with normalized op names and shapes.

Loading a task runs user code, so :func:`analyze` does the work in a sandboxed child
(:func:`analyze_child`): it builds ``Model(*get_init_inputs())`` and the example inputs under a seed,
puts the model in ``eval()`` (as the verifier runs it), traces it with ``torch.fx.symbolic_trace``
and propagates shapes with ``ShapeProp`` (on fake tensors, falling back to the real ones). The
result is plain JSON, wrapped in :class:`TaskAnalysis` on the parent side.

A forward that does arithmetic on its inputs' shapes (``torch.ones(x.shape[-2], ...)``,
``math.sqrt(q.size(-1))``) defeats the symbolic tracer. It is then traced again with fx's
``MetaTracer``, which runs each op on meta tensors so that shapes are numbers: the graph holds the
example's sizes as constants. ``traced`` stays False (kernels generated from such a graph would be
those sizes' only) and ``traced_at_shapes`` says the nodes are there; a strategy that traces the
module again for every input signature at run time (the attention rewrite) may use them.

Node records: ``name``, ``kind`` (fx's op: ``placeholder``, ``get_attr``, ``call_function``,
``call_method``, ``call_module``, ``output``), ``op`` (the normalized name: ``add``, ``gelu``,
``linear``, ... the same for ``torch.add``, ``operator.add``, ``x.add(...)``; ``input`` for a
placeholder; ``parameter``/``buffer``/``attribute`` for a ``get_attr``), ``target`` (the raw
callable or attribute as text), ``args``/``kwargs`` (``{"ref": node}`` for an earlier node,
``{"param": dotted_name}`` for a module's own weight, ``{"dtype": name}``, numbers, bools, strings,
``None``, lists), ``inplace``, ``shape``/``dtype`` (``None`` for non-tensor values, which carry a
``type`` and, for numbers, their ``value``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelcrew.config import Settings
from kernelcrew.task import TaskError, check_source
from kernelcrew.tools import sandbox

TARGET = "kernelcrew.agents.playbook.analysis:analyze_child"

#: Raw function/method names -> normalized op names (everything else keeps its own name).
OP_ALIASES = {
    "truediv": "div",
    "true_divide": "div",
    "divide": "div",
    "multiply": "mul",
    "subtract": "sub",
    "negative": "neg",
    "absolute": "abs",
    "clip": "clamp",
    "clip_min": "clamp_min",
    "clip_max": "clamp_max",
    "floordiv": "floor_divide",
    "greater": "gt",
    "greater_equal": "ge",
    "less": "lt",
    "less_equal": "le",
    "not_equal": "ne",
    "and_": "bitwise_and",
    "or_": "bitwise_or",
    "xor": "bitwise_xor",
    "invert": "bitwise_not",
    "inv": "bitwise_not",
    "pos": "positive",
    "dropout1d": "dropout",
    "dropout2d": "dropout",
    "dropout3d": "dropout",
    "alpha_dropout": "dropout",
    "feature_alpha_dropout": "dropout",
    "special_expit": "sigmoid",
    "expit": "sigmoid",
    "log_sigmoid": "logsigmoid",
    "_threshold": "threshold",
    "arctan": "atan",
    "matrix_multiply": "matmul",
}

#: Tensor methods that only change the dtype: normalized to ``to`` with the resulting dtype.
CAST_METHODS = frozenset(
    {"to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte"}
)

#: torch.nn leaf modules -> (normalized op, attributes passed as kwargs, weights passed as kwargs).
MODULE_OPS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "ReLU": ("relu", (), ()),
    "ReLU6": ("relu6", (), ()),
    "LeakyReLU": ("leaky_relu", ("negative_slope",), ()),
    "GELU": ("gelu", ("approximate",), ()),
    "Sigmoid": ("sigmoid", (), ()),
    "Tanh": ("tanh", (), ()),
    "SiLU": ("silu", (), ()),
    "Mish": ("mish", (), ()),
    "Softplus": ("softplus", ("beta", "threshold"), ()),
    "ELU": ("elu", ("alpha",), ()),
    "CELU": ("celu", ("alpha",), ()),
    "SELU": ("selu", (), ()),
    "Hardtanh": ("hardtanh", ("min_val", "max_val"), ()),
    "Hardsigmoid": ("hardsigmoid", (), ()),
    "Hardswish": ("hardswish", (), ()),
    "LogSigmoid": ("logsigmoid", (), ()),
    "Softsign": ("softsign", (), ()),
    "Tanhshrink": ("tanhshrink", (), ()),
    "Threshold": ("threshold", ("threshold", "value"), ()),
    "Identity": ("identity", (), ()),
    "Dropout": ("dropout", ("p",), ()),
    "Dropout1d": ("dropout", ("p",), ()),
    "Dropout2d": ("dropout", ("p",), ()),
    "Dropout3d": ("dropout", ("p",), ()),
    "AlphaDropout": ("dropout", ("p",), ()),
    "FeatureAlphaDropout": ("dropout", ("p",), ()),
    "Softmax": ("softmax", ("dim",), ()),
    "LogSoftmax": ("log_softmax", ("dim",), ()),
    "CrossEntropyLoss": ("cross_entropy", ("ignore_index", "reduction", "label_smoothing"), ("weight",)),
    "Linear": ("linear", (), ("weight", "bias")),
    "Bilinear": ("bilinear", (), ("weight", "bias")),
    "Conv1d": ("conv1d", ("stride", "padding", "dilation", "groups"), ("weight", "bias")),
    "Conv2d": ("conv2d", ("stride", "padding", "dilation", "groups"), ("weight", "bias")),
    "Conv3d": ("conv3d", ("stride", "padding", "dilation", "groups"), ("weight", "bias")),
    "ConvTranspose1d": (
        "conv_transpose1d",
        ("stride", "padding", "output_padding", "groups", "dilation"),
        ("weight", "bias"),
    ),
    "ConvTranspose2d": (
        "conv_transpose2d",
        ("stride", "padding", "output_padding", "groups", "dilation"),
        ("weight", "bias"),
    ),
    "ConvTranspose3d": (
        "conv_transpose3d",
        ("stride", "padding", "output_padding", "groups", "dilation"),
        ("weight", "bias"),
    ),
    "LayerNorm": ("layer_norm", ("normalized_shape", "eps"), ("weight", "bias")),
    "RMSNorm": ("rms_norm", ("normalized_shape", "eps"), ("weight",)),
    "GroupNorm": ("group_norm", ("num_groups", "eps"), ("weight", "bias")),
    "BatchNorm1d": ("batch_norm", ("eps", "momentum"), ("running_mean", "running_var", "weight", "bias")),
    "BatchNorm2d": ("batch_norm", ("eps", "momentum"), ("running_mean", "running_var", "weight", "bias")),
    "BatchNorm3d": ("batch_norm", ("eps", "momentum"), ("running_mean", "running_var", "weight", "bias")),
    "InstanceNorm1d": ("instance_norm", ("eps",), ("running_mean", "running_var", "weight", "bias")),
    "InstanceNorm2d": ("instance_norm", ("eps",), ("running_mean", "running_var", "weight", "bias")),
    "InstanceNorm3d": ("instance_norm", ("eps",), ("running_mean", "running_var", "weight", "bias")),
    "Embedding": ("embedding", ("padding_idx",), ("weight",)),
    "MaxPool1d": ("max_pool1d", ("kernel_size", "stride", "padding", "dilation"), ()),
    "MaxPool2d": ("max_pool2d", ("kernel_size", "stride", "padding", "dilation"), ()),
    "MaxPool3d": ("max_pool3d", ("kernel_size", "stride", "padding", "dilation"), ()),
    "AvgPool1d": ("avg_pool1d", ("kernel_size", "stride", "padding"), ()),
    "AvgPool2d": ("avg_pool2d", ("kernel_size", "stride", "padding"), ()),
    "AvgPool3d": ("avg_pool3d", ("kernel_size", "stride", "padding"), ()),
    "AdaptiveAvgPool1d": ("adaptive_avg_pool1d", ("output_size",), ()),
    "AdaptiveAvgPool2d": ("adaptive_avg_pool2d", ("output_size",), ()),
    "AdaptiveAvgPool3d": ("adaptive_avg_pool3d", ("output_size",), ()),
    "Flatten": ("flatten", ("start_dim", "end_dim"), ()),
}


@dataclass
class TaskAnalysis:
    """The child's JSON description of a task, with helpers; ``data`` is the raw record."""

    data: dict[str, Any]
    task_source: str = ""
    task_path: str = "task.py"
    _nodes: dict[str, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._nodes = {n["name"]: n for n in self.data.get("nodes", [])}

    @property
    def traced(self) -> bool:
        return bool(self.data.get("traced"))

    @property
    def traced_at_shapes(self) -> bool:
        """Only a trace at the example's shapes worked (their sizes are constants in the graph)."""
        return bool(self.data.get("traced_at_shapes"))

    @property
    def trace_error(self) -> str:
        return self.data.get("trace_error", "")

    @property
    def op_sequence(self) -> list[str]:
        return list(self.data.get("op_sequence", []))

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return list(self.data.get("inputs", []))

    @property
    def parameters(self) -> list[dict[str, Any]]:
        return list(self.data.get("parameters", []))

    @property
    def buffers(self) -> list[dict[str, Any]]:
        return list(self.data.get("buffers", []))

    @property
    def state_dict(self) -> list[dict[str, Any]]:
        """The entries of ``Model.state_dict()`` in order: name, shape, dtype, kind (parameter/buffer)."""
        return list(self.data.get("state_dict", []))

    @property
    def nodes(self) -> list[dict[str, Any]]:
        return list(self.data.get("nodes", []))

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """The flattened outputs: ``ref`` (the node, or None untraced), ``shape``, ``dtype``."""
        return list(self.data.get("outputs", []))

    @property
    def forward_args(self) -> list[dict[str, Any]]:
        """The forward's arguments in order: ``name`` and, when it has one, ``default``."""
        return list(self.data.get("forward_args", []))

    def node(self, name: str) -> dict[str, Any]:
        """The node record called ``name``; ``KeyError`` when there is none."""
        return self._nodes[name]

    def users(self, name: str) -> list[str]:
        """Names of the nodes that take node ``name`` as an argument, in graph order."""
        return [n["name"] for n in self.nodes if name in refs_of(n)]

    def call_nodes(self) -> list[dict[str, Any]]:
        """The nodes that compute something (calls of functions, methods and modules)."""
        return [n for n in self.nodes if n["kind"].startswith("call_")]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


def refs_of(node: dict[str, Any]) -> list[str]:
    """The node names a node record refers to (in its args and kwargs), in order, with repeats."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if set(value) == {"ref"}:
                found.append(value["ref"])
            else:
                for v in value.values():
                    walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(node.get("args", []))
    walk(node.get("kwargs", {}))
    return found


def analyze(
    task_source: str, task_path: str = "task.py", seed: int = 0, settings: Settings | None = None
) -> TaskAnalysis:
    """Analyse a task in a sandboxed child; raises :class:`TaskError` with the child's message on failure."""
    check_source(task_source, "task", task_path)
    payload = {"task_source": task_source, "task_path": task_path, "seed": int(seed)}
    res = sandbox.run(TARGET, payload, settings=settings)
    if not res.ok:
        message = res.message or res.status
        if res.status == "crashed" and res.output_tail:
            message += f"; output: {res.output_tail[-500:]}"
        raise TaskError(f"analysis failed ({res.status}): {message}", path=task_path)
    return TaskAnalysis(res.value or {}, task_source=task_source, task_path=task_path)


# ----------------------------------------------------------------------------------------------
# Child side (runs the task's code)
# ----------------------------------------------------------------------------------------------


def analyze_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Sandbox target: build the task's model and inputs under the seed, trace and describe them."""
    import torch

    from kernelcrew.task import call_inputs, load_task

    del workdir
    path = payload.get("task_path", "task.py")
    seed = int(payload.get("seed", 0))
    task = load_task(payload["task_source"], path=path)
    torch.manual_seed(seed)
    init = call_inputs(task.get_init_inputs, "get_init_inputs", path)
    try:
        model = task.model_cls(*init)
    except Exception as exc:
        raise TaskError(f"Model(*get_init_inputs()) raised {type(exc).__name__}: {exc}", path=path) from exc
    model.eval()
    torch.manual_seed(seed)
    inputs = call_inputs(task.get_inputs, "get_inputs", path)

    result: dict[str, Any] = {
        "seed": seed,
        "init_inputs": [_encode_value(v) for v in init],
        "inputs": [],
        "parameters": [
            {"name": name, **_tensor_meta(p)} for name, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [],
        "state_dict": [],
        "traced": False,
        "trace_error": "",
        "nodes": [],
        "outputs": [],
        "op_sequence": [],
        "forward_args": [],
        "notes": [],
    }
    state = model.state_dict()
    param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, b in model.named_buffers(remove_duplicate=False):
        result["buffers"].append({"name": name, **_tensor_meta(b), "persistent": name in state})
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            kind = "parameter" if name in param_names else "buffer"
            result["state_dict"].append({"name": name, **_tensor_meta(value), "kind": kind})
        else:
            result["state_dict"].append({"name": name, "kind": "extra_state", "type": type(value).__name__})

    try:
        gm = _trace(model)
    except Exception as exc:
        result["trace_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        try:
            gm = trace_at_shapes(model, inputs)
        except Exception as meta_exc:
            result["notes"].append(
                f"tracing at the example's shapes failed too: {type(meta_exc).__name__}: {meta_exc}"[:500]
            )
            result["inputs"] = _describe_inputs(inputs, [])
            result["outputs"] = _eager_outputs(model, inputs, result["notes"])
            return result
        result["traced_at_shapes"] = True
        result["notes"].append(
            "traced at the example's shapes (MetaTracer): its sizes are constants in the graph"
        )

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    result["inputs"] = _describe_inputs(inputs, [str(n.target) for n in placeholders])
    result["forward_args"] = [_forward_arg(n) for n in placeholders]
    _propagate_shapes(gm, inputs, result["notes"])
    result["traced"] = not result.get("traced_at_shapes")
    owners = {
        "modules": dict(gm.named_modules()),
        "parameters": dict(gm.named_parameters(remove_duplicate=False)),
        "buffers": dict(gm.named_buffers(remove_duplicate=False)),
        "state": state,
    }
    for node in gm.graph.nodes:
        rec = _describe_node(node, owners)
        result["nodes"].append(rec)
        if rec["kind"].startswith("call_"):
            result["op_sequence"].append(rec["op"])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result["outputs"] = [
        {"ref": ref.name if isinstance(ref, torch.fx.Node) else None, **_node_meta(ref)}
        for ref in _flatten(output.args[0])
    ]
    return result


def _trace(model: Any) -> Any:
    """``symbolic_trace`` with buffers as graph inputs (get_attr), not folded into constants."""
    import torch

    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True
    graph = tracer.trace(model)
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def trace_at_shapes(model: Any, inputs: list[Any]) -> Any:
    """fx's ``MetaTracer`` on ``inputs``' shapes (meta tensors: nothing computed), buffers as graph
    inputs; non-tensor inputs are constants. The attention candidate carries the same function
    (candidates import nothing of kernelcrew), so the graphs it traces at run time name their nodes
    as this one does."""
    import inspect

    import torch
    from torch.fx.experimental.meta_tracer import MetaTracer

    names = list(inspect.signature(model.forward).parameters)[: len(inputs)]
    meta = {n: x.to("meta") for n, x in zip(names, inputs, strict=False) if isinstance(x, torch.Tensor)}
    concrete = {n: x for n, x in zip(names, inputs, strict=False) if not isinstance(x, torch.Tensor)}
    tracer = MetaTracer()
    tracer.proxy_buffer_attributes = True
    graph = tracer.trace(model, meta_args=meta, concrete_args=concrete or None)
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def _tensor_meta(t: Any) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


def _describe_inputs(inputs: list[Any], names: list[str]) -> list[dict[str, Any]]:
    import torch

    described = []
    for i, x in enumerate(inputs):
        rec: dict[str, Any] = {"index": i, "name": names[i] if i < len(names) else f"input{i}"}
        if isinstance(x, torch.Tensor):
            rec.update(kind="tensor", **_tensor_meta(x))
            if x.numel() and not x.is_complex() and x.dtype != torch.bool:
                rec["nonnegative"] = bool((x.detach() >= 0).all())
            else:
                rec["nonnegative"] = x.numel() > 0 and x.dtype == torch.bool
        else:
            rec.update(kind=type(x).__name__, value=_encode_value(x))
        described.append(rec)
    return described


def _forward_arg(node: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"name": str(node.target)}
    if node.args:
        rec["default"] = _encode_value(node.args[0])
    return rec


def _eager_outputs(model: Any, inputs: list[Any], notes: list[str]) -> list[dict[str, Any]]:
    import torch

    from kernelcrew.tools.harness import flatten_outputs

    try:
        with torch.no_grad():
            outs = flatten_outputs(model(*inputs))
    except Exception as exc:
        notes.append(f"the model failed on the example inputs: {type(exc).__name__}: {exc}"[:500])
        return []
    return [{"ref": None, **_tensor_meta(t)} for t in outs]


def _propagate_shapes(gm: Any, inputs: list[Any], notes: list[str]) -> None:
    """ShapeProp on fake tensors (no compute); on the real inputs when fake propagation fails."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp

    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with torch.no_grad():
            ShapeProp(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
        return
    except Exception as exc:
        notes.append(f"fake shape propagation failed ({type(exc).__name__}); ran the real inputs")
    for node in gm.graph.nodes:
        node.meta.pop("tensor_meta", None)
        node.meta.pop("type", None)
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*inputs)
    except Exception as exc:
        notes.append(f"shape propagation failed: {type(exc).__name__}: {exc}"[:500])


def _node_meta(node: Any) -> dict[str, Any]:
    """shape/dtype of a node's value (None for non-tensors, with their type and a number's value)."""
    import torch

    if not isinstance(node, torch.fx.Node):
        return {"shape": None, "dtype": None, "type": type(node).__name__, "value": _encode_value(node)}
    meta = node.meta.get("tensor_meta")
    rec: dict[str, Any] = {"shape": None, "dtype": None}
    typ = node.meta.get("type")
    if typ is not None:
        rec["type"] = "Tensor" if issubclass(typ, torch.Tensor) else typ.__name__
    if meta is not None and hasattr(meta, "shape"):
        rec["shape"] = [int(s) for s in meta.shape]
        rec["dtype"] = dtype_name(meta.dtype)
    elif isinstance(meta, list | tuple):
        rec["items"] = [
            {"shape": [int(s) for s in m.shape], "dtype": dtype_name(m.dtype)}
            if hasattr(m, "shape")
            else None
            for m in meta
        ]
    return rec


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [v for item in value for v in _flatten(item)]
    if isinstance(value, dict):
        return [v for k in sorted(value) for v in _flatten(value[k])]
    return [value]


def _encode_value(value: Any) -> Any:
    """A JSON-serializable form of an fx argument."""
    import torch

    if isinstance(value, torch.fx.Node):
        return {"ref": value.name}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, list | tuple | torch.Size):
        return [_encode_value(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {str(k): _encode_value(v) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [_encode_value(value.start), _encode_value(value.stop), _encode_value(value.step)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    return {"repr": repr(value)[:200]}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _normalize_name(raw: str) -> tuple[str, bool]:
    """(normalized op, in place?) of a function or method name."""
    inplace = raw.endswith("_") and not raw.endswith("__") and raw not in OP_ALIASES
    name = raw[:-1] if inplace else raw
    return OP_ALIASES.get(name, name), inplace


def _describe_node(node: Any, owners: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import torch
    from torch.fx.node import _get_qualified_name

    rec: dict[str, Any] = {"name": node.name, "kind": node.op, "target": str(node.target)}
    args = [_encode_value(a) for a in node.args]
    kwargs = {k: _encode_value(v) for k, v in node.kwargs.items()}
    inplace = bool(node.kwargs.get("inplace", False))

    if node.op == "placeholder":
        rec["op"] = "input"
        args = []
    elif node.op == "get_attr":
        target = str(node.target)
        if target in owners["parameters"]:
            rec["op"] = "parameter"
        elif target in owners["buffers"]:
            rec["op"] = "buffer"
            rec["persistent"] = target in owners["state"]
        else:
            rec["op"] = "attribute"
    elif node.op == "call_function":
        target = node.target
        try:
            rec["target"] = (
                _get_qualified_name(target)
                .replace("_operator.", "operator.")
                .replace("torch._C._nn.", "torch.nn.functional.")
            )
        except Exception:
            rec["target"] = repr(target)[:200]
        raw = getattr(target, "__name__", str(target))
        if getattr(target, "__module__", "") in ("_operator", "operator"):
            rec["op"], inplace_name = OP_ALIASES.get(raw, raw), False
        else:
            rec["op"], inplace_name = _normalize_name(raw)
        inplace = inplace or inplace_name
        rec["op"], args, kwargs = _binary_minmax(rec["op"], node, args, kwargs)
    elif node.op == "call_method":
        raw = str(node.target)
        rec["target"] = f"Tensor.{raw}"
        if raw in CAST_METHODS:
            rec["op"] = "to"
            args = args[:1]
            kwargs = {"dtype": {"dtype": _node_meta(node).get("dtype")}}
        else:
            rec["op"], inplace_name = _normalize_name(raw)
            inplace = inplace or inplace_name
            if rec["op"] == "where" and len(args) >= 3:  # x.where(cond, y) is torch.where(cond, x, y)
                args = [args[1], args[0], *args[2:]]
            rec["op"], args, kwargs = _binary_minmax(rec["op"], node, args, kwargs)
    elif node.op == "call_module":
        module = owners["modules"][str(node.target)]
        cls = type(module)
        rec["module_type"] = f"{cls.__module__}.{cls.__qualname__}"
        op, attrs, weights = MODULE_OPS.get(cls.__name__, (_snake(cls.__name__), (), ()))
        rec["op"] = op
        for attr in attrs:
            if hasattr(module, attr):
                kwargs[attr] = _encode_value(getattr(module, attr))
        for weight in weights:
            tensor = getattr(module, weight, None)
            kwargs[weight] = (
                {"param": f"{node.target}.{weight}"} if isinstance(tensor, torch.Tensor) else None
            )
        if op == "dropout":
            kwargs["training"] = bool(module.training)
        if op in ("batch_norm", "instance_norm"):
            kwargs["training"] = bool(module.training)
        inplace = bool(getattr(module, "inplace", False))
    else:  # output
        rec["op"] = "output"
    rec["args"] = args
    rec["kwargs"] = kwargs
    if inplace:
        rec["inplace"] = True
    rec.update(_node_meta(node) if node.op != "output" else _output_meta(node))
    return rec


def _output_meta(node: Any) -> dict[str, Any]:
    value = node.args[0]
    if isinstance(value, list | tuple):
        return {"shape": None, "dtype": None, "items": [_node_meta(v) for v in _flatten(value)]}
    return _node_meta(value)


def _binary_minmax(
    op: str, node: Any, args: list[Any], kwargs: dict[str, Any]
) -> tuple[str, list[Any], dict[str, Any]]:
    """``torch.max(x, y)`` (two tensors) is ``maximum``; ``torch.max(x, dim)`` stays a reduction."""
    import torch

    if op in ("max", "min") and len(node.args) >= 2 and isinstance(node.args[1], torch.fx.Node):
        meta = node.args[1].meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            return ("maximum" if op == "max" else "minimum"), args, kwargs
    if op in ("max", "min") and isinstance(node.kwargs.get("other"), torch.fx.Node):
        return ("maximum" if op == "max" else "minimum"), [args[0], kwargs.pop("other")], kwargs
    return op, args, kwargs


__all__ = ["TaskAnalysis", "analyze", "analyze_child", "dtype_name", "refs_of"]
