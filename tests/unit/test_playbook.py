"""The offline playbook: task analysis, the fused pointwise kernel generator, torch.compile candidates, menu."""

from __future__ import annotations

import importlib.util
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernelcrew.agents import playbook
from kernelcrew.agents.playbook import STRATEGIES, applicable, generate
from kernelcrew.agents.playbook.analysis import analyze
from kernelcrew.agents.playbook.compiler import generate_compiled, reference_source
from kernelcrew.agents.playbook.pointwise import (
    explain_pointwise,
    generate_pointwise,
    match_pointwise,
    tuning_space,
)
from kernelcrew.config import Settings
from kernelcrew.task import TaskError, import_source, load_task
from kernelcrew.tools.anticheat import static_check
from kernelcrew.tools.correctness import verify
from tests.conftest import FIXTURES, local_analysis

ROOT = Path(__file__).resolve().parents[2]
TASKS = {
    "pointwise": FIXTURES / "tasks" / "pointwise.py",
    "softmax": FIXTURES / "tasks" / "softmax.py",
    "linear_relu": FIXTURES / "tasks" / "linear_relu.py",
    "elementwise_chain": ROOT / "examples" / "elementwise_chain.py",
}
SETTINGS = Settings(sandbox_timeout_s=240)

CONTROL_FLOW = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def get_inputs():
    return [torch.randn(4, 5)]


def get_init_inputs():
    return []
"""

#: Broadcasting (a (C,) bias, an (N, 1) column, a 0-d buffer, a column of a 3-D input: GENERAL
#: indexing), fp16 next to fp32 inputs, a scale from get_init_inputs, odd test shapes.
BROADCAST = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels: int, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(channels))
        self.register_buffer("offset", torch.tensor(0.25))
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x, col, y16):
        z = self.act(x * self.scale + self.bias) - col.sigmoid()
        z = torch.where(z > 0, z, 0.1 * z) + y16 * 0.5
        return torch.clamp(z, min=-2.0) / (1 + x.abs()) + self.offset


def get_inputs():
    return [torch.randn(8, 24), torch.randn(8, 1), torch.randn(8, 24).half()]


def get_init_inputs():
    return [24, 1.5]


def get_test_inputs():
    return [
        [torch.randn(37, 24), torch.randn(37, 1), torch.randn(37, 24).half()],
        [torch.randn(3, 5, 24), torch.randn(5, 1), torch.randn(3, 5, 24).half()],
        [torch.randn(1, 24), torch.randn(1, 1), torch.randn(24).half()],
    ]
"""


@pytest.fixture(scope="module")
def analyses():
    """analyze() (sandboxed children, run side by side) on the fixture tasks and a control-flow task."""
    sources = {name: path.read_text() for name, path in TASKS.items()}
    sources["control_flow"] = CONTROL_FLOW
    with ThreadPoolExecutor(max_workers=len(sources)) as pool:
        futures = {
            name: pool.submit(analyze, src, f"{name}.py", 0, SETTINGS) for name, src in sources.items()
        }
        return {name: f.result() for name, f in futures.items()}


# ----------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------


def test_op_sequences(analyses):
    assert analyses["pointwise"].op_sequence == ["mul", "add", "tanh"]
    assert analyses["softmax"].op_sequence == ["softmax"]
    assert analyses["linear_relu"].op_sequence == ["linear", "relu"]
    assert analyses["elementwise_chain"].op_sequence == ["mul", "add", "gelu", "sigmoid", "mul"]


def test_analysis_describes_inputs_weights_and_nodes(analyses):
    chain = analyses["elementwise_chain"]
    assert chain.traced and chain.trace_error == ""
    assert chain.inputs == [
        {
            "index": 0,
            "name": "x",
            "kind": "tensor",
            "shape": [4096, 4096],
            "dtype": "float32",
            "nonnegative": False,
        }
    ]
    assert chain.parameters == [{"name": "bias", "shape": [4096], "dtype": "float32"}]
    assert chain.state_dict == [{"name": "bias", "shape": [4096], "dtype": "float32", "kind": "parameter"}]
    mul = chain.node("mul")
    assert mul["args"] == [{"ref": "x"}, 1.5]  # the scale from get_init_inputs, as a constant
    assert mul["shape"] == [4096, 4096] and mul["dtype"] == "float32"
    assert chain.node("bias")["op"] == "parameter"
    assert chain.outputs == [{"ref": "mul_1", "shape": [4096, 4096], "dtype": "float32", "type": "Tensor"}]
    assert chain.users("x") == ["mul", "sigmoid"]

    linear = analyses["linear_relu"]
    node = linear.node("linear")
    assert node["kind"] == "call_module" and node["module_type"].endswith("Linear")
    assert node["kwargs"] == {"weight": {"param": "linear.weight"}, "bias": {"param": "linear.bias"}}
    assert [e["name"] for e in linear.state_dict] == ["linear.weight", "linear.bias"]
    assert analyses["softmax"].node("softmax")["kwargs"] == {"dim": -1}


def test_untraceable_forward_is_reported(analyses):
    flow = analyses["control_flow"]
    assert not flow.traced
    assert "control flow" in flow.trace_error
    assert flow.op_sequence == [] and flow.nodes == []
    assert flow.outputs == [{"ref": None, "shape": [4, 5], "dtype": "float32"}]
    assert flow.inputs[0]["shape"] == [4, 5]
    assert match_pointwise(flow) is None
    assert "could not be traced" in explain_pointwise(flow)
    # torch.compile still applies: it falls back to graph breaks where fx cannot trace.
    assert [s.name for s, _ in applicable(flow)] == [
        "cuda_graphs",
        "torch_compile",
        "torch_compile_max_autotune",
    ]


def test_shape_arithmetic_is_traced_at_the_examples_shapes_only():
    """torch.ones(seq, seq) and math.sqrt(q.shape[-1]) defeat the symbolic tracer; the MetaTracer
    follows them with the example's sizes as constants. Kernels generated from that graph would be
    for those sizes only, so only the strategy that re-traces per input signature takes it."""
    causal = local_analysis((FIXTURES / "tasks" / "attention_causal.py").read_text())
    assert not causal.traced and causal.traced_at_shapes
    assert "ones()" in causal.trace_error
    assert causal.op_sequence[-4:] == ["bitwise_not", "masked_fill", "softmax", "matmul"]
    assert [s.name for s, _ in applicable(causal)] == [
        "sdpa_attention",
        "cuda_graphs",
        "torch_compile",
        "torch_compile_max_autotune",
    ]
    assert "could not be traced" in explain_pointwise(causal)


def test_analyze_raises_task_error_with_the_childs_message():
    broken = CONTROL_FLOW.replace(
        "def get_inputs():\n    return [torch.randn(4, 5)]", "def get_inputs():\n    return 3"
    )
    with pytest.raises(TaskError, match="get_inputs\\(\\) must return a list"):
        analyze(broken, "broken.py", settings=SETTINGS)


def test_call_forms_normalize_alike():
    source = textwrap.dedent(
        """
        import operator
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.act = nn.GELU()
                self.sig = nn.Sigmoid()
                self.drop = nn.Dropout(0.3)
                self.ident = nn.Identity()

            def forward(self, x, y):
                a = torch.add(x, y) + x.add(y)
                b = F.gelu(a) * self.act(a)
                c = torch.sigmoid(b).mul(2) - self.sig(b) - b.sigmoid()
                d = torch.max(c, x) + self.drop(c) + self.ident(c)
                return d.float() + x.relu_()


        def get_inputs():
            return [torch.rand(3, 4), torch.randn(3, 4)]


        def get_init_inputs():
            return []
        """
    )
    a = local_analysis(source)
    assert a.op_sequence == [
        *("add", "add", "add", "gelu", "gelu", "mul", "sigmoid", "mul", "sigmoid", "sub", "sigmoid"),
        *("sub", "maximum", "dropout", "add", "identity", "add", "to", "relu", "add"),
    ]
    assert a.inputs[0]["nonnegative"] and not a.inputs[1]["nonnegative"]
    assert a.node("drop")["kwargs"]["training"] is False  # traced in eval(), as the verifier runs it
    assert a.node("relu_")["inplace"] is True
    assert a.node("float_1")["kwargs"] == {"dtype": {"dtype": "float32"}}


# ----------------------------------------------------------------------------------------------
# Pointwise matching
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pointwise", "relu", "dropout"])
def test_match_accepts_fixture_tasks(name):
    a = local_analysis((FIXTURES / "tasks" / f"{name}.py").read_text())
    plan = match_pointwise(a)
    assert plan is not None, explain_pointwise(a)
    assert plan.out_dtype == "float32"


def test_match_accepts_elementwise_chain(analyses):
    plan = match_pointwise(analyses["elementwise_chain"])
    assert plan is not None
    assert [(o.name, o.source) for o in plan.operands] == [("x", "input"), ("bias", "parameter")]
    assert ("c", 1.5) in plan.steps[0].args


def test_dropout_in_eval_is_the_identity():
    plan = match_pointwise(local_analysis((FIXTURES / "tasks" / "dropout.py").read_text()))
    assert [s.op for s in plan.steps] == ["mul"]
    assert plan.steps[0].args == (("in", 0), ("c", 2.0))


@pytest.mark.parametrize(("name", "reason"), [("softmax", "'softmax'"), ("linear_relu", "'linear' (Linear")])
def test_match_rejects_with_a_reason(analyses, name, reason):
    assert match_pointwise(analyses[name]) is None
    assert reason in explain_pointwise(analyses[name])
    assert "not pointwise" in explain_pointwise(analyses[name])


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        ("return F.dropout(x, 0.5)", "training mode is random"),
        ("return x.sum(dim=-1)", "'sum'"),
        ("return x.view(-1) * 2", "'view'"),
        ("return x * x.size(1)", "'size'"),
        ("return x, x * 2", "one tensor"),
        ("return x > 0", "dtype is bool"),
        ("return torch.pow(x, x)", "tensor exponent"),
        ("return torch.div(x, 2, rounding_mode='floor')", "rounding_mode"),
        ("return (x * 2).long() + 1", "int64"),
    ],
)
def test_match_rejects_non_pointwise_forwards(forward, reason):
    a = local_analysis(task_source(forward))
    assert match_pointwise(a) is None
    assert reason in explain_pointwise(a)


# ----------------------------------------------------------------------------------------------
# Generated kernels: many ops, run in this process under the Triton interpreter
# ----------------------------------------------------------------------------------------------


def task_source(forward: str, inputs: str = "torch.randn(5, 7), torch.randn(5, 7)", init: str = "") -> str:
    return textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                {init}

            def forward(self, x, y=None):
                {forward}


        def get_inputs():
            return [{inputs}]


        def get_init_inputs():
            return []
        """
    ).format(forward=forward, inputs=inputs, init=init or "pass")


ZOO = {
    "arith": "return torch.add(x, y, alpha=2) - torch.sub(x, y, alpha=0.5) + torch.rsub(x, 1.0) + (1 - x) / (2 + y.abs())",
    "math": "return torch.exp(x) - torch.log(y.abs() + 1) + torch.sqrt(y.abs()) * torch.rsqrt(y.abs() + 1) + torch.exp2(x) + torch.log2(x.abs() + 1) + torch.log10(x.abs() + 1)",
    "special": "return torch.log1p(x.abs()) + torch.expm1(x) + x.sin() + x.cos() + torch.erf(x) + x.floor() + x.ceil() + x.sign() + x.tanh() + torch.sigmoid(y)",
    "activations": "return F.leaky_relu(x, 0.2) + F.softplus(x) + F.silu(x) + F.elu(x) + F.selu(x) + F.celu(x, 0.5) + F.gelu(y) + F.gelu(y, approximate='tanh') + F.relu(y)",
    "hard": "return F.hardtanh(x, -0.5, 0.5) + F.relu6(x * 4) + F.hardsigmoid(x * 4) + F.hardswish(x * 4) + F.mish(x) + F.logsigmoid(x) + F.softsign(x) + F.tanhshrink(x) + F.threshold(x, 0.1, 20.0)",
    "powers": "return x.pow(3) + x ** 2 - torch.pow(x.abs(), 1.7) + 2 ** x + torch.square(x) + torch.reciprocal(x.abs() + 1) + x ** -2 + x.abs() ** 0.5 + x ** 0",
    "minmax": "return torch.maximum(x, y) - torch.minimum(x, y) + torch.max(x, y) + torch.where(x > y, x, y) + x.where(x < 0, y)",
    "clamps": "return torch.clamp(x, -1, 1) + x.clamp_min(0) + x.clamp_max(0.5) + torch.clamp(x, min=y) + x.clip(max=0.2)",
    "masks": "return torch.where((x > 0) & (y < 0), x, y) + torch.where(~(x > 1), 1.0, 0.0) + (x >= y).float() * x + torch.logical_or(x < 0, y == 0) * 3.0",
    "casts": "return (x.half() * 2).float() + x.to(torch.bfloat16).float() + x.type_as(y) + x.double().float()",
    "blends": "return torch.lerp(x, y, 0.3) + torch.addcmul(x, x, y, value=0.5) + torch.addcdiv(x, x, y.abs() + 1)",
    "inplace": "z = x * 2\n        z.relu_()\n        return z + 1",
}

MODULE_ZOO = (
    "self.a = nn.ReLU(inplace=True); self.b = nn.Tanh(); self.c = nn.Sigmoid(); self.d = nn.SiLU(); "
    "self.e = nn.Dropout(0.3); self.f = nn.Identity(); self.g = nn.Hardtanh(-2.0, 2.0); "
    "self.h = nn.LeakyReLU(0.3); self.i = nn.Softplus(beta=2.0, threshold=10.0); self.j = nn.ELU(0.7); "
    "self.k = nn.Threshold(0.1, 20.0); self.l = nn.ReLU6(); self.m = nn.Mish()"
)
MODULE_FORWARD = (
    "return self.b(x) + self.c(x) + self.d(x) + self.e(x) + self.f(x) + self.g(x * 3) + self.h(x) "
    "+ self.i(x) + self.j(x) + self.k(x) + self.l(x * 4) + self.m(x) + self.a(x * 1)"
)


def run_candidate(source: str, candidate: str, input_sets, monkeypatch):
    """Reference (float64) and candidate outputs on each input set, in this process."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    task = load_task(source, "zoo_task.py")
    ref = task.model_cls().eval()
    new_cls = import_source(candidate, f"zoo_{uuid.uuid4().hex[:8]}", "zoo_candidate.py").ModelNew
    new = new_cls()
    new.load_state_dict(ref.state_dict(), strict=True)
    pairs = []
    ref64 = task.model_cls().eval().double()
    ref64.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for inputs in input_sets:
            native = ref(*inputs)
            golden = ref64(*[t.double() if t.is_floating_point() else t for t in inputs])
            out = new(*inputs)
            assert out.dtype == native.dtype and out.shape == native.shape
            pairs.append((out, golden))
    return pairs


def assert_close(out, golden, rtol=1e-4):
    import torch

    g = golden.double()
    o = out.double()
    finite = torch.isfinite(g)
    assert torch.equal(torch.isnan(o), torch.isnan(g)), "NaN where the reference has none (or the reverse)"
    rms = float(g[finite].pow(2).mean().sqrt()) if finite.any() else 1.0
    err = (o[finite] - g[finite]).abs()
    limit = rtol * g[finite].abs() + rtol * rms
    assert bool((err <= limit).all()), f"max error {float(err.max()):.3g}"


@pytest.mark.parametrize("case", sorted(ZOO))
def test_generated_kernel_matches_reference(case, monkeypatch):
    import torch

    source = task_source(ZOO[case])
    a = local_analysis(source)
    plan = match_pointwise(a)
    assert plan is not None, explain_pointwise(a)
    candidate = generate_pointwise(a, plan, {"BLOCK_SIZE": 64, "num_warps": 1})
    assert static_check(candidate) == []
    torch.manual_seed(1)
    sets = [
        [torch.randn(5, 7), torch.randn(5, 7)],
        [torch.randn(3, 1, 7), torch.randn(4, 1)],  # broadcast both ways: GENERAL indexing
        [torch.randn(130), torch.randn(())],  # several programs; a 0-d operand
    ]
    for out, golden in run_candidate(source, candidate, sets, monkeypatch):
        assert_close(out, golden)


@pytest.mark.parametrize(("dtype", "rtol"), [("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_generated_kernel_in_half_precision(dtype, rtol, monkeypatch):
    import torch

    source = task_source(
        "return F.silu(x) * y + x.float().half().to(x.dtype)",
        inputs=f"torch.randn(5, 7).to(torch.{dtype}), torch.randn(7).to(torch.{dtype})",
    )
    a = local_analysis(source)
    plan = match_pointwise(a)
    assert plan is not None, explain_pointwise(a)
    assert plan.out_dtype == dtype
    candidate = generate_pointwise(a, plan, {"BLOCK_SIZE": 16})
    torch.manual_seed(4)
    half = getattr(torch, dtype)
    sets = [
        [torch.randn(9, 7).to(half), torch.randn(7).to(half)],
        [torch.randn(3, 1).to(half), torch.randn(7).to(half)],
    ]
    for out, golden in run_candidate(source, candidate, sets, monkeypatch):
        assert_close(out, golden, rtol=rtol)


def test_exact_gelu_keeps_its_relative_accuracy_below_zero(monkeypatch):
    # 1 + erf(x / sqrt 2) cancels below 0: near x = -3.7 it cost 5e-4 relative error in float32,
    # outside the strict tolerance where the outputs are small (KernelBench's ConvTranspose2d_Add_
    # Min_GELU_Multiply on an H100). The tail is computed from erfc instead.
    import torch

    source = task_source("return F.gelu(x) * 2.0", inputs="torch.randn(64)")
    a = local_analysis(source)
    plan = match_pointwise(a)
    assert plan is not None, explain_pointwise(a)
    candidate = generate_pointwise(a, plan, {"BLOCK_SIZE": 256})
    x = torch.linspace(-6.0, 3.0, 2001)  # float64 gelu cancels too, further out
    [(out, golden)] = run_candidate(source, candidate, [[x]], monkeypatch)
    rel = ((out.double() - golden) / golden.abs().clamp_min(1e-300)).abs()
    assert float(rel[golden != 0].max()) < 2e-5


def test_generated_kernel_for_nn_modules(monkeypatch):
    import torch

    source = task_source(MODULE_FORWARD, inputs="torch.randn(6, 9)", init=MODULE_ZOO)
    a = local_analysis(source)
    plan = match_pointwise(a)
    assert plan is not None, explain_pointwise(a)
    candidate = generate_pointwise(a, plan, {})
    assert static_check(candidate) == []
    torch.manual_seed(2)
    for out, golden in run_candidate(source, candidate, [[torch.randn(6, 9) * 3]], monkeypatch):
        assert_close(out, golden)


def test_generated_kernel_dtypes_weights_and_nan(monkeypatch):
    """fp64 compute, bool and integer operands, nested weight names, NaN propagation."""
    import torch

    init = (
        "self.inner = nn.Module(); self.inner.scale = nn.Parameter(torch.randn(7)); "
        "self.register_buffer('steps', torch.arange(7)); self.register_buffer('unused', torch.ones(2, 2))"
    )
    forward = "return torch.where(y, x * self.inner.scale, self.steps * 0.5).relu() + torch.log(x)"
    source = task_source(forward, inputs="torch.rand(4, 7).double(), torch.rand(4, 7) > 0.5", init=init)
    a = local_analysis(source)
    plan = match_pointwise(a)
    assert plan is not None, explain_pointwise(a)
    assert plan.compute_dtype == "float64" and plan.out_dtype == "float64"
    assert {e["name"] for e in a.state_dict} == {"inner.scale", "steps", "unused"}
    candidate = generate_pointwise(a, plan, {"BLOCK_SIZE": 32})
    assert static_check(candidate) == []
    torch.manual_seed(3)
    x = torch.randn(4, 7).double()  # negative values: log gives NaN, and relu must keep it
    mask = torch.rand(4, 7) > 0.5
    for out, golden in run_candidate(source, candidate, [[x, mask], [x[:1], mask]], monkeypatch):
        assert_close(out, golden)


def test_kernel_is_not_specialized_to_the_example_shape(analyses):
    candidate = generate_pointwise(
        analyses["elementwise_chain"], match_pointwise(analyses["elementwise_chain"])
    )
    assert "4096" not in candidate.split("class ModelNew")[0]  # the kernel and host code
    assert "n_elements" in candidate and "torch.broadcast_shapes" in candidate
    assert "def __init__(self, *args, **kwargs):" in candidate
    assert "register_parameter('bias', nn.Parameter(torch.zeros((4096,), dtype=torch.float32)))" in candidate


def test_generate_rejects_bad_params(analyses):
    plan = match_pointwise(analyses["pointwise"])
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        generate_pointwise(analyses["pointwise"], plan, {"BLOCK_SIZE": 1000})
    with pytest.raises(ValueError, match="num_warps"):
        generate_pointwise(analyses["pointwise"], plan, {"num_warps": 3})
    with pytest.raises(ValueError, match="unknown parameter"):
        generate_pointwise(analyses["pointwise"], plan, {"BLOCK": 64})


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90", "sm_90a", "sm_100", "sm_120", "cuda", "cpu"])
def test_tuning_space_per_arch(analyses, arch):
    plan = match_pointwise(analyses["pointwise"])
    configs = tuning_space(plan, arch)
    assert configs
    for config in configs:
        assert set(config) == {"BLOCK_SIZE", "num_warps"}
        generate_pointwise(analyses["pointwise"], plan, config)  # every config is valid
    if arch == "cpu":
        assert len(configs) == 1
    else:
        assert len(configs) >= 3
    with pytest.raises(ValueError, match="unknown architecture"):
        tuning_space(plan, "tpu")


# ----------------------------------------------------------------------------------------------
# Real verification (sandboxed children, Triton interpreter): a few, each takes about 10 s
# ----------------------------------------------------------------------------------------------


def test_fused_pointwise_passes_verify(analyses):
    task = TASKS["pointwise"].read_text()
    candidate = generate("fused_pointwise", task, analyses["pointwise"], {"BLOCK_SIZE": 256})
    assert static_check(candidate) == []
    verdict = verify(task, candidate, device="cpu", settings=SETTINGS)
    assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
    assert verdict.kind == "kernel"


def test_fused_pointwise_with_broadcasting_and_mixed_dtypes_passes_verify():
    a = analyze(BROADCAST, "broadcast.py", settings=SETTINGS)
    plan = match_pointwise(a)
    assert plan is not None, explain_pointwise(a)
    assert [(o.name, o.dtype) for o in plan.operands] == [
        ("x", "float32"),
        ("col", "float32"),
        ("y16", "float16"),
        ("bias", "float32"),
        ("offset", "float32"),
    ]
    assert plan.out_dtype == "float32"
    candidate = generate("fused_pointwise", BROADCAST, a)
    assert static_check(candidate) == []
    verdict = verify(BROADCAST, candidate, device="cpu", settings=SETTINGS)
    assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
    assert verdict.kind == "kernel"
    assert "verified at one shape" not in verdict.flags


def test_torch_compile_candidate_passes_verify():
    task = TASKS["pointwise"].read_text()
    candidate = generate_compiled(task, "default")
    assert static_check(candidate) == []
    verdict = verify(task, candidate, device="cpu", settings=SETTINGS)
    assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
    assert verdict.kind == "compiler"


INPLACE_AFTER_RELU = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.shortcut = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            out = F.relu(self.conv(x))
            out += self.shortcut(x)  # in place on what relu's backward needs: fine in a forward
            return out


    def get_inputs():
        return [torch.randn(2, 3, 8, 8)]


    def get_init_inputs():
        return []
    """
)


def test_a_compile_that_fails_only_under_autograd_passes_with_a_note():
    """ShuffleNet's residual ``out += shortcut(x)`` after a ReLU: torch.compile under autograd
    refuses the in-place update of a value its backward needs, while eager runs the forward. The
    verifier's grad-mode call of a candidate is a check of what a user may do, not of what the
    task asks: the compiler's candidate passes, and the verdict notes the grad mode."""
    candidate = generate_compiled(INPLACE_AFTER_RELU, "default")
    verdict = verify(INPLACE_AFTER_RELU, candidate, device="cpu", settings=SETTINGS)
    assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
    notes = " ".join(verdict.flags)
    assert "does not run in grad mode" in notes and "torch.compile failed" in notes


# ----------------------------------------------------------------------------------------------
# torch.compile candidates and the menu
# ----------------------------------------------------------------------------------------------


def test_compiled_candidate_copies_what_model_needs():
    task = textwrap.dedent(
        '''
        """A task with helpers."""
        from __future__ import annotations

        import random
        import torch
        import torch.nn as nn

        SCALE = 2.0
        UNUSED = random.random()


        def helper(x):
            return x * SCALE


        class Block(nn.Module):
            def forward(self, x):
                return helper(x).relu()


        class Model(nn.Module):
            def __init__(self):
                super(Model, self).__init__()
                self.block = Block()

            def forward(self, x: "torch.Tensor") -> torch.Tensor:
                return self.block(x) + 1


        def get_inputs():
            return [torch.randn(2, 3)]


        def get_init_inputs():
            return []
        '''
    )
    for mode in ("default", "max-autotune-no-cudagraphs"):
        candidate = generate_compiled(task, mode)
        assert static_check(candidate) == []
        assert f"mode={mode!r}" in candidate and "dynamic=False" in candidate
    ref = reference_source(task)
    assert ref.startswith("from __future__ import annotations")
    assert "class _Reference(nn.Module)" in ref and "super(_Reference, self)" in ref
    assert "SCALE = 2.0" in ref and "def helper" in ref and "class Block" in ref
    for absent in ("Model", "get_inputs", "get_init_inputs", "random", "UNUSED"):
        assert absent not in ref
    with pytest.raises(ValueError, match=r"unknown torch\.compile mode"):
        generate_compiled(task, "reduce-overhead")


def test_compiled_candidate_refuses_a_reference_that_breaks_the_rules():
    task = task_source("return x * self.k").replace(
        "pass", "self.k = float(open('/etc/hostname').read(1) == 'x')"
    )
    with pytest.raises(ValueError, match="file access"):
        generate_compiled(task, "default")


def test_menu(analyses):
    assert {"fused_pointwise", "torch_compile", "torch_compile_max_autotune"} <= set(STRATEGIES)
    assert STRATEGIES["fused_pointwise"].source_kind == "kernel"
    assert STRATEGIES["torch_compile"].source_kind == "compiler"
    for strategy in STRATEGIES.values():
        module = strategy.implementation()
        assert callable(module.match) and callable(module.generate) and callable(module.tuning_space)

    names = [s.name for s, _ in applicable(analyses["pointwise"])]
    assert names == ["fused_pointwise", "cuda_graphs", "torch_compile", "torch_compile_max_autotune"]
    reasons = dict((s.name, r) for s, r in applicable(analyses["pointwise"]))
    assert "mul, add, tanh" in reasons["fused_pointwise"]
    assert [s.name for s, _ in applicable(analyses["softmax"])] == [
        "row_reduction",
        "cuda_graphs",
        "torch_compile",
        "torch_compile_max_autotune",
    ]
    assert "softmax" in playbook.rejected(analyses["softmax"])["fused_pointwise"]

    task = TASKS["pointwise"].read_text()
    assert "torch.compile" in generate("torch_compile_max_autotune", task, analyses["pointwise"])
    assert "fused_pointwise_kernel" in generate("fused_pointwise", task, analyses["pointwise"])
    assert playbook.tuning_space("torch_compile", analyses["pointwise"], "sm_90") == [{}]
    with pytest.raises(ValueError, match="unknown strategy"):
        generate("flash_attention", task, analyses["pointwise"])
    with pytest.raises(ValueError, match="does not apply"):
        generate("fused_pointwise", TASKS["softmax"].read_text(), analyses["softmax"])


@pytest.mark.parametrize("name", ["attention_bias", "attention_masked", "attention_causal"])
def test_spelled_out_attention_becomes_sdpa_and_verifies(name):
    """A scale with an additive bias, and a projection, a division and a -inf boolean mask with a
    residual after it, and a causal mask and scale computed from the inputs' shapes (traced at
    each input signature's shapes): each site is replaced, the rest of the graph still runs, and
    the verifier passes it as a library candidate."""
    source = (FIXTURES / "tasks" / f"{name}.py").read_text()
    analysis = local_analysis(source)
    assert "sdpa_attention" in [s.name for s, _ in applicable(analysis)]
    candidate = generate("sdpa_attention", source, analysis)
    assert not static_check(candidate)
    verdict = verify(source, candidate, device="cpu")
    assert verdict.verdict == "pass", verdict.message
    assert verdict.kind == "library"


ATTENTION_SCORES_KEPT = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, q, k, v, w):
        scores = q @ k.transpose(-2, -1)
        return torch.softmax(scores * w, dim=-1) @ v, scores


def get_inputs():
    return [torch.randn(2, 8, 4), torch.randn(2, 8, 4), torch.randn(2, 8, 4), torch.randn(2, 8, 8)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        (
            "scores = q @ k.transpose(-2, -1)\n        return torch.softmax(scores * w, dim=-1) @ v, scores",
            "tensor",
        ),
        (
            "s = q @ k.transpose(-2, -1) * 0.5\n        return torch.softmax(s, dim=-1) @ v, s",
            "used elsewhere",
        ),
        ("return torch.softmax(2.0 / (q @ k.transpose(-2, -1)), dim=-1) @ v", "no scale"),
        ("return torch.softmax(q @ k.transpose(-2, -1) + (w > 0), dim=-1) @ v", "floating-point bias"),
    ],
    ids=["scaled-by-tensor", "scores-reused", "constant-over-scores", "boolean-added"],
)
def test_what_is_not_an_attention_is_left_alone(forward, reason):
    """Softmax-of-matmul graphs that SDPA would change: a tensor scale, a constant divided by the
    scores, a boolean added as if it were a bias."""
    source = ATTENTION_SCORES_KEPT.replace(
        "scores = q @ k.transpose(-2, -1)\n        return torch.softmax(scores * w, dim=-1) @ v, scores",
        forward,
    )
    analysis = local_analysis(source)
    assert "sdpa_attention" not in [s.name for s, _ in applicable(analysis)]
    assert reason in playbook.rejected(analysis)["sdpa_attention"]


@pytest.mark.parametrize("name", ["linear_relu", "linear_gelu_tanh"])
def test_linear_with_relu_or_tanh_gelu_gets_a_cublaslt_epilogue_candidate(name):
    """On the CPU the candidate runs the unfused ops (cuBLASLt's GELU is the tanh form, the CPU's
    _addmm_activation the exact one): it must verify there, as a library candidate."""
    source = (FIXTURES / "tasks" / f"{name}.py").read_text()
    analysis = local_analysis(source)
    candidate = generate("cublaslt_epilogue", source, analysis)
    assert "torch._addmm_activation" in candidate and "rows.is_cuda" in candidate
    verdict = verify(source, candidate, device="cpu")
    assert verdict.verdict == "pass", verdict.message
    assert verdict.kind == "library"


def test_exact_gelu_and_a_linear_output_used_twice_get_no_epilogue_candidate():
    erf = (FIXTURES / "tasks" / "linear_gelu_tanh.py").read_text().replace(', approximate="tanh"', "")
    why = playbook.rejected(local_analysis(erf))["cublaslt_epilogue"]
    assert "exact (erf)" in why
    twice = erf.replace("return F.gelu(self.fc(x))", "y = self.fc(x)\n        return torch.relu(y) + y")
    assert "cublaslt_epilogue" in playbook.rejected(local_analysis(twice))


#: A per-channel parameter over an NCHW input (KernelBench level 2's ``self.bias`` of shape
#: (C, 1, 1)).
PER_CHANNEL = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(6, 1, 1))

    def forward(self, x):
        return torch.tanh(x + self.bias) * 2.0


def get_inputs():
    return [torch.randn(3, 6, 7, 9)]


def get_init_inputs():
    return []
"""


def test_a_per_channel_operand_is_read_by_its_middle_dims_not_general_strides(tmp_path):
    """A per-channel bias read by GENERAL indexing (three 64-bit divisions an element) made the
    anchored candidate of KernelBench's l2_71 (a 128 x 64 x 126 x 126 output) time 1.84 ms on an
    H100, 1.02 ms with one division and one remainder (MIDDLE; one-off runs). Offsets are 64-bit
    only where the output needs them."""
    source = generate("fused_pointwise", BROADCAST, analyze(BROADCAST, "broadcast.py", settings=SETTINGS))
    (tmp_path / "pointwise_layouts.py").write_text(source)
    spec = importlib.util.spec_from_file_location("pointwise_layouts", tmp_path / "pointwise_layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    namespace = vars(module)
    layout, middle = namespace["_layout"], namespace["MIDDLE"]
    assert layout((6, 1, 1), (3, 6, 7, 9)) == (middle, 6, 63, None)
    assert layout((1, 6, 1, 1), (3, 6, 7, 9)) == (middle, 6, 63, None)
    assert layout((5, 1), (4, 5, 11)) == (middle, 5, 11, None)
    assert layout((6, 1, 9), (3, 6, 7, 9))[0] == namespace["GENERAL"]  # a broadcast dim inside
    assert layout((7, 9), (3, 6, 7, 9))[0] == namespace["SUFFIX"]
    assert "INDEX64=n_elements + 1024 >= 2**31" in source
    candidate = generate(
        "fused_pointwise", PER_CHANNEL, analyze(PER_CHANNEL, "per_channel.py", settings=SETTINGS)
    )
    verdict = verify(PER_CHANNEL, candidate, device="cpu", settings=SETTINGS)
    assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
