"""How much of KernelBench the anchored_fusion strategy covers, measured without running a kernel.

    python bench/coverage.py [--root ../shared/kernelbench] [--levels 1 2 3] [--json OUT] [-v]

For every task of each level: is its forward traced (``torch.fx``, or fx's MetaTracer at the
example's shapes), does a whole-module strategy apply, does ``anchored_fusion`` produce a
candidate with at least one own region kernel (the candidate source is generated and passes the
verifier's static rules), and how many regions it lowers against the fusible ops it leaves to
torch. Nothing runs on a GPU: each model is built and its inputs made on PyTorch's ``meta``
device (shapes only, no memory, no compute), so the tasks' full KernelBench shapes are analysed
as they are. The task files are trusted here (they run in this process, not in the sandbox the
crew uses): point ``--root`` only at a KernelBench checkout.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Seconds a task may take to build, trace and plan.
TASK_TIMEOUT_S = 60


def meta_analysis(source: str, path: str) -> Any:
    """The playbook's analysis of a task whose model and inputs live on the meta device."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp

    from kernelcrew.agents.playbook import analysis as an
    from kernelcrew.task import load_task

    task = load_task(source, path=path)
    with torch.device("meta"):
        torch.manual_seed(0)
        init = list(task.get_init_inputs())
        model = task.model_cls(*init)
        inputs = list(task.get_inputs())
    model.eval()
    data: dict[str, Any] = {
        "traced": False,
        "trace_error": "",
        "nodes": [],
        "outputs": [],
        "op_sequence": [],
        "forward_args": [],
        "notes": [],
        "parameters": [{"name": n, **an._tensor_meta(p)} for n, p in model.named_parameters()],
        "buffers": [],
        "state_dict": [],
        "inputs": [],
    }
    state = model.state_dict()
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            kind = "parameter" if name in params else "buffer"
            data["state_dict"].append({"name": name, **an._tensor_meta(value), "kind": kind})
        else:
            data["state_dict"].append({"name": name, "kind": "extra_state"})
    try:
        gm = an._trace(model)
    except Exception as exc:
        data["trace_error"] = f"{type(exc).__name__}: {exc}"[:300]
        gm = an.trace_at_shapes(model, inputs)
        data["traced_at_shapes"] = True
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    data["forward_args"] = [an._forward_arg(n) for n in holders]
    data["inputs"] = [
        {"index": i, "name": str(h.target), "kind": "tensor", **an._tensor_meta(x)}
        for i, (h, x) in enumerate(zip(holders, inputs, strict=False))
        if isinstance(x, torch.Tensor)
    ]
    with torch.no_grad():
        ShapeProp(gm).propagate(*inputs)
    data["traced"] = not data.get("traced_at_shapes")
    owners = {
        "modules": dict(gm.named_modules()),
        "parameters": dict(gm.named_parameters(remove_duplicate=False)),
        "buffers": dict(gm.named_buffers(remove_duplicate=False)),
        "state": state,
    }
    for node in gm.graph.nodes:
        rec = an._describe_node(node, owners)
        data["nodes"].append(rec)
        if rec["kind"].startswith("call_"):
            data["op_sequence"].append(rec["op"])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    data["outputs"] = [
        {"ref": r.name if isinstance(r, torch.fx.Node) else None, **an._node_meta(r)}
        for r in an._flatten(output.args[0])
    ]
    return an.TaskAnalysis(data, task_source=source, task_path=path)


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def measure(path: Path) -> dict[str, Any]:
    """One task's row: traced, whole-module strategy, candidate, regions lowered and left."""
    from kernelcrew.agents.playbook import anchored, generate

    row: dict[str, Any] = {"task": path.name, "traced": False, "candidate": False}
    source = path.read_text()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TASK_TIMEOUT_S)
    try:
        a = meta_analysis(source, str(path))
        row["traced"] = a.traced or a.traced_at_shapes
        whole = anchored._whole_module(a) if row["traced"] else ""
        row["whole_module"] = whole
        if row["traced"]:
            parts = anchored.partition(a)
            row["regions"] = len(parts.regions)
            row["left"] = len(parts.left)
            row["anchors"] = sorted(set(parts.anchors))
        plan, reason = anchored.match(a)
        row["reason"] = reason
        if plan is not None:
            params = anchored.tuning_space(plan, "sm_90")[0]
            generate("anchored_fusion", source, a, params)
            row["candidate"] = True
    except _Timeout:
        row["error"] = f"timed out after {TASK_TIMEOUT_S} s"
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        signal.alarm(0)
    return row


def summary(level: str, rows: list[dict[str, Any]]) -> str:
    traced = sum(r["traced"] for r in rows)
    whole = sum(bool(r.get("whole_module")) for r in rows)
    cand = sum(r["candidate"] for r in rows)
    lowered = sum(r.get("regions", 0) for r in rows)
    left = sum(r.get("left", 0) for r in rows)
    return (
        f"{level}: {len(rows)} tasks, traced {traced}, whole-module strategy {whole}, "
        f"anchored candidate {cand}; regions lowered {lowered}, fusible ops left to torch {left}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    roots = [ROOT.parent / "shared" / "kernelbench", ROOT.parents[1] / "shared" / "kernelbench"]
    default = next((r for r in roots if r.is_dir()), roots[0])
    parser.add_argument("--root", type=Path, default=default, help="a KernelBench checkout")
    parser.add_argument("--levels", nargs="*", default=["1", "2", "3"])
    parser.add_argument("--json", type=Path, default=None, help="write every task's row here")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per task")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    every: dict[str, list[dict[str, Any]]] = {}
    for level in args.levels:
        folder = args.root / f"level{level}"
        rows = [measure(p) for p in sorted(folder.glob("*.py"))]
        every[f"level{level}"] = rows
        if args.verbose:
            for r in rows:
                state = "candidate" if r["candidate"] else r.get("error") or r.get("reason", "")
                print(f"  {r['task']}: regions {r.get('regions', '-')}, left {r.get('left', '-')}: {state}")
        print(summary(f"level{level}", rows), flush=True)
        reasons = Counter(
            (r.get("error") or r.get("reason", "")).split(":")[0][:80] for r in rows if not r["candidate"]
        )
        for reason, count in reasons.most_common(6):
            print(f"    no candidate ({count}): {reason}")
    if args.json:
        args.json.write_text(json.dumps(every, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
