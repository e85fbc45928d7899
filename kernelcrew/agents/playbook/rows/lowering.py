"""Traced graph -> row IR: library ops (softmax, norms, cross_entropy, ...) and hand-written spellings."""

from __future__ import annotations

import math
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.pointwise import (
    FLOAT_DTYPES,
    INT_DTYPES,
    SUPPORTED_OPS,
    Operand,
    Step,
    Unsupported,
    _key,
    _Lowering,
    node_origin,
)
from kernelcrew.agents.playbook.rows.ir import REDUCTIONS

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
            raise Unsupported(f"op {op!r} ({node_origin(node)}) is neither pointwise nor a row reduction")
        super().visit(node)

    def bind_row(self, node: dict[str, Any], op: str) -> dict[str, Any]:
        args = list(node["args"])
        if op in ("softmax", "log_softmax") and len(args) == 3 and isinstance(args[2], dict):
            # torch.softmax(x, dim, dtype): no _stacklevel
            node = {**node, "args": args[:2], "kwargs": {**node["kwargs"], "dtype": args[2]}}
        bound = self.bind(node, op, SIGNATURES)
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
