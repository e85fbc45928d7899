"""best.py's torch.compile packaging: one custom op, inside a user's compiled model, and verifiable."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kernelcrew.agents import playbook
from kernelcrew.agents.playbook.analysis import TaskAnalysis, analyze_child
from kernelcrew.task import TaskError
from kernelcrew.tools.correctness import verify
from kernelcrew.tools.packaging import MARKER, custom_op_name, launched_kernels, packable, package, unpack
from tests.conftest import FIXTURES, interpreted_json

POINTWISE = FIXTURES / "tasks" / "pointwise.py"
GROUPNORM = FIXTURES / "tasks" / "rows" / "groupnorm_silu.py"
LINEAR_RELU = FIXTURES / "tasks" / "linear_relu.py"


def candidate(task: Path, strategy: str) -> str:
    source = task.read_text()
    value = analyze_child({"task_source": source, "task_path": task.name, "seed": 0}, Path("."))
    return playbook.generate(strategy, source, TaskAnalysis(value, task_source=source, task_path=task.name))


@pytest.fixture(scope="module")
def sources():
    return {
        "pointwise": candidate(POINTWISE, "fused_pointwise"),
        "groupnorm": candidate(GROUPNORM, "row_reduction"),
        "compiled": candidate(POINTWISE, "torch_compile"),
    }


def test_package_and_unpack(sources):
    for name in ("pointwise", "groupnorm"):
        source = sources[name]
        packaged = package(source)
        assert packaged.startswith(source.rstrip("\n")) and MARKER in packaged
        assert unpack(packaged) == (source.rstrip("\n") + "\n", True)
        assert unpack(packaged.rstrip("\n")) == unpack(packaged), "a lost final newline is no edit"
        assert unpack(source) == (source, False)
        op = custom_op_name(packaged)
        assert op and op.startswith("kernelcrew_") and op.endswith("::forward")
    assert launched_kernels(sources["groupnorm"]) == ("group_norm_kernel",)
    assert custom_op_name(package(sources["pointwise"])) != custom_op_name(package(sources["groupnorm"]))


def test_only_own_triton_kernels_are_packaged(sources):
    assert packable(sources["pointwise"]) == (True, "")
    ok, why = packable(sources["compiled"])
    assert not ok and "no Triton kernel" in why
    ok, why = packable(package(sources["pointwise"]))
    assert not ok and why == "already packaged"
    with pytest.raises(ValueError, match="cannot package"):
        package("import torch\n\nclass Model(torch.nn.Module):\n    pass\n")


def test_an_edited_or_moved_block_is_refused(sources):
    packaged = package(sources["pointwise"])
    edited = packaged.replace("return lambda *args, **kwargs: None", "return print")
    moved = sources["groupnorm"].rstrip("\n") + "\n" + packaged[packaged.index("\n\n\n" + MARKER) + 1 :]
    inside = sources["pointwise"].replace("class ModelNew", MARKER + "\nclass ModelNew")
    for bad in (edited, moved, inside):
        with pytest.raises(TaskError, match="packaging block"):
            unpack(bad, "best.py")
    broken = "class ModelNew(:\n" + packaged[packaged.index("\n\n\n" + MARKER) :]
    with pytest.raises(TaskError, match="syntax error"):
        unpack(broken, "best.py")


def test_verify_takes_the_block_off_and_refuses_an_edited_one(sources):
    """``kernelcrew verify best.py`` judges the kernels; the block may not carry anything else."""
    task = POINTWISE.read_text()
    packaged = package(sources["pointwise"])
    verdict = verify(task, packaged, seed=3)
    assert verdict.passed, verdict.message
    assert next(c for c in verdict.checks if c["name"] == "packaging")["passed"]
    with pytest.raises(TaskError, match="packaging block"):
        verify(task, packaged.replace("_kc_local.shapes_only = True", "pass"), seed=3)


USER_MODEL = textwrap.dedent(
    """
    import importlib.util, json, sys
    import torch, torch.nn as nn
    from kernelcrew.task import load_task

    task = load_task(open(sys.argv[1]).read(), "task.py")
    spec = importlib.util.spec_from_file_location("best", sys.argv[2])
    best = importlib.util.module_from_spec(spec)
    sys.modules["best"] = best  # as `import best` would
    spec.loader.exec_module(best)
    torch.manual_seed(0)
    reference = task.model_cls(*task.get_init_inputs())

    class UserModel(nn.Module):  # the optimized module inside a bigger model
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *xs):
            return torch.tanh(self.inner(*[x * 2 for x in xs])) + 1

    inner = best.ModelNew(*task.get_init_inputs())
    inner.load_state_dict(reference.state_dict())
    user, want_model = UserModel(inner), UserModel(reference)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    out = {}
    with torch.no_grad():
        for i, xs in enumerate([task.get_inputs(), *task.get_test_inputs()]):
            want = want_model(*xs)
            eager = user(*xs)
            compiled = torch.compile(user, fullgraph=True)(*xs)  # inductor, no graph break allowed
            torch._dynamo.reset()
            torch.compile(user, fullgraph=True, backend=recording)(*xs)
            torch._dynamo.reset()
            out[i] = [float((eager - want).abs().max()), float((compiled - want).abs().max())]
    print(json.dumps({"errors": out, "graphs": graphs}))
    """
)


@pytest.mark.parametrize(
    ("task", "strategy"),
    [(POINTWISE, "fused_pointwise"), (GROUPNORM, "row_reduction"), (LINEAR_RELU, "matmul_epilogue")],
)
def test_packaged_best_works_inside_a_users_compiled_model(task, strategy, tmp_path):
    """The user's torch.compile(fullgraph=True) takes the module whole, as one custom op node, and
    computes what the reference does, at the task's shapes and at its other test shapes."""

    best = tmp_path / "best.py"
    best.write_text(package(candidate(task, strategy)))
    script = tmp_path / "user.py"
    script.write_text(USER_MODEL)
    result = interpreted_json([str(script), str(task), str(best)])
    for eager_err, compiled_err in result["errors"].values():
        assert eager_err < 1e-4 and compiled_err < 1e-4
    op = custom_op_name(best.read_text()).replace("::", ".")  # as the graph names it
    assert result["graphs"] and all(any(op in t for t in g) for g in result["graphs"])
