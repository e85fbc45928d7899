"""The row_reduction strategy: matching, kernels under the Triton interpreter, the real verifier."""

from __future__ import annotations

import importlib.util
import inspect
import os
import textwrap
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from kernelcrew.agents import playbook
from kernelcrew.agents.playbook import STRATEGIES, applicable
from kernelcrew.agents.playbook.rows import (
    DEFAULT_PARAMS,
    generate_rowwise,
    match,
    row_length,
    splittable,
    tuning_space,
)
from kernelcrew.config import Settings
from kernelcrew.knowledge_base import order_configs
from kernelcrew.task import import_source, load_task
from kernelcrew.tools.anticheat import static_check
from kernelcrew.tools.correctness import verify
from tests.conftest import FIXTURES, local_analysis

ROWS = FIXTURES / "tasks" / "rows"
SETTINGS = Settings(sandbox_timeout_s=240)
#: Blocks small enough that the test shapes take both paths: rows of up to 32 columns stay in
#: registers, longer ones run the multi-pass loop in 16-column chunks.
SMALL = {"MAX_SINGLE": 32, "CHUNK": 16, "TILE": 1024, "num_warps": 1}
#: SMALL with long rows split in parts of 16 columns kept in registers by waiting programs.
SMALL_WAIT = {**SMALL, "MAX_SINGLE": 16, "WAIT_PART": 16}
#: SMALL and SMALL_WAIT with every row of the patterns' examples too long for registers: a candidate
#: carries the split launches only where the example's rows take the multi-pass loop.
SPLIT_SMALL = {**SMALL, "MAX_SINGLE": 16}
SPLIT_WAIT = SMALL_WAIT
#: Fixture task -> the parameters its candidate is verified with.
VERIFIED = {
    "attention_softmax": SMALL,  # 12 and 7 columns in registers, 45 in chunks; -inf mask
    "log_softmax": SMALL,  # bfloat16; 40 and 97 columns in chunks, 7 in registers
    "layernorm_residual": SMALL,  # float16; 48 columns: the chunked (Chan) moments
    "rmsnorm": {"MAX_SINGLE": 64},  # bfloat16 LLaMA spelling; 40 columns in registers
    "l2norm": SMALL,
    "row_stats": SMALL,  # float16 amax, mean and sum without keepdim
    "cross_entropy": SMALL,  # mean over rows, ignore_index, 70 classes in chunks
    "groupnorm_silu": SMALL,  # groups of 18, 54 and 14 elements; ranks 4 and 3; channels-last
}


def task_source(forward: str, inputs: str, init: str = "pass", args: str = "x") -> str:
    return textwrap.dedent(
        """
        import math
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                {init}

            def forward(self, {args}):
                {forward}


        def get_inputs():
            return [{inputs}]


        def get_init_inputs():
            return []
        """
    ).format(forward=forward, inputs=inputs, init=init, args=args)


def plan_of(source: str):
    a = local_analysis(source)
    plan, reason = match(a)
    assert plan is not None, reason
    return a, plan


def compare_in_interpreter(source: str, candidate: str, input_sets, rtol: float) -> None:
    """Run ``candidate`` under the Triton interpreter next to a float64 reference, per input set.

    The pass rule is the verifier's: every element within ``rtol * (|golden| + rms(golden))`` (plus
    twice PyTorch's own error), NaN exactly where the golden has it, the reference's dtype and shape.
    Runs in the :func:`interpreter` process.
    """
    import torch

    task = load_task(source, "row_task.py")
    ref = task.model_cls().eval()
    ref64 = task.model_cls().eval().double()
    with torch.no_grad():  # weights away from their defaults of ones and zeros
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1)
    ref64.load_state_dict(ref.state_dict())
    new = import_source(candidate, f"rows_{uuid.uuid4().hex[:8]}", "row_candidate.py").ModelNew()
    new.load_state_dict(ref.state_dict(), strict=True)
    with torch.no_grad():
        for inputs in input_sets:
            native = ref(*inputs)
            golden = ref64(*[t.double() if t.is_floating_point() else t for t in inputs]).double()
            out = new(*inputs)
            assert out.dtype == native.dtype and out.shape == native.shape
            o = out.double()
            assert torch.equal(torch.isnan(o), torch.isnan(golden))
            finite = torch.isfinite(golden)
            rms = float(golden[finite].pow(2).mean().sqrt())
            err = (o[finite] - golden[finite]).abs()
            own = float((native.double()[finite] - golden[finite]).abs().max())  # PyTorch's own error
            limit = rtol * (golden[finite].abs() + rms) + 2 * own
            assert bool((err <= limit).all()), f"max error {float(err.max()):.3g} (PyTorch's own {own:.3g})"


@pytest.fixture(scope="module")
def interpreter():
    """A spawned process in Triton's interpreter mode from its start.

    ``tl.sum``/``tl.max`` are jit functions of triton.language itself: they run under the
    interpreter only if triton was first imported in interpreter mode. A pool initializer is too
    late: unpickling it imports this module, whose imports (torch._dynamo) import triton. So the
    process is started with the variable in the environment it inherits.
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ProcessPoolExecutor(1, mp_context=context)
        pool.submit(int).result()  # the worker starts now, with the variable set
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    with pool:
        yield pool


def check_candidate(
    interpreter, source, input_sets, params=None, rtol=1e-4, split_target=None, waiting=False
) -> str:
    """Generate the candidate of ``source`` with ``params`` and compare it with the reference.

    ``split_target``: rows are split over programs when a launch would have fewer (on a GPU the
    candidate takes it from the SM count; on the CPU it never splits unless told). ``waiting``:
    split rows must take the one launch of waiting parts (the candidate has no other split launch).
    """
    a, plan = plan_of(source)
    candidate = generate_rowwise(a, plan, params)
    if split_target is not None:
        assert "SPLIT_TARGET = None" in candidate
        candidate = candidate.replace("SPLIT_TARGET = None", f"SPLIT_TARGET = {split_target}")
    if waiting:
        assert "_wait_kernel[" in candidate and "_split_kernel" not in candidate
    assert static_check(candidate) == []
    interpreter.submit(compare_in_interpreter, source, candidate, input_sets, rtol).result()
    return candidate


# ----------------------------------------------------------------------------------------------
# Patterns and their spellings: matched, and the kernel right on both paths
# ----------------------------------------------------------------------------------------------

#: name -> (forward, example inputs, __init__ body, forward arguments, input sets to check).
PATTERNS = {
    "softmax_masked_fill": (
        "return x.masked_fill(mask == 0, float('-inf')).softmax(-1)",
        "torch.randn(2, 5, 20), (torch.rand(5, 20) > 0.3).long()",
        "pass",
        "x, mask",
        lambda t: [
            [t.randn(2, 5, 20), (t.rand(5, 20) > 0.3).long()],
            [t.randn(3, 50), (t.rand(3, 50) > 0.3).long()],
        ],
    ),
    "softmax_dtype_and_module": (
        "return self.sm(x * self.scale).to(torch.float16)",
        "torch.randn(4, 24)",
        "self.sm = nn.Softmax(dim=-1); self.scale = nn.Parameter(torch.tensor(0.7))",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(3, 40) * 4]],
    ),
    "manual_softmax": (
        "e = torch.exp(x - x.max(dim=-1, keepdim=True)[0])\n        return e / e.sum(-1, keepdim=True)",
        "torch.randn(4, 24)",
        "pass",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(3, 50)]],
    ),
    "layer_norm_functional_no_affine": (
        "return F.layer_norm(x + r, (x.shape[-1],), eps=1e-6)",
        "torch.randn(4, 24), torch.randn(4, 24)",
        "pass",
        "x, r",
        lambda t: [[t.randn(4, 24) + 3, t.randn(4, 24)], [t.randn(2, 3, 70), t.randn(70)]],
    ),
    "layer_norm_then_gelu": (
        "return F.gelu(self.norm(x)) * 2",
        "torch.randn(4, 24)",
        "self.norm = nn.LayerNorm(24)",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(2, 3, 24) * 10 + 5]],
    ),
    "manual_layer_norm": (
        "m = x.mean(-1, keepdim=True)\n        v = ((x - m) ** 2).mean(-1, keepdim=True)\n"
        "        return (x - m) / torch.sqrt(v + 1e-5) * self.w + self.b",
        "torch.randn(4, 24)",
        "self.w = nn.Parameter(torch.ones(24)); self.b = nn.Parameter(torch.zeros(24))",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(3, 24) * 3]],
    ),
    "layer_norm_with_var": (
        "m = x.mean(-1, keepdim=True)\n        v = x.var(-1, keepdim=True, unbiased=False)\n"
        "        return (x - m) / torch.sqrt(v + 1e-5)",
        "torch.randn(4, 24)",
        "pass",
        "x",
        lambda t: [[t.randn(4, 24) + 3], [t.randn(3, 50)]],
    ),
    "std_and_var_corrections": (
        "return x.std(-1) + torch.var(x, dim=-1, correction=2) + torch.std(x, -1, False, False)",
        "torch.randn(4, 24)",
        "pass",
        "x",
        lambda t: [[t.randn(4, 24) * 2], [t.randn(3, 50)]],
    ),
    "rms_norm_module": (
        "return self.norm(x)",
        "torch.randn(4, 24)",
        "self.norm = nn.RMSNorm(24, eps=1e-6)",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(2, 3, 24)]],
    ),
    "rms_norm_reciprocal_sqrt": (
        "return self.w * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-5))",
        "torch.randn(4, 40)",
        "self.w = nn.Parameter(torch.ones(40))",
        "x",
        lambda t: [[t.randn(4, 40)], [t.randn(1, 40) * 3]],
    ),
    "rms_norm_functional_default_eps": (
        "return F.rms_norm(x, (x.size(-1),))",
        "torch.randn(4, 24)",
        "pass",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(3, 45)]],
    ),
    "l2_norm_division": (
        "return x / x.norm(dim=-1, keepdim=True)",
        "torch.randn(4, 24)",
        "pass",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(3, 50)]],
    ),
    "vector_norms": (
        "return torch.linalg.vector_norm(x, dim=-1) + x.norm(p=1, dim=-1) + torch.norm(x, float('inf'), -1)",
        "torch.randn(4, 24)",
        "pass",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(3, 50)]],
    ),
    "reductions_keepdim_and_bias": (
        "return torch.mean(x, dim=-1, keepdim=True) * 2 + self.b - x.amin(-1, keepdim=True)",
        "torch.randn(4, 24)",
        "self.b = nn.Parameter(torch.randn(4, 1))",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(4, 50)]],
    ),
    "logsumexp": (
        "return torch.logsumexp(x * 3, dim=-1)",
        "torch.randn(4, 24)",
        "pass",
        "x",
        lambda t: [[t.randn(4, 24)], [t.randn(3, 50)]],
    ),
    "cross_entropy_flattened_sum": (
        "return F.cross_entropy(x.view(-1, x.size(-1)), t.view(-1), reduction='sum')",
        "torch.randn(2, 4, 24), torch.randint(0, 24, (2, 4))",
        "pass",
        "x, t",
        lambda t: [
            [t.randn(2, 4, 24), t.randint(0, 24, (2, 4))],
            [t.randn(3, 3, 70), t.randint(0, 70, (3, 3))],
        ],
    ),
    "group_norm_silu_any_rank": (
        "return F.silu(self.gn(x))",
        "torch.randn(2, 8, 5, 5)",
        "self.gn = nn.GroupNorm(4, 8)",
        "x",
        lambda t: [[t.randn(2, 8, 5, 5)], [t.randn(3, 8, 7)], [t.randn(2, 8)], [t.randn(1, 8, 3, 4, 5) + 2]],
    ),
    "group_norm_embedding_residual": (
        "h = F.group_norm(x + emb, 2, self.w, self.b, 1e-6)\n        return h * torch.sigmoid(h) + x",
        "torch.randn(2, 6, 4, 4), torch.randn(2, 6, 1, 1)",
        "self.w = nn.Parameter(torch.rand(6)); self.b = nn.Parameter(torch.randn(6))",
        "x, emb",
        lambda t: [
            [t.randn(2, 6, 4, 4), t.randn(2, 6, 1, 1)],
            [t.randn(2, 4, 6, 6).permute(0, 3, 1, 2), t.randn(2, 6, 1, 1)],  # channels-last
        ],
    ),
    "cross_entropy_module": (
        "return self.loss(x, t)",
        "torch.randn(8, 24), torch.randint(0, 24, (8,))",
        "self.loss = nn.CrossEntropyLoss(ignore_index=3, reduction='sum')",
        "x, t",
        lambda t: [[t.randn(8, 24), t.randint(0, 24, (8,))], [t.randn(5, 70), t.tensor([3, 1, 3, 69, 0])]],
    ),
    "cross_entropy_none_ignore": (
        "return F.cross_entropy(x / 2, t, reduction='none', ignore_index=0)",
        "torch.randn(8, 24), torch.randint(0, 24, (8,))",
        "pass",
        "x, t",
        lambda t: [[t.randn(8, 24), t.randint(0, 24, (8,))], [t.randn(5, 70), t.randint(0, 70, (5,))]],
    ),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_kernel_on_both_paths(name, interpreter):
    """Default blocks (every row in registers) and SMALL ones (rows over 32 columns in chunks)."""
    import torch

    forward, inputs, init, args, sets = PATTERNS[name]
    source = task_source(forward, inputs, init, args)
    torch.manual_seed(0)
    input_sets = sets(torch)
    candidate = check_candidate(interpreter, source, input_sets)
    check_candidate(interpreter, source, input_sets, params=SMALL)
    kernel = candidate.split("class ModelNew")[0]
    for library in ("softmax", "layer_norm", "rms_norm", "normalize", "cross_entropy", "logsumexp", "F."):
        assert f"torch.{library}" not in kernel and f"F.{library}" not in kernel


@pytest.mark.parametrize(
    ("dtype", "rtol"), [("float16", 2e-3), ("bfloat16", 1.6e-2)], ids=["float16", "bfloat16"]
)
def test_half_precision_inputs(dtype, rtol, interpreter):
    """Half inputs and weights: fp32 math, one rounding at the store (bf16 rounded to nearest even)."""
    import torch

    half = getattr(torch, dtype)
    h = f"dtype=torch.{dtype}"
    cases = [
        (
            "return self.norm(x + r)",
            f"torch.randn(4, 24, {h}), torch.randn(4, 24, {h})",
            f"self.norm = nn.LayerNorm(24, {h})",
            "x, r",
            [[torch.randn(4, 24, dtype=half) + 2, torch.randn(4, 24, dtype=half)]],
        ),
        (
            "return F.softmax(x, dim=-1, dtype=torch.float32)",
            f"torch.randn(4, 24, {h})",
            "pass",
            "x",
            [[torch.randn(4, 50, dtype=half)]],
        ),
        (
            "return F.cross_entropy(x, t)",
            f"torch.randn(8, 50, {h}), torch.randint(0, 50, (8,))",
            "pass",
            "x, t",
            [[torch.randn(8, 50, dtype=half), torch.randint(0, 50, (8,))]],
        ),
    ]
    for forward, example, init, args, sets in cases:
        check_candidate(interpreter, task_source(forward, example, init, args), sets, params=SMALL, rtol=rtol)


def test_non_contiguous_inputs(interpreter):
    """Transposed, strided and sliced inputs: read through their strides or made contiguous."""
    import torch

    source = task_source("return F.softmax(x, dim=-1) * 2", "torch.randn(4, 24)")
    torch.manual_seed(1)
    sets = [
        [torch.randn(24, 4).t()],  # columns not contiguous: copied
        [torch.randn(4, 48)[:, ::2]],
        [torch.randn(5, 4, 40).transpose(0, 1)],  # leading dims permuted: read in place
        [torch.randn(4, 30)[:, 3:27]],
    ]
    check_candidate(interpreter, source, sets)
    check_candidate(interpreter, source, sets, params=SMALL)


def _splittable(name: str) -> bool:
    forward, inputs, init, args, _ = PATTERNS[name]
    _, plan = plan_of(task_source(forward, inputs, init, args))
    return splittable(plan)


SPLITTABLE = [name for name in sorted(PATTERNS) if _splittable(name)]


def test_which_plans_split_their_rows():
    """One reduction level of mergeable states and an output per element; not a loss, not two levels."""
    for name in (
        "softmax_masked_fill",
        "layer_norm_then_gelu",
        "rms_norm_module",
        "group_norm_silu_any_rank",
    ):
        assert name in SPLITTABLE
    for name in ("cross_entropy_module", "manual_layer_norm", "logsumexp", "vector_norms"):
        assert name in PATTERNS and name not in SPLITTABLE


def test_multi_pass_walks_each_pass_the_other_way():
    """Each pass starts on the chunks the pass before read last (still in L2); the passes before
    the last hint evict_last, the last evict_first (log_softmax on the H100: long_rows_walk.md)."""
    import re

    forward, inputs, init, args, _sets = PATTERNS["manual_layer_norm"]  # two levels, then the output
    a, plan = plan_of(task_source(forward, inputs, init, args))
    assert plan.levels == 2
    source = generate_rowwise(a, plan, SMALL)
    one_row = source[source.index("else:  # rows longer than one block") :]  # not splittable: no PHASE
    headers = re.findall(r"^ *(for start in range\(0, n_cols|for k in range\(0, n_cols)", one_row, flags=re.M)
    assert [h.split()[1] for h in headers] == ["start", "k", "start"]
    assert one_row.count("start = last - k") == 1
    loops = re.split(r"^ *# pass \d", one_row, flags=re.M)[1:]
    assert "evict_last" in loops[0] and "evict_last" in loops[1] and "evict_first" not in loops[0] + loops[1]
    assert "evict_first" in loops[2] and "evict_last" not in loops[2]


@pytest.mark.parametrize("name", SPLITTABLE)
def test_split_rows_merge_their_states_into_scalars(name):
    """Both split paths merge a row's SPLITS states from one-dimensional loads reduced whole into
    scalars. Loaded as [1, SPLITS] tiles, Triton 3.6 kept every state in every thread (254
    registers for GroupNorm's 64 parts, bench/results/waiting_rows.md); and [1, 1] statistics went
    through shared memory once per program (the output launch L1-bound, 9x slower at 32 parts per
    row on the H100), where scalars broadcast into the output's layout for free."""
    import re

    forward, inputs, init, args, _sets = PATTERNS[name]
    a, plan = plan_of(task_source(forward, inputs, init, args))
    for params, kernel in ((SPLIT_SMALL, "_split_kernel("), (SPLIT_WAIT, "_wait_kernel(")):
        source = generate_rowwise(a, plan, params)
        stats = source[source.index("parts = tl.arange(0, SPLITS)", source.index(kernel)) :]
        end = re.search(r"^\s*(for start in range\(lo, hi, BLOCK_N\):|start = lo)$", stats, flags=re.M)
        stats = stats[: end.start()]
        loads = re.findall(r"= (tl\.load\(ws_ptr[^\n]*)", stats)
        assert loads and all(load.endswith("* SPLITS + parts)") for load in loads), loads
        assert "axis=" not in stats and "None" not in stats, stats


#: Splittable patterns whose input sets have rows longer than SMALL keeps in registers (32 columns),
#: so that their rows split; LayerNorm(24)'s and the RMSNorm module's rows always fit.
SPLIT_ROWS = [name for name in SPLITTABLE if name not in ("layer_norm_then_gelu", "rms_norm_module")]


def load_candidate(candidate: str, path: Path):
    """``candidate`` imported as a fresh module from ``path`` (@triton.jit needs a source file)."""
    path.write_text(candidate)
    return import_source(candidate, f"{path.stem}_{uuid.uuid4().hex[:8]}", str(path))


def launched_phases(name: str, params: dict, tmp_path: Path) -> set[int]:
    """The PHASE of every kernel launch of pattern ``name``'s candidate on its input sets, with rows
    split over programs when fewer than 64 would run: the launches are recorded, not run."""
    import torch

    forward, inputs, init, args, sets = PATTERNS[name]
    a, plan = plan_of(task_source(forward, inputs, init, args))
    candidate = generate_rowwise(a, plan, params).replace("SPLIT_TARGET = None", "SPLIT_TARGET = 64")
    module = load_candidate(candidate, tmp_path / f"{name}_launches.py")
    launches: list = []
    record_launches(module, launches)
    torch.manual_seed(2)
    for input_set in sets(torch):
        module.ModelNew()(*input_set)
    return {phase_of(kernel, kwargs) for kernel, _, kwargs in launches}


def test_grouped_chunks_stay_within_two_channels(tmp_path, interpreter):
    """A chunk of a grouped row spanning more than two channels gathers the per-channel weights
    column by column (on the H100, 186 registers per thread and 2.2x slower than a chunk of one
    channel's positions: row_configs.md). So the chunk shrinks to the largest power of two within a
    channel, down to MIN_GROUPED_CHUNK; below that it spans channels, of at most MAX_GATHER_CHUNK
    columns and GATHER_PER_THREAD a thread, split rows too. Rows with no per-channel operand keep CHUNK."""
    import torch

    small = {
        "MIN_GROUPED_CHUNK = 1024": "MIN_GROUPED_CHUNK = 16",
        "GATHER_PER_THREAD = 16": "GATHER_PER_THREAD = 1",
    }

    def candidate_of(source, chunk=64, gather=32, split_target=None):
        params = {"MAX_SINGLE": 16, "CHUNK": chunk, "TILE": 1024, "num_warps": 1}
        candidate = generate_rowwise(*plan_of(source), params)
        edits = {**small, "MAX_GATHER_CHUNK = 4096": f"MAX_GATHER_CHUNK = {gather}"}
        if split_target:
            edits["SPLIT_TARGET = None"] = f"SPLIT_TARGET = {split_target}"
        for old, new in edits.items():
            assert old in candidate
            candidate = candidate.replace(old, new)
        return candidate

    def launches(source, shapes, **kwargs):
        module = load_candidate(
            candidate_of(source, **kwargs), tmp_path / f"grouped_{uuid.uuid4().hex[:6]}.py"
        )
        record: list = []
        record_launches(module, record)
        for shape in shapes:
            module.ModelNew()(torch.randn(*shape))
        return [(kw["BLOCK_N"], kw["WIDE_POSITIONS"], kw["ROWS"], kw["num_warps"]) for _, _, kw in record]

    # 4 rows of 2 channels, of 100, 32, 20 and 12 positions; 4 rows of 32 gathering columns: 4 warps
    shapes = [(1, 8, 10, 10), (1, 8, 4, 8), (1, 8, 4, 5), (1, 8, 3, 4)]
    affine = task_source(
        "return F.silu(self.gn(x))", "torch.randn(2, 8, 4, 4)", "self.gn = nn.GroupNorm(4, 8)"
    )
    assert launches(affine, shapes) == [
        (64, True, 4, 1),
        (32, True, 4, 1),
        (16, True, 4, 1),
        (32, False, 4, 4),
    ]
    plain = task_source("return F.group_norm(x, 4)", "torch.randn(2, 8, 4, 4)")  # x alone: one flat run
    assert launches(plain, shapes) == [
        (64, True, 4, 1),
        (64, False, 4, 1),
        (64, False, 4, 1),
        (64, False, 4, 1),
    ]
    # one row of 32 channels of 12 positions, split over 2 programs: 128 gathering columns, 4 warps
    one = task_source(
        "return F.silu(self.gn(x))", "torch.randn(1, 32, 3, 4)", "self.gn = nn.GroupNorm(1, 32)"
    )
    split = {"chunk": 128, "gather": 128, "split_target": 64}
    assert launches(one, [(1, 32, 3, 4)], **split) == [(128, False, 1, 4)] * 2
    torch.manual_seed(4)  # and the shrunken chunks give the reference's answer
    sets = [[torch.randn(*shape) * 2 + 1] for shape in shapes]
    interpreter.submit(compare_in_interpreter, affine, candidate_of(affine), sets, 1e-4).result()
    interpreter.submit(
        compare_in_interpreter, one, candidate_of(one, **split), [[torch.randn(1, 32, 3, 4)]], 1e-4
    ).result()


def test_weights_are_read_as_columns_where_blocks_would_gather_them(tmp_path, interpreter):
    """Where a block spans more than two channels, weights that are the same for every sample are
    copied to one value per column and read like the input (on the H100, 0.0999 ms against 0.1488
    for the gathers: row_configs.md); only with PER_COLUMN_SAMPLES samples per copy (the copy is
    made each call), never per-sample values (an embedding added to every channel), never where
    blocks stay within a channel."""
    import torch

    def modes(source, shapes, params):
        candidate = generate_rowwise(*plan_of(source), params)
        module = load_candidate(candidate, tmp_path / f"columns_{uuid.uuid4().hex[:6]}.py")
        record: list = []
        record_launches(module, record)
        for shape in shapes:
            module.ModelNew()(*(torch.randn(*s) for s in shape))
        return [
            tuple(v for k, v in kw.items() if k.startswith("MODE")) for _, _, kw in record
        ]  # operand order

    chunks = {"MAX_SINGLE": 16, "CHUNK": 64, "TILE": 1024, "num_warps": 1}  # 24 columns: multi-pass
    source = task_source(
        "return F.silu(self.gn(x))", "torch.randn(2, 8, 4, 4)", "self.gn = nn.GroupNorm(4, 8)"
    )
    assert modes(source, [[(16, 8, 3, 4)], [(15, 8, 3, 4)]], chunks) == [(0, 0, 0), (0, 2, 2)]  # 15: too few
    assert modes(source, [[(16, 8, 3, 4)]], {**chunks, "MAX_SINGLE": 32}) == [(0, 0, 0)]  # in registers too
    assert modes(source, [[(16, 8, 8, 8)]], chunks) == [(0, 2, 2)]  # 64 positions: within a channel
    forward, inputs, init, args, _sets = PATTERNS["group_norm_embedding_residual"]  # x + emb, weights
    emb = modes(task_source(forward, inputs, init, args), [[(16, 6, 3, 4), (16, 6, 1, 1)]], chunks)
    assert len(emb) == 1 and sorted(emb[0]) == [0, 0, 0, 2]  # one value per sample and channel: gathered
    torch.manual_seed(5)
    sets = [[torch.randn(16, 8, 3, 4) * 2 + 1], [torch.randn(16, 8, 5) - 3]]
    interpreter.submit(
        compare_in_interpreter, source, generate_rowwise(*plan_of(source), chunks), sets, 1e-4
    ).result()


@pytest.mark.parametrize("name", SPLITTABLE)
def test_split_patterns_split_their_rows(name, tmp_path):
    """The split tests below run on the patterns whose rows split: two launches, or one of waiting parts."""
    if name in SPLIT_ROWS:
        assert launched_phases(name, SPLIT_SMALL, tmp_path) >= {1, 2}
        assert 3 in launched_phases(name, SMALL_WAIT, tmp_path)
    else:
        # rows that fit in registers in the example: the candidate carries no split launch
        assert launched_phases(name, {**SMALL_WAIT, "MAX_SINGLE": 32}, tmp_path) == {0}


@pytest.mark.parametrize("name", SPLIT_ROWS)
def test_rows_split_over_programs(name, interpreter):
    """A row's parts reduced by several programs, their states merged, each part written by its own."""
    import torch

    forward, inputs, init, args, sets = PATTERNS[name]
    torch.manual_seed(2)
    check_candidate(
        interpreter, task_source(forward, inputs, init, args), sets(torch), SPLIT_SMALL, split_target=64
    )


@pytest.mark.parametrize("name", SPLIT_ROWS)
def test_rows_split_over_programs_that_wait_for_each_other(name, interpreter):
    """One launch: each program reduces its part, waits for the row's statistics and writes its part.
    The interpreter runs programs one at a time, so every part but a row's last reduces the row itself."""
    import torch

    forward, inputs, init, args, sets = PATTERNS[name]
    torch.manual_seed(2)
    source = task_source(forward, inputs, init, args)
    check_candidate(interpreter, source, sets(torch), SMALL_WAIT, split_target=64, waiting=True)


def test_waiting_parts_read_the_row_once():
    """Each program of the waiting launch loads its part once, hinted ``evict_last``, and posts its
    states before it counts itself (a release); it writes part ``flat - lag`` (before that when
    lagged, after it otherwise): it polls that part's row a bounded number of times (reducing the
    row itself if it stopped waiting) and reads the part once more, hinted ``evict_first``, and
    stores it streaming (``.cs``)."""
    import re

    forward, inputs, init, args, _sets = PATTERNS["group_norm_embedding_residual"]
    a, plan = plan_of(task_source(forward, inputs, init, args))
    source = generate_rowwise(a, plan, SPLIT_WAIT)
    body = source[source.index("_wait_kernel(") :].split("\n\n\n", 1)[0]
    write, post = body.split("elif flat < n_rows * SPLITS:", 1)
    assert "if (step == 0) == LAGGED:" in write and "if flat >= lag:" in write
    assert post.index("tl.store(ws_ptr") < post.index('tl.atomic_add(posted_ptr + pid, 1, sem="release")')
    waiting, rest = write.split("while (seen < target) & (polls < spin):", 1)
    fallback, output = rest.split("parts = tl.arange(0, SPLITS)", 1)
    x_load = r"v0 = tl\.load\(x_ptr \+ off_x\[:, None\] \+ cols[^\n]*"
    policy = r'eviction_policy="(\w+)"'
    assert [re.search(policy, x)[1] for x in re.findall(x_load, post)] == ["evict_last"]
    assert not re.findall(x_load, waiting)
    # the fallback reduces the whole row in chunks of an eighth of a part, and posts nothing
    assert "if seen < target:" in fallback and "for start in range(0, n_cols, (BLOCK_N // 8)):" in fallback
    assert "tl.store(" not in fallback and "tl.atomic" not in fallback.split("if seen < target:")[1]
    assert [re.search(policy, x)[1] for x in re.findall(x_load, output)] == ["evict_first"]
    stores = re.findall(r"tl\.store\(out_ptr[^\n]*", output)
    assert stores and all(x.endswith('cache_modifier=".cs")') for x in stores)


#: Patterns whose waiting launch runs with a lag on the CPU (one row's parts there).
LAGGED = ["group_norm_embedding_residual", "softmax_masked_fill", "layer_norm_with_var"]


@pytest.mark.parametrize("name", LAGGED)
def test_lagged_programs_only_wait_for_programs_started_before_them(name, interpreter):
    """With WAIT_LAG, program i writes part i - lag, lag at least a row's parts: every part of the
    row it writes belongs to a program started before it, so the interpreter, which runs programs
    one at a time in order and never polls, finds each row posted and never reduces a row itself
    (a fallback taken here raises; with no lag it does)."""
    import re

    import torch

    forward, inputs, init, args, sets = PATTERNS[name]
    source = task_source(forward, inputs, init, args)
    a, plan = plan_of(source)
    candidate = generate_rowwise(a, plan, {**SMALL_WAIT, "WAIT_LAG": 30})
    candidate = candidate.replace("SPLIT_TARGET = None", "SPLIT_TARGET = 64")
    fallback = "if seen < target:  # not all posted after spin polls: reduce the whole row here"
    assert candidate.count(fallback) == 1
    indent = re.search(rf"^( *){re.escape(fallback)}", candidate, flags=re.M).group(1)
    # the interpreter runs a kernel as Python: a raise in the fallback raises when it is taken
    candidate = candidate.replace(
        fallback, f'{fallback}\n{indent}    raise AssertionError("a row not posted")'
    )
    assert "_split_kernel" not in candidate  # the waiting launch, or one program per row
    torch.manual_seed(2)
    interpreter.submit(compare_in_interpreter, source, candidate, sets(torch), 1e-4).result()
    unlagged = candidate.replace("WAIT_LAG = 30", "WAIT_LAG = 0")
    with pytest.raises(Exception, match="a row not posted"):
        interpreter.submit(compare_in_interpreter, source, unlagged, sets(torch), 1e-4).result()


def repeated_calls(source: str, candidate: str, input_sets, calls: list[int]):
    """Call the candidate on ``input_sets[i]`` for each i of ``calls`` (in the interpreter): each
    output's largest error against the float64 reference, and the waiting launch's counters after."""
    import torch

    task = load_task(source, "row_task.py")
    ref64 = task.model_cls().eval().double()
    module = import_source(candidate, f"rows_{uuid.uuid4().hex[:8]}", "row_candidate.py")
    new = module.ModelNew()
    new.load_state_dict(ref64.state_dict())
    errors = []
    with torch.no_grad():
        for i in calls:
            inputs = input_sets[i]
            golden = ref64(*[t.double() if t.is_floating_point() else t for t in inputs])
            errors.append(float((new(*inputs).double() - golden).abs().max()))
    return errors, {key[2:]: posted.tolist() for key, posted in module._POSTED.items()}


@pytest.mark.parametrize("wait_lag", [0, 30])
def test_waiting_counters_are_kept_between_calls(wait_lag, interpreter):
    """No memset per call: each waiting launch adds SPLITS to every row's counter (and the lag to
    the count of the programs after the rows), and the next call's targets start from there. Calls
    of two shapes in turn keep their own counters and compute every row: a target too low would
    merge states not yet stored (unlagged, the interpreter's rows are not whole when their first
    parts write), one too high would take the fallback, which raises here when lagged."""
    import re

    import torch

    forward, inputs, init, args, _sets = PATTERNS["softmax_masked_fill"]
    source = task_source(forward, inputs, init, args)
    a, plan = plan_of(source)
    params = {**SMALL_WAIT, "WAIT_LAG": wait_lag}
    candidate = generate_rowwise(a, plan, params).replace("SPLIT_TARGET = None", "SPLIT_TARGET = 64")
    if wait_lag:
        fallback = "if seen < target:  # not all posted after spin polls: reduce the whole row here"
        indent = re.search(rf"^( *){re.escape(fallback)}", candidate, flags=re.M).group(1)
        candidate = candidate.replace(
            fallback, f'{fallback}\n{indent}    raise AssertionError("a row not posted")'
        )
    torch.manual_seed(4)
    input_sets = [
        [torch.randn(rows, cols), (torch.rand(rows, cols) > 0.3).long()] for rows, cols in ((3, 50), (2, 90))
    ]
    calls = [0, 0, 1, 0, 1, 1]
    errors, counters = interpreter.submit(repeated_calls, source, candidate, input_sets, calls).result()
    assert max(errors) < 1e-5, errors
    assert len(counters) == 2  # a shape each
    for (n_rows, parts, lag), posted in counters.items():
        shape = next(i for i, xs in enumerate(input_sets) if len(xs[0]) == n_rows)
        made = calls.count(shape)
        assert parts > 1 and lag == (parts if wait_lag else 0)
        assert posted == [made * parts] * n_rows + [made * lag]


@pytest.mark.parametrize("name", ["group_norm_embedding_residual", "softmax_masked_fill"])
def test_kernels_take_64_bit_offsets_where_an_operand_reaches_2_31(name, interpreter, tmp_path):
    """Offsets are 32-bit unless an operand's or the output's reach 2**31 elements (OFF64): the
    64-bit branch, forced here on small inputs, computes the same rows, split or not."""
    import torch

    forward, inputs, init, args, sets = PATTERNS[name]
    source = task_source(forward, inputs, init, args)
    a, plan = plan_of(source)
    candidate = generate_rowwise(a, plan, SMALL_WAIT).replace("SPLIT_TARGET = None", "SPLIT_TARGET = 64")
    module = load_candidate(candidate, tmp_path / "off64_candidate.py")
    meta = {"device": "meta"}
    assert not module._off64([torch.empty(4, 8), torch.empty(3, 1, **meta).expand(3, 2**31)])
    assert not module._off64([torch.empty(2**31, dtype=torch.int8, **meta)])  # 2**31 - 1 at most
    assert module._off64([torch.empty(2**31 + 1, dtype=torch.int8, **meta)])
    assert not module._off64([torch.empty_strided((2, 2), (2**30, 1), **meta)])  # 2**30 + 1 at most
    assert module._off64([torch.empty_strided((3, 2), (2**30, 1), **meta)])
    forced = "    off64 = _off64([*views, out])"
    assert candidate.count(forced) == 1
    torch.manual_seed(2)
    wide = candidate.replace(forced, "    off64 = True")
    interpreter.submit(compare_in_interpreter, source, wide, sets(torch), 1e-4).result()


def test_how_far_behind_a_waiting_program_writes(tmp_path):
    """The lag: WAIT_LAG % of L2 in parts read, at least a row's parts (so a program waits only for
    programs started before it) and at most every part; 0 without WAIT_LAG; one row's parts on the CPU."""
    import torch

    a, plan = plan_of(task_source("return x.softmax(-1)", "torch.randn(4, 64)"))
    params = {**SMALL_WAIT, "WAIT_LAG": 25}
    module = load_candidate(generate_rowwise(a, plan, params), tmp_path / "lag_candidate.py")
    cpu = torch.device("cpu")
    assert module._wait_lag(4096, 16, 8192, cpu) == 16
    module.WAIT_LAG_PARTS = 1000
    assert module._wait_lag(4096, 16, 8192, cpu) == 1000
    assert module._wait_lag(600, 16, 8192, cpu) == 600  # never past the last part
    module.WAIT_LAG_PARTS = 3
    assert module._wait_lag(4096, 16, 8192, cpu) == 16  # never within a row
    module.WAIT_LAG = 0
    assert module._wait_lag(4096, 16, 8192, cpu) == 0


def test_split_rows_with_empty_and_fully_masked_parts(interpreter):
    """65 columns in 16-column chunks over 4 parts leave the last part empty (in 8 waiting parts of
    16 columns, the last 3); a masked half leaves whole parts at -inf (their softmax sums must not
    turn into NaN when merged)."""
    import torch

    torch.manual_seed(3)
    x = torch.randn(3, 65)
    mask = torch.ones(3, 65, dtype=torch.long)
    mask[:, :40] = 0
    mask[1] = 1
    softmax = task_source(
        "return x.masked_fill(mask == 0, float('-inf')).softmax(-1)", "x, mask", args="x, mask"
    ).replace("return [x, mask]", "return [torch.randn(3, 65), torch.ones(3, 65, dtype=torch.long)]")
    norm = task_source("return F.layer_norm(x, (65,)) * x.amax(-1, keepdim=True)", "torch.randn(3, 65)")
    for params, waiting in ((SPLIT_SMALL, False), (SMALL_WAIT, True)):  # two launches, then one
        check_candidate(interpreter, softmax, [[x, mask]], params, split_target=64, waiting=waiting)
        check_candidate(interpreter, norm, [[x], [x[:2] * 100 + 5]], params, split_target=64, waiting=waiting)


def test_how_many_programs_share_a_row(tmp_path):
    """A power of two, at most one per chunk and MAX_SPLITS, only when the rows alone leave the
    launch under its target; never on the CPU unless a target is set."""
    import torch

    a, plan = plan_of(task_source("return x.softmax(-1)", "torch.randn(4, 64)"))
    module = load_candidate(generate_rowwise(a, plan, SPLIT_SMALL), tmp_path / "split_candidate.py")
    cpu = torch.device("cpu")
    assert module._splits(3, 10**6, 2048, cpu) == 1
    module.SPLIT_TARGET = 64
    assert module._splits(3, 65, 16, cpu) == 4  # 5 chunks: the power of two below
    assert module._splits(3, 10**6, 2048, cpu) == 16  # 64 // 3 = 21 programs per row at most
    assert module._splits(1, 10**9, 16, cpu) == module.MAX_SPLITS == 64
    assert module._splits(40, 10**6, 2048, cpu) == 1  # 40 rows already fill more than half the target
    assert module._splits(3, 100, 2048, cpu) == 1  # one chunk per row: nothing to split


def test_plan_structure():
    _, softmax = plan_of(
        task_source(
            "return torch.softmax(x * 0.5 + m, dim=-1)",
            "torch.randn(2, 3, 8, 8), torch.randn(8, 8)",
            args="x, m",
        )
    )
    assert [s.op for s in softmax.reductions] == ["rlse"] and softmax.levels == 1
    assert softmax.layouts == ["row", "row"]  # the (8, 8) mask is read per element, broadcast by strides
    assert softmax.row_shape == (2, 3, 8, 8) and softmax.result_layout == "row"

    _, manual = plan_of(
        task_source(PATTERNS["manual_layer_norm"][0], "torch.randn(4, 24)", PATTERNS["manual_layer_norm"][2])
    )
    assert manual.levels == 2  # the variance needs the mean first: three passes over long rows

    _, stats = plan_of(
        task_source(
            "return x.sum(-1) * self.s", "torch.randn(4, 24)", "self.s = nn.Parameter(torch.randn(4))"
        )
    )
    assert stats.result_layout == "flat" and stats.layouts == ["row", "flat"]

    _, group = plan_of((ROWS / "groupnorm_silu.py").read_text())
    assert group.groups == 4 and group.layouts == ["row", "row", "row"]  # x, weight, bias
    assert group.reshapes == [None, "channel", "channel"]  # (C,) weights broadcast along dim 1

    _, loss = plan_of((ROWS / "cross_entropy.py").read_text())
    assert loss.loss_reduction == "mean" and loss.index_operands == frozenset({1})
    assert loss.layouts == ["row", "flat"] and loss.out_shape == ()


# ----------------------------------------------------------------------------------------------
# What does not apply, and why
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forward", "inputs", "init", "reason"),
    [
        ("return x @ x", "torch.randn(4, 4)", "pass", "'matmul'"),
        (
            "return self.fc(x).softmax(-1)",
            "torch.randn(4, 8)",
            "self.fc = nn.Linear(8, 8)",
            "'linear' (Linear",
        ),
        ("return x.softmax(0)", "torch.randn(4, 8)", "pass", "reduction over dim 0"),
        ("return x.sum(dim=1)", "torch.randn(4, 8, 3)", "pass", "reduction over dim 1"),
        ("return x.sum()", "torch.randn(4, 8)", "pass", "every element"),
        ("return x.softmax(-1), x", "torch.randn(4, 8)", "pass", "one tensor"),
        ("return x * 2 + 1", "torch.randn(4, 8)", "pass", "elementwise (see fused_pointwise)"),
        ("return x.max(-1)[1].float()", "torch.randn(4, 8)", "pass", "argmax"),
        ("return x.sum(-1).sum(-1)", "torch.randn(4, 8, 5)", "pass", "already one per row"),
        ("return x - x.mean(-1, keepdim=True)", "torch.randn(4, 1)", "pass", "rows of length 1"),
        ("return F.layer_norm(x, x.shape[-2:])", "torch.randn(4, 8, 5)", "pass", "computed at run time"),
        ("return F.layer_norm(x, (8, 5))", "torch.randn(4, 8, 5)", "pass", "last 2 dims"),
        ("return F.group_norm(x, 2).softmax(-1)", "torch.randn(4, 8, 5)", "pass", "next to group_norm"),
        ("return F.group_norm(x.softmax(-1), 2)", "torch.randn(4, 8, 5)", "pass", "next to another"),
        ("return x.softmax(-1) + y", "torch.randn(1, 8), torch.randn(3, 8)", "pass", "not the broadcast"),
    ],
)
def test_rejects_with_a_reason(forward, inputs, init, reason):
    args = "x, y" if inputs.count("torch.") == 2 else "x"
    plan, why = match(local_analysis(task_source(forward, inputs, init, args)))
    assert plan is None
    assert reason in why


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        ("return F.cross_entropy(x, t, weight=self.w)", "class weights"),
        ("return F.cross_entropy(x, t, label_smoothing=0.1)", "label_smoothing"),
        (
            "return F.cross_entropy(x.unsqueeze(-1).expand(4, 8, 3), t.unsqueeze(-1).expand(4, 3))",
            "'unsqueeze'",
        ),
        ("return F.cross_entropy(x, t) * 2", "the loss must be the output"),
        ("return F.cross_entropy(x, (x * 2).softmax(-1))", "integer input"),
    ],
)
def test_cross_entropy_rejects_with_a_reason(forward, reason):
    source = task_source(
        forward,
        "torch.randn(4, 8), torch.randint(0, 8, (4,))",
        "self.w = nn.Parameter(torch.rand(8))",
        "x, t",
    )
    plan, why = match(local_analysis(source))
    assert plan is None
    assert reason in why


def test_cross_entropy_module_with_class_weights_is_refused():
    source = task_source(
        "return self.loss(x, t)",
        "torch.randn(4, 8), torch.randint(0, 8, (4,))",
        "self.loss = nn.CrossEntropyLoss(weight=torch.rand(8))",
        "x, t",
    )
    plan, why = match(local_analysis(source))
    assert plan is None
    assert "class weights" in why


# ----------------------------------------------------------------------------------------------
# Parameters, tuning and the menu
# ----------------------------------------------------------------------------------------------


def test_kernel_is_not_specialized_to_the_example_shape():
    a, plan = plan_of(
        task_source("return self.norm(x)", "torch.randn(4096, 1536)", "self.norm = nn.LayerNorm(1536)")
    )
    candidate = generate_rowwise(a, plan)
    host_and_kernel = candidate.split("class ModelNew")[0]
    for size in ("4096", "1536"):
        assert size not in host_and_kernel
    assert "n_cols = row_shape[-1]" in candidate and "torch.broadcast_shapes" in candidate
    assert (
        "register_parameter('weight', nn.Parameter(torch.zeros((1536,), dtype=torch.float32)))" in candidate
    )


def test_generate_rejects_bad_params():
    a, plan = plan_of(task_source("return x.softmax(-1)", "torch.randn(4, 8)"))
    with pytest.raises(ValueError, match="MAX_SINGLE"):
        generate_rowwise(a, plan, {"MAX_SINGLE": 1000})
    with pytest.raises(ValueError, match="num_warps"):
        generate_rowwise(a, plan, {"num_warps": 3})
    with pytest.raises(ValueError, match="unknown parameter"):
        generate_rowwise(a, plan, {"BLOCK_SIZE": 64})
    with pytest.raises(ValueError, match="SPLIT_PER_SM"):
        generate_rowwise(a, plan, {"SPLIT_PER_SM": -1})
    for part in (8, 3000, 32768, True):
        with pytest.raises(ValueError, match="WAIT_PART"):
            generate_rowwise(a, plan, {"WAIT_PART": part})
    for lag in (-1, 101, 0.5, True):
        with pytest.raises(ValueError, match="WAIT_LAG"):
            generate_rowwise(a, plan, {"WAIT_LAG": lag})


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90", "sm_90a", "sm_100", "cuda", "cpu"])
def test_tuning_space_per_arch(arch):
    a, plan = plan_of(task_source("return x.softmax(-1)", "torch.randn(4, 8)"))
    configs = tuning_space(plan, arch)
    assert len(configs) == 1 if arch == "cpu" else len(configs) >= 4
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for config in configs:
        assert {"MAX_SINGLE", "CHUNK", "TILE", "num_warps"} <= set(config) <= {*DEFAULT_PARAMS}
        generate_rowwise(a, plan, config)  # every configuration is valid
    if arch != "cpu":  # a softmax's rows can be split: one configuration measures them unsplit
        assert configs[-1]["SPLIT_PER_SM"] == 0 and all("SPLIT_PER_SM" not in c for c in configs[:-1])
    with pytest.raises(ValueError, match="unknown architecture"):
        tuning_space(plan, "tpu")


def test_long_rows_try_the_biggest_chunks_first():
    """The planner tries configurations in order and only the first few fit a run's budget: rows
    longer than any single-pass block (measured on the H100 in long_rows.md) start at CHUNK 8192."""
    _, short = plan_of(task_source("return x.log_softmax(-1)", "torch.randn(4, 4096)"))
    _, long = plan_of(task_source("return x.log_softmax(-1)", "torch.randn(4, 32000)"))
    _, groups = plan_of(task_source("return F.group_norm(x, 2)", "torch.randn(2, 4, 128, 128)"))
    assert row_length(long) == 32000 and row_length(groups) == 2 * 128 * 128
    assert tuning_space(short, "sm_90")[0]["CHUNK"] == 4096
    for plan in (long, groups):
        space = tuning_space(plan, "sm_90")
        # few long rows: the first two try them in one launch of waiting parts of 8192 columns,
        # then 4096, each program writing a part read 28 % of L2 earlier (waiting_rows.md); the
        # third is the same in two launches
        assert space[0] == {**space[2], "WAIT_PART": 8192, "WAIT_LAG": 28}
        assert space[1] == {**space[2], "WAIT_PART": 4096, "WAIT_LAG": 28}
        assert space[2]["CHUNK"] == 8192 and space[-1] == {**space[2], "SPLIT_PER_SM": 0}
        assert [c["CHUNK"] for c in space[2:-1]] == sorted((c["CHUNK"] for c in space[2:-1]), reverse=True)

    def configs(plan):  # the same configurations, in another order
        plain = {"MAX_SINGLE", "CHUNK", "TILE", "num_warps"}
        return {tuple(sorted(c.items())) for c in tuning_space(plan, "sm_90") if set(c) == plain}

    assert configs(long) == configs(short)
    assert not any("WAIT_PART" in c for c in tuning_space(short, "sm_90"))  # rows that fit: no parts
    # the knowledge base's seed advice and a win on another (short-row) task do not push it back
    seed = {"source": "seed", "strategy": "row_reduction", "params": {"num_warps": [4, 8, 16]}}
    won = {"source": "verified", "strategy": "row_reduction", "params": tuning_space(short, "sm_90")[0]}
    ordered = order_configs(tuning_space(long, "sm_90"), [won, seed], "row_reduction")
    assert ordered[0] == tuning_space(long, "sm_90")[0] and ordered[1] == won["params"]


def test_menu_offers_row_reduction_first():
    assert STRATEGIES["row_reduction"].source_kind == "kernel"
    a = local_analysis((FIXTURES / "tasks" / "softmax.py").read_text())
    names = [s.name for s, _ in applicable(a)]
    assert names == ["row_reduction", "cuda_graphs", "torch_compile", "torch_compile_max_autotune"]
    assert "_kernel[grid](" in playbook.generate("row_reduction", a.task_source, a, {})
    assert playbook.tuning_space("row_reduction", a, "sm_90")[0]["MAX_SINGLE"] >= 4096
    pointwise = local_analysis((FIXTURES / "tasks" / "pointwise.py").read_text())
    assert "elementwise" in playbook.rejected(pointwise)["row_reduction"]


# ----------------------------------------------------------------------------------------------
# The real Triton compiler: the interpreter accepts code that does not compile for a GPU
# ----------------------------------------------------------------------------------------------

POINTER_TYPES = {
    "float32": "*fp32",
    "float16": "*fp16",
    "bfloat16": "*bf16",
    "int64": "*i64",
    "int32": "*i32",
    "bool": "*i1",
}
#: Fixture tasks whose kernels are compiled: strided rows on both paths, the loss kernels, bf16
#: rounding, grouped rows.
COMPILED = ("attention_softmax", "cross_entropy", "rmsnorm", "groupnorm_silu")
#: Of those, the ones with few enough rows to be split over programs (compiled that way too).
SPLIT_COMPILED = ("rmsnorm", "groupnorm_silu")


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the launch instead."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return self.record

    def record(self, *args, **kwargs) -> None:
        self.launches.append((self.kernel, args, kwargs))


def record_launches(module, launches: list) -> None:
    """Every ``*_kernel`` of a candidate module replaced by a :class:`LaunchRecorder`."""
    for name in dir(module):
        if name.endswith("_kernel"):
            setattr(module, name, LaunchRecorder(getattr(module, name), launches))


def launch_kind(kernel_name: str) -> str:
    """``rows`` (one program per block of rows), ``split``, ``wait`` or ``loss``, from a kernel's name."""
    for kind in ("split", "wait"):
        if kernel_name.endswith(f"_{kind}_kernel"):
            return kind
    return "loss" if kernel_name == "loss_reduce_kernel" else "rows"


def phase_of(kernel, kwargs: dict) -> int:
    """A launch as the phases of split rows: 0 one program per row, 1 and 2 the split launches, 3
    the waiting launch."""
    kind = launch_kind(kernel.__name__)
    return {"rows": 0, "wait": 3}.get(kind, kwargs.get("PHASE", 0))


def compile_for_sm90(jobs: dict[str, tuple[str, str]], workdir: str) -> dict[str, list[dict] | str]:
    """Compile every kernel launch of each ``(task source, candidate source)`` to an sm_90 cubin.

    Runs in a fresh process (the Triton interpreter patches ``triton.language`` in the process that
    used it). No GPU is needed: the launches are recorded on CPU tensors instead of run, on the
    task's inputs and test inputs, then each distinct specialization goes through Triton's whole
    pipeline (TTIR, TTGIR, LLVM, PTX, ptxas). Returns per job the constexprs of each compiled
    specialization, or the error as text.
    """
    import os

    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = os.path.join(workdir, "triton-cache")
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results: dict[str, list[dict] | str] = {}
    for name, (task_text, candidate) in jobs.items():
        try:
            path = Path(workdir) / f"{name}_candidate.py"  # @triton.jit needs a source file
            path.write_text(candidate)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            launches = []
            record_launches(module, launches)
            task = load_task(task_text, f"{name}.py")
            torch.manual_seed(0)
            model = module.ModelNew()
            for inputs in [task.get_inputs(), *task.get_test_inputs()]:
                model(*inputs)  # the loss's final kernel is recorded too; its unwritten result is unused
            compiled, seen = [], set()
            for kernel, args, kwargs in launches:
                kwargs = dict(kwargs)
                warps = kwargs.pop("num_warps", 4)  # Triton's default
                signature = {}
                values = [*args, *kwargs.values()]
                for param, value in zip(inspect.signature(kernel.fn).parameters, values, strict=True):
                    if param in kwargs:
                        signature[param] = "constexpr"
                    elif isinstance(value, torch.Tensor):
                        signature[param] = POINTER_TYPES[str(value.dtype).replace("torch.", "")]
                    else:
                        signature[param] = "i64" if abs(int(value)) >= 2**31 else "i32"
                key = (kernel.__name__, tuple(signature.values()), tuple(kwargs.items()), warps)
                if key in seen:
                    continue
                seen.add(key)
                source = ASTSource(fn=kernel, signature=signature, constexprs=kwargs)
                binary = triton.compile(
                    source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
                )
                if binary.asm["cubin"]:
                    compiled.append({"kernel": kernel.__name__, **kwargs})
            results[name] = compiled
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"[:3000]
    return results


@pytest.fixture(scope="module")
def sm90_builds(tmp_path_factory):
    """Each COMPILED fixture's candidate (SMALL blocks, 4 warps) compiled in one spawned process."""
    import multiprocessing

    jobs = {}
    for name in COMPILED:
        source = (ROWS / f"{name}.py").read_text()
        a, plan = plan_of(source)
        jobs[name] = (source, generate_rowwise(a, plan, {**SMALL, "num_warps": 4}))
    for name in SPLIT_COMPILED:  # the same candidates with their rows split over programs
        source = jobs[name][0]
        a, plan = plan_of(source)
        candidate = generate_rowwise(a, plan, {**SPLIT_SMALL, "num_warps": 4})
        jobs[f"{name}_split"] = (source, candidate.replace("SPLIT_TARGET = None", "SPLIT_TARGET = 64"))
        for suffix, lag in (("wait", 0), ("lagged", 28)):
            waiting = generate_rowwise(a, plan, {**SMALL_WAIT, "WAIT_LAG": lag, "num_warps": 4})
            jobs[f"{name}_{suffix}"] = (source, waiting.replace("SPLIT_TARGET = None", "SPLIT_TARGET = 64"))
    workdir = str(tmp_path_factory.mktemp("sm90"))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(compile_for_sm90, jobs, workdir).result()


@pytest.mark.parametrize("name", COMPILED)
def test_kernels_compile_for_sm90(name, sm90_builds):
    """The interpreter accepts code that the compiler refuses: every specialization must build."""
    compiled = sm90_builds[name]
    assert isinstance(compiled, list), compiled
    rows = {c.get("SINGLE_PASS") for c in compiled if launch_kind(c["kernel"]) == "rows"}
    _, plan = plan_of((ROWS / f"{name}.py").read_text())
    # rows of the example longer than SMALL's 32 columns: the loop alone (rmsnorm's 40, 70 classes)
    assert rows == ({None} if row_length(plan) > SMALL["MAX_SINGLE"] else {False, True})
    assert ("loss_reduce_kernel" in {c["kernel"] for c in compiled}) == (name == "cross_entropy")


@pytest.mark.parametrize("name", SPLIT_COMPILED)
def test_split_row_kernels_compile_for_sm90(name, sm90_builds):
    """The stats launch and the output launch of split rows build too."""
    compiled = sm90_builds[f"{name}_split"]
    assert isinstance(compiled, list), compiled
    phases = {c["PHASE"] for c in compiled if launch_kind(c["kernel"]) == "split" and c["SPLITS"] > 1}
    assert phases == {1, 2}


@pytest.mark.parametrize("name", SPLIT_COMPILED)
@pytest.mark.parametrize("lagged", [False, True])
def test_waiting_row_kernels_compile_for_sm90(name, lagged, sm90_builds):
    """The one launch of waiting parts (atomics, a bounded poll, the fallback loop) builds, each
    program writing its own part or, lagged, an earlier one first."""
    compiled = sm90_builds[f"{name}_{'lagged' if lagged else 'wait'}"]
    assert isinstance(compiled, list), compiled
    waiting = [c for c in compiled if launch_kind(c["kernel"]) == "wait" and c["SPLITS"] > 1]
    assert {c["LAGGED"] for c in waiting} == {lagged}


# ----------------------------------------------------------------------------------------------
# The real verifier (sandboxed golden and candidate children): one task per pattern
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verdicts():
    """Each fixture task's candidate through the whole verification protocol, two at a time.

    The candidates are generated here first (FX tracing is not thread-safe); the verifications run
    in two spawned processes, not threads: CPython 3.11's ``ast`` module (the verifier's static
    checks) fails when two threads parse at once.
    """
    import multiprocessing

    jobs = {}
    for name, params in VERIFIED.items():
        source = (ROWS / f"{name}.py").read_text()
        a, plan = plan_of(source)
        jobs[name] = (source, generate_rowwise(a, plan, params))
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {
            name: pool.submit(
                verify, source, candidate, device="cpu", settings=SETTINGS, task_path=f"{name}.py"
            )
            for name, (source, candidate) in jobs.items()
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", list(VERIFIED))
def test_fixture_candidate_passes_verify(name, verdicts):
    verdict = verdicts[name]
    assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
    assert verdict.kind == "kernel", verdict.kind_evidence
    assert "verified at one shape" not in verdict.flags
    assert len(verdict.input_sets) >= 7


# ----------------------------------------------------------------------------------------------
# A candidate carries only the path its plan and parameters select
# ----------------------------------------------------------------------------------------------

SUITE = sorted((Path(__file__).parents[2] / "bench" / "suite").glob("*.py"))
#: Names that belong to split rows, waiting parts or GroupNorm rows only.
SPLIT_NAMES = ("_split_kernel", "_splits", "SPLIT_TARGET", "ws_ptr", "PHASE")
WAIT_NAMES = ("_wait_kernel", "_POSTED", "_posted", "SPIN_POLLS", "posted_ptr", "atomic_add", "_wait_lag")
GROUPED_NAMES = ("_grouped", "GROUPS", "MODE_", "HAS_SPLIT", "WIDE_POSITIONS", "ONE_CHANNEL", "_per_column")


def test_rmsnorm_candidate_carries_only_its_rows():
    """6 rows of 40 columns: rows in registers and the multi-pass loop for longer rows of other
    shapes; no split or waiting launch, no counters, no GroupNorm indexing, whatever the configuration."""
    a, plan = plan_of((ROWS / "rmsnorm.py").read_text())
    for params in [*tuning_space(plan, "sm_90"), *tuning_space(plan, "cpu"), {}]:
        source = generate_rowwise(a, plan, params)
        for name in (*SPLIT_NAMES, *WAIT_NAMES, *GROUPED_NAMES, "loss_reduce_kernel", "spin"):
            assert name not in source, (name, params)
        assert "def rms_norm_kernel(" in source and "def rms_norm(x, weight):" in source
        assert "if SINGLE_PASS:" in source  # and its loop for longer rows
        assert len(source.splitlines()) <= 250


def test_groupnorm_candidate_with_waiting_parts(interpreter):
    """GroupNorm's waiting-parts parameters keep the waiting launch, its counters and the grouped
    indexing (and no two-launch split); it computes the reference's answer under the interpreter."""
    import torch

    source = (ROWS / "groupnorm_silu.py").read_text()
    a, plan = plan_of(source)
    candidate = generate_rowwise(a, plan, SMALL_WAIT)
    for name in ("_wait_kernel", "_POSTED", "SPIN_POLLS", "atomic_add", "_grouped", "GROUPS"):
        assert name in candidate, name
    assert "_split_kernel" not in candidate and "loss_reduce_kernel" not in candidate
    task = load_task(source, "groupnorm_silu.py")
    torch.manual_seed(6)
    sets = [task.get_inputs(), *task.get_test_inputs()]
    candidate = candidate.replace("SPLIT_TARGET = None", "SPLIT_TARGET = 64")  # split on the CPU too
    assert static_check(candidate) == []
    interpreter.submit(compare_task_in_interpreter, source, candidate, sets).result()


def _suite_tasks() -> list[tuple[str, str]]:
    found = []
    for path in SUITE:
        source = path.read_text()
        plan, _ = match(local_analysis(source, str(path)))
        if plan is not None:
            found.append((path.stem, source))
    return found


SUITE_ROWS = _suite_tasks()


def test_suite_has_row_tasks():
    names = {name for name, _ in SUITE_ROWS}
    assert {"rmsnorm_llama_bf16", "groupnorm_silu_fp16", "cross_entropy_llm_vocab_bf16"} <= names


def shrunk_inputs(inputs: list, groups: bool) -> list:
    """The task's inputs cut to a few rows, the reduced dims (and GroupNorm's channels) kept whole."""
    out = []
    for t in inputs:
        if not hasattr(t, "dim") or t.dim() == 0:
            out.append(t)
            continue
        if not t.is_floating_point():  # class indices: one per row, cut as the rows are
            index = tuple(slice(0, 2) for _ in range(t.dim()))
        elif groups:  # (N, C, *): one sample, C whole, 2 positions per spatial dim
            index = (slice(0, 1), slice(None), *(slice(0, 2) for _ in range(t.dim() - 2)))
        else:
            index = (*(slice(0, 2) for _ in range(t.dim() - 1)), slice(None))
        out.append(t[index[: t.dim()]].clone())
    return out


def compare_task_in_interpreter(source: str, candidate: str, input_sets: list) -> None:
    """The candidate against a float64 reference of the task (built from its init inputs) on each
    input set (in the interpreter process)."""
    import torch

    task = load_task(source, "suite_task.py")
    torch.manual_seed(0)
    ref = task.model_cls(*task.get_init_inputs()).eval()
    ref64 = task.model_cls(*task.get_init_inputs()).eval().double()
    ref64.load_state_dict(ref.state_dict())
    new = import_source(candidate, f"suite_{uuid.uuid4().hex[:8]}", "suite_candidate.py").ModelNew(
        *task.get_init_inputs()
    )
    new.load_state_dict(ref.state_dict())
    for inputs in input_sets:
        with torch.no_grad():
            native = ref(*inputs)
            golden = ref64(*[t.double() if t.is_floating_point() else t for t in inputs]).double()
            out = new(*inputs)
        assert out.dtype == native.dtype and out.shape == golden.shape
        own = float((native.double() - golden).abs().max())
        err = float((out.double() - golden).abs().max())
        assert err <= 1e-4 * float(golden.abs().max() + 1) + 2 * own, (err, own)


@pytest.mark.parametrize(("name", "source"), SUITE_ROWS, ids=[name for name, _ in SUITE_ROWS])
def test_suite_candidates_compile_and_verify(name, source, interpreter):
    """Each configuration the planner tries first on sm_90 gives a candidate that parses; the
    first one computes the reference's answer on a few rows under the interpreter."""
    import ast

    import torch

    a, plan = plan_of(source)
    space = tuning_space(plan, "sm_90")
    for params in space[:4]:
        ast.parse(generate_rowwise(a, plan, params))
    candidate = generate_rowwise(a, plan, space[0])
    torch.manual_seed(1)
    inputs = shrunk_inputs(load_task(source, f"{name}.py").get_inputs(), plan.groups is not None)
    interpreter.submit(compare_task_in_interpreter, source, candidate, [inputs]).result()
