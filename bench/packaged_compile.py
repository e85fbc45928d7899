"""The delivered best.py inside a user's torch.compile'd model, on a GPU.

For one task per own-kernel strategy this script generates the playbook's candidate (its first
``sm_90`` configuration), packages it as ``kernelcrew optimize`` delivers it (``best.py``: the
kernels registered as one ``torch.library.custom_op``), and puts the optimized module inside a
bigger user model (``tanh(inner(2 * x)) + 1``). That model must compile with
``torch.compile(fullgraph=True)`` (Inductor, no graph break), take the module as one custom-op
node, and match the same user model built on the reference, on fresh inputs at the task's shapes
and at its test shapes. The user model is timed eager and compiled, on the packaged module and on
the reference (``triton.testing.do_bench`` medians). Writes ``packaged_compile.json`` and ``.md``.

    python bench/packaged_compile.py OUT_DIR
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import WORK, rel_error, run_suite  # noqa: E402

from kernelcrew.agents import playbook  # noqa: E402
from kernelcrew.agents.playbook.analysis import TaskAnalysis, analyze_child  # noqa: E402
from kernelcrew.task import load_task  # noqa: E402
from kernelcrew.tools.packaging import custom_op_name, package  # noqa: E402

#: task -> the own-kernel strategy whose candidate is packaged
TASKS = {
    "linear_residual_fp32": "matmul_epilogue",
    "rmsnorm_llama_bf16": "row_reduction",
    "swiglu_bf16": "fused_pointwise",
}


class User(nn.Module):
    """A user's model with the module inside."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *xs):
        return torch.tanh(self.inner(*[x * 2 if x.is_floating_point() else x for x in xs])) + 1


def run_task(path: Path, sms: int) -> dict:
    del sms
    strategy = TASKS[path.stem]
    source = path.read_text()
    record = analyze_child({"task_source": source, "task_path": path.name, "seed": 0}, Path("."))
    analysis = TaskAnalysis(record, task_source=source, task_path=path.name)
    params = playbook.tuning_space(strategy, analysis, "sm_90")[0]
    best_source = package(playbook.generate(strategy, source, analysis, params))
    file = WORK / f"best_{path.stem}.py"
    file.write_text(best_source)
    spec = importlib.util.spec_from_file_location(f"best_{path.stem}", file)
    best = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = best
    spec.loader.exec_module(best)

    task = load_task(source, path.name)
    torch.manual_seed(0)
    reference = task.model_cls(*task.get_init_inputs()).cuda().eval()
    inner = best.ModelNew(*task.get_init_inputs()).cuda()
    inner.load_state_dict(reference.state_dict())
    mine, theirs = User(inner), User(reference)
    op = custom_op_name(best_source).replace("::", ".")
    nodes: list[list[str]] = []

    def recording(gm, example_inputs):
        nodes.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    row = {"task": path.stem, "strategy": strategy, "params": params, "custom_op": op, "checks": []}
    with torch.no_grad():
        for xs in [task.get_inputs(), *task.get_test_inputs()]:
            xs = [x.cuda() for x in xs]
            compiled = torch.compile(mine, fullgraph=True)
            want = theirs(*xs)
            row["checks"].append(
                {
                    "shapes": [list(x.shape) for x in xs],
                    "eager_rel_error": rel_error(mine(*xs), want),
                    "compiled_rel_error": rel_error(compiled(*xs), want),
                }
            )
            torch._dynamo.reset()
            torch.compile(mine, fullgraph=True, backend=recording)(*xs)
            torch._dynamo.reset()
        row["one_custom_op_node"] = bool(nodes) and all(sum(op in t for t in g) == 1 for g in nodes)
        xs = [x.cuda() for x in task.get_inputs()]
        mine_c, theirs_c = torch.compile(mine, fullgraph=True), torch.compile(theirs)
        mine_c(*xs), theirs_c(*xs)
        for name, fn in {
            "user_eager": theirs,
            "user_compiled": theirs_c,
            "packaged_compiled": mine_c,
        }.items():
            row[f"{name}_ms"] = triton.testing.do_bench(
                lambda fn=fn: fn(*xs), warmup=25, rep=200, return_mode="median"
            )
    print(row, flush=True)
    return row


def markdown(result: dict) -> str:
    lines = [
        "# The packaged best.py inside a user's torch.compile'd model, on the GPU",
        "",
        f"Device: {result['device']}; torch {result['versions']['torch']}, Triton "
        f"{result['versions']['triton']}; commit {result['commit']}. `python bench/packaged_compile.py`. "
        "The user model is `tanh(inner(2 * x)) + 1`; `inner` is the packaged candidate (the playbook's "
        "first sm_90 configuration) or the reference. Compiled with `torch.compile(fullgraph=True)`; "
        "errors are relative L2 against the same user model on the reference; times are "
        "`triton.testing.do_bench` medians at the task's shapes.",
        "",
        "| task | strategy | one custom-op node, no graph break | worst rel. error, eager / compiled "
        "(task's and test shapes) | user model eager ms | compiled on the reference ms | compiled on "
        "best.py ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        eager = max(c["eager_rel_error"] for c in r["checks"])
        comp = max(c["compiled_rel_error"] for c in r["checks"])
        lines.append(
            f"| {r['task']} | {r['strategy']} | {'yes' if r['one_custom_op_node'] else 'no'} | "
            f"{eager:.1e} / {comp:.1e} ({len(r['checks'])} shapes) | {r['user_eager_ms']:.4f} | "
            f"{r['user_compiled_ms']:.4f} | {r['packaged_compiled_ms']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    tasks = [ROOT / "bench/suite" / f"{name}.py" for name in TASKS]
    run_suite(
        "packaged_compile", tasks, run_task, markdown, commit=os.environ.get("KERNELCREW_COMMIT", "unknown")
    )


if __name__ == "__main__":
    main()
