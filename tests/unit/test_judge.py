"""The timing judge against candidates that behave only when checked or sabotage the baseline (CPU)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from kernelcrew.config import Settings
from kernelcrew.tools.correctness import make_golden
from kernelcrew.tools.timing import benchmark, fresh_inputs

TASK = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2 + 1

    def get_inputs():
        return [torch.randn(256, 64)]

    def get_init_inputs():
        return []
    """
)

HONEST = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2 + 1
    """
)

# Finds the task's Model class in its process and makes its forward sleep 20 ms: a judge that ran
# the reference in the candidate's process would time a slowed baseline (the state checks do not
# watch the task's own classes).
SABOTAGE = textwrap.dedent(
    """
    import gc
    import time
    import torch
    import torch.nn as nn

    def _slow_down_the_reference():
        for obj in gc.get_objects():
            if isinstance(obj, type) and obj.__name__ == "Model" and issubclass(obj, nn.Module):
                original = obj.forward

                def forward(self, *args, _original=original):
                    time.sleep(0.02)
                    return _original(self, *args)

                obj.forward = forward

    class ModelNew(nn.Module):
        def forward(self, x):
            _slow_down_the_reference()
            return torch.tanh(x) * 2 + 1
    """
)

# Right on its first calls (those a verifier makes), then returns the first answer again.
LATE_CHEAT = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.kept = None

        def forward(self, x):
            self.calls += 1
            if self.calls <= 4 or self.kept is None:
                self.kept = torch.tanh(x) * 2 + 1
            return self.kept.clone()
    """
)

# Returns nothing once it has been called a few times.
RETURNS_NOTHING = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return torch.tanh(x) * 2 + 1 if self.calls <= 4 else None
    """
)


@pytest.fixture(scope="module")
def golden():
    made = make_golden(TASK, device="cpu", seed=99, settings=Settings(sandbox_timeout_s=120))
    yield made
    made.cleanup()


def run(golden, source: str):
    return benchmark(
        TASK,
        {"cand": (source, "candidate.py")},
        golden=golden,
        quick=True,
        settings=Settings(sandbox_timeout_s=120),
    )


def test_honest_candidate_passes_and_its_timed_outputs_are_judged(golden):
    result = run(golden, HONEST)
    assert result.failure is None, result.failure
    assert result.samples_checked and result.samples_checked >= 2
    assert result.results["cand"].samples == result.samples_checked


def test_a_candidate_cannot_slow_the_baseline_down(golden):
    result = run(golden, SABOTAGE)
    assert result.failure is None, result.failure
    honest = run(golden, HONEST)
    # no Model lives in the candidates' process: the baseline is not slowed (nor the candidate)
    assert result.results["eager"].median_ms < 10, result.results["eager"]
    assert result.results["eager"].median_ms < 3 * honest.results["eager"].median_ms + 1


@pytest.mark.parametrize("source", [LATE_CHEAT, RETURNS_NOTHING], ids=["stale", "nothing"])
def test_a_candidate_wrong_on_timed_calls_fails(golden, source):
    result = run(golden, source)
    assert result.failure is not None
    assert result.failure.stage == "timed_output", result.failure


def test_fresh_inputs_are_new_data_of_the_same_kind():
    x = torch.randn(64, 32)
    positive = torch.rand(1000)
    mask = (torch.rand(64, 32) > 0.5).float()
    labels = torch.randint(0, 10, (50,))
    inputs = [x, [positive, {"m": mask}], labels, 3]
    a, b = fresh_inputs(inputs, 5), fresh_inputs(inputs, 5)
    c = fresh_inputs(inputs, 6)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])  # deterministic per seed
    assert not torch.equal(a[0], x)
    assert torch.equal(torch.sign(a[0]), torch.sign(x))  # signs and zeros kept
    ratio = a[0] / x
    assert float(ratio.min()) >= 0.75 - 1e-6 and float(ratio.max()) <= 1.25 + 1e-6
    assert bool((a[1][0] >= 0).all()) and not torch.equal(a[1][0], positive)
    assert torch.equal(a[1][1]["m"], mask)  # a mask keeps its values
    assert torch.equal(a[2], labels) and a[3] == 3
    assert a[0].data_ptr() != x.data_ptr() and a[2].data_ptr() != labels.data_ptr()


def test_judged_elements_are_the_same_positions_on_both_sides():
    from kernelcrew.tools.timing import JUDGED_ELEMENTS, pick_elements

    big = torch.randn(300, 1000)
    small = torch.randn(10)
    a = pick_elements([big, small], pick=7)
    b = pick_elements([big.clone(), small.clone()], pick=7)
    assert a[0]["values"].numel() == JUDGED_ELEMENTS and a[0]["shape"] == [300, 1000]
    assert torch.equal(a[0]["values"], b[0]["values"])  # the golden side draws the same positions
    assert torch.equal(a[1]["values"], small)  # a small tensor is judged whole
    assert not torch.equal(pick_elements([big], pick=8)[0]["values"], a[0]["values"])


EXPANDING = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return x[:, None] * x[None, :]

    def get_inputs():
        return [torch.randn(128)]

    def get_init_inputs():
        return []
    """
)


def test_a_task_whose_outputs_are_large_gets_fewer_sets_and_says_so(monkeypatch, tmp_path):
    """The golden child keeps every set's golden and native output: a task whose output is
    far larger than its inputs (here 128 x its input) is bounded by what it keeps, not by its inputs
    (a 1 GB input with a 6 GB golden per set filled a 100 GB machine)."""
    from kernelcrew.tools import harness

    per_set = 128 * 4 + 128 * 128 * (4 + 4)  # input, golden (stored in float32), float32 native
    (tmp_path / "child").mkdir()
    payload = {"device": "cpu", "seed": 3, "precision": "strict", "task_source": EXPANDING}
    payload.update(task_path="task.py", n_seeds=5)
    monkeypatch.setattr(harness, "golden_kept_budget", lambda: int(3.5 * per_set))
    meta = harness.golden_child(payload, tmp_path)
    assert [r["origin"] for r in meta["sets"]] == ["seed", "seed", "seed"]
    assert any("input sets not judged" in n and "golden and native outputs" in n for n in meta["notes"])
    monkeypatch.setattr(harness, "golden_kept_budget", lambda: 0)  # never fewer than two seeds
    assert [r["origin"] for r in harness.golden_child(payload, tmp_path)["sets"]] == ["seed", "seed"]
    monkeypatch.setattr(harness, "golden_kept_budget", lambda: 1000 * per_set)
    meta = harness.golden_child(payload, tmp_path)
    assert len(meta["sets"]) > 5 and not any("not judged" in n for n in meta["notes"])


def test_a_task_with_large_inputs_gets_fewer_sets(monkeypatch):
    from kernelcrew.task import load_task
    from kernelcrew.tools import harness

    task = load_task(TASK, path="task.py")
    one_set = 256 * 64 * 4
    monkeypatch.setattr(harness, "GOLDEN_INPUT_BYTES", int(2.5 * one_set))
    sets = harness._make_input_sets(task, 1, 5, "cpu")
    assert [s["origin"] for s in sets] == ["seed", "seed"]
    monkeypatch.setattr(harness, "GOLDEN_INPUT_BYTES", 0)  # never fewer than two: the cache sequence
    assert len(harness._make_input_sets(task, 1, 5, "cpu")) == 2
    monkeypatch.setattr(harness, "GOLDEN_INPUT_BYTES", 100 * one_set)
    assert len(harness._make_input_sets(task, 1, 5, "cpu")) == 5
