"""Pattern signatures: what a task computes, normalized so that the same kind of work shares one.

A signature is one line of three parts::

    ops=mul>add>tanh | dtypes=float32 | shape=2d rows=4096 x cols=4096 (>=L2)

* ``ops``: the forward's op sequence (from the FX analysis), each name canonical: lowercase,
  without ``torch.``/``F.``/``aten::`` prefixes, overload suffixes or the in-place ``_``, with
  aliases folded (``truediv`` -> ``div``, ``multiply`` -> ``mul``, ``expit`` -> ``sigmoid``), and
  layout-only ops that move no data (``view``, ``reshape``, ``contiguous``, ``identity``, ...)
  dropped. Longer than :data:`MAX_OPS` ops, the tail is counted (``...+12``).
* ``dtypes``: the tensors' dtypes, canonical (``torch.half`` -> ``float16``), sorted, unique.
* ``shape``: the *shape class* of the largest tensor, not its shape: its rank, its 2-D view
  (``cols`` = last dim, ``rows`` = everything else) with each side rounded to the nearest power
  of two, and the memory regime of all the tensors together: ``(launch)`` under
  :data:`LAUNCH_BYTES` (launch overhead dominates), ``(<L2)`` under :data:`L2_BYTES` (fits the L2
  of every data-centre GPU we target; A100 has 40 MB), ``(>=L2)`` above (HBM bandwidth bound).
  So 4000 x 4100 and 4096 x 4096 share a class; 64 x 64 and 4096 x 4096 do not.

:func:`pattern_kind` sorts an op sequence into ``attention``, ``matmul``, ``conv``, ``reduction``,
``pointwise`` or ``other`` (the first that applies), which the seeds' applicability and retrieval
use. Nothing here imports torch or the agents: the input is plain JSON.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_OPS = 48
LAUNCH_BYTES = 256 * 1024
L2_BYTES = 32 * 1024 * 1024
PATTERN_KINDS = ("attention", "matmul", "conv", "reduction", "pointwise", "other")

OP_ALIASES = {
    "truediv": "div",
    "true_divide": "div",
    "divide": "div",
    "floordiv": "floor_divide",
    "multiply": "mul",
    "subtract": "sub",
    "negative": "neg",
    "absolute": "abs",
    "clip": "clamp",
    "expit": "sigmoid",
    "special_expit": "sigmoid",
    "log_sigmoid": "logsigmoid",
    "swish": "silu",
    "matrix_multiply": "matmul",
    "arctan": "atan",
    "dropout1d": "dropout",
    "dropout2d": "dropout",
    "dropout3d": "dropout",
    "native_layer_norm": "layer_norm",
    "convolution": "conv",
    "_scaled_dot_product_attention": "scaled_dot_product_attention",
    "sdpa": "scaled_dot_product_attention",
}
#: Ops that move no data (or are the identity in eval mode): not part of a pattern.
LAYOUT_OPS = frozenset(
    {
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "contiguous",
        "clone",
        "detach",
        "identity",
        "alias",
        "dropout",
        "size",
        "dim",
        "getitem",
    }
)
DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "f32": "float32",
    "half": "float16",
    "fp16": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "double": "float64",
    "fp64": "float64",
    "f64": "float64",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "byte": "uint8",
    "bool_": "bool",
}
DTYPE_BYTES = {
    "float64": 8,
    "int64": 8,
    "float32": 4,
    "int32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_ATTENTION = frozenset({"scaled_dot_product_attention", "multi_head_attention_forward", "flash_attention"})
_MATMUL = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "einsum", "bilinear"})
_REDUCTION = frozenset(
    {
        *("softmax", "log_softmax", "layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"),
        *("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std", "var_mean"),
        *("norm", "normalize", "logsumexp", "cross_entropy", "nll_loss", "cumsum", "cumprod", "prod"),
        *("mse_loss", "l1_loss", "kl_div", "smooth_l1_loss", "all", "any"),
    }
)
_POINTWISE = frozenset(
    {
        *("add", "sub", "rsub", "mul", "div", "pow", "neg", "abs", "exp", "exp2", "log", "log2", "log10"),
        *("log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tan", "atan", "erf", "floor", "ceil", "round"),
        *("sigmoid", "tanh", "relu", "relu6", "leaky_relu", "gelu", "silu", "mish", "softplus", "elu"),
        *("celu", "selu", "hardtanh", "hardsigmoid", "hardswish", "logsigmoid", "softsign", "tanhshrink"),
        *("threshold", "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "where", "lerp"),
        *("addcmul", "addcdiv", "square", "reciprocal", "sign", "to", "gt", "ge", "lt", "le", "eq", "ne"),
        *("logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not"),
        *("floor_divide", "remainder", "fmod", "positive", "masked_fill", "bool_to_float", "type_as"),
    }
)


def canonical_op(name: str) -> str:
    """``torch.nn.functional.relu_`` -> ``relu``; ``aten::mul.Tensor`` -> ``mul``; ``operator.truediv`` -> ``div``."""
    text = str(name).strip().lower()
    prefixes = (
        "torch.nn.functional.",
        "torch.special.",
        "torch.",
        "aten::",
        "aten.",
        "_operator.",
        "operator.",
    )
    for prefix in (*prefixes, "f.", "tensor."):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    text = text.split(".", 1)[0]  # aten overloads: mul.Tensor, add.Scalar
    if text in OP_ALIASES:
        return OP_ALIASES[text]
    if text.endswith("_") and not text.endswith("__") and len(text) > 1:
        text = text[:-1]
    text = text.strip("_") or text
    return OP_ALIASES.get(text, text)


def canonical_ops(op_sequence: Iterable[str]) -> list[str]:
    """The canonical op names, layout-only ops dropped, in order."""
    ops = [canonical_op(op) for op in op_sequence]
    return [op for op in ops if op and op not in LAYOUT_OPS]


def canonical_dtype(name: str) -> str:
    """``torch.float32`` / ``float`` / ``fp32`` -> ``float32``."""
    text = str(name).strip().lower().replace("torch.", "")
    return DTYPE_ALIASES.get(text, text)


def pattern_kind(op_sequence: Iterable[str]) -> str:
    """The kind of work: attention, matmul, conv, reduction, pointwise or other (first that applies)."""
    ops = canonical_ops(op_sequence)
    if not ops:
        return "other"
    found = set(ops)
    if found & _ATTENTION or ("softmax" in found and sum(op in _MATMUL for op in ops) >= 2):
        return "attention"
    if found & _MATMUL:
        return "matmul"
    if any(op.startswith(("conv", "conv_transpose")) for op in found):
        return "conv"
    if found & _REDUCTION:
        return "reduction"
    if found <= _POINTWISE:
        return "pointwise"
    return "other"


def _pow2(n: int) -> int:
    """``n`` rounded to the nearest power of two on a log scale (0 stays 0)."""
    if n <= 0:
        return 0
    return 1 << round(math.log2(n))


def shape_class(shapes: Sequence[Sequence[int]], dtypes: Sequence[str] = ()) -> str:
    """``2d rows=4096 x cols=4096 (>=L2)``: rank, power-of-two 2-D view, memory regime (module doc)."""
    clean = [[int(d) for d in s] for s in shapes if s is not None]
    if not clean:
        return "unknown"
    itemsize = max((DTYPE_BYTES.get(canonical_dtype(d), 4) for d in dtypes), default=4)
    sizes = [math.prod(s) for s in clean]
    largest = clean[max(range(len(clean)), key=lambda i: sizes[i])]
    numel = math.prod(largest)
    cols = largest[-1] if largest else 1
    rows = numel // cols if cols else 0
    total = sum(sizes) * itemsize
    if total < LAUNCH_BYTES:
        regime = "launch"
    elif total < L2_BYTES:
        regime = "<L2"
    else:
        regime = ">=L2"
    if len(largest) == 0:
        return f"0d ({regime})"
    return f"{len(largest)}d rows={_pow2(rows)} x cols={_pow2(cols)} ({regime})"


def signature(op_sequence: Iterable[str], dtypes: Iterable[str], shapes: Sequence[Sequence[int]]) -> str:
    """The normalized pattern signature of a task (format in the module docstring)."""
    ops = canonical_ops(op_sequence)
    shown = ">".join(ops[:MAX_OPS]) + (f">...+{len(ops) - MAX_OPS}" if len(ops) > MAX_OPS else "")
    kinds = sorted({canonical_dtype(d) for d in dtypes if d})
    return f"ops={shown or '?'} | dtypes={','.join(kinds) or '?'} | shape={shape_class(shapes, kinds)}"


def signature_key(text: str) -> str:
    """The deduplication key of a signature (sha256, hex)."""
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class TaskSignature:
    """A task's signature with what retrieval needs besides the text."""

    text: str
    kind: str
    ops: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return signature_key(self.text)


def from_analysis(analysis: Mapping[str, Any]) -> TaskSignature:
    """The signature of a task from the playbook's analysis record (``TaskAnalysis.to_dict()``).

    Dtypes and shapes come from the tensor inputs and the outputs; an analysis without a traced
    graph gives ``ops=?`` and kind ``other``.
    """
    ops = list(analysis.get("op_sequence") or [])
    tensors = [t for t in analysis.get("inputs") or [] if t.get("kind", "tensor") == "tensor"]
    tensors += list(analysis.get("outputs") or [])
    shapes = [t["shape"] for t in tensors if t.get("shape") is not None]
    dtypes = [t["dtype"] for t in tensors if t.get("dtype")]
    return TaskSignature(signature(ops, dtypes, shapes), pattern_kind(ops), tuple(canonical_ops(ops)))


_OPS_PART = re.compile(r"ops=([^|]*)")


def from_text(text: str) -> TaskSignature:
    """A :class:`TaskSignature` from a signature line (or any text: its kind is then guessed)."""
    found = _OPS_PART.search(text)
    ops = [op for op in found.group(1).strip().split(">") if op and op != "?"] if found else []
    ops = [op for op in ops if not op.startswith("...")]
    return TaskSignature(text.strip(), pattern_kind(ops), tuple(ops))


__all__ = [
    "PATTERN_KINDS",
    "TaskSignature",
    "canonical_dtype",
    "canonical_op",
    "canonical_ops",
    "from_analysis",
    "from_text",
    "pattern_kind",
    "shape_class",
    "signature",
    "signature_key",
]
