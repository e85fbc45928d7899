"""The dim_reduction strategy: one reduction over a dim other than the last as one own Triton kernel,
on the CPU (Triton's interpreter)."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernelcrew.agents.playbook import dimreduce
from kernelcrew.config import Settings
from kernelcrew.tools.anticheat import static_check
from kernelcrew.tools.correctness import make_golden, verify
from tests.conftest import interpreted_json, local_analysis

SETTINGS = Settings(sandbox_timeout_s=300)


def task(forward: str, inputs: str = "torch.randn(3, 37, 5)", tests: str = "[]") -> str:
    """A KernelBench-style task (tasks 47 to 53): the reduced dim comes from get_init_inputs."""
    return textwrap.dedent(
        """
        import torch
        import torch.nn as nn


        class Model(nn.Module):
            def __init__(self, dim):
                super().__init__()
                self.dim = dim

            def forward(self, x):
                return {forward}


        def get_inputs():
            return [{inputs}]


        def get_init_inputs():
            return [1]


        def get_test_inputs():
            return {tests}
        """
    ).format(forward=forward, inputs=inputs, tests=tests)


#: forward -> (op, reduced dim of the example, keepdim, what the forward returns), inputs (3, 37, 5).
ACCEPTED = {
    "torch.sum(x, dim=self.dim, keepdim=True)": ("sum", 1, True, ("values",)),
    "torch.mean(x, dim=-2)": ("mean", 1, False, ("values",)),
    "torch.argmax(x, dim=1)": ("argmax", 1, False, ("indices",)),
    "torch.prod(x, 1)": ("prod", 1, False, ("values",)),
    "x.sum(0)": ("sum", 0, False, ("values",)),
    "torch.max(x, dim=1)[0]": ("max", 1, False, ("values",)),
    "torch.min(x, 1, True).indices": ("min", 1, True, ("indices",)),
    "torch.max(x, dim=1)": ("max", 1, False, ("pair",)),
}


@pytest.mark.parametrize("forward", sorted(ACCEPTED))
def test_match_takes_one_reduction_over_a_dim_that_is_not_the_last(forward):
    plan, reason = dimreduce.match(local_analysis(task(forward)))
    assert plan is not None, reason
    assert (plan.op, plan.axis, plan.keepdim, plan.results) == ACCEPTED[forward]
    assert f"over dim {plan.axis}, not the last" in reason


def test_match_takes_amax_over_dim_0_of_a_matrix():
    plan, reason = dimreduce.match(local_analysis(task("torch.amax(x, dim=0)", "torch.randn(37, 5)")))
    assert plan is not None, reason
    assert (plan.op, plan.dim, plan.want) == ("amax", 0, "values")
    assert "(outer, reduced, inner) = (1, 37, 5)" in reason


#: forward (inputs (3, 37, 5) unless given) -> a part of the reason it is refused.
REFUSED = {
    "torch.sum(x, dim=-1)": "reduces the last dim: that is the row_reduction strategy's case",
    "torch.argmax(x, dim=2)": "reduces the last dim",
    "torch.sum(x, dim=(0, 1))": "reduces 2 dims [0, 1]; only one dim is supported",
    "torch.sum(x)": "reduces every element, not one dim",
    "torch.mean(x, dim=None)": "reduces every element, not one dim",
    "torch.max(x)": "reduces every element, not one dim",
    "torch.relu(x)": "'relu' is not a reduction this kernel computes",
    "torch.cumsum(x, 1)": "'cumsum' is not a reduction this kernel computes",
    "torch.sum(x, dim=1) * 2": "not exactly one reduction (it computes sum, mul)",
    "torch.max(x, dim=1)[0] + 1": "not exactly one reduction (it computes max, add)",
    "torch.mean(x, 1, dtype=torch.float64)": "has dtype=",
    "x.sum(1)[0]": "indexes a value (getitem) other than max/min's (values, indices)",
}


@pytest.mark.parametrize("forward", sorted(REFUSED))
def test_match_refuses_the_rest_with_a_reason(forward):
    plan, reason = dimreduce.match(local_analysis(task(forward)))
    assert plan is None
    assert REFUSED[forward] in reason


def test_match_refuses_other_dtypes():
    source = task("torch.sum(x, dim=1)", "torch.randn(3, 37, 5, dtype=torch.float64)")
    plan, reason = dimreduce.match(local_analysis(source))
    assert plan is None
    assert "the kernel reduces float32, float16 or bfloat16 tensors" in reason


#: name -> task whose candidate must pass the verifier as an own kernel.
END_TO_END = {
    "sum-keepdim": task("torch.sum(x, dim=self.dim, keepdim=True)", tests="[[torch.randn(2, 9, 4, 3)]]"),
    "mean-bfloat16": task("torch.mean(x, dim=-2)", "torch.randn(3, 37, 5).bfloat16()"),
    "argmax": task("torch.argmax(x, dim=self.dim)", tests="[[torch.randn(4, 300, 3)]]"),
    "amin-float16": task("torch.amin(x, dim=1)", "torch.randn(3, 37, 5).half()"),
    "prod": task("torch.prod(x, dim=1)"),
    "max-values-and-indices": task("torch.max(x, dim=1, keepdim=True)"),
}


def _verify(source: str) -> tuple[str, str, str, list]:
    """(verdict, stage and message, kind, static findings) of the candidate for the CPU."""
    analysis = local_analysis(source)
    plan, reason = dimreduce.match(analysis)
    assert plan is not None, reason
    candidate = dimreduce.generate(source, analysis, plan, dimreduce.tuning_space(plan, "cpu")[0])
    golden = make_golden(source, device="cpu", precision="strict", settings=SETTINGS)
    try:
        verdict = verify(source, candidate, golden=golden, settings=SETTINGS)
    finally:
        golden.cleanup()
    return verdict.verdict, f"{verdict.stage}: {verdict.message}", verdict.kind, static_check(candidate)


@pytest.fixture(scope="module")
def verdicts():
    """Each END_TO_END task's candidate verified (with the verifier's own kind profile). The
    sandboxed children spend much of their time starting up, so the tasks run side by side."""
    with ThreadPoolExecutor(len(END_TO_END)) as pool:
        return dict(zip(END_TO_END, pool.map(_verify, END_TO_END.values()), strict=True))


@pytest.mark.parametrize("name", sorted(END_TO_END))
def test_candidates_pass_the_verifier_as_own_kernels(verdicts, name):
    verdict, message, kind, findings = verdicts[name]
    assert findings == []
    assert verdict == "pass", message
    assert kind == "kernel"


#: Runs in a fresh interpreter: TRITON_INTERPRET must be set before Triton is imported.
CHECK = """
import json, sys
import torch

sys.path.insert(0, sys.argv[1])
import own_dimreduce as own

torch.manual_seed(0)
out = {}


def compare(name, got, want, exact):
    try:
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        if exact or not want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        else:
            tol = 1e-5 if want.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
        out[name] = None
    except AssertionError as e:
        out[name] = str(e)[:500]


def ties_and_nans(shape, dim, dtype):
    # small integers: many equal values down each reduced slice; a few slices with NaNs (four in
    # the first), an inf, only -inf or only +inf; the rest NaN-free, so the ties decide
    slices = torch.randint(-3, 4, shape).to(dtype).movedim(dim, -1).contiguous()
    rows = slices.view(-1, shape[dim])
    last = shape[dim] - 1
    nan, inf = float("nan"), float("inf")
    nans = [(0, p, nan) for p in (1, 9, 17, 33)]  # several in one lane of the running tile
    for row, position, value in [*nans, (1, last, nan), (2, 1, inf), (4, 0, -inf)]:
        if row < rows.shape[0]:
            rows[row, min(position, last)] = value
    if rows.shape[0] > 6:
        rows[5] = -inf
        rows[6] = inf
    return slices.movedim(-1, dim).contiguous()


# one launch computes both results; amax/argmax (amin/argmin) are the same kernel writing one of them
EXTREME = {
    "max": (torch.max, torch.amax, torch.argmax),
    "min": (torch.min, torch.amin, torch.argmin),
}
ACCUMULATE = {
    "sum": lambda x, d, k: torch.sum(x, d, keepdim=k),
    "mean": lambda x, d, k: torch.mean(x, d, keepdim=k),
    "prod": lambda x, d, k: torch.prod(x, d, keepdim=k),
}
# (shape, dim, params): one lane per row and one step; many lanes, steps and column blocks;
# trailing dims of size 1 (the inner size is 1); a reduced dim of size 1
CASES = [
    ((3, 37, 5), 1, {"BLOCK_R": 64, "BLOCK_I": 64, "num_warps": 1}),
    ((3, 37, 5), -2, {"BLOCK_R": 4, "BLOCK_I": 2, "num_warps": 1}),
    ((2, 3, 50, 1), 2, {"BLOCK_R": 8, "BLOCK_I": 4, "num_warps": 1}),
    ((40, 6), 0, {"BLOCK_R": 16, "BLOCK_I": 4, "num_warps": 1}),
    ((4, 1, 7), 1, {"BLOCK_R": 4, "BLOCK_I": 4, "num_warps": 1}),
]
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for case, (shape, dim, params) in enumerate(CASES):
        keepdim = case % 2 == 0
        x = ties_and_nans(shape, dim, dtype)
        for op, (pair, values, indices) in EXTREME.items():
            got_v, got_i = own.dim_reduce(x, dim, keepdim, op, "both", params)
            want_v, want_i = pair(x, dim, keepdim=keepdim)
            compare(f"{op}-values-{dtype}-{case}", got_v, want_v, exact=True)
            compare(f"{op}-indices-{dtype}-{case}", got_i, want_i, exact=True)
            compare(f"a{op}-{dtype}-{case}", got_v, values(x, dim, keepdim=keepdim), exact=True)
            compare(f"arg{op}-{dtype}-{case}", got_i, indices(x, dim, keepdim=keepdim), exact=True)
        x = torch.randn(shape).to(dtype)
        for op, ref in ACCUMULATE.items():
            got, _ = own.dim_reduce(x, dim, keepdim, op, "values", params)
            compare(f"{op}-{dtype}-{case}", got, ref(x, dim, keepdim), exact=False)

# an empty reduced dim: sum 0, prod 1, mean NaN, as torch; max has no element to pick
empty = torch.randn(2, 0, 3)
for op, ref in ACCUMULATE.items():
    got, _ = own.dim_reduce(empty, 1, False, op, "values", CASES[0][2])
    compare(f"{op}-empty", got, ref(empty, 1, False), exact=True)
try:
    own.dim_reduce(empty, 1, False, "max", "both", CASES[0][2])
    out["max-empty-raises"] = "no error"
except ValueError:
    out["max-empty-raises"] = None
# a float64 input runs the reference's own op
model = own.ModelNew(1)
x64 = torch.randn(3, 5, 4, dtype=torch.float64)
compare("float64-falls-back", model(x64), torch.sum(x64, 1, keepdim=True), exact=True)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    """Name -> mismatch against torch (None when equal), from the kernels of a generated candidate."""
    source = task("torch.sum(x, dim=self.dim, keepdim=True)")
    analysis = local_analysis(source)
    plan, reason = dimreduce.match(analysis)
    assert plan is not None, reason
    folder = tmp_path_factory.mktemp("dimreduce")
    candidate = dimreduce.generate(source, analysis, plan, dimreduce.tuning_space(plan, "cpu")[0])
    (folder / "own_dimreduce.py").write_text(candidate)
    return interpreted_json(["-c", CHECK, str(folder)], timeout=300)


def test_the_kernels_match_torch_with_ties_and_nans(kernel_results):
    """Max/min values and indices equal torch's exactly (first NaN, else first extreme element);
    sums, means and products within float tolerance; every dtype and tiling."""
    assert len(kernel_results) == 3 * 5 * 11 + 5  # dtypes x cases x results, then the edge cases
    mismatches = {name: error for name, error in kernel_results.items() if error is not None}
    assert mismatches == {}


def test_tuning_space_and_params():
    plan, _ = dimreduce.match(local_analysis(task("torch.sum(x, dim=1)")))
    h100 = dimreduce.tuning_space(plan, "sm_90")
    assert h100[0] == {"BLOCK_R": 32, "BLOCK_I": 128, "num_warps": 4}
    for arch in ("sm_90", "sm_80", "sm_100", "cpu"):
        space = dimreduce.tuning_space(plan, arch)
        assert space
        for config in space:
            assert dimreduce.check_params(config) == config
    assert dimreduce.check_params({"BLOCK_R": 8}) == {"BLOCK_R": 8, "BLOCK_I": 128, "num_warps": 4}
    with pytest.raises(ValueError, match="BLOCK_I must be a power of two"):
        dimreduce.check_params({"BLOCK_I": 100})
    with pytest.raises(ValueError, match="at most 16384"):
        dimreduce.check_params({"BLOCK_R": 1024, "BLOCK_I": 1024})
    with pytest.raises(ValueError, match="unknown dim reduction parameter"):
        dimreduce.check_params({"BLOCK": 64})


def test_generate_refuses_a_reference_that_defines_the_candidates_names():
    source = task("torch.sum(x, dim=1)").replace(
        "class Model", "def dim_reduce():\n    pass\n\n\nclass Model"
    )
    source = source.replace("return torch.sum(x, dim=1)", "dim_reduce()\n        return torch.sum(x, dim=1)")
    analysis = local_analysis(source)
    plan = dimreduce.DimReducePlan("x", "sum", 1, False, ("values",), False, (3, 37, 5), "float32")
    with pytest.raises(ValueError, match="the reference defines dim_reduce"):
        dimreduce.generate(source, analysis, plan, {})
