"""A linear layer followed by ReLU or tanh-GELU, as one cuBLASLt call with the activation fused.

``relu(x @ W^T + b)`` and ``gelu(x @ W^T + b, approximate="tanh")`` run in eager as a GEMM that
writes its output and an activation kernel that reads it back and writes it again; with
``torch.compile``'s default mode the second kernel stays (Inductor keeps cuBLAS for the GEMM). cuBLASLt
can apply bias and activation in the GEMM's epilogue (``torch._addmm_activation``): the output is
written once. The candidate is a ``library`` candidate.

:func:`match` takes a forward that is exactly one input through a linear layer with a bias (an
``nn.Linear`` or ``F.linear`` of the module's own weight and bias), then ReLU or GELU with the tanh
approximation, and nothing after it. cuBLASLt's GELU epilogue is the tanh form; the exact (erf) GELU
is not offered. On a CPU, ``_addmm_activation`` computes the exact GELU, so the candidate runs the
unfused ops there: the fused path is taken only for CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.compiler import REFERENCE_NAME, checked_copy, reference_source

DTYPES = frozenset({"float16", "bfloat16", "float32"})


@dataclass(frozen=True)
class EpiloguePlan:
    """The input, the linear layer's weight and bias (state-dict names) and the activation."""

    input: str
    weight: str
    bias: str
    activation: str  # "relu" or "gelu_tanh"


class Unsupported(ValueError):
    pass


def _param(value: Any) -> str | None:
    return value.get("param") if isinstance(value, dict) else None


def _activation(node: dict[str, Any]) -> str:
    op = node.get("op")
    if op == "relu":
        return "relu"
    if op == "gelu":
        approximate = (node.get("kwargs") or {}).get("approximate", "none")
        if approximate == "tanh":
            return "gelu_tanh"
        raise Unsupported("the GELU is the exact (erf) one; cuBLASLt fuses only the tanh approximation")
    raise Unsupported(f"the linear layer is followed by {op!r}, not ReLU or tanh-GELU")


def _match(a: TaskAnalysis) -> EpiloguePlan:
    if not a.traced:
        raise Unsupported(f"the module could not be traced with torch.fx: {a.trace_error}")
    calls = a.call_nodes()
    outputs = a.outputs
    inputs = [n for n in a.nodes if n.get("op") == "input"]
    if len(calls) != 2 or len(outputs) != 1 or len(inputs) != 1:
        raise Unsupported("the forward is not one input through a linear layer and an activation")
    linear, act = calls
    if linear.get("op") != "linear" or outputs[0].get("ref") != act["name"]:
        raise Unsupported("the forward is not a linear layer followed by its activation")
    activation = _activation(act)
    args = linear.get("args") or []
    kwargs = linear.get("kwargs") or {}
    weight = _param(args[1] if len(args) > 1 else kwargs.get("weight"))
    bias = _param(args[2] if len(args) > 2 else kwargs.get("bias"))
    if not (weight and bias) or (args[0] or {}).get("ref") != inputs[0]["name"]:
        raise Unsupported("the linear layer needs the module's own weight and bias applied to the input")
    if act["args"][0].get("ref") != linear["name"] or len(a.users(linear["name"])) != 1:
        raise Unsupported("the linear layer's output is used elsewhere too")
    if linear.get("dtype") not in DTYPES:
        raise Unsupported(f"dtype {linear.get('dtype')} (cuBLASLt epilogues: fp16, bf16, fp32)")
    return EpiloguePlan(inputs[0]["name"], weight, bias, activation)


def match(analysis: TaskAnalysis) -> tuple[EpiloguePlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    try:
        plan = _match(analysis)
    except Unsupported as exc:
        return None, str(exc)
    except (LookupError, TypeError, ValueError) as exc:  # a graph of another shape than expected
        return None, f"not a linear layer and its activation ({type(exc).__name__}: {exc})"
    act = "ReLU" if plan.activation == "relu" else "tanh-GELU"
    return plan, (
        f"the forward is a linear layer with bias and {act}: cuBLASLt applies both in the GEMM's "
        "epilogue, so the output is written once instead of three times"
    )


def tuning_space(plan: EpiloguePlan, arch: str) -> list[dict[str, Any]]:
    """cuBLASLt chooses its own algorithm: nothing to tune by hand."""
    del plan, arch
    return [{}]


def generate(task_source: str, analysis: TaskAnalysis, plan: EpiloguePlan, params: dict[str, Any]) -> str:
    """The candidate: the reference's parameters, one fused cuBLASLt call on CUDA tensors."""
    del analysis
    if params:
        raise ValueError(f"the cuBLASLt epilogue takes no parameters, got {sorted(params)}")
    unfused = (
        "torch.relu(out)"
        if plan.activation == "relu"
        else 'torch.nn.functional.gelu(out, approximate="tanh")'
    )
    source = TEMPLATE.format(
        reference=reference_source(task_source),
        name=REFERENCE_NAME,
        x=plan.input,
        weight=plan.weight,
        bias=plan.bias,
        use_gelu=plan.activation == "gelu_tanh",
        unfused=unfused,
    )
    return checked_copy(source)


TEMPLATE = '''"""cuBLASLt epilogue (kernelcrew playbook): the linear layer's bias and activation applied inside
the GEMM (torch._addmm_activation) on CUDA tensors; the unfused ops elsewhere. Library candidate.
The reference is copied as {name}; ModelNew inherits its parameters.
"""

{reference}


class ModelNew({name}):
    """{name} with its linear layer and activation in one cuBLASLt call."""

    def forward(self, {x}):
        weight = self.get_parameter({weight!r})
        bias = self.get_parameter({bias!r})
        rows = {x}.reshape(-1, {x}.shape[-1])
        if rows.is_cuda:
            out = torch._addmm_activation(bias, rows, weight.t(), use_gelu={use_gelu})
        else:
            out = torch.nn.functional.linear(rows, weight, bias)
            out = {unfused}
        return out.reshape(*{x}.shape[:-1], weight.shape[0])
'''

__all__ = ["EpiloguePlan", "generate", "match", "tuning_space"]
