"""The matmul_epilogue strategy: what it matches, its kernel under the real verifier, its rank."""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest

from kernelcrew.agents import playbook
from kernelcrew.agents.playbook import applicable, generate, matmul
from kernelcrew.agents.playbook.matmul import COL, FULL, ROW, SCALAR, match, operand_mode, tuning_space
from kernelcrew.config import Settings
from kernelcrew.tools.anticheat import static_check
from kernelcrew.tools.correctness import verify
from tests.conftest import local_analysis

SETTINGS = Settings(sandbox_timeout_s=240)


def task(init: str, forward: str, inputs: str, tests: str, args: str = "x", init_args: str = "") -> str:
    return textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Model(nn.Module):
            def __init__(self{init_args}):
                super().__init__()
                {init}

            def forward(self, {args}):
                {forward}


        def get_inputs():
            return [{inputs}]


        def get_init_inputs():
            return []


        def get_test_inputs():
            return {tests}
        """
    ).format(init=init, forward=forward, inputs=inputs, tests=tests, args=args, init_args=init_args)


#: name -> a task whose candidate must verify: each spelling, dtype and operand layout.
TASKS = {
    # a gated pair (two accumulators), float16, odd row counts and a 3-D input
    "swiglu_fp16": task(
        "self.gate = nn.Linear(40, 24, bias=False, dtype=torch.float16); "
        "self.up = nn.Linear(40, 24, bias=False, dtype=torch.float16)",
        "return F.silu(self.gate(x)) * self.up(x)",
        "torch.randn(20, 40, dtype=torch.float16)",
        "[[torch.randn(7, 40, dtype=torch.float16)], [torch.randn(3, 5, 40, dtype=torch.float16)]]",
    ),
    # float32 with bias, a (N,) scale and a full-size residual: TF32x3 on a GPU
    "residual_fp32": task(
        "self.proj = nn.Linear(48, 40); self.gamma = nn.Parameter(torch.full((40,), 0.1))",
        "return r + self.gamma * self.proj(x)",
        "torch.randn(18, 48), torch.randn(18, 40)",
        "[[torch.randn(5, 48), torch.randn(5, 40)], [torch.randn(2, 3, 48), torch.randn(2, 3, 40)]]",
        args="x, r",
    ),
    # bfloat16, F.linear of own parameters, exact GELU
    "gelu_bf16": task(
        "self.w = nn.Parameter(torch.randn(36, 32, dtype=torch.bfloat16) / 6); "
        "self.b = nn.Parameter(torch.randn(36, dtype=torch.bfloat16))",
        "return F.gelu(F.linear(x, self.w, self.b))",
        "torch.randn(21, 32, dtype=torch.bfloat16)",
        "[[torch.randn(1, 32, dtype=torch.bfloat16)], [torch.randn(2, 9, 32, dtype=torch.bfloat16)]]",
    ),
    # x @ W of a [K, N] parameter, a per-row scale input, a scalar buffer, a transposed input
    "matmul_rowscale_fp32": task(
        "self.w = nn.Parameter(torch.randn(24, 33) / 5); self.register_buffer('t', torch.tensor(0.5))",
        "return torch.tanh((x @ self.w) * s) + self.t",
        "torch.randn(17, 24), torch.rand(17, 1)",
        "[[torch.randn(24, 5).t(), torch.rand(5, 1)], [torch.randn(1, 24), torch.rand(1, 1)]]",
        args="x, s",
    ),
    # A @ B of two arguments (KernelBench's level-1 products): the right-hand side is loaded like
    # a weight, strided views included
    "two_arguments_fp32": task(
        "pass",
        "return torch.relu(torch.matmul(x, w)) * 0.5",
        "torch.randn(19, 24), torch.randn(24, 30)",
        "[[torch.randn(5, 24), torch.randn(30, 24).t()], [torch.randn(2, 3, 24), torch.randn(24, 30)]]",
        args="x, w",
    ),
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_candidate_passes_the_verifier_as_an_own_kernel(name):
    source = TASKS[name]
    analysis = local_analysis(source)
    assert "matmul_epilogue" in [s.name for s, _ in applicable(analysis)], playbook.rejected(analysis)
    candidate = generate("matmul_epilogue", source, analysis, tuning_space(match(analysis)[0], "cpu")[0])
    assert static_check(candidate) == []
    verdict = verify(source, candidate, device="cpu", settings=SETTINGS)
    assert verdict.verdict == "pass", verdict.message
    assert verdict.kind == "kernel"


@pytest.mark.parametrize(
    ("init", "forward", "inputs", "args", "reason"),
    [
        ("self.fc = nn.Linear(8, 4)", "return self.fc(x * 2)", "torch.randn(3, 8)", "x", "not an argument"),
        (
            "self.a = nn.Linear(8, 4); self.b = nn.Linear(8, 4); self.c = nn.Linear(8, 4)",
            "return self.a(x) + self.b(x) * self.c(x)",
            "torch.randn(3, 8)",
            "x",
            "more than 2",
        ),
        ("pass", "return F.linear(x, w)", "torch.randn(3, 8), torch.randn(4, 8)", "x, w", "not a parameter"),
        (
            "self.a = nn.Linear(8, 4); self.b = nn.Linear(8, 4)",
            "return self.a(x) * self.b(y)",
            "torch.randn(3, 8), torch.randn(3, 8)",
            "x, y",
            "different inputs",
        ),
        (
            "self.a = nn.Linear(8, 4); self.b = nn.Linear(8, 1)",
            "return self.a(x) * self.b(x)",
            "torch.randn(3, 8)",
            "x",
            "differ in shape",
        ),
        ("self.fc = nn.Linear(8, 4)", "return self.fc(x).sum(-1)", "torch.randn(3, 8)", "x", "'sum'"),
        (
            "self.fc = nn.Linear(8, 4)",
            "return self.fc(x) + r",
            "torch.randn(2, 3, 8), torch.randn(2, 1, 4)",
            "x, r",
            "broadcasts over the output",
        ),
        (
            "self.fc = nn.Linear(8, 4).double()",
            "return self.fc(x)",
            "torch.randn(3, 8).double()",
            "x",
            "float64",
        ),
        (
            "self.fc = nn.Linear(8, 4); self.w = nn.Parameter(torch.randn(8, 4))",
            "return self.fc(x) * (x @ self.w)",
            "torch.randn(3, 8)",
            "x",
            "the other x @ W",
        ),
        ("pass", "return x @ x", "torch.randn(8, 8)", "x", "or an argument of forward"),
    ],
    ids=[
        "input-computed",
        "three-layers",
        "weight-is-input",
        "two-inputs",
        "shapes-differ",
        "reduced",
        "broadcast-residual",
        "float64",
        "linear-and-matmul",
        "input-times-itself",
    ],
)
def test_what_is_not_a_matmul_epilogue_says_why(init, forward, inputs, args, reason):
    analysis = local_analysis(task(init, forward, inputs, f"[[{inputs}]]", args=args))
    plan, why = match(analysis)
    assert plan is None and reason in why, why


def test_a_product_with_too_few_output_tiles_is_the_librarys(monkeypatch):
    """A matrix-vector product or a long-K product with a small output leaves most SMs idle in a
    kernel with no split over K; the rule is by size (monkeypatched here: CPU-sized shapes)."""
    monkeypatch.setattr(matmul, "MIN_SPLIT_FLOP", 0)
    source = task(
        "pass", "return torch.matmul(x, v)", "torch.randn(64, 16), torch.randn(16, 1)", "[]", args="x, v"
    )
    plan, why = match(local_analysis(source))
    assert plan is None and "fewer than 66 tiles" in why, why


def test_operand_modes():
    out = (2, 3, 5)
    assert operand_mode((2, 3, 5), out) == operand_mode((1, 2, 3, 5)[1:], out) == FULL
    assert operand_mode((5,), out) == operand_mode((1, 1, 5), out) == COL
    assert operand_mode((2, 3, 1), out) == ROW
    assert operand_mode((), out) == operand_mode((1, 1), out) == SCALAR
    assert operand_mode((2, 1, 5), out) is None  # per (sample, column): the kernel reads a copy
    assert operand_mode((3, 1), out) is None
    assert operand_mode((1, 2, 3, 5), out) is None  # more dims than the output


def test_rank_and_tuning_follow_the_measurements():
    """float32 layers (TF32x3 beat cuBLAS 1.7x on the H100) and gated pairs are tried first; one
    fp16/bf16 layer (cuBLAS 1.2-1.3x faster) after the library and compiler candidates.
    bench/results/matmul_epilogue.md."""
    fp32 = local_analysis(TASKS["residual_fp32"])
    assert next(s.name for s, _ in applicable(fp32)) == "matmul_epilogue"
    gated = local_analysis(TASKS["swiglu_fp16"])  # two fp16 layers: beat cuBLAS + compile
    assert next(s.name for s, _ in applicable(gated)) == "matmul_epilogue"
    relu = task(
        "self.fc = nn.Linear(32, 16, dtype=torch.float16)",
        "return torch.relu(self.fc(x))",
        "torch.randn(8, 32, dtype=torch.float16)",
        "[]",
    )
    assert [s.name for s, _ in applicable(local_analysis(relu))] == [
        "cublaslt_epilogue",
        "cuda_graphs",
        "torch_compile",
        "torch_compile_max_autotune",
        "matmul_epilogue",
    ]
    plan = match(fp32)[0]
    assert tuning_space(plan, "sm_90")[0] == {
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "BLOCK_K": 32,
        "GROUP_M": 8,
        "num_warps": 4,
        "num_stages": 4,
    }
    assert len(tuning_space(plan, "cpu")) == 1
    # 2048 x 1024 in fp16: the 256-row and 256-column tiles make 64 programs, half the SMs idle
    half = replace(match(local_analysis(TASKS["swiglu_fp16"]))[0], rows=2048, out_features=1024)
    half.layers = half.layers[:1]
    tiles = [(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in tuning_space(half, "sm_90")]
    assert tiles == [(128, 128, 64), (128, 128, 32), (256, 128, 64), (128, 256, 64)]
    with pytest.raises(ValueError, match="BLOCK_N"):
        generate("matmul_epilogue", TASKS["residual_fp32"], fp32, {"BLOCK_N": 48})
    with pytest.raises(ValueError, match="unknown"):
        generate("matmul_epilogue", TASKS["residual_fp32"], fp32, {"BLOCK_SIZE": 64})
