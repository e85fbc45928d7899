"""A candidate's kind from where its time goes: own names, the classification, CPU profiles."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from kernelcrew.tools.kinds import KernelRow, OwnNames, classify, kernel_path, own_names, owner, profile_kind

# ----------------------------------------------------------------------------------------------
# own_names
# ----------------------------------------------------------------------------------------------


def test_own_names_finds_triton_kernels_through_every_wrapper_and_alias():
    source = textwrap.dedent(
        """
        import triton
        import triton as tr
        import triton.language as tl
        from triton import jit, autotune as tune

        @triton.jit
        def plain_kernel(x_ptr, BLOCK: tl.constexpr):
            pass

        @tune(configs=[triton.Config({"BLOCK": 64})], key=["n"])
        @jit
        def tuned_kernel(x_ptr, n, BLOCK: tl.constexpr):
            pass

        @tr.heuristics({"EVEN": lambda args: args["n"] % 2 == 0})
        @tr.jit(do_not_specialize=["n"])
        def guided_kernel(x_ptr, n, EVEN: tl.constexpr):
            pass

        def body(x_ptr):
            pass

        wrapped_kernel = triton.jit(body)

        def other_body(x_ptr, n):
            pass

        configured_kernel = triton.jit(do_not_specialize=["n"])(other_body)

        def helper(x):
            return x
        """
    )
    own = own_names(source)
    assert own.triton == {"plain_kernel", "tuned_kernel", "guided_kernel", "body", "other_body"}
    assert own.cuda == frozenset()
    assert own.compiler is False


def test_own_names_reads_cuda_global_functions_from_string_constants():
    source = textwrap.dedent(
        '''
        from torch.utils.cpp_extension import load_inline

        CUDA = r"""
        #include <torch/extension.h>
        __device__ float twice(float x) { return 2 * x; }
        extern "C" __global__ void __launch_bounds__(256) scale_kernel(const float* x, float* y, int n) {}
        template <int BLOCK>
        __global__ void
        row_sum_kernel(const float* x, float* y) {}
        __global__ __launch_bounds__(128, 2) void tail_kernel(float* y) {}
        torch::Tensor scale(torch::Tensor x);
        """

        def build():
            return load_inline("ext", cpp_sources="", cuda_sources=CUDA, functions=["scale"])
        '''
    )
    own = own_names(source)
    assert own.cuda == {"scale_kernel", "row_sum_kernel", "tail_kernel"}
    assert own.triton == frozenset()


@pytest.mark.parametrize(
    "line",
    [
        "model = torch.compile(model)",
        "step = compile(step)",
        "torch._dynamo.config.cache_size_limit = 8",
    ],
)
def test_own_names_sees_torch_compile(line):
    source = f"import torch\nfrom torch import compile\nmodel = step = None\n{line}\n"
    assert own_names(source).compiler is True
    assert own_names("import torch\nx = torch.relu\n").compiler is False


def test_own_names_of_a_file_that_does_not_parse_is_empty():
    assert own_names("def broken(:\n") == OwnNames()


# ----------------------------------------------------------------------------------------------
# Whose kernel: names as the profiler shows them
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("softmax_kernel", ["softmax_kernel"]),
        ("scale_kernel(float const*, float*, long)", ["scale_kernel"]),
        ("void row_sum_kernel<128>(float const*, float*)", ["row_sum_kernel"]),
        ("_Z12scale_kernelPKfPfl", ["scale_kernel"]),
        ("_ZN2at6native13reduce_kernelEv", ["at", "native", "reduce_kernel"]),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
            "exp_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >"
            "(int, at::native::exp_kernel_cuda, std::array<char*, 2ul>)",
            ["at", "native", "vectorized_elementwise_kernel"],
        ),
    ],
)
def test_kernel_path_reads_demangled_and_mangled_names(name, path):
    assert kernel_path(name) == path


OWN = OwnNames(
    triton=frozenset({"softmax_kernel"}), cuda=frozenset({"scale_kernel", "ampere_sgemm_128x64_nn"})
)


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (KernelRow("softmax_kernel", 1, 1), "own"),
        (KernelRow("void scale_kernel<256>(float const*, float*)", 1, 1), "own"),
        (KernelRow("_Z12scale_kernelPKfPf", 1, 1), "own"),
        # the own name, launched from inside an aten op or in a library namespace: not own
        (KernelRow("softmax_kernel", 1, 1, "aten"), "library"),
        (KernelRow("void at::native::scale_kernel(float*)", 1, 1), "library"),
        # a vendor kernel's name declared in a dead string: still the vendor's
        (KernelRow("ampere_sgemm_128x64_nn", 1, 1), "library"),
        (KernelRow("triton_poi_fused_add_mul_0", 1, 1), "compiler"),
        (KernelRow("triton_red_fused__softmax_1", 1, 1), "compiler"),
        (KernelRow("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", 1, 1), "library"),
        (KernelRow("nvjet_tst_128x64_64x8_1x2_h_bz_TNT", 1, 1), "library"),
        (KernelRow("Memcpy DtoD (Device -> Device)", 1, 1), "library"),
        (KernelRow("torch.compile region", 1, 1, "compiled"), "compiler"),
        (KernelRow("host (Python)", 1, 1, "host"), "library"),
        (KernelRow("aten::softmax", 1, 1, "aten"), "library"),
    ],
)
def test_owner_of_a_profiled_kernel(row, expected):
    assert owner(row, OWN) == expected


def test_an_inductor_named_own_kernel_is_the_compilers_when_the_candidate_compiles():
    name = "triton_poi_fused_add_0"
    assert owner(KernelRow(name, 1, 1), OwnNames(triton=frozenset({name}))) == "own"
    assert owner(KernelRow(name, 1, 1), OwnNames(triton=frozenset({name}), compiler=True)) == "compiler"


# ----------------------------------------------------------------------------------------------
# classify: the shares decide
# ----------------------------------------------------------------------------------------------


def test_own_kernels_with_most_of_the_time_are_a_kernel():
    rows = [("softmax_kernel", 80.0, 5), ("Memset (Device)", 5.0, 5)]
    kind, evidence = classify(rows, OWN, calls=5)
    assert kind == "kernel"
    assert evidence["shares"]["own"] == pytest.approx(80 / 85)
    assert evidence["top_kernels"][0] == {
        "name": "softmax_kernel",
        "owner": "own",
        "time_us": 80.0,
        "count": 5,
        "share": pytest.approx(80 / 85),
    }
    assert evidence["calls_profiled"] == 5


def test_exactly_half_is_a_kernel_and_a_real_share_below_half_is_hybrid():
    assert classify([("softmax_kernel", 50.0, 1), ("ampere_sgemm_64x64_nn", 50.0, 1)], OWN)[0] == "kernel"
    assert classify([("softmax_kernel", 30.0, 1), ("ampere_sgemm_64x64_nn", 70.0, 1)], OWN)[0] == "hybrid"
    assert classify([("softmax_kernel", 10.0, 1), ("ampere_sgemm_64x64_nn", 90.0, 1)], OWN)[0] == "hybrid"


def test_a_token_own_launch_beside_library_work_is_library():
    rows = [
        ("softmax_kernel", 2.0, 1),
        (
            "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)",
            95.0,
            1,
        ),
        ("Memcpy HtoD (Pageable -> Device)", 3.0, 1),
    ]
    kind, evidence = classify(rows, OWN)
    assert kind == "library"
    assert evidence["shares"]["own"] == pytest.approx(0.02)


def test_inductor_kernels_are_compiler_and_the_larger_share_decides():
    rows = [
        ("triton_per_fused__softmax_0", 60.0, 10),
        ("triton_poi_fused_gelu_1", 20.0, 10),
        ("sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8", 20.0, 10),
    ]
    kind, evidence = classify(rows, OwnNames(compiler=True), calls=10)
    assert kind == "compiler"
    assert evidence["shares"]["compiler"] == pytest.approx(0.8)
    assert classify([*rows, ("nvjet_hsh_256x128_64x4_2x1_v_bz_TNN", 90.0, 10)], OwnNames())[0] == "library"


def test_no_time_or_lost_calls_never_make_a_kernel():
    assert classify([], OWN)[0] == "library"
    kind, evidence = classify([("softmax_kernel", 100.0, 3)], OWN, calls=2, complete=False)
    assert kind == "library"
    assert "lost" in evidence["note"]


# ----------------------------------------------------------------------------------------------
# profile_kind on a CPU: Triton's interpreter, real torch.profiler
# ----------------------------------------------------------------------------------------------

_SOFTMAX_KERNEL = """
import numpy as np
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(out_ptr + row * stride + offs, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def touch_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def softmax(x):
    out = torch.empty_like(x)
    softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def touch(x):
    scratch = torch.empty(1, dtype=x.dtype)
    touch_kernel[(1,)](x, scratch, 1, BLOCK=16)
"""

HONEST = (
    _SOFTMAX_KERNEL
    + """
class ModelNew(nn.Module):
    def forward(self, x):
        return softmax(x)
"""
)

TOKEN_LAUNCH = (
    _SOFTMAX_KERNEL
    + """
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(512, 1024)

    def forward(self, x):
        touch(x)
        return torch.softmax(self.proj(x), dim=-1)
"""
)

NUMPY_WORK = (
    _SOFTMAX_KERNEL
    + """
class ModelNew(nn.Module):
    def forward(self, x):
        touch(x)
        a = x.numpy().astype(np.float64)
        for _ in range(60):
            e = np.exp(a - a.max(axis=-1, keepdims=True))
            y = e / e.sum(axis=-1, keepdims=True)
        return torch.from_numpy(y.astype(np.float32))
"""
)

FIRST_CALL_ONLY = (
    _SOFTMAX_KERNEL
    + """
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            return softmax(x)
        return torch.softmax(x, dim=-1)
"""
)


def _kind_in_child(
    source: str, shape: tuple[int, ...], warmups: int, reps: int
) -> tuple[str, dict[str, Any]]:
    """Import ``source`` as a candidate (Triton needs a file), warm it up, then :func:`profile_kind`."""
    path = Path(tempfile.mkdtemp()) / "candidate.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("candidate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.ModelNew()
    inputs_list = [[torch.randn(*shape)] for _ in range(2)]
    with torch.no_grad():
        for i in range(warmups):
            model(*inputs_list[i % 2])
    return profile_kind(
        lambda inputs: model(*inputs), inputs_list, device="cpu", own=own_names(source), reps=reps
    )


@pytest.fixture(scope="module")
def interpreter():
    """A spawned process in Triton's interpreter mode from its start (``tl.max`` and ``tl.sum`` are
    jit functions of triton.language: they are interpreted only if triton was imported so)."""
    import multiprocessing

    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(int).result()
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    with pool:
        yield pool


def test_an_honest_triton_softmax_is_a_kernel(interpreter):
    kind, evidence = interpreter.submit(_kind_in_child, HONEST, (16, 200), 1, 3).result()
    assert kind == "kernel", evidence
    assert evidence["calls_profiled"] == 3
    assert evidence["triton_launches"]["softmax_kernel"]["launches"] == 3
    assert evidence["top_kernels"][0]["name"] == "softmax_kernel"
    assert evidence["top_kernels"][0]["owner"] == "own"
    # it stored every element of its outputs (masked-off lanes not counted): its time counts whole
    assert evidence["interpreter_stored_elements"] == {"softmax_kernel": 3 * 16 * 200}
    assert evidence["output_elements"] == 3 * 16 * 200


def test_one_tiny_launch_then_torch_ops_is_not_a_kernel(interpreter):
    kind, evidence = interpreter.submit(_kind_in_child, TOKEN_LAUNCH, (512, 512), 1, 3).result()
    # The interpreter's time per operation hardly depends on the data, so a token launch could
    # read as much of a call on a loaded machine: an interpreted kernel's time counts in proportion
    # to the elements it stored (one a call here) against the call's outputs.
    assert kind == "library", evidence
    assert evidence["shares"]["own"] < 0.01, evidence["shares"]
    assert evidence["triton_launches"]["touch_kernel"]["launches"] == 3
    assert evidence["interpreter_stored_elements"] == {"touch_kernel": 3}
    assert evidence["output_elements"] == 3 * 512 * 1024
    assert any(k["name"] == "aten::linear" and k["owner"] == "library" for k in evidence["top_kernels"])


def test_one_tiny_launch_then_numpy_is_not_a_kernel(interpreter):
    kind, evidence = interpreter.submit(_kind_in_child, NUMPY_WORK, (256, 512), 1, 3).result()
    assert kind in {"library", "hybrid"}, evidence
    assert evidence["shares"]["library"] > 0.75, evidence["shares"]
    assert evidence["top_kernels"][0]["name"].startswith("host")


def test_a_launch_only_on_the_first_call_is_not_a_kernel_after_it(interpreter):
    kind, evidence = interpreter.submit(_kind_in_child, FIRST_CALL_ONLY, (16, 200), 1, 3).result()
    assert kind == "library", evidence
    assert evidence["triton_launches"] == {}


def test_profile_kind_puts_the_launch_hooks_back_even_when_the_candidate_raises():
    from triton.runtime.interpreter import InterpreterBuilder
    from triton.runtime.jit import JITFunction

    original = JITFunction.__dict__["run"]
    store = InterpreterBuilder.__dict__["create_masked_store"]
    seen = []

    def boom(inputs):
        seen.append(JITFunction.__dict__["run"] is original)
        seen.append(InterpreterBuilder.__dict__["create_masked_store"] is store)
        raise RuntimeError("candidate failed")

    with pytest.raises(RuntimeError, match="candidate failed"):
        profile_kind(boom, [[torch.ones(2)]], device="cpu", own=OwnNames(), reps=2)
    assert seen == [False, False]  # hooked while it ran
    assert JITFunction.__dict__["run"] is original
    assert InterpreterBuilder.__dict__["create_masked_store"] is store


@pytest.mark.slow
def test_torch_compile_inside_the_candidate_is_compiler():
    def chain(x):
        return torch.nn.functional.gelu(x * 2.0 + 1.0) * torch.sigmoid(x)

    compiled = torch.compile(chain)
    inputs_list = [[torch.randn(1024, 1024)] for _ in range(2)]
    with torch.no_grad():
        compiled(*inputs_list[0])
    kind, evidence = profile_kind(
        lambda inputs: compiled(*inputs), inputs_list, device="cpu", own=OwnNames(compiler=True), reps=3
    )
    assert kind == "compiler", evidence
