"""The CUDA graph strategy off the GPU: what it generates, where the planner offers it, and the
plain forward it runs on CPU tensors (tests/gpu/test_graphs.py runs the graphs themselves)."""

from __future__ import annotations

import uuid

import pytest
import torch

from kernelcrew.agents.planner import _menu, idle_fraction
from kernelcrew.agents.playbook.graphs import generate_graphed
from kernelcrew.agents.state import CrewState, Options
from kernelcrew.task import import_source
from kernelcrew.tools.anticheat import static_check
from tests.conftest import FIXTURES, local_analysis

TASK = (FIXTURES / "tasks" / "softmax.py").read_text()


def test_the_candidate_keeps_the_rules_and_runs_cpu_inputs_plainly():
    source = generate_graphed(TASK)
    assert static_check(source) == []
    ref = import_source(TASK, f"task_{uuid.uuid4().hex}", "task.py").Model
    cand = import_source(source, f"cand_{uuid.uuid4().hex}", "candidate.py").ModelNew
    x = torch.randn(4, 33)
    with torch.no_grad():
        torch.testing.assert_close(cand()(x), ref()(x))
        assert cand()._graphs == {}


def _state(device: str = "cuda", **baseline) -> CrewState:
    analysis = local_analysis(TASK)
    return CrewState(
        task_source=TASK,
        options=Options(device=device),
        baseline={"analysis": analysis.data, "arch": "sm_90", **baseline},
    )


@pytest.mark.parametrize(
    ("baseline", "device", "where"),
    [
        # a launch-bound module (the GPU busy 2 ms of eager's 10 ms): the graph goes first
        ({"eager_ms": 10.0, "hotspot_total_us": 2000.0, "hotspot_clock": "cuda kernels"}, "cuda", 0),
        # 8 % idle: worth a step after the own kernels
        ({"eager_ms": 10.0, "hotspot_total_us": 9200.0, "hotspot_clock": "cuda kernels"}, "cuda", "late"),
        # the GPU busy 98 % of the time: nothing to save
        ({"eager_ms": 10.0, "hotspot_total_us": 9800.0, "hotspot_clock": "cuda kernels"}, "cuda", None),
        # no profile of the kernels, or a CPU: not offered
        ({"eager_ms": 10.0}, "cuda", None),
        ({"eager_ms": 10.0, "hotspot_total_us": 2000.0, "hotspot_clock": "cpu aten ops"}, "cpu", None),
    ],
)
def test_the_planner_offers_the_graph_by_the_idle_time_the_baseline_measured(baseline, device, where):
    state = _state(device, **baseline)
    names = [s.strategy for s in _menu(state)]
    if where is None:
        assert "cuda_graphs" not in names
    elif where == 0:
        assert names[0] == "cuda_graphs"
        assert f"{1 - idle_fraction(state):.0%}" in _menu(state)[0].rationale
    else:
        assert names.index("cuda_graphs") > names.index("row_reduction")


def test_a_compile_the_baseline_could_not_time_is_not_tried_again_as_a_step():
    """The baseline's compile of the reference failed or was stopped at its share of the budget:
    a compiler step would compile the same module again, in any mode."""
    timed = {"eager_ms": 10.0, "compile_ms": {}, "compile_errors": {}}
    names = [s.strategy for s in _menu(_state(**timed))]
    assert "torch_compile" in names and "torch_compile_max_autotune" in names
    stopped = {**timed, "compile_errors": {"default": "not timed: not compiled within 54 s"}}
    names = [s.strategy for s in _menu(_state(**stopped))]
    assert "torch_compile" not in names and "torch_compile_max_autotune" not in names
