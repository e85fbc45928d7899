"""``kernelcrew optimize`` with the offline playbook on the GPU: a verified own kernel that beats eager,
delivered as a ``best.py`` that works inside a user's ``torch.compile``'d model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from kernelcrew.task import load_candidate, load_task
from kernelcrew.tools.packaging import custom_op_name
from tests.gpu.conftest import ROOT, kernelcrew

pytestmark = pytest.mark.gpu

#: example -> the playbook strategy that must win it
EXAMPLES = {"softmax": "row_reduction", "elementwise_chain": "fused_pointwise"}


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def run(request, tmp_path_factory) -> tuple[str, Path, dict]:
    """One optimize run per example: its name, output folder and report."""
    name, out = request.param, tmp_path_factory.mktemp(request.param)
    args = f"optimize examples/{name}.py --device cuda --backend playbook --max-iters 2 --time-budget 120"
    proc = kernelcrew(*args.split(), "--compile-modes", "none", "--out", str(out), timeout=420)
    assert (out / "report.json").exists(), proc.stderr[-3000:]
    return name, out, json.loads((out / "report.json").read_text())


def test_the_playbook_finds_a_verified_speedup(run):
    name, _out, report = run
    best = report.get("best") or {}
    assert report["status"] == "improved", report.get("stop_reason")
    assert best["strategy"] == EXAMPLES[name] and best["kind"] == "kernel"
    assert best["speedup_eager"] > 1.0


class User(nn.Module):
    """A user's model with the optimized module inside."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *xs):
        return torch.tanh(self.inner(*[x * 2 if x.is_floating_point() else x for x in xs])) + 1


def test_best_py_compiles_inside_a_users_model_as_one_custom_op(run):
    """fullgraph=True: no graph break; the delivered module is one custom-op node of the user's graph
    and matches the user model built on the reference, at the task's shapes and its test shapes."""
    name, out, _report = run
    source = (ROOT / "examples" / f"{name}.py").read_text()
    task = load_task(source, f"examples/{name}.py")
    best_source = (out / "best.py").read_text()
    torch.manual_seed(0)
    reference = task.model_cls(*task.get_init_inputs()).cuda().eval()
    inner = load_candidate(best_source, str(out / "best.py"))(*task.get_init_inputs()).cuda().eval()
    inner.load_state_dict(reference.state_dict())
    mine, theirs = User(inner), User(reference)
    op = custom_op_name(best_source).replace("::", ".")
    graphs: list[list[str]] = []

    def recording(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    with torch.no_grad():
        for xs in [task.get_inputs(), *task.get_test_inputs()]:
            xs = [x.cuda() for x in xs]
            torch._dynamo.reset()
            got = torch.compile(mine, fullgraph=True)(*xs)
            torch.testing.assert_close(got, theirs(*xs), rtol=1e-4, atol=1e-5)
            torch._dynamo.reset()
            torch.compile(mine, fullgraph=True, backend=recording)(*xs)
    torch._dynamo.reset()
    assert graphs and all(sum(op in target for target in g) == 1 for g in graphs), (op, graphs)
