"""Fused pointwise strategy: a forward that is a DAG of elementwise ops becomes ONE Triton kernel.

:func:`match_pointwise` lowers the traced graph (from :mod:`.analysis`) to a small expression IR
over *operands* (the forward's tensor inputs, parameters and persistent buffers) and scalar
constants; :func:`generate_pointwise` writes a candidate whose kernel loads every operand once with
its own broadcast indexing, evaluates the expression in fp32 (fp64 when the module uses float64)
registers and stores once. Broadcasting is resolved at run time by the host code, per operand:
``FULL`` (same shape as the output), ``SUFFIX`` (the output's trailing dims: ``offs % n``),
``PREFIX`` (its leading dims: ``offs // inner``), ``MIDDLE`` (a run of its middle dims, such as a
per-channel parameter: ``offs // inner % n``), ``SCALAR`` (one element) or ``GENERAL``
(per-dimension strides of the coalesced output shape, up to :data:`MAX_RANK` dims), so any input
shape works and nothing of the example's sizes is baked in. Only core ``tl.*`` math is used
(libdevice does not run under ``TRITON_INTERPRET=1``).

Numerics follow the verifier's float64 golden: implicit dtype promotion is not replayed (values
stay in fp32), explicit casts to a narrower float (``.half()``, ``.to(torch.bfloat16)``) round
as the reference does, and the output is stored once in the dtype the reference returns.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis, refs_of

#: Most dims of the coalesced output shape that GENERAL indexing handles.
MAX_RANK = 6
DEFAULT_PARAMS = {"BLOCK_SIZE": 1024, "num_warps": 4}

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8"})
TRITON_DTYPES = {
    "float16": "tl.float16",
    "bfloat16": "tl.bfloat16",
    "float32": "tl.float32",
    "float64": "tl.float64",
}

#: Argument names of each supported op (as torch spells them), with defaults (``_REQUIRED``: none).
_REQUIRED = object()
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {}


def _sig(names: str, *defaults: Any) -> tuple[tuple[str, Any], ...]:
    parts = names.split()
    pad = [_REQUIRED] * (len(parts) - len(defaults))
    return tuple(zip(parts, [*pad, *defaults], strict=True))


for _op in ("add", "sub", "rsub"):
    SIGNATURES[_op] = _sig("input other alpha", 1)
for _op in ("mul", "maximum", "minimum", "gt", "ge", "lt", "le", "eq", "ne"):
    SIGNATURES[_op] = _sig("input other")
for _op in ("logical_and", "logical_or", "bitwise_and", "bitwise_or"):
    SIGNATURES[_op] = _sig("input other")
SIGNATURES["div"] = _sig("input other rounding_mode", None)
SIGNATURES["pow"] = _sig("input exponent")
SIGNATURES["where"] = _sig("condition input other")
SIGNATURES["clamp"] = _sig("input min max", None, None)
SIGNATURES["clamp_min"] = _sig("input min")
SIGNATURES["clamp_max"] = _sig("input max")
SIGNATURES["hardtanh"] = _sig("input min_val max_val inplace", -1.0, 1.0, False)
SIGNATURES["relu6"] = _sig("input inplace", False)
SIGNATURES["relu"] = _sig("input inplace", False)
SIGNATURES["leaky_relu"] = _sig("input negative_slope inplace", 0.01, False)
SIGNATURES["gelu"] = _sig("input approximate", "none")
SIGNATURES["silu"] = _sig("input inplace", False)
SIGNATURES["mish"] = _sig("input inplace", False)
SIGNATURES["softplus"] = _sig("input beta threshold", 1.0, 20.0)
SIGNATURES["elu"] = _sig("input alpha inplace", 1.0, False)
SIGNATURES["celu"] = _sig("input alpha inplace", 1.0, False)
SIGNATURES["selu"] = _sig("input inplace", False)
SIGNATURES["hardsigmoid"] = _sig("input inplace", False)
SIGNATURES["hardswish"] = _sig("input inplace", False)
SIGNATURES["threshold"] = _sig("input threshold value inplace", False)
SIGNATURES["dropout"] = _sig("input p training inplace", 0.5, True, False)
SIGNATURES["to"] = _sig("input dtype")
SIGNATURES["lerp"] = _sig("input end weight")
SIGNATURES["addcmul"] = _sig("input tensor1 tensor2 value", 1)
SIGNATURES["addcdiv"] = _sig("input tensor1 tensor2 value", 1)
UNARY = (
    *("neg", "abs", "exp", "exp2", "log", "log2", "log10", "log1p", "expm1", "sqrt", "rsqrt"),
    *("sin", "cos", "erf", "floor", "ceil", "sigmoid", "tanh", "square", "reciprocal", "sign"),
    *("logsigmoid", "softsign", "tanhshrink", "logical_not", "bitwise_not"),
)
for _op in UNARY:
    SIGNATURES[_op] = _sig("input")
IDENTITY_OPS = frozenset({"identity", "contiguous", "clone", "detach", "positive", "alias"})

#: Torch-level ops this strategy fuses (what :func:`match_pointwise` accepts).
SUPPORTED_OPS = frozenset(SIGNATURES) | IDENTITY_OPS


class Unsupported(Exception):
    """The module is not a pure pointwise DAG; the message says what is not supported."""


@dataclass(frozen=True)
class Operand:
    """A tensor the kernel loads: a forward argument (``input``) or a weight (``parameter``/``buffer``)."""

    name: str
    source: str
    shape: tuple[int, ...]
    dtype: str
    is_bool: bool = False


@dataclass(frozen=True)
class Step:
    """One IR instruction: ``out = op(args...)``; an arg is ``("in", i)``, ``("t", name)`` or ``("c", x)``."""

    out: str
    op: str
    args: tuple[tuple[str, Any], ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key: str) -> Any:
        return dict(self.attrs)[key]


@dataclass
class PointwisePlan:
    """What the fused kernel computes: operands, the IR steps, the result and the output dtype."""

    operands: list[Operand]
    steps: list[Step]
    result: tuple[str, Any]
    forward_args: list[dict[str, Any]]
    out_dtype: str
    out_shape: tuple[int, ...]
    compute_dtype: str = "float32"
    ops: list[str] = field(default_factory=list)

    @property
    def n_inputs(self) -> int:
        return sum(o.source == "input" for o in self.operands)


# ----------------------------------------------------------------------------------------------
# Matching: the traced graph -> the IR
# ----------------------------------------------------------------------------------------------


def match(analysis: TaskAnalysis) -> tuple[PointwisePlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    try:
        plan = _match(analysis)
    except Unsupported as exc:
        return None, str(exc)
    names = ", ".join(dict.fromkeys(plan.ops)) or "a copy"
    return plan, (
        f"the forward is a pointwise DAG ({names}) over {len(plan.operands)} operand(s): "
        f"one fused kernel reads each operand once and writes the {plan.out_dtype} output once"
    )


def match_pointwise(analysis: TaskAnalysis) -> PointwisePlan | None:
    """The plan when the whole forward is an elementwise DAG with one tensor output, else None."""
    return match(analysis)[0]


def explain_pointwise(analysis: TaskAnalysis) -> str:
    """Why :func:`match_pointwise` rejects this module ('' when it accepts it)."""
    plan, reason = match(analysis)
    return "" if plan is not None else reason


def node_origin(node: dict[str, Any]) -> str:
    """Where a traced node comes from, for messages: its module class and path, or its target."""
    if "module_type" in node:
        return f"{node['module_type'].rsplit('.', 1)[-1]} at {node['target']!r}"
    return str(node["target"])


def single_output(a: TaskAnalysis) -> dict[str, Any]:
    """The traced forward's one output; :class:`Unsupported` when it was not traced or does not
    return exactly one tensor (every graph strategy needs both)."""
    if not a.traced:
        raise Unsupported(f"the module could not be traced with torch.fx: {a.trace_error}")
    outputs = a.outputs
    if len(outputs) != 1 or outputs[0].get("ref") is None:
        raise Unsupported(f"the forward must return one tensor (it returns {len(outputs)} values)")
    return outputs[0]


def check_float_output(a: TaskAnalysis, out: dict[str, Any], verb: str) -> None:
    """:class:`Unsupported` unless ``out`` is floating point and the module keeps no extra state
    (a generated kernel ``verb`` only floating-point outputs and copies a plain state dict)."""
    if out.get("dtype") not in FLOAT_DTYPES:
        raise Unsupported(f"the output dtype is {out.get('dtype')}; only floating-point outputs are {verb}")
    if any(e.get("kind") == "extra_state" for e in a.state_dict):
        raise Unsupported("the module has extra state in its state dict")


def _match(a: TaskAnalysis) -> PointwisePlan:
    out = single_output(a)
    check_float_output(a, out, "fused")
    needed = _reachable(a, out["ref"])
    lowering = _Lowering(a)
    for node in a.nodes:
        if node["name"] in needed and node["kind"] != "output":
            lowering.visit(node)
    result = lowering.values[out["ref"]]
    if result[0] == "c":
        raise Unsupported("the output is a constant")
    if lowering.kinds.get(_key(result)) == "b":
        raise Unsupported("the output is a boolean mask")
    if not lowering.operands:
        raise Unsupported("the output depends on no tensor")
    for arg in a.forward_args:
        if not re.fullmatch(r"[A-Za-z_]\w*", arg["name"]):
            raise Unsupported(f"forward argument {arg['name']!r} (varargs are not supported)")
        if "default" in arg and not _simple_literal(arg["default"]):
            raise Unsupported(f"forward argument {arg['name']!r} has a default that is not a literal")
    wide = any(o.dtype == "float64" for o in lowering.operands) or any(
        a.node(n).get("dtype") == "float64" for n in needed if a.node(n)["kind"] != "output"
    )
    return PointwisePlan(
        operands=lowering.operands,
        steps=lowering.steps,
        result=result,
        forward_args=a.forward_args,
        out_dtype=out["dtype"],
        out_shape=tuple(out.get("shape") or ()),
        compute_dtype="float64" if wide else "float32",
        ops=lowering.ops,
    )


def _simple_literal(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _reachable(a: TaskAnalysis, root: str) -> set[str]:
    """The nodes the output depends on, in-place ops on any of them included."""
    seen: set[str] = set()
    stack = [root]
    while True:
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(refs_of(a.node(name)))
        for node in a.nodes:  # an in-place op changes a needed value without being referred to
            first = node["args"][0] if node.get("inplace") and node["args"] else None
            if isinstance(first, dict) and first.get("ref") in seen and node["name"] not in seen:
                stack.append(node["name"])
        if not stack:
            return seen


def _key(value: tuple[str, Any]) -> str:
    return f"{value[0]}:{value[1]}"


class _Lowering:
    """Walks the graph in order, turning each node into operands or IR steps."""

    def __init__(self, analysis: TaskAnalysis) -> None:
        self.a = analysis
        self.operands: list[Operand] = []
        self.steps: list[Step] = []
        self.values: dict[str, tuple[str, Any]] = {}
        self.kinds: dict[str, str] = {}  # value key -> "f" (number) or "b" (mask)
        self.ops: list[str] = []

    # --- values --------------------------------------------------------------------------------
    def operand(self, node: dict[str, Any], name: str, source: str) -> None:
        dtype = node.get("dtype")
        if node.get("shape") is None or dtype is None:
            raise Unsupported(f"{source} {name!r} is not a tensor")
        if dtype not in FLOAT_DTYPES | INT_DTYPES | {"bool"}:
            raise Unsupported(f"{source} {name!r} has dtype {dtype}")
        op = Operand(name, source, tuple(node["shape"]), dtype, is_bool=dtype == "bool")
        self.operands.append(op)
        value = ("in", len(self.operands) - 1)
        self.values[node["name"]] = value
        self.kinds[_key(value)] = "b" if op.is_bool else "f"

    def emit(self, out: str, op: str, args: list[tuple[str, Any]], kind: str = "f", **attrs: Any):
        value = ("t", out)
        self.steps.append(Step(out, op, tuple(args), tuple(sorted(attrs.items()))))
        self.kinds[_key(value)] = kind
        return value

    def kind(self, value: tuple[str, Any]) -> str:
        return "f" if value[0] == "c" else self.kinds[_key(value)]

    def num(self, value: tuple[str, Any], name: str) -> tuple[str, Any]:
        """``value`` as a number (a mask becomes 1.0/0.0, as PyTorch promotes bool)."""
        if self.kind(value) == "b":
            return self.emit(f"{name}_num{len(self.steps)}", "bool_to_float", [value])
        return value

    def mask(self, value: tuple[str, Any], what: str) -> tuple[str, Any]:
        if self.kind(value) != "b":
            raise Unsupported(f"{what} must be a boolean mask")
        return value

    def arg(self, value: Any, node: dict[str, Any]) -> tuple[str, Any]:
        """An fx argument as an IR value: a node's value or a finite scalar constant."""
        if isinstance(value, dict) and set(value) == {"ref"}:
            return self.values[value["ref"]]
        if isinstance(value, bool):
            return ("c", 1.0 if value else 0.0)
        if isinstance(value, int | float):
            if not math.isfinite(value):
                raise Unsupported(f"{node['name']}: non-finite constant {value!r}")
            return ("c", float(value))
        raise Unsupported(
            f"{node['name']} ({node['op']}): argument {value!r} is neither a tensor nor a number"
        )

    # --- nodes ---------------------------------------------------------------------------------
    def visit(self, node: dict[str, Any]) -> None:
        kind, name = node["kind"], node["name"]
        if kind == "placeholder":
            self.operand(node, node["target"], "input")
            return
        if kind == "get_attr":
            if node["op"] == "parameter" or (node["op"] == "buffer" and node.get("persistent", True)):
                self.operand(node, node["target"], node["op"])
                return
            raise Unsupported(f"attribute {node['target']!r} is not in the state dict")
        op = node["op"]
        if op not in SUPPORTED_OPS:
            raise Unsupported(f"op {op!r} ({node_origin(node)}) is not pointwise or not supported")
        if node.get("shape") is None or node.get("dtype") is None:
            raise Unsupported(f"{op} ({name}) does not produce a tensor")
        if node["dtype"] not in FLOAT_DTYPES | {"bool"}:
            raise Unsupported(f"{op} ({name}) computes in {node['dtype']}; only float math is fused")
        self.ops.append(op)
        if op in IDENTITY_OPS:
            if not node["args"]:
                raise Unsupported(f"{op} ({name}) has no input")
            self.values[name] = self.arg(node["args"][0], node)
        else:
            self.values[name] = self.lower(node, op, self.bind(node, op))
        first = node["args"][0] if node.get("inplace") and node["args"] else None
        if isinstance(first, dict) and "ref" in first:  # later readers of the mutated value see this one
            self.values[first["ref"]] = self.values[name]

    def bind(
        self, node: dict[str, Any], op: str, signatures: dict[str, tuple[tuple[str, Any], ...]] = SIGNATURES
    ) -> dict[str, Any]:
        """The node's arguments by name, with defaults, against ``signatures[op]``."""
        sig = signatures[op]
        names = [n for n, _ in sig]
        args, kwargs = list(node["args"]), dict(node["kwargs"])
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
        return bound

    def lower(self, node: dict[str, Any], op: str, b: dict[str, Any]) -> tuple[str, Any]:
        name = node["name"]

        def val(key: str) -> tuple[str, Any]:
            return self.arg(b[key], node)

        def num(key: str) -> tuple[str, Any]:
            return self.num(val(key), name)

        def const(key: str) -> float:
            value = b[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise Unsupported(f"{op} ({name}): {key} must be a finite number, got {value!r}")
            return float(value)

        if op in ("add", "sub", "rsub"):
            x, y = num("input"), num("other")
            if op == "rsub":  # torch.rsub(input, other, alpha) = other - alpha * input
                x, y = y, x
            alpha = const("alpha")
            if alpha != 1.0:
                y = self.emit(f"{name}_alpha", "mul", [y, ("c", alpha)])
            return self.emit(name, "add" if op == "add" else "sub", [x, y])
        if op == "mul":
            return self.emit(name, "mul", [num("input"), num("other")])
        if op == "div":
            if b["rounding_mode"] is not None:
                raise Unsupported(f"div ({name}) with rounding_mode={b['rounding_mode']!r}")
            return self.emit(name, "div", [num("input"), num("other")])
        if op == "square":
            x = num("input")
            return self.emit(name, "mul", [x, x])
        if op == "reciprocal":
            return self.emit(name, "div", [("c", 1.0), num("input")])
        if op == "log10":
            log = self.emit(f"{name}_ln", "log", [num("input")])
            return self.emit(name, "mul", [log, ("c", 1.0 / math.log(10.0))])
        if op in ("maximum", "minimum"):
            return self.emit(name, op, [num("input"), num("other")])
        if op in ("gt", "ge", "lt", "le", "eq", "ne"):
            return self.emit(name, op, [num("input"), num("other")], kind="b")
        if op in ("logical_and", "logical_or", "bitwise_and", "bitwise_or"):
            x, y = val("input"), val("other")
            if self.kind(x) != "b" or self.kind(y) != "b":
                raise Unsupported(f"{op} ({name}) on non-boolean tensors")
            return self.emit(name, "and" if op.endswith("and") else "or", [x, y], kind="b")
        if op in ("logical_not", "bitwise_not"):
            return self.emit(name, "not", [self.mask(val("input"), f"{op} ({name})'s input")], kind="b")
        if op == "where":
            cond = self.mask(val("condition"), f"where ({name})'s condition")
            return self.emit(name, "where", [cond, num("input"), num("other")])
        if op in ("clamp", "clamp_min", "clamp_max", "hardtanh", "relu6"):
            if op == "hardtanh":
                lo, hi = ("c", const("min_val")), ("c", const("max_val"))
            elif op == "relu6":
                lo, hi = ("c", 0.0), ("c", 6.0)
            else:
                lo = num("min") if b.get("min") is not None else None
                hi = num("max") if b.get("max") is not None else None
                if lo is None and hi is None:
                    raise Unsupported(f"clamp ({name}) without min or max")
            args = [num("input")] + [v for v in (lo, hi) if v is not None]
            return self.emit(name, "clamp", args, has_min=lo is not None, has_max=hi is not None)
        if op == "threshold":
            x = num("input")
            return self.emit(name, "threshold", [x, ("c", const("threshold")), ("c", const("value"))])
        if op == "leaky_relu":
            return self.emit(name, "leaky_relu", [num("input")], slope=const("negative_slope"))
        if op == "gelu":
            if b["approximate"] not in ("none", "tanh"):
                raise Unsupported(f"gelu ({name}) approximate={b['approximate']!r}")
            return self.emit(name, "gelu", [num("input")], approximate=b["approximate"])
        if op == "softplus":
            return self.emit(
                name, "softplus", [num("input")], beta=const("beta"), threshold=const("threshold")
            )
        if op in ("elu", "celu"):
            alpha = const("alpha")
            return self.emit(
                name,
                "elu",
                [num("input")],
                alpha=alpha,
                scale=1.0,
                input_scale=1.0 / alpha if op == "celu" else 1.0,
            )
        if op == "selu":
            return self.emit(
                name,
                "elu",
                [num("input")],
                alpha=1.6732632423543772,
                scale=1.0507009873554805,
                input_scale=1.0,
            )
        if op == "dropout":
            if b["training"] and const("p") > 0:
                raise Unsupported(f"dropout ({name}) in training mode is random")
            return self.arg(b["input"], node)
        if op == "to":
            return self.cast(node, val("input"))
        if op == "pow":
            return self.power(node, b)
        if op == "lerp":
            x, end, w = num("input"), num("end"), num("weight")
            diff = self.emit(f"{name}_diff", "sub", [end, x])
            scaled = self.emit(f"{name}_scaled", "mul", [w, diff])
            return self.emit(name, "add", [x, scaled])
        if op in ("addcmul", "addcdiv"):
            x, t1, t2 = num("input"), num("tensor1"), num("tensor2")
            prod = self.emit(f"{name}_prod", "mul" if op == "addcmul" else "div", [t1, t2])
            value = const("value")
            if value != 1.0:
                prod = self.emit(f"{name}_value", "mul", [prod, ("c", value)])
            return self.emit(name, "add", [x, prod])
        if op in ("relu", "silu", "mish", "hardsigmoid", "hardswish") or op in UNARY:
            return self.emit(name, op, [num("input")])
        raise Unsupported(f"op {op!r} ({name}) is not supported")

    def cast(self, node: dict[str, Any], x: tuple[str, Any]) -> tuple[str, Any]:
        target = node["dtype"]
        name = node["name"]
        if target == "bool":
            if self.kind(x) == "b":
                return x
            return self.emit(name, "ne", [x, ("c", 0.0)], kind="b")
        x = self.num(x, name)
        if target in ("float16", "bfloat16") or (target == "float32" and self._wide_possible()):
            return self.emit(name, "round", [x], dtype=target)
        return x

    def _wide_possible(self) -> bool:
        return any(o.dtype == "float64" for o in self.operands) or any(
            n.get("dtype") == "float64" for n in self.a.nodes if n["kind"].startswith("call_")
        )

    def power(self, node: dict[str, Any], b: dict[str, Any]) -> tuple[str, Any]:
        name = node["name"]
        base, exponent = self.arg(b["input"], node), self.arg(b["exponent"], node)
        if base[0] != "c" and exponent[0] == "c":
            e = exponent[1]
            base = self.num(base, name)
            if e == int(e) and abs(e) <= 64:
                return self.emit(name, "pow_int", [base], n=int(e))
            if e == 0.5:
                return self.emit(name, "sqrt", [base])
            if e == -0.5:
                return self.emit(name, "rsqrt", [base])
            return self.emit(name, "pow_float", [base], e=e)
        if base[0] == "c" and exponent[0] != "c":
            c = base[1]
            if c <= 0:
                raise Unsupported(f"pow ({name}) of the non-positive constant {c}")
            return self.emit(name, "exp_base", [self.num(exponent, name)], log_base=math.log(c))
        raise Unsupported(f"pow ({name}) with a tensor exponent and a tensor base")


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------


CONTAINER_SOURCE = """def _container(root, path):
    \"\"\"The submodule at dotted ``path`` of ``root``, made of empty nn.Module()s where missing.\"\"\"
    module = root
    for part in path.split(".") if path else []:
        try:
            module = module.get_submodule(part)
        except AttributeError:
            child = nn.Module()
            module.add_module(part, child)
            module = child
    return module
"""
"""Emitted into every generated candidate (candidates are self-contained files): the submodule
where a state-dict entry of the reference lives."""


def arch_class(arch: str) -> str:
    """``sm_86`` -> ``sm_80``, ``sm_90a`` -> ``sm_90``, ``sm_120`` -> ``sm_100``, ``cpu`` -> ``cpu``.

    A GPU named without its architecture (``cuda``, ``cuda:1``) gets the conservative ``sm_80`` class.
    """
    text = arch.strip().lower()
    if text in ("cpu", "interpreter"):
        return "cpu"
    if re.fullmatch(r"(cuda|gpu)(:\d+)?", text):
        return "sm_80"
    found = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)[a-z]?", text)
    if not found:
        raise ValueError(f"unknown architecture {arch!r} (expected sm_XY, cuda or cpu)")
    number = int(found.group(1))
    if number >= 100:
        return "sm_100"
    if number >= 90:
        return "sm_90"
    return "sm_80"


def tuning_space(plan: PointwisePlan, arch: str) -> list[dict[str, int]]:
    """BLOCK_SIZE x num_warps configurations worth timing on ``arch`` (one for the CPU interpreter)."""
    cls = arch_class(arch)
    if cls == "cpu":
        return [{"BLOCK_SIZE": 1024, "num_warps": 1}]
    wide = plan.compute_dtype == "float64"
    if cls == "sm_80":
        configs = [(1024, 4), (2048, 8), (512, 4), (4096, 8)]
    elif cls == "sm_90":
        configs = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)]
    else:
        configs = [(1024, 4), (2048, 8), (4096, 8), (8192, 16), (16384, 16)]
    if wide:  # fp64 registers: stay at the smaller blocks
        configs = [c for c in configs if c[0] <= 2048]
    return [{"BLOCK_SIZE": b, "num_warps": w} for b, w in configs]


# ----------------------------------------------------------------------------------------------
# Code generation
# ----------------------------------------------------------------------------------------------


def _const(x: float) -> str:
    text = repr(float(x))
    return f"({text})" if text.startswith("-") else text


class _Emitter:
    """IR values -> Triton expressions, one assignment per step."""

    def __init__(self, plan: PointwisePlan) -> None:
        self.plan = plan
        self.compute = TRITON_DTYPES[plan.compute_dtype]
        self.helpers: set[str] = set()
        self.lines: list[str] = []

    def expression(self) -> str:
        """Emit every step of the plan; the result's expression, rounded as the output dtype is
        stored (bfloat16 under the interpreter too)."""
        for step in self.plan.steps:
            self.step(step)
        result = self.ref(self.plan.result)
        if self.plan.out_dtype == "bfloat16":  # round as the GPU does, under the interpreter too
            self.helpers.add("_round_bf16")
            result = f"_round_bf16({result})"
        return result

    def helper_source(self) -> str:
        """The source of the helpers the emitted lines call, in dependency order."""
        if "_softplus" in self.helpers:
            self.helpers.add("_log1p")
        return "".join(HELPERS[h] for h in HELPER_ORDER if h in self.helpers)

    def ref(self, value: tuple[str, Any]) -> str:
        kind, x = value
        if kind == "in":
            return f"v{x}"
        if kind == "t":
            return f"t_{x}"
        return _const(x)

    def step(self, s: Step) -> None:
        a = [self.ref(v) for v in s.args]
        x = a[0] if a else ""
        out = f"t_{s.out}"
        op = s.op
        simple = {
            "add": "{0} + {1}",
            "sub": "{0} - {1}",
            "mul": "{0} * {1}",
            "div": "{0} / {1}",
            "neg": "-{0}",
            "abs": "tl.abs({0})",
            "exp": "tl.exp({0})",
            "exp2": "tl.exp2({0})",
            "log": "tl.log({0})",
            "log2": "tl.log2({0})",
            "sqrt": "tl.sqrt({0})",
            "rsqrt": "tl.rsqrt({0})",
            "sin": "tl.sin({0})",
            "cos": "tl.cos({0})",
            "erf": "tl.erf({0})",
            "floor": "tl.floor({0})",
            "ceil": "tl.ceil({0})",
            "sigmoid": "1.0 / (1.0 + tl.exp(-{0}))",
            "tanh": "_tanh({0})",
            "log1p": "_log1p({0})",
            "expm1": "_expm1({0})",
            "relu": "tl.where({0} < 0, 0.0, {0})",
            "silu": "{0} / (1.0 + tl.exp(-{0}))",
            "mish": "{0} * _tanh(_softplus({0}, 1.0, 20.0))",
            "hardsigmoid": "tl.where({0} < -3.0, 0.0, tl.where({0} > 3.0, 1.0, {0} / 6.0 + 0.5))",
            "hardswish": "{0} * tl.where({0} < -3.0, 0.0, tl.where({0} > 3.0, 1.0, {0} / 6.0 + 0.5))",
            "logsigmoid": "-_softplus(-{0}, 1.0, 20.0)",
            "softsign": "{0} / (1.0 + tl.abs({0}))",
            "tanhshrink": "{0} - _tanh({0})",
            "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, {0}))",
            "maximum": "tl.where({0} != {0}, {0}, tl.where({1} != {1}, {1}, tl.where({0} > {1}, {0}, {1})))",
            "minimum": "tl.where({0} != {0}, {0}, tl.where({1} != {1}, {1}, tl.where({0} < {1}, {0}, {1})))",
            "gt": "{0} > {1}",
            "ge": "{0} >= {1}",
            "lt": "{0} < {1}",
            "le": "{0} <= {1}",
            "eq": "{0} == {1}",
            "ne": "{0} != {1}",
            "and": "{0} & {1}",
            "or": "{0} | {1}",
            "not": "{0} == 0",
            "where": "tl.where({0}, {1}, {2})",
            "bool_to_float": "tl.where({0}, 1.0, 0.0)",
            "threshold": "tl.where({0} <= {1}, {2}, {0})",
        }
        if op in simple:
            expr = simple[op].format(*a)
            for helper in ("_tanh", "_log1p", "_expm1", "_softplus"):
                if helper + "(" in expr:
                    self.helpers.add(helper)
            self.lines.append(f"{out} = {expr}")
            return
        if op == "clamp":
            lines, cur, rest = [], x, a[1:]
            if s.attr("has_min"):
                lines.append(f"{out} = tl.where({cur} < {rest[0]}, {rest[0]}, {cur})")
                cur, rest = out, rest[1:]
            if s.attr("has_max"):
                lines.append(f"{out} = tl.where({cur} > {rest[0]}, {rest[0]}, {cur})")
            self.lines.extend(lines)
            return
        if op == "leaky_relu":
            self.lines.append(f"{out} = tl.where({x} < 0, {x} * {_const(s.attr('slope'))}, {x})")
            return
        if op == "gelu":
            if s.attr("approximate") == "tanh":
                self.helpers.add("_tanh")
                inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
                self.lines.append(f"{out} = 0.5 * {x} * (1.0 + _tanh({inner}))")
            else:
                self.helpers.add("_gelu")
                self.lines.append(f"{out} = _gelu({x})")
            return
        if op == "softplus":
            self.helpers.update({"_softplus", "_log1p"})
            beta, threshold = _const(s.attr("beta")), _const(s.attr("threshold"))
            self.lines.append(f"{out} = _softplus({x}, {beta}, {threshold})")
            return
        if op == "elu":
            self.helpers.add("_expm1")
            alpha, scale, k = (_const(s.attr(n)) for n in ("alpha", "scale", "input_scale"))
            neg = f"{alpha} * _expm1({x} * {k})" if s.attr("input_scale") != 1.0 else f"{alpha} * _expm1({x})"
            expr = f"tl.where({x} > 0, {x}, {neg})"
            self.lines.append(f"{out} = {scale} * {expr}" if s.attr("scale") != 1.0 else f"{out} = {expr}")
            return
        if op == "round":
            target = s.attr("dtype")
            if target == "bfloat16":
                self.helpers.add("_round_bf16")
                self.lines.append(f"{out} = _round_bf16({x}).to({self.compute})")
            else:
                self.lines.append(f"{out} = {x}.to({TRITON_DTYPES[target]}).to({self.compute})")
            return
        if op == "pow_int":
            self.pow_int(out, x, s.attr("n"))
            return
        if op == "pow_float":
            e = s.attr("e")
            self.lines.append(f"{out} = tl.exp({_const(e)} * tl.log({x}))")
            return
        if op == "exp_base":
            self.lines.append(f"{out} = tl.exp({x} * {_const(s.attr('log_base'))})")
            return
        raise ValueError(f"no Triton code for IR op {op!r}")

    def pow_int(self, out: str, x: str, n: int) -> None:
        """x ** n by square-and-multiply (NaN/Inf as PyTorch: 1 for n == 0)."""
        if n == 0:
            self.lines.append(f"{out} = tl.where({x} == {x}, 1.0, 1.0)")
            return
        k = abs(n)
        power, result, i = x, None, 0
        while True:
            if k & 1:
                if result is None:
                    result = power
                else:
                    self.lines.append(f"{out}_r{i} = {result} * {power}")
                    result = f"{out}_r{i}"
            k >>= 1
            if not k:
                break
            self.lines.append(f"{out}_p{i} = {power} * {power}")
            power = f"{out}_p{i}"
            i += 1
        self.lines.append(f"{out} = {result}" if n > 0 else f"{out} = 1.0 / {result}")


HELPERS = {
    "_gelu": """
@triton.jit
def _gelu(x):
    # x * Phi(x). Below 0, 1 + erf(x / sqrt(2)) cancels (5e-4 relative error near x = -3.7 in
    # float32): there Phi(x) = erfc(|x| / sqrt(2)) / 2, from exp(-z^2) times a Chebyshev fit of
    # fractional error under 1.2e-7 (Numerical Recipes' erfcc): about 1e-6 relative in float32.
    z = tl.abs(x) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * z)
    fit = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    low = 0.5 * x * (t * tl.exp(fit - z * z))
    return tl.where(x < 0, low, 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476)))
""",
    "_tanh": """
@triton.jit
def _tanh(z):
    # tanh from exp(-2|z|) (never overflows); an odd series near 0, where 1 - exp(-2|z|) cancels.
    az = tl.abs(z)
    e = tl.exp(-2.0 * az)
    t_big = (1.0 - e) / (1.0 + e)
    z2 = z * z
    t_small = az * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0 + z2 * (62.0 / 2835.0)))))
    t = tl.where(az < 0.3, t_small, t_big)
    return tl.where(z < 0, -t, t)
""",
    "_log1p": """
@triton.jit
def _log1p(x):
    # log(1 + x) accurate for small x: log(u) * x / (u - 1) with u = 1 + x rounded (Kahan).
    u = 1.0 + x
    d = u - 1.0
    d = tl.where(d == 0.0, 1.0, d)
    return tl.where(u == 1.0, x, tl.where(x > 1e30, tl.log(u), tl.log(u) * (x / d)))
""",
    "_expm1": """
@triton.jit
def _expm1(x):
    # exp(x) - 1 accurate for small x: (u - 1) * x / log(u) with u = exp(x) rounded (Kahan).
    u = tl.exp(x)
    lu = tl.log(u)
    lu = tl.where(lu == 0.0, 1.0, lu)
    r = tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * (x / lu))
    return tl.where(u == 1.0, x, tl.where(x > 50.0, u - 1.0, r))
""",
    "_round_bf16": """


@triton.jit
def _round_bf16(x):
    # x rounded to bfloat16 (nearest even) and back to float32, from the bits: exact everywhere,
    # the Triton interpreter included (its own conversion truncates).
    xf = x.to(tl.float32)
    bits = xf.to(tl.int32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(xf != xf, xf, rounded)
""",
    "_softplus": """
@triton.jit
def _softplus(x, beta, threshold):
    # log(1 + exp(beta * x)) / beta, and x itself above the threshold (as F.softplus).
    bx = x * beta
    return tl.where(bx > threshold, x, _log1p(tl.exp(bx)) / beta)
""",
}
HELPER_ORDER = ("_gelu", "_tanh", "_log1p", "_expm1", "_softplus", "_round_bf16")


def generate(task_source: str, analysis: TaskAnalysis, plan: PointwisePlan, params: dict[str, Any]) -> str:
    """The playbook's strategy protocol: the candidate source for ``plan``."""
    del task_source
    return generate_pointwise(analysis, plan, params)


def _check_params(params: dict[str, Any] | None) -> dict[str, int]:
    merged = {**DEFAULT_PARAMS, **(params or {})}
    unknown = set(merged) - set(DEFAULT_PARAMS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} (BLOCK_SIZE, num_warps)")
    block, warps = merged["BLOCK_SIZE"], merged["num_warps"]
    if not isinstance(block, int) or block < 16 or block > 65536 or block & (block - 1):
        raise ValueError(f"BLOCK_SIZE must be a power of two in [16, 65536], got {block!r}")
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be 1, 2, 4, 8, 16 or 32, got {warps!r}")
    return {"BLOCK_SIZE": block, "num_warps": warps}


def generate_pointwise(
    analysis: TaskAnalysis, plan: PointwisePlan, params: dict[str, Any] | None = None
) -> str:
    """A complete candidate source (``ModelNew`` + one ``fused_pointwise_kernel``) for ``plan``."""
    p = _check_params(params)
    emitter = _Emitter(plan)
    result = emitter.expression()
    helpers = emitter.helper_source()
    n = len(plan.operands)
    compute = emitter.compute

    # --- kernel ---
    ptrs = ", ".join(f"in{i}_ptr" for i in range(n))
    sizes = ", ".join(f"in{i}_n" for i in range(n))
    inners = ", ".join(f"in{i}_inner" for i in range(n))
    strides = "\n".join(f"    {', '.join(f'in{i}_s{d}' for d in range(MAX_RANK))}," for i in range(n))
    modes = ", ".join(f"MODE{i}: tl.constexpr" for i in range(n))
    dims = ", ".join(f"dim{d}" for d in range(1, MAX_RANK))
    body = [
        "pid = tl.program_id(0)",
        "if INDEX64:  # int32 offsets otherwise: their divisions are several times cheaper",
        "    pid = pid.to(tl.int64)",
        "offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
        "mask = offs < n_elements",
        "if HAS_GENERAL:  # coordinates in the coalesced output shape (outermost first)",
        "    rem = offs",
    ]
    for d in range(MAX_RANK - 1, 0, -1):
        body += [f"    c{d} = rem % dim{d}", f"    rem = rem // dim{d}"]
    body.append("    c0 = rem")
    for i, op in enumerate(plan.operands):
        general = " + ".join(f"c{d} * in{i}_s{d}" for d in range(MAX_RANK))
        body += [
            f"# operand {i}: {op.source} {op.name} ({op.dtype})",
            f"if MODE{i} == 0:  # FULL",
            f"    p{i} = in{i}_ptr + offs",
            f"elif MODE{i} == 1:  # SUFFIX",
            f"    p{i} = in{i}_ptr + offs % in{i}_n",
            f"elif MODE{i} == 2:  # PREFIX",
            f"    p{i} = in{i}_ptr + offs // in{i}_n",
            f"elif MODE{i} == 3:  # SCALAR",
            f"    p{i} = in{i}_ptr + offs * 0",
            f"elif MODE{i} == 5:  # MIDDLE",
            f"    p{i} = in{i}_ptr + (offs // in{i}_inner) % in{i}_n",
            "else:  # GENERAL",
            f"    p{i} = in{i}_ptr + ({general})",
        ]
        load = f"tl.load(p{i}, mask=mask, other=0)"
        body.append(f"v{i} = {load} != 0" if op.is_bool else f"v{i} = {load}.to({compute})")
    body.append(f"# the expression, in {plan.compute_dtype} registers")
    body += emitter.lines
    body.append(f"tl.store(out_ptr + offs, {result}.to(out_ptr.dtype.element_ty), mask=mask)")
    kernel_body = "\n".join(f"    {line}" if line else "" for line in body)

    # --- host ---
    args = [f"in{i}" for i in range(n)]
    launch_args = "\n".join(
        [*(f"        ops[{i}]," for i in range(n)), "        out,", "        n_elements,"]
        + [f"        sizes[{i}]," for i in range(n)]
        + [f"        inners[{i}]," for i in range(n)]
        + ["        *dims,"]
        + [f"        *strides[{i}]," for i in range(n)]
        + [f"        MODE{i}=modes[{i}]," for i in range(n)]
        + [
            "        HAS_GENERAL=GENERAL in modes,",
            f"        INDEX64=n_elements + {p['BLOCK_SIZE']} >= 2**31,",
            f"        BLOCK_SIZE={p['BLOCK_SIZE']},",
            f"        num_warps={p['num_warps']},",
        ]
    )
    ops_desc = ", ".join(dict.fromkeys(plan.ops)) or "a copy"
    operand_desc = ", ".join(f"{o.name} ({o.source}, {o.dtype})" for o in plan.operands)
    init_lines = _state_lines(analysis)
    forward_sig = ", ".join(["self", *(_forward_param(a) for a in plan.forward_args)])
    call_args = ", ".join(_operand_expr(o) for o in plan.operands)

    return f'''"""Fused pointwise candidate (kernelcrew playbook, strategy fused_pointwise).

Ops fused into one Triton kernel: {ops_desc}.
Operands: {operand_desc}. Output: {plan.out_dtype}, computed in {plan.compute_dtype}.
Each operand is loaded once with its own broadcast indexing, chosen at run time from its shape.
"""

import torch
import torch.nn as nn
import triton
import triton.language as tl

# Broadcast modes of an operand (the kernel's MODE constexprs).
FULL = 0  # the output's shape: read at the flat offset
SUFFIX = 1  # the output's trailing dims: offset % numel
PREFIX = 2  # the output's leading dims: offset // inner size
SCALAR = 3  # one element
GENERAL = 4  # any other broadcast: per-dimension strides, 0 where broadcast
MIDDLE = 5  # a run of the output's middle dims (a per-channel parameter): offset // inner % numel
MAX_RANK = {MAX_RANK}
{helpers}

@triton.jit
def fused_pointwise_kernel(
    # operands and output
    {ptrs},
    out_ptr,
    # sizes: elements of the output, per-operand size argument of SUFFIX/PREFIX/MIDDLE, and
    # per-operand elements of the output dims after a MIDDLE operand's
    n_elements,
    {sizes},
    {inners},
    # coalesced output dims 1..{MAX_RANK - 1} and per-operand element strides (GENERAL only)
    {dims},
{strides}
    # meta-parameters
    {modes},
    HAS_GENERAL: tl.constexpr,
    INDEX64: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
{kernel_body}


def _layout(shape, out_shape):
    """(mode, size argument, inner size, strides) of a contiguous operand of ``shape`` broadcast
    to ``out_shape``."""
    rank = len(out_shape)
    padded = [1] * (rank - len(shape)) + list(shape)
    numel = 1
    for s in shape:
        numel *= s
    out_numel = 1
    for s in out_shape:
        out_numel *= s
    if numel == out_numel:
        return FULL, 1, 1, None
    if numel == 1:
        return SCALAR, 1, 1, None
    kept = [i for i in range(rank) if padded[i] != 1]
    broadcast = [i for i in range(rank) if padded[i] == 1 and out_shape[i] != 1]
    if max(broadcast) < min(kept):
        return SUFFIX, numel, 1, None
    if min(broadcast) > max(kept):
        return PREFIX, out_numel // numel, 1, None
    if not [i for i in broadcast if min(kept) < i < max(kept)]:
        inner = 1
        for s in out_shape[max(kept) + 1 :]:
            inner *= s
        return MIDDLE, numel, inner, None
    strides = [0] * rank
    step = 1
    for i in range(rank - 1, -1, -1):
        strides[i] = step if padded[i] != 1 else 0
        step *= padded[i]
    return GENERAL, 1, 1, strides


def _coalesce(out_shape, strides):
    """Merge adjacent output dims that every GENERAL operand walks alike; pad to MAX_RANK."""
    dims = list(out_shape)
    keep = [i for i in range(len(dims)) if dims[i] != 1]
    dims = [dims[i] for i in keep]
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
    if len(dims) > MAX_RANK:
        raise ValueError(f"broadcast over {{len(dims)}} dims after coalescing; at most {{MAX_RANK}} are supported")
    pad = MAX_RANK - len(dims)
    return [1] * pad + dims, [[0] * pad + s for s in strides]


def fused_pointwise({", ".join(args)}):
    """{ops_desc} over NumPy-broadcast operands, in one kernel; returns a new {plan.out_dtype} tensor."""
    ops = [{", ".join(f"{a}.contiguous()" for a in args)}]
    device = ops[0].device
    for t in ops:
        if t.device != device:
            raise ValueError(f"all operands must be on one device, got {{t.device}} and {{device}}")
    out_shape = torch.broadcast_shapes(*[t.shape for t in ops])
    out = torch.empty(out_shape, dtype=torch.{plan.out_dtype}, device=device)
    n_elements = out.numel()
    if n_elements == 0:
        return out
    layouts = [_layout(tuple(t.shape), tuple(out_shape)) for t in ops]
    modes = [m for m, _, _, _ in layouts]
    sizes = [n for _, n, _, _ in layouts]
    inners = [i for _, _, i, _ in layouts]
    general = [s for _, _, _, s in layouts if s is not None]
    if general:
        all_dims, coalesced = _coalesce(tuple(out_shape), general)
    else:
        all_dims, coalesced = [1] * MAX_RANK, []
    dims = all_dims[1:]
    strides = []
    for m in modes:
        strides.append(coalesced.pop(0) if m == GENERAL else [0] * MAX_RANK)
    grid = lambda META: (triton.cdiv(n_elements, META["BLOCK_SIZE"]),)
    fused_pointwise_kernel[grid](
{launch_args}
    )
    return out


{CONTAINER_SOURCE}

class ModelNew(nn.Module):
    """The task's module as one fused pointwise kernel; same state dict names and shapes."""

    def __init__(self, *args, **kwargs):
        super().__init__(){init_lines}

    def forward({forward_sig}):
        return fused_pointwise({call_args})
'''


def _forward_param(arg: dict[str, Any]) -> str:
    if "default" in arg:
        return f"{arg['name']}={arg['default']!r}"
    return arg["name"]


def _operand_expr(op: Operand) -> str:
    if op.source == "input":
        return op.name
    getter = "get_parameter" if op.source == "parameter" else "get_buffer"
    return f"self.{getter}({op.name!r})"


def _state_lines(analysis: TaskAnalysis) -> str:
    lines = []
    for entry in analysis.state_dict:
        if entry.get("kind") == "extra_state":
            raise ValueError(f"state dict entry {entry['name']!r} is extra state, not a tensor")
        parent, _, leaf = entry["name"].rpartition(".")
        shape = tuple(entry["shape"])
        dtype = entry["dtype"]
        tensor = f"torch.zeros({shape!r}, dtype=torch.{dtype})"
        owner = f"_container(self, {parent!r})" if parent else "self"
        if entry["kind"] == "parameter":
            grad = "" if dtype in FLOAT_DTYPES or dtype.startswith("complex") else ", requires_grad=False"
            lines.append(f"\n        {owner}.register_parameter({leaf!r}, nn.Parameter({tensor}{grad}))")
        else:
            lines.append(f"\n        {owner}.register_buffer({leaf!r}, {tensor})")
    return "".join(lines)


__all__ = [
    "MAX_RANK",
    "SUPPORTED_OPS",
    "Operand",
    "PointwisePlan",
    "Step",
    "arch_class",
    "explain_pointwise",
    "generate",
    "generate_pointwise",
    "match",
    "match_pointwise",
    "tuning_space",
]
