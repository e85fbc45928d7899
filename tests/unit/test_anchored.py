"""The anchored_fusion strategy: library anchors kept, the regions between them lowered to own kernels."""

from __future__ import annotations

import textwrap

import pytest

from kernelcrew.agents import playbook
from kernelcrew.agents.playbook import anchored, applicable, conv, generate
from kernelcrew.config import Settings
from kernelcrew.tools.anticheat import static_check
from kernelcrew.tools.correctness import make_golden, verify
from kernelcrew.tools.timing import benchmark
from tests.conftest import local_analysis

SETTINGS = Settings(sandbox_timeout_s=300)


def task(init: str, forward: str, inputs: str, tests: str) -> str:
    return textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
        {init}

            def forward(self, x):
        {forward}


        def get_inputs():
            return [{inputs}]


        def get_init_inputs():
            return []


        def get_test_inputs():
            return {tests}
        """
    ).format(
        init=textwrap.indent(textwrap.dedent(init).strip(), " " * 8),
        forward=textwrap.indent(textwrap.dedent(forward).strip(), " " * 8),
        inputs=inputs,
        tests=tests,
    )


#: name -> (task, generators of the regions it must lower, in graph order; ops it must leave to torch).
TASKS = {
    "conv_bias_relu_scale": (
        task(
            """
            self.conv = nn.Conv2d(3, 4, 3)
            self.bias = nn.Parameter(torch.randn(4, 1, 1))
            """,
            """
            x = self.conv(x)
            x = x + self.bias
            x = torch.relu(x)
            return x * 0.5
            """,
            "torch.randn(2, 3, 8, 8)",
            "[[torch.randn(1, 3, 6, 7)]]",
        ),
        ["pointwise"],
        [],
    ),
    "linear_layernorm_gelu": (
        task(
            """
            self.fc = nn.Linear(16, 24)
            self.ln = nn.LayerNorm(24)
            """,
            "return F.gelu(self.ln(self.fc(x)))",
            "torch.randn(5, 16)",
            "[[torch.randn(3, 16)], [torch.randn(2, 3, 16)]]",
        ),
        ["matmul", "rows"],
        [],
    ),
    "conv_spatial_mean_sigmoid": (
        task(
            "self.conv = nn.Conv2d(3, 4, 3)",
            """
            x = self.conv(x)
            x = torch.mean(x, dim=(2, 3), keepdim=True)
            return torch.sigmoid(x)
            """,
            "torch.randn(2, 3, 8, 8)",
            "[[torch.randn(1, 3, 5, 9)]]",
        ),
        ["rows"],
        [],
    ),
    "gemm_softmax_double": (
        task(
            "self.fc = nn.Linear(16, 10)",
            """
            x = self.fc(x)
            x = torch.softmax(x, dim=1)
            return x * 2.0
            """,
            "torch.randn(6, 16)",
            "[[torch.randn(1, 16)], [torch.randn(9, 16)]]",
        ),
        ["matmul", "rows"],
        [],
    ),
    # the second region reads the first one's value directly (the anchor between them, a tensor
    # made on the value's device, only reads its attribute)
    "region_reads_region": (
        task(
            "self.conv = nn.Conv2d(3, 4, 3)",
            """
            x = self.conv(x)
            x = x + 0.5
            x = torch.min(x, torch.tensor(0.0, device=x.device))
            return F.gelu(x) * 2.0
            """,
            "torch.randn(2, 3, 8, 8)",
            "[[torch.randn(1, 3, 5, 9)]]",
        ),
        ["pointwise", "pointwise"],
        [],
    ),
    # a pointwise region, then a reduction over other dims than the last in a region of its own
    "adjacent_regions": (
        task(
            "self.conv = nn.Conv2d(3, 4, 3)",
            """
            x = self.conv(x)
            x = F.hardtanh(x, min_val=-0.5, max_val=0.5)
            x = torch.mean(x, dim=(2, 3), keepdim=True)
            return torch.tanh(x)
            """,
            "torch.randn(2, 3, 8, 8)",
            "[[torch.randn(1, 3, 5, 9)]]",
        ),
        ["pointwise", "rows"],
        [],
    ),
    "two_anchors": (
        task(
            """
            self.fc1 = nn.Linear(8, 12)
            self.fc2 = nn.Linear(12, 6)
            """,
            """
            x = x * 2.0 + 1.0
            x = self.fc1(x)
            x = torch.softmax(x, dim=1)
            x = torch.tanh(x) - 0.5
            x = self.fc2(x)
            return torch.logsumexp(x, dim=-1)
            """,
            "torch.randn(2, 5, 8)",
            "[[torch.randn(3, 4, 8)]]",
        ),
        # each float32 linear layer is an own GEMM head; no elementwise op follows it directly
        ["pointwise", "matmul", "pointwise", "matmul", "rows"],
        ["softmax"],
    ),
    "gemm_swish_groupnorm": (
        task(
            """
            self.fc = nn.Linear(8, 16)
            self.bias = nn.Parameter(torch.randn(16))
            self.norm = nn.GroupNorm(4, 16)
            """,
            """
            x = self.fc(x)
            x = torch.sigmoid(x) * x
            x = x + self.bias
            return self.norm(x)
            """,
            "torch.randn(6, 8)",
            "[[torch.randn(9, 8)]]",
        ),
        # the linear layer and its elementwise tail are one own GEMM with an epilogue
        ["matmul", "rows"],
        [],
    ),
    # a grouped, strided convolution (the own kernel) and a transposed one (cuDNN's) around a
    # pointwise region
    "own_conv_and_transposed": (
        task(
            """
            self.conv = nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=2)
            self.up = nn.ConvTranspose2d(32, 4, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2)
            """,
            """
            x = torch.relu(self.conv(x)) * 0.5
            return self.up(x) - 1.0
            """,
            "torch.randn(2, 32, 9, 9)",
            "[[torch.randn(1, 32, 6, 7)]]",
        ),
        ["pointwise", "pointwise"],
        [],
    ),
    "matmul_of_two_arguments": (
        textwrap.dedent(
            """
            import torch
            import torch.nn as nn


            class Model(nn.Module):
                def forward(self, a, b):
                    return torch.logsumexp(torch.matmul(a, b) * 0.5, dim=1)


            def get_inputs():
                return [torch.randn(5, 8), torch.randn(8, 12)]


            def get_init_inputs():
                return []
            """
        ),
        ["matmul", "rows"],
        [],
    ),
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_regions_lower_and_the_candidate_verifies(name):
    source, generators, left = TASKS[name]
    analysis = local_analysis(source)
    plan, reason = anchored.match(analysis)
    assert plan is not None, reason
    assert [r.generator for r in plan.regions] == generators
    assert [analysis.node(n)["op"] for n in plan.left] == left
    assert plan.convs == (["conv"] if name == "own_conv_and_transposed" else []), plan.convs
    assert "anchored_fusion" in [s.name for s, _ in applicable(analysis)], playbook.rejected(analysis)
    params = playbook.tuning_space("anchored_fusion", analysis, "cpu")[0]
    candidate = generate("anchored_fusion", source, analysis, params)
    assert static_check(candidate) == []
    _passes_as_own_kernels(source, candidate)


def _passes_as_own_kernels(source: str, candidate: str) -> None:
    """The candidate verifies and, timed, is a kernel or hybrid: the anchors are the reference's
    own ops, so the kind comes from where the time goes."""
    golden = make_golden(source, device="cpu", precision="strict", settings=SETTINGS)
    try:
        verdict = verify(source, candidate, golden=golden, settings=SETTINGS)
        assert verdict.verdict == "pass", (verdict.stage, verdict.message)
        timed = benchmark(
            source, {"anchored": (candidate, "candidate.py")}, golden=golden, quick=True, settings=SETTINGS
        )
    finally:
        golden.cleanup()
    assert timed.failure is None, timed.failure
    kind = timed.kinds["anchored"]
    assert kind["kind"] in ("kernel", "hybrid"), kind["evidence"]


def test_whole_module_strategies_come_first():
    """A module one whole-module strategy covers is not split into parts."""
    linear_relu = task(
        "self.fc = nn.Linear(8, 4)", "return torch.relu(self.fc(x))", "torch.randn(3, 8)", "[]"
    )
    plan, reason = anchored.match(local_analysis(linear_relu))
    assert plan is None
    assert "matmul_epilogue" in reason


def test_nothing_to_lower_says_why():
    pool_only = task("self.pool = nn.MaxPool2d(2)", "return self.pool(x)", "torch.randn(1, 3, 6, 6)", "[]")
    plan, reason = anchored.match(local_analysis(pool_only))
    assert plan is None
    assert "no region" in reason


CONVS_ONLY = task(
    """
    self.c1 = nn.Conv1d(32, 32, 3, padding=2, padding_mode="reflect", groups=2)
    self.c3 = nn.Conv3d(16, 16, (1, 1, 3), stride=(1, 1, 2), dilation=(1, 1, 2))
    self.t1 = nn.ConvTranspose1d(32, 16, 4, stride=3, groups=2)
    """,
    """
    y = self.t1(self.c1(x))
    return self.c3(y.unsqueeze(2).unsqueeze(3))
    """,
    "torch.randn(3, 32, 10)",
    "[[torch.randn(2, 32, 7)]]",
)


def test_float32_convolutions_alone_run_as_own_kernels_and_verify():
    """Nothing to fuse, but float32 convolutions (1-D with reflect padding and groups, 3-D): the
    candidate is the graph with each one as the own convolution kernel; the transposed one stays
    cuDNN's."""
    analysis = local_analysis(CONVS_ONLY)
    plan, reason = anchored.match(analysis)
    assert plan is not None, reason
    assert plan.regions == [] and plan.convs == ["c1", "c3"]
    assert "2 float32 convolution(s) as own TF32x3 kernels" in reason
    h100 = playbook.tuning_space("anchored_fusion", analysis, "sm_90")
    assert [c["conv"] for c in h100] == conv.tuning_space("sm_90")  # no "library" config: nothing else
    params = playbook.tuning_space("anchored_fusion", analysis, "cpu")[0]
    candidate = generate("anchored_fusion", CONVS_ONLY, analysis, params)
    assert static_check(candidate) == []
    assert "CONVS = {\n    'c1': (0, 1),\n    'c3': (2, 3),\n}" in candidate
    _passes_as_own_kernels(CONVS_ONLY, candidate)
    library = generate("anchored_fusion", CONVS_ONLY, analysis, {**params, "conv": "library"})
    assert "CONVS = {}" in library
    with pytest.raises(ValueError, match="conv must be"):
        generate("anchored_fusion", CONVS_ONLY, analysis, {"conv": "tf32"})


DEPTHWISE_SEPARABLE = task(
    """
    self.dw = nn.Conv2d(4, 4, (3, 1), groups=4, bias=False)
    self.pw = nn.Conv2d(4, 16, 1)
    """,
    "return torch.relu(self.pw(self.dw(x)))",
    "torch.randn(2, 4, 9, 8)",
    "[[torch.randn(1, 4, 5, 3)]]",
)


def test_depthwise_convolutions_run_as_own_direct_kernels_and_verify():
    """A depthwise convolution (one channel per group) is the own direct kernel's; the pointwise
    one after it (4 input channels: too few for the implicit GEMM's tiles) stays cuDNN's;
    conv="library" keeps both the library's."""
    analysis = local_analysis(DEPTHWISE_SEPARABLE)
    plan, reason = anchored.match(analysis)
    assert plan is not None, reason
    assert plan.directs == ["dw"] and plan.convs == []
    assert "1 depthwise convolution(s) as own direct kernels" in reason
    h100 = playbook.tuning_space("anchored_fusion", analysis, "sm_90")
    assert h100[-1]["conv"] == "library" and all("direct" in c for c in h100)
    params = playbook.tuning_space("anchored_fusion", analysis, "cpu")[0]
    candidate = generate("anchored_fusion", DEPTHWISE_SEPARABLE, analysis, params)
    assert static_check(candidate) == []
    assert "DIRECT_CONVS = {\n    'dw': (0, None),\n}" in candidate
    _passes_as_own_kernels(DEPTHWISE_SEPARABLE, candidate)
    library = generate("anchored_fusion", DEPTHWISE_SEPARABLE, analysis, {**params, "conv": "library"})
    assert "DIRECT_CONVS = {}" in library and "def conv_direct" not in library


def test_half_precision_linear_layers_stay_library_anchors():
    """cuBLAS beats the own GEMM in float16 (docs/benchmarks.md): only float32 layers are heads."""
    source = task(
        """
        self.fc = nn.Linear(8, 16).half()
        self.norm = nn.LayerNorm(16).half()
        """,
        "return self.norm(torch.relu(self.fc(x)))",
        "torch.randn(6, 8, dtype=torch.float16)",
        "[]",
    )
    plan, reason = anchored.match(local_analysis(source))
    assert plan is not None, reason
    assert "linear" in plan.anchors
    assert "matmul" not in [r.generator for r in plan.regions]


def test_a_mutated_value_read_later_is_not_fused():
    """relu_ changes the conv's output in place; a later reader of it must see the change."""
    source = task(
        "self.conv = nn.Conv2d(3, 4, 3)",
        """
        y = self.conv(x)
        z = torch.relu_(y)
        return torch.cat([y * 2.0, z], dim=1)
        """,
        "torch.randn(1, 3, 6, 6)",
        "[]",
    )
    plan, _ = anchored.match(local_analysis(source))
    assert plan is not None
    fused = {n for r in plan.regions for n in r.nodes}
    assert "relu_" not in fused


def test_tuning_space_per_architecture():
    source = TASKS["two_anchors"][0]
    analysis = local_analysis(source)
    cpu = playbook.tuning_space("anchored_fusion", analysis, "cpu")
    h100 = playbook.tuning_space("anchored_fusion", analysis, "sm_90")
    assert len(cpu) == 1
    assert len(h100) > 1
    for params in h100:
        assert set(params) == {"pointwise", "rows", "matmul"}
        assert params["matmul"]["BLOCK_M"] >= 64
        assert params["pointwise"]["BLOCK_SIZE"] >= 512
    assert len({repr(p) for p in h100}) == len(h100)
    with pytest.raises(ValueError, match="unknown"):
        generate("anchored_fusion", source, analysis, {"BLOCK": 4})


def test_the_playbook_tries_it_before_the_compiler():
    analysis = local_analysis(TASKS["conv_bias_relu_scale"][0])
    names = [s.name for s, _ in applicable(analysis)]
    assert names.index("anchored_fusion") < names.index("torch_compile")
    assert "anchored_fusion" not in playbook.rejected(analysis)


#: KernelBench level 2's pattern: a convolution with few input channels (cuDNN's), then elementwise
#: math with a per-channel parameter; a strided transposed one; one whose output a pooling reads too.
CONV_BIAS = task(
    "self.conv = nn.Conv2d(3, 8, 3)\nself.bias = nn.Parameter(torch.randn(8, 1, 1))",
    "return torch.tanh(self.conv(x)) * 2.0 + self.bias",
    "torch.randn(2, 3, 10, 9)",
    "[[torch.randn(1, 3, 6, 7)]]",
)
TRANSPOSED_BIAS = task(
    "self.up = nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1)",
    "return torch.relu(self.up(x)) - 0.5",
    "torch.randn(2, 4, 11)",
    "[]",
)
READ_OUTSIDE = task(
    "self.conv = nn.Conv2d(3, 8, 3)",
    "y = self.conv(x)\nreturn F.max_pool2d(torch.sigmoid(y), 2) + F.avg_pool2d(y, 2)",
    "torch.randn(2, 3, 10, 9)",
    "[]",
)


@pytest.mark.parametrize("source", [CONV_BIAS, TRANSPOSED_BIAS], ids=["conv2d", "conv_transpose1d"])
def test_a_library_convolutions_bias_is_added_by_the_region_after_it(source):
    """PyTorch adds a convolution's bias in a pass of its own over the output; the region that
    reads the output adds it for free (torch.compile does the same), and the library's
    convolution runs without it."""
    analysis = local_analysis(source)
    plan, reason = anchored.match(analysis)
    assert plan is not None, reason
    [(node, (target, nd))] = plan.bias_folds.items()
    assert target == node and nd == (2 if "Conv2d" in source else 1)
    region = plan.regions[0]
    assert node not in region.nodes and region.analysis.node(f"{node}_biased")["op"] == "add"
    assert ("node", f"{node}_bias") in region.args
    assert "the bias of 1 library convolution(s) added in the region after it" in reason
    params = playbook.tuning_space("anchored_fusion", analysis, "cpu")[0]
    candidate = generate("anchored_fusion", source, analysis, params)
    assert static_check(candidate) == []
    assert f"BIAS_FOLDS = {{\n    {node!r}: ({target!r}, " in candidate
    _passes_as_own_kernels(source, candidate)


def test_a_convolution_read_outside_the_region_keeps_its_bias():
    plan, reason = anchored.match(local_analysis(READ_OUTSIDE))
    assert plan is not None, reason
    assert plan.bias_folds == {}


def test_a_plan_of_many_kernels_goes_after_the_library_and_compiler_candidates():
    """A network of many small convolutions and elementwise regions: each region is a Triton
    launch, so the plan is tried after CUDA graphs and torch.compile; a block of a few stays first."""
    deep = task(
        f"self.convs = nn.ModuleList([nn.Conv2d(4, 4, 1) for _ in range({anchored.MANY_KERNELS + 1})])",
        """
        for conv in self.convs:
            x = torch.relu(conv(x)) * 0.5
        return x
        """,
        "torch.randn(1, 4, 5, 5)",
        "[]",
    )
    analysis = local_analysis(deep)
    plan, reason = anchored.match(analysis)
    assert plan is not None, reason
    assert len(plan.regions) == anchored.MANY_KERNELS + 1 and anchored.rank(plan) == 2
    names = [s.name for s, _ in applicable(analysis)]
    assert names.index("anchored_fusion") > max(names.index("cuda_graphs"), names.index("torch_compile"))
    few, _ = anchored.match(local_analysis(TASKS["conv_bias_relu_scale"][0]))
    assert anchored.rank(few) == 0
