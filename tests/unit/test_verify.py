"""Every honest fixture candidate passes; every cheating or broken one fails at its expected stage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kernelcrew.config import Settings
from kernelcrew.task import TaskError, load_task
from kernelcrew.tools.correctness import compare_output, make_golden, tolerance_for, verify
from kernelcrew.tools.harness import (
    SCALE_FACTORS,
    SIGNED_SETS,
    _bitwise_equal,
    _input_sets,
    _scaled_variant,
    _signed_variant,
    clone_tensors,
    construct_on,
    copy_into,
    describe_inputs,
    inputs_unchanged,
    shares_storage,
    zero_inputs,
)
from tests.conftest import FIXTURES, fixture_meta

CANDIDATES = sorted((FIXTURES / "candidates").glob("*.py"))
SLOW = {"load_inline_error.py"}  # compiles torch/extension.h: about 40 s on two cores
HANGS = {"hangs.py", "hangs_import.py"}


@pytest.fixture(scope="module")
def goldens():
    """One golden per fixture task (fixed seed), shared by all candidates of that task."""
    made = {}
    settings = Settings(sandbox_timeout_s=120)
    for task in (FIXTURES / "tasks").glob("*.py"):
        made[task.stem] = make_golden(
            task.read_text(), device="cpu", seed=1234, task_path=str(task), settings=settings
        )
    yield made
    for golden in made.values():
        golden.cleanup()


@pytest.mark.parametrize("path", CANDIDATES, ids=[p.name for p in CANDIDATES])
def test_fixture_candidate(path, goldens):
    task, expect = fixture_meta(path)
    golden = goldens[task]
    timeout = 6 if path.name in HANGS else (300 if path.name in SLOW else 120)
    verdict = verify(
        golden.task_source,
        path.read_text(),
        candidate_path=str(path),
        task_path=golden.task_path,
        golden=golden,
        settings=Settings(sandbox_timeout_s=timeout),
    )
    if expect == "pass":
        assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
        assert verdict.stage == "done"
        assert verdict.max_rel_error is not None and verdict.max_rel_error < 1e-4
        assert all(c["passed"] for c in verdict.checks), verdict.checks
    else:
        assert not verdict.passed
        assert verdict.stage == expect, (verdict.stage, verdict.message)
        assert verdict.failures and verdict.failures[0]["stage"] == expect
        assert verdict.message


def test_kinds(goldens):
    triton = verify(
        goldens["softmax"].task_source,
        (FIXTURES / "candidates" / "softmax_triton.py").read_text(),
        golden=goldens["softmax"],
    )
    assert triton.kind == "kernel"
    assert triton.kind_evidence["shares"]["own"] >= 0.5
    library = verify(
        goldens["linear_relu"].task_source,
        (FIXTURES / "candidates" / "linear_relu_torch.py").read_text(),
        golden=goldens["linear_relu"],
    )
    assert library.passed and library.kind == "library"
    assert library.kind_evidence["shares"]["own"] == 0


def test_failure_records_are_structured(goldens):
    verdict = verify(
        goldens["softmax"].task_source,
        (FIXTURES / "candidates" / "hardcoded_shape.py").read_text(),
        golden=goldens["softmax"],
    )
    failure = verdict.failures[0]
    assert failure["stage"] == "correctness"
    assert failure["input_set"]["origin"] == "test"
    assert failure["input_set"]["shapes"] == ["(3, 257):float32"]
    assert failure["max_abs_error"] > 0
    assert len(failure["first_bad_index"]) == 2


def test_one_shape_task_is_flagged_and_signed_variants_run(goldens):
    verdict = verify(
        goldens["relu"].task_source,
        (FIXTURES / "candidates" / "relu_triton.py").read_text(),
        golden=goldens["relu"],
    )
    assert verdict.passed
    assert "verified at one shape" in verdict.flags
    signed = [s for s in verdict.input_sets if s["origin"] == "signed"]
    assert 1 <= len(signed) <= SIGNED_SETS
    assert sum(s["origin"] == "seed" for s in verdict.input_sets) >= 5


NUMPY_INPUTS = """
import numpy as np
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return x * 2

def get_inputs():
    return [torch.from_numpy(torch.rand(4, 3).numpy() + np.float32(1))]

def get_init_inputs():
    return []

def get_test_inputs():
    return [[torch.rand(2, 5)]]
"""


def test_inputs_that_cannot_be_made_on_the_device_are_made_on_the_cpu_with_a_note():
    # The meta device stands in for a GPU here: a tensor made there cannot become a NumPy array.
    task = load_task(NUMPY_INPUTS, path="numpy_task.py")
    sets, note = _input_sets(task, 11, 2, "meta")
    cpu_sets, cpu_note = _input_sets(task, 11, 2, "cpu")
    assert "inputs made on the CPU" in note and not cpu_note
    assert [s["origin"] for s in sets] == ["seed", "seed", "test"]
    for made, expected in zip(sets, cpu_sets, strict=True):
        assert all(
            torch.equal(a, b) and a.device.type == "cpu"
            for a, b in zip(made["inputs"], expected["inputs"], strict=True)
        )


class _Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.rnn = torch.nn.GRU(4, 4)  # keeps its parameters in a list too (_flat_weights)
        self.register_buffer("scale", torch.ones(4))


class _Stray(_Plain):
    def __init__(self):
        super().__init__()
        self.mask = [torch.ones(4)]  # an attribute .to() leaves where it was made


class _NeedsCpu(_Plain):
    def __init__(self):
        super().__init__()
        self.table = torch.from_numpy(torch.arange(4).numpy())  # raises on another device


def test_modules_are_built_on_the_device_unless_that_would_change_them():
    # The meta device stands in for a GPU: a module whose tensors all move with .to() is built
    # there; one that keeps a stray tensor, or whose __init__ needs the CPU, is built on the CPU
    # (under the seed again), as a user's Model(...).to(device) would be.
    assert next(construct_on("meta", _Plain, 3).parameters()).device.type == "meta"
    for cls in (_Stray, _NeedsCpu):
        built = construct_on("meta", cls, 3)
        torch.manual_seed(3)
        expected = cls()
        assert all(p.device.type == "cpu" for p in built.parameters())
        assert all(
            torch.equal(a, b)
            for a, b in zip(built.state_dict().values(), expected.state_dict().values(), strict=True)
        )
    assert next(construct_on("cpu", _Plain, 3).parameters()).device.type == "cpu"


def test_constant_parameters_are_randomized(goldens):
    assert "norm.weight" in goldens["layernorm"].meta["randomized_parameters"]
    assert "norm.bias" in goldens["layernorm"].meta["randomized_parameters"]


def test_seeds_are_secret_per_run_and_replayable():
    task = (FIXTURES / "tasks" / "pointwise.py").read_text()
    cand = (FIXTURES / "candidates" / "pointwise_triton.py").read_text()
    first = verify(task, cand)
    second = verify(task, cand)
    assert first.seed != second.seed
    replay = verify(task, cand, seed=first.seed)
    assert replay.seed == first.seed
    assert [s["seed"] for s in replay.input_sets] == [s["seed"] for s in first.input_sets]


@pytest.mark.parametrize("bad", sorted((FIXTURES / "tasks" / "bad").glob("*.py")), ids=lambda p: p.name)
def test_bad_task_is_a_task_error(bad):
    cand = (FIXTURES / "candidates" / "softmax_triton.py").read_text()
    with pytest.raises(TaskError) as info:
        verify(bad.read_text(), cand, task_path=str(bad))
    assert str(bad) in str(info.value)


def test_golden_is_private_to_the_parent(goldens):
    """Candidate children run as the sandbox user; the golden outputs are the parent's alone."""
    from kernelcrew.tools import sandbox

    golden = goldens["softmax"]
    assert golden.path.stat().st_mode & 0o777 == 0o700
    where = golden.file("golden.pt")
    if golden.kept is None:
        assert where.stat().st_mode & 0o777 == 0o600
    else:  # in the golden child's box, reachable only through this process's descriptor
        assert not (golden.path / "golden.pt").exists()
        where = Path(str(where).replace("/proc/self/", f"/proc/{os.getpid()}/"))
        assert where.read_bytes()[:2] == golden.file("golden.pt").read_bytes()[:2]
    res = sandbox.run("tests.unit.sandbox_targets:read_path", {"path": str(where)})
    if res.isolation.get("mode") == "bwrap":  # outside the child's view: it does not exist there
        assert res.status == "error" and res.error_type == "FileNotFoundError"
        return
    if res.isolation["user"] == "root":
        pytest.skip("no privilege drop here: the static rules are the only barrier (docs/security.md)")
    assert res.status == "error" and res.error_type == "PermissionError"


def test_a_golden_kept_in_memory_spills_to_its_private_folder_and_judges_the_same():
    """Under bubblewrap the golden and native outputs stay in the golden child's box (memory); a
    long-lived executor moves all but its newest golden's to their folders, private as the rest."""
    task = (FIXTURES / "tasks" / "linear_relu.py").read_text()
    cand = (FIXTURES / "candidates" / "linear_relu_torch.py").read_text()
    golden = make_golden(task, seed=7, task_path="linear_relu.py")
    try:
        if golden.kept is None:
            pytest.skip("no box here: the outputs were copied out")
        assert golden.kept.names == ("golden.pt", "native.pt") and golden.meta["phase_s"]["copy_out"] < 5
        before = verify(task, cand, golden=golden, candidate_path="c.py")
        golden.spill()
        assert golden.kept is None and golden.file("golden.pt") == golden.path / "golden.pt"
        assert all((golden.path / n).stat().st_mode & 0o777 == 0o600 for n in ("golden.pt", "native.pt"))
        after = verify(task, cand, golden=golden, candidate_path="c.py")
        assert before.passed and after.passed and before.max_rel_error == after.max_rel_error
    finally:
        golden.cleanup()


def test_naive_softmax_fails_on_a_scaled_set_named_in_the_message(goldens):
    verdict = verify(
        goldens["softmax"].task_source,
        (FIXTURES / "candidates" / "softmax_no_max.py").read_text(),
        golden=goldens["softmax"],
    )
    assert not verdict.passed
    failure = verdict.failures[0]
    assert failure["input_set"]["origin"] == "scaled"
    assert failure["input_set"]["factor"] > 1
    assert "scaled x" in failure["message"] and "scaled x" in verdict.message


def test_scaled_variants_are_recorded_with_their_factor_and_flagged(goldens):
    verdict = verify(
        goldens["softmax"].task_source,
        (FIXTURES / "candidates" / "softmax_triton.py").read_text(),
        golden=goldens["softmax"],
    )
    assert verdict.passed, verdict.message
    scaled = [s for s in verdict.input_sets if s["origin"] == "scaled"]
    seeds = {s["index"] for s in verdict.input_sets if s["origin"] == "seed"}
    assert {s["factor"] for s in scaled} == set(SCALE_FACTORS)
    assert all(s["of"] in seeds for s in scaled)
    assert any(f.startswith("scaled variants tested") for f in verdict.flags)


def test_a_scaled_variant_whose_golden_is_not_finite_is_skipped_with_a_note(goldens):
    meta = goldens["exp_overflow"].meta
    factors = {s["factor"] for s in meta["sets"] if s["origin"] == "scaled"}
    assert max(SCALE_FACTORS) not in factors  # exp(100 * 100) is beyond float64
    assert min(SCALE_FACTORS) in factors
    assert any("not tested" in n and f"x{max(SCALE_FACTORS):g}" in n for n in meta["notes"])


# ----------------------------------------------------------------------------------------------
# The pass rule on non-finite and out-of-range elements
# ----------------------------------------------------------------------------------------------

STRICT = tolerance_for("float32", "pointwise", "strict")


def test_elements_where_float32_overflows_are_judged():
    g = torch.tensor([1.0, -2.0, 3.0, 1e40, -1e40, 0.5], dtype=torch.float64)
    n = g.float()  # inf and -inf where the golden is beyond float32's range
    assert compare_output(n.clone(), g, n, STRICT)["ok"]
    garbage = n.clone()
    garbage[3] = 0.0
    res = compare_output(garbage, g, n, STRICT)
    assert res["stage"] == "correctness" and res["first_bad_index"] == [3]
    assert "range" in res["message"]
    wrong_sign = n.clone()
    wrong_sign[4] = float("inf")
    assert compare_output(wrong_sign, g, n, STRICT)["first_bad_index"] == [4]
    assert compare_output(wrong_sign, g, n, STRICT)["stage"] == "nan"
    nan_there = n.clone()
    nan_there[3] = float("nan")
    assert compare_output(nan_there, g, n, STRICT)["stage"] == "nan"
    # Just beyond the range, the largest float32 is within tolerance of the golden: it passes too.
    edge = torch.tensor([1.0, torch.finfo(torch.float32).max * (1 + 2**-24)], dtype=torch.float64)
    near = torch.tensor([1.0, torch.finfo(torch.float32).max])
    assert compare_output(near, edge, edge.float(), STRICT)["ok"]


def test_pytorch_overflowing_is_no_licence_where_the_golden_is_representable():
    g = torch.tensor([1.0, 2.0, 3e38, 4.0], dtype=torch.float64)
    n = g.float()
    n[2] = float("inf")  # PyTorch's own intermediate overflow
    copy = n.clone()
    res = compare_output(copy, g, n, STRICT)
    assert res["stage"] == "nan" and res["first_bad_index"] == [2]
    assert compare_output(g.float(), g, n, STRICT)["ok"]


def test_nan_only_where_the_golden_is_nan():
    g = torch.randn(8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g[0, 0] = float("nan")
    n = g.float()
    n[1, 1] = float("nan")  # PyTorch's own NaN where the golden is finite
    assert compare_output(g.float(), g, n, STRICT)["ok"]
    assert compare_output(n.clone(), g, n, STRICT)["first_bad_index"] == [1, 1]
    finite = g.float()
    finite[0, 0] = 0.0
    res = compare_output(finite, g, n, STRICT)
    assert res["stage"] == "nan" and res["first_bad_index"] == [0, 0]


def test_elements_beyond_the_range_do_not_loosen_atol(monkeypatch):
    from kernelcrew.tools import correctness

    monkeypatch.setattr(correctness, "JUDGE_CHUNK", 16)
    g = torch.randn(100, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    g[3] = 1e39
    n = g.float()
    cand = n.clone()
    cand[70] += 0.5
    res = compare_output(cand, g, n, STRICT)
    assert res["stage"] == "correctness" and res["first_bad_index"] == [70]
    assert res["atol"] < 1e-3
    cand = n.clone()
    cand[90] = 7.0
    cand[3] = 1.0
    res = compare_output(cand, g, n, STRICT)
    assert res["first_bad_index"] == [3] and res["message"].startswith("2 of 100")


# ----------------------------------------------------------------------------------------------
# Inputs nested in lists, tuples and dicts
# ----------------------------------------------------------------------------------------------


def _nested():
    gen = torch.Generator().manual_seed(8)
    return [
        torch.randn(3, generator=gen),
        [torch.randn(2, 3, generator=gen), (torch.rand(4, generator=gen), 2)],
        {"w": torch.zeros(5), "k": 3},
    ]


def test_nested_inputs_are_described_and_zero_tensors_found():
    inputs = _nested()
    assert describe_inputs(inputs) == [
        "(3,):float32",
        "[(2, 3):float32, ((4,):float32, int)]",
        "{'w': (5,):float32, 'k': int}",
    ]
    assert zero_inputs(inputs) == ["2['w']"]


def test_inputs_unchanged_names_the_path_of_a_changed_nested_tensor():
    inputs = _nested()
    snapshot = clone_tensors(inputs)
    assert inputs_unchanged(snapshot, inputs) is None
    inputs[1][1][0][2] += 1.0
    assert inputs_unchanged(snapshot, inputs) == (1, 1, 0)
    inputs = _nested()
    inputs[1].append(torch.ones(1))
    assert inputs_unchanged(snapshot, inputs) == (1,)
    inputs = _nested()
    del inputs[2]["k"]
    assert inputs_unchanged(snapshot, inputs) == (2,)
    inputs = _nested()
    inputs[1][1] = (inputs[1][1][0], 5)
    assert inputs_unchanged(snapshot, inputs) == (1, 1, 1)


def test_aliasing_bitwise_equality_and_copies_reach_nested_tensors():
    inputs = _nested()
    inner = inputs[1][1][0]
    assert shares_storage((torch.ones(1), [inner.view(2, 2)]), inputs)
    assert shares_storage({"a": inputs[2]["w"][1:]}, inputs)
    assert not shares_storage([t.clone() for t in (inputs[0], inner)], inputs)
    assert _bitwise_equal(inputs, clone_tensors(inputs))
    other = _nested()
    other[1][0][0, 0] = 42.0
    assert not _bitwise_equal(inputs, other)
    assert not _bitwise_equal(inputs, inputs[:2])
    address = inputs[1][0].data_ptr()
    copy_into(inputs, other)
    assert inputs[1][0].data_ptr() == address and _bitwise_equal(inputs, other)


def test_signed_and_scaled_variants_reach_nested_tensors():
    inputs = _nested()
    signed = _signed_variant(inputs, 5)
    assert signed is not None and bool((signed[1][1][0] < 0).any())
    assert torch.equal(signed[1][1][0].abs(), inputs[1][1][0])
    assert torch.equal(signed[0], inputs[0]) and signed[2]["k"] == 3
    scaled = _scaled_variant(inputs, 100.0)
    assert torch.equal(scaled[1][0], inputs[1][0] * 100.0)
    assert torch.equal(scaled[2]["w"], inputs[2]["w"]) and scaled[1][1][1] == 2
    assert _scaled_variant([torch.arange(3), 1.5], 100.0) is None


EXPM1_NAIVE = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.exp(x) - 1

def get_inputs():
    return [torch.randn(16, 32)]

def get_init_inputs():
    return []
"""


def test_a_scale_where_pytorch_itself_loses_accuracy_is_not_tested():
    """exp(x) - 1 cancels in float32 once x is small: PyTorch's own output would use most of the
    tolerance there, so the x1e-3 set would judge rounding, not the candidate."""
    with make_golden(
        EXPM1_NAIVE, seed=3, task_path="expm1.py", settings=Settings(sandbox_timeout_s=120)
    ) as g:
        factors = {s["factor"] for s in g.meta["sets"] if s["origin"] == "scaled"}
        notes = g.meta["notes"]
    assert 1e-3 not in factors
    assert any("x0.001" in n and "PyTorch's own output" in n for n in notes), notes


def test_a_norm_without_eps_fails_only_on_the_small_scaled_set(goldens):
    verdict = verify(
        goldens["layernorm"].task_source,
        (FIXTURES / "candidates" / "layernorm_no_eps.py").read_text(),
        golden=goldens["layernorm"],
    )
    origins = {(f["input_set"]["origin"], f["input_set"].get("factor")) for f in verdict.failures}
    assert origins == {("scaled", min(SCALE_FACTORS))}, verdict.failures


def test_outputs_are_judged_on_one_thread_and_the_thread_count_comes_back(monkeypatch):
    """The judgement runs in small slices: on a machine whose cores were busy, each parallel op
    waited on descheduled threads (a 25M-element output took 20x longer on two threads than one)."""
    from kernelcrew.tools import correctness

    seen = []
    real = correctness._judge_float
    monkeypatch.setattr(
        correctness, "_judge_float", lambda *a: seen.append(torch.get_num_threads()) or real(*a)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.randn(1000, dtype=torch.float64)
        res = compare_output(g.float(), g, g.float(), tolerance_for("float32", "pointwise", "strict"))
        assert res["ok"] and seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


_WIDE_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2.0


def get_inputs():
    return [torch.randn(300, 1000)]


def get_init_inputs():
    return []
"""

_WRONG_WITH_GRAD = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x * (3.0 if torch.is_grad_enabled() else 2.0)
"""


def test_a_large_recheck_output_is_judged_on_random_positions_and_its_error_located():
    """A re-check call's output (here grad mode) of more than RECHECK_ELEMENTS is kept and judged at
    random positions the child drew after the call returned; a wrong answer is still found, and
    the failure names a position of the whole output."""
    verdict = verify(_WIDE_TASK, _WRONG_WITH_GRAD, device="cpu", settings=Settings(sandbox_timeout_s=120))
    assert not verdict.passed
    failure = verdict.failures[0]
    assert "grad" in failure["message"] and "drawn at random" in failure["message"], failure
    row, col = failure["first_bad_index"]
    assert 0 <= row < 300 and 0 <= col < 1000


def test_the_compiler_fallback_s_verification_leaves_out_the_mode_calls_and_says_so():
    """``mode_checks=False`` (kernelcrew's own torch.compile of the reference only) leaves out the
    calls with autograd on and in inference mode: a candidate wrong only under autograd, which the
    default verification fails, then passes, and the verdict flags what was not re-checked."""
    settings = Settings(sandbox_timeout_s=120)
    verdict = verify(_WIDE_TASK, _WRONG_WITH_GRAD, device="cpu", settings=settings, mode_checks=False)
    assert verdict.passed, verdict.message
    assert any("grad and inference modes not re-checked" in f for f in verdict.flags), verdict.flags


_RIGHT_ONLY_ONCE = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * (2.0 if self.calls == 1 else 2.5)
"""


def test_a_large_task_s_later_seed_sets_are_judged_on_a_sample_and_still_catch_a_wrong_answer(
    monkeypatch,
):
    """Past LARGE_OUTPUT_ELEMENTS, the seed sets after the first are judged on SET_SAMPLE_ELEMENTS
    elements drawn in the child after the call: a correct candidate passes with the flag saying so,
    and one right only on its first call fails on the sampled set, located in the whole output."""
    from kernelcrew.tools import correctness

    monkeypatch.setattr(correctness, "LARGE_OUTPUT_ELEMENTS", 1000)
    monkeypatch.setattr(correctness, "SET_SAMPLE_ELEMENTS", 5000)
    settings = Settings(sandbox_timeout_s=120)
    with make_golden(_WIDE_TASK, device="cpu", settings=settings) as golden:
        sampled = correctness.sampled_sets(golden.meta)
        seeds = [r["index"] for r in golden.meta["sets"] if r["origin"] == "seed"]
        assert len(seeds) >= 2 and sampled == dict.fromkeys(seeds[1:], 5000)
        good = verify(_WIDE_TASK, _WIDE_TASK.replace("class Model(", "class ModelNew("), golden=golden)
        assert good.passed, good.message
        assert any("judged on 5000 elements" in f for f in good.flags), good.flags
        bad = verify(_WIDE_TASK, _RIGHT_ONLY_ONCE, golden=golden)
    assert not bad.passed
    failure = bad.failures[0]
    assert failure["input_set"]["index"] == seeds[1] and "drawn at random" in failure["message"], failure
    row, col = failure["first_bad_index"]
    assert 0 <= row < 300 and 0 <= col < 1000


_STATE_IN_INIT = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        torch.autograd.set_detect_anomaly(True)

    def forward(self, x):
        return x * 2.0
"""


def test_global_state_changed_while_the_candidate_is_built_fails_without_the_static_rules(monkeypatch):
    """Each call's state snapshot is taken after ModelNew was built: a change made in ``__init__``
    is checked on its own (here with the static rules, which also refuse it, switched off)."""
    from kernelcrew.tools import correctness

    monkeypatch.setattr(correctness, "static_check", lambda source, path="candidate.py": [])
    verdict = verify(_WIDE_TASK, _STATE_IN_INIT, device="cpu", settings=Settings(sandbox_timeout_s=120))
    assert verdict.stage == "state" and "building ModelNew" in verdict.message, verdict.message
    assert "anomaly_enabled" in verdict.message


def test_a_child_cannot_have_an_input_set_judged_on_a_sample_the_parent_did_not_choose(tmp_path):
    """Which sets are sampled is the parent's decision: a child that keeps the first set's call as
    a sample (positions of its choosing) is judged on it in full and fails; a sampled set's sample
    must have exactly the size asked for."""
    from types import SimpleNamespace

    from kernelcrew.records import Verdict
    from kernelcrew.tools import correctness

    golden_outs = [[torch.randn(10_000, dtype=torch.float64)] for _ in range(2)]
    torch.save(golden_outs, tmp_path / "golden.pt")
    torch.save([[g.float() for g in outs] for outs in golden_outs], tmp_path / "native.pt")
    made = SimpleNamespace(file=lambda name: tmp_path / name)
    meta = {
        "reference_ops": {},
        "sets": [{"index": i, "origin": "seed", "seed": i, "shapes": ["float32[10000]"]} for i in (0, 1)],
    }

    def judged(samples: dict[int, int], whole: tuple[int, ...] = (0,)) -> Verdict:
        outputs, picks = {f"set:{i}": [golden_outs[i][0].float()] for i in whole}, {}
        for i, size in samples.items():  # the calls the child kept as samples of ``size``
            positions = torch.randint(0, 10_000, (size,))
            outputs[f"set:{i}"] = [golden_outs[i][0][positions].float()]
            picks[f"set:{i}"] = [{"positions": positions, "shape": [10_000]}]
        torch.save(outputs, tmp_path / "outputs.pt")
        torch.save(picks, tmp_path / "picks.pt")
        verdict = Verdict(verdict="fail", stage="", message="", seed=1, device="cpu", precision="strict")
        correctness._judge(verdict, meta, lambda n: tmp_path / n, made, False, {1: 100})
        return verdict

    assert judged({1: 100}).passed
    assert judged({0: 100, 1: 100}, whole=()).stage == "shape"  # the first set's sample: no output
    assert "outputs on input sets [0]" in judged({1: 100}, whole=()).message  # nor may it be left out
    assert "malformed sample positions" in judged({1: 10}).message


@pytest.mark.parametrize(
    "written", [b"not a torch file", "chmod", ["a", "list"], {"set:0": "a string"}], ids=repr
)
def test_outputs_the_child_left_unreadable_fail_the_candidate_not_the_run(tmp_path, written):
    """The candidate's process writes ``outputs.pt`` and may spoil it (garbage, no permission, the
    wrong structure): the verdict fails with the reason, the verification does not crash."""
    from types import SimpleNamespace

    from kernelcrew.records import Verdict
    from kernelcrew.tools import correctness

    path = tmp_path / "outputs.pt"
    if isinstance(written, bytes):
        path.write_bytes(written)
    elif written == "chmod":
        torch.save({"set:0": [torch.zeros(2)]}, path)
        path.chmod(0)
        if os.access(path, os.R_OK):  # root reads it anyway
            pytest.skip("this user reads any file")
    else:
        torch.save(written, path)
    verdict = Verdict(verdict="fail", stage="", message="", seed=1, device="cpu", precision="strict")
    golden = SimpleNamespace(file=lambda name: pytest.fail("the golden is never read"))
    correctness._judge(verdict, {"reference_ops": {}, "sets": []}, lambda n: tmp_path / n, golden, False)
    assert verdict.stage == "output_type" and "outputs could not be read" in verdict.message


def test_saved_tensors_skip_the_checksums_and_load_back(tmp_path):
    """Children save their outputs without the archive's CRC-32 (five times slower to write on a
    large task); the files still load, plainly and with mmap, as the parent reads them."""
    import zipfile

    from kernelcrew.tools.harness import save_tensors

    data = {"set:0": [torch.randn(1000), torch.arange(7)]}
    path = tmp_path / "outputs.pt"
    save_tensors(data, path)
    crcs = [info.CRC for info in zipfile.ZipFile(path).infolist() if "/data/" in info.filename]
    assert crcs and set(crcs) == {0}
    for mmap in (False, True):
        back = torch.load(path, weights_only=True, mmap=mmap)
        assert all(torch.equal(a, b) for a, b in zip(back["set:0"], data["set:0"], strict=True))
    from torch.utils.serialization import config

    assert config.save.compute_crc32  # the setting is put back


def test_host_copy_never_shares_memory():
    from kernelcrew.tools.harness import host_copy

    x = torch.randn(64, 3)[:, 1]  # a strided view
    copy = host_copy(x)
    assert torch.equal(copy, x) and copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_outputs_are_judged_on_several_threads_and_torch_gets_its_threads_back(monkeypatch):
    """The parent judges a verification's calls side by side, each on one torch thread."""
    import threading

    from kernelcrew.tools import correctness

    seen_threads, torch_threads = set(), set()
    compare = correctness.compare_output

    def spy(*args, **kwargs):
        seen_threads.add(threading.get_ident())
        torch_threads.add(torch.get_num_threads())
        return compare(*args, **kwargs)

    monkeypatch.setattr(correctness, "compare_output", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        verdict = verify(_WIDE_TASK, _WRONG_WITH_GRAD, device="cpu", settings=Settings(sandbox_timeout_s=120))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert not verdict.passed and "grad" in verdict.failures[0]["message"]
    assert torch_threads == {1} and len(seen_threads) >= 1
    threads = torch.get_num_threads()
    with correctness._judging_pools(1) as (per_call, per_range):
        assert per_call._max_workers == 1
        assert per_range._max_workers == max(1, min(correctness.JUDGE_THREADS, threads))
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("case", ["right", "wrong_late", "nan_and_wrong", "beyond_range", "ulp_noise"])
def test_ranges_judged_side_by_side_give_the_whole_output_s_verdict(monkeypatch, case):
    """A large output is judged in ranges on a pool; every metric, the first bad element and
    the first non-finite one match judging it whole."""
    from concurrent.futures import ThreadPoolExecutor

    from kernelcrew.tools import correctness

    monkeypatch.setattr(correctness, "JUDGE_CHUNK", 64)
    monkeypatch.setattr(correctness, "JUDGE_RANGE", 1000)
    gen = torch.Generator().manual_seed(3)
    golden = torch.randn(50, 101, generator=gen, dtype=torch.float64)
    native = golden.float()
    cand = native.clone()
    dtype = "float32"
    if case == "wrong_late":
        cand[40, 7] += 1.0
        cand[45, 0] -= 2.0
    elif case == "nan_and_wrong":
        cand[30, 3] = float("nan")
        cand[2, 100] += 0.5
        cand[33, 3] = float("inf")
    elif case == "beyond_range":
        golden[20, 20] = 1e6
        native, cand, dtype = golden.half(), golden.half(), "float16"
        cand[25, 1] += 1.0
    elif case == "ulp_noise":
        cand = (golden * (1 + 1e-6 * torch.randn(50, 101, generator=gen, dtype=torch.float64))).float()
    tol = tolerance_for(dtype, "pointwise", "strict")
    whole = compare_output(cand, golden, native, tol)
    with ThreadPoolExecutor(4) as pool:
        ranged = compare_output(cand, golden, native, tol, pool)
    assert ranged == pytest.approx(whole), (ranged, whole)
    assert whole["ok"] == (case in ("right", "ulp_noise"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_judging_never_changes_the_golden_or_pytorch_s_output(dtype):
    """The judge works on its slices in place; a float64 slice of a float64 golden (or native
    output) would be the tensor itself, and every later candidate would be judged against it."""
    gen = torch.Generator().manual_seed(8)
    golden = torch.randn(3000, generator=gen, dtype=torch.float64).to(dtype)
    native = golden.clone()
    cand = (golden * 1.0001).float() if dtype == torch.float32 else golden * 1.0001
    before = (golden.clone(), native.clone())
    tol = tolerance_for(str(dtype).replace("torch.", ""), "pointwise", "strict")
    first = compare_output(cand, golden, native, tol)
    assert torch.equal(golden, before[0]) and torch.equal(native, before[1])
    assert compare_output(cand, golden, native, tol) == first


def test_an_element_as_wrong_as_pytorch_itself_there_passes_and_twice_more_fails():
    """ConvTranspose2d, min, GELU on an H100: 94 of 277M outputs near zero carried the
    convolution's fp32 rounding (1.7e-7) above an atol scaled to the outputs' RMS (3.4e-8), and
    torch.compile, the crew's kernel and PyTorch itself all failed. An element within twice
    PyTorch's own error there passes; three times, or where PyTorch is not finite, fails."""
    gen = torch.Generator().manual_seed(5)
    golden = torch.randn(4096, generator=gen, dtype=torch.float64) * 3.4e-4  # atol 3.4e-8
    golden[100:110] = 1e-9  # near-zero outputs ...
    native = golden.float()
    native[100:110] += 1.7e-7  # ... with an upstream op's rounding
    tol = tolerance_for("float32", "matmul", "strict")
    assert compare_output(native.clone(), golden, native, tol)["ok"]
    twice = native.clone()
    twice[100:110] = (golden[100:110] + 2 * 1.7e-7).float()
    assert compare_output(twice, golden, native, tol)["ok"]
    thrice = native.clone()
    thrice[100:110] = (golden[100:110] + 3.5 * 1.7e-7).float()
    res = compare_output(thrice, golden, native, tol)
    assert not res["ok"] and "twice PyTorch's own error" in res["message"]
    overflowed = native.clone()
    overflowed[100] = float("inf")  # PyTorch not finite there: no allowance
    wrong = native.clone()
    wrong[100] = 1e-3
    assert not compare_output(wrong, golden, overflowed, tol)["ok"]


_RIGHT_WIDE = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x * 2.0
"""


@pytest.mark.parametrize(("candidate", "passes"), [(_RIGHT_WIDE, True), (_WRONG_WITH_GRAD, False)])
def test_input_sets_that_do_not_fit_the_device_move_one_call_at_a_time(
    monkeypatch, tmp_path, candidate, passes
):
    """A task whose input sets do not fit a verification child's share of the device (6.4 GB sets ran
    an H100 out of memory) gets each set moved for its own call, outputs held only while they fit,
    and its re-checks kept at random positions: judged as when everything fits."""
    from kernelcrew.records import Verdict
    from kernelcrew.tools import correctness, harness

    golden = correctness.make_golden(
        _WIDE_TASK, device="cpu", seed=5, settings=Settings(sandbox_timeout_s=120)
    )
    try:
        correctness.share_inputs(golden, tmp_path)
        (tmp_path / "child").mkdir()
        monkeypatch.setattr(harness, "_check_memory", lambda device: 1)  # nothing fits
        payload = {
            "device": "cpu",
            "seed": 5,
            "precision": "strict",
            "task_source": _WIDE_TASK,
            "task_path": "task.py",
            "candidate_source": candidate,
            "candidate_path": str(tmp_path / "candidate.py"),
            "sets": golden.meta["sets"],
            "reference_aliases": False,
            "profile_kind": False,
        }
        result = harness.candidate_child(payload, tmp_path)
        assert any("one call at a time" in note for note in result["notes"])
        picks = torch.load(tmp_path / "child" / "picks.pt", weights_only=True)
        assert picks["set:0"] == [None] and picks["repeat:0"][0]["shape"] == [300, 1000]
        verdict = Verdict(verdict="fail", stage="", message="", seed=5, device="cpu", precision="strict")
        correctness._judge(verdict, golden.meta, lambda n: tmp_path / "child" / n, golden, False)
        assert (not verdict.failures) is passes, verdict.failures
        if not passes:
            assert (
                "grad" in verdict.failures[0]["message"]
                and "drawn at random" in verdict.failures[0]["message"]
            )
            return
        # The child wrote the positions: what it may have put there fails the candidate, never the judge.
        for tampered, message in (
            (
                {**picks, "repeat:0": [{"shape": [300, 1000], "positions": torch.tensor([10**9])}]},
                "malformed",
            ),
            ({**picks, "repeat:0": [{"positions": "everywhere"}]}, "malformed"),
            ({**picks, "set:0": [{"shape": [300, 1000], "positions": torch.tensor([0])}]}, None),
            (["not", "a", "dict"], "could not be read"),
        ):
            torch.save(tampered, tmp_path / "child" / "picks.pt")
            verdict = Verdict(verdict="fail", stage="", message="", seed=5, device="cpu", precision="strict")
            correctness._judge(verdict, golden.meta, lambda n: tmp_path / "child" / n, golden, False)
            if message is None:  # an input set's output is judged in full whatever the file says
                assert not verdict.failures and verdict.verdict == "pass", verdict.failures
            else:
                assert not verdict.passed and message in verdict.message, verdict
    finally:
        golden.cleanup()


def test_a_golden_that_does_not_fit_in_float64_is_computed_in_float32_and_says_so():
    """A 6.4 GB float32 input is 12.8 GB in float64: where that does not fit the device (the timing's
    reference process holds its sets besides), the golden falls back to the reference in float32
    under strict precision, named in its mode, rather than failing the timing."""
    from kernelcrew.tools.harness import _run_golden

    class Model(torch.nn.Module):
        def forward(self, x):
            if x.dtype == torch.float64:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB.")
            return torch.log_softmax(x, dim=-1)

    x = torch.randn(4, 9)
    outs, mode = _run_golden(Model(), Model(), [x], "cpu")
    assert mode == "float32 (float64 did not fit the device's memory)"
    torch.testing.assert_close(outs[0], torch.log_softmax(x, dim=-1))
    outs, mode = _run_golden(torch.nn.Softmax(dim=-1), Model(), [x], "cpu", to_host=False)
    assert mode == "float64" and outs[0].dtype == torch.float64


def test_the_golden_is_stored_rounded_to_float32_where_that_keeps_every_value_finite():
    """A float64 golden is kept rounded to float32 where PyTorch's own output is float32 or narrower
    (half the bytes to copy, write and judge), and kept in float64 where the output is float64 or a
    value is beyond float32's range, where the judge must tell such elements apart."""
    from kernelcrew.tools.harness import stored_golden

    g = torch.randn(64, dtype=torch.float64)
    beyond = torch.tensor([1.0, 1e39, float("nan"), float("inf")], dtype=torch.float64)
    ints = torch.arange(4)
    native = [g.float(), g.clone(), beyond.float(), ints, g.half()]
    stored = stored_golden([g, g, beyond, ints, g], native)
    assert [t.dtype for t in stored] == [
        torch.float32,
        torch.float64,
        torch.float64,
        torch.int64,
        torch.float32,
    ]
    assert torch.equal(stored[0], g.float()) and stored[1] is g
    edge = torch.tensor([float("nan"), float("-inf"), 3e38], dtype=torch.float64)
    assert stored_golden([edge], [edge.float()])[0].dtype == torch.float32  # NaN and Inf survive rounding
    assert stored_golden([g], None)[0] is g


def test_a_made_golden_keeps_float32_outputs_rounded_and_judges_as_before(goldens):
    """The golden file holds the rounded golden; a correct candidate still passes against it with a
    worst error far inside the tolerance, and one off by 1e-3 still fails."""
    golden = goldens["softmax"]
    gold = torch.load(golden.file("golden.pt"), weights_only=True, mmap=True)
    native = torch.load(golden.file("native.pt"), weights_only=True, mmap=True)
    assert all(
        g.dtype == n.dtype == torch.float32
        for gs, ns in zip(gold, native, strict=True)
        for g, n in zip(gs, ns, strict=True)
    )
    tol = tolerance_for("float32", "pointwise", "strict")
    n = native[0][0]
    assert compare_output(n, gold[0][0], n, tol)["ok"]
    assert not compare_output(n * (1 + 1e-3), gold[0][0], n, tol)["ok"]
