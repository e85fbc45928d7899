"""Strategy micro-benchmark: every tuning configuration of the playbook's candidates for a task.

For each task the playbook's analysis picks the strategies that apply (by default the own-kernel
ones, ``row_reduction``, ``fused_pointwise`` and ``matmul_epilogue``, and the ``cublaslt_epilogue``
library call); every configuration of each strategy's tuning space for this device's architecture
becomes a candidate. Each candidate is checked against the module run in float64 on inputs the
timing never sees (relative L2 error, bounded by a few times eager's own error), then eager,
``torch.compile`` and every candidate that passed are timed in one interleaved
:func:`kernelcrew.tools.timing.measure` call (the crew's protocol). Writes ``micro.json`` and
``micro.md`` to ``--out``.

    python bench/micro.py bench/suite/rmsnorm_llama_bf16.py bench/suite/linear_gelu_bf16.py --device cuda
    python bench/micro.py tests/fixtures/tasks/softmax.py --device cpu --compile none   # interpreter

On ``--device cpu`` Triton runs in its interpreter (``TRITON_INTERPRET=1``) on the task's first
``get_test_inputs()`` set (``--inputs test``): the figures show the harness works, not GPU speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_STRATEGIES = ("row_reduction", "fused_pointwise", "matmul_epilogue", "cublaslt_epilogue")
#: Smallest error bound per output dtype: a candidate passes below max(4 x eager's error, this).
ERROR_FLOOR = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("tasks", nargs="+", type=Path, help="task files (KernelBench format)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", type=Path, default=Path("bench-out/micro"))
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES), help="comma list")
    ap.add_argument("--arch", help="tuning space of this architecture (default: the device's)")
    ap.add_argument("--inputs", choices=["full", "test"], help="get_inputs() or get_test_inputs()[0]")
    ap.add_argument("--compile", default="default", help="torch.compile mode of the baseline, or none")
    ap.add_argument("--time-s", type=float, default=30.0, help="timing budget per task (GPU)")
    args = ap.parse_args(argv)
    args.inputs = args.inputs or ("full" if args.device == "cuda" else "test")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported: before any of ours
    from kernelcrew.tools import hardware

    info = hardware.detect(args.device)
    arch = args.arch or info.arch
    result: dict[str, Any] = {
        "command": " ".join(["python", "bench/micro.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": info.name,
        "arch": arch,
        "versions": hardware.versions(),
        "inputs": args.inputs,
        "tasks": [],
    }
    with tempfile.TemporaryDirectory(prefix="kc-micro-") as work:
        for path in args.tasks:
            result["tasks"].append(run_task(path, args, arch, Path(work)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "micro.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "micro.md").write_text(markdown(result))
    print(markdown(result))
    return result


def run_task(path: Path, args: argparse.Namespace, arch: str, work: Path) -> dict[str, Any]:
    import torch

    from kernelcrew.agents import playbook
    from kernelcrew.task import load_candidate, load_task, test_input_sets
    from kernelcrew.tools.timing import TimingConfig, measure

    source = path.read_text()
    task = load_task(source, str(path))
    analysis = playbook.analyze(source, str(path))
    dev = torch.device(args.device)

    torch.manual_seed(0)
    model = task.model_cls(*task.get_init_inputs()).eval()
    with torch.no_grad():  # weights away from the ones and zeros a wrong kernel could agree with
        for p in model.parameters():
            p.mul_(1 + 0.1 * torch.randn_like(p)).add_(0.01 * torch.randn_like(p))
    reference = copy.deepcopy(model).double().to(dev)
    model = model.to(dev)
    if args.inputs == "full":
        timed = [to(t, dev) for t in task.get_inputs()]
        torch.manual_seed(1)
        checks = [[to(t, dev) for t in task.get_inputs()]]
    else:
        sets = test_input_sets(task)
        if not sets:
            raise SystemExit(f"{path}: no get_test_inputs() for --inputs test")
        timed, checks = [to(t, dev) for t in sets[0]], [[to(t, dev) for t in s] for s in sets]
    with torch.no_grad():
        golden = [reference(*[t.double() if t.is_floating_point() else t for t in xs]) for xs in checks]

    def error(fn: Any) -> float:
        with torch.no_grad():
            return max(rel_error(fn(*xs), ref) for xs, ref in zip(checks, golden, strict=True))

    row: dict[str, Any] = {"task": path.stem, "inputs": [list(t.shape) for t in timed], "candidates": []}
    row["eager_rel_error"] = error(model)
    out_dtype = str(model(*timed).dtype).removeprefix("torch.")
    bound = max(4 * row["eager_rel_error"], ERROR_FLOOR.get(out_dtype, 1e-5))
    row["error_bound"] = bound
    callables = {"eager": lambda xs: model(*xs)}
    if args.compile != "none":
        compiled = torch.compile(model, mode=args.compile)
        row["compile_rel_error"] = error(compiled)
        callables["compile"] = lambda xs: compiled(*xs)

    applicable = {s.name: reason for s, reason in playbook.applicable(analysis)}
    wanted = [s for s in args.strategies.split(",") if s]
    row["not_applicable"] = {s: why for s, why in playbook.rejected(analysis).items() if s in wanted}
    for strategy in (s for s in wanted if s in applicable):
        for order, params in enumerate(playbook.tuning_space(strategy, analysis, arch)):
            name = f"{strategy}/{order}"
            entry: dict[str, Any] = {"name": name, "strategy": strategy, "order": order, "params": params}
            try:
                text = playbook.generate(strategy, source, analysis, params)
                file = work / f"{path.stem}_{strategy}_{order}.py"  # Triton reads kernels from a file
                file.write_text(text)
                new = load_candidate(text, str(file))(*task.get_init_inputs()).to(dev).eval()
                new.load_state_dict(model.state_dict())
                entry["rel_error"] = error(new)
            except Exception as exc:  # a candidate that fails to build or run is a row, not the end
                entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            else:
                entry["ok"] = entry["rel_error"] <= bound
                if entry["ok"]:
                    callables[name] = lambda xs, new=new: new(*xs)
            row["candidates"].append(entry)
            print(f"{path.stem} {name}: {entry.get('rel_error', entry.get('error'))}", flush=True)

    config = TimingConfig(max_time_s=args.time_s) if args.device == "cuda" else TimingConfig.quick()
    with torch.no_grad():
        timing = measure(callables, [timed], device=args.device, config=config)
    row["clock"] = timing["clock"]
    figures = {name: figures_of(r) for name, r in timing["results"].items()}
    row["eager"], row["compile"] = figures["eager"], figures.get("compile")
    for entry in row["candidates"]:
        if entry["name"] in figures:
            entry.update(figures[entry["name"]])
            entry["vs_eager"] = row["eager"]["median_ms"] / entry["median_ms"]
            if row["compile"]:
                entry["vs_compile"] = row["compile"]["median_ms"] / entry["median_ms"]
    return row


def to(value: Any, device: Any) -> Any:
    return value.to(device) if hasattr(value, "to") else value


def rel_error(out: Any, ref: Any) -> float:
    """Relative L2 error of ``out`` against the float64 ``ref`` (NaN where ``out`` has a NaN)."""
    o, r = out.double(), ref.double()
    if not o.isfinite().all() and r.isfinite().all():
        return float("nan")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def figures_of(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result.get(k) for k in ("median_ms", "p10_ms", "p90_ms", "reps")}


def markdown(result: dict[str, Any]) -> str:
    v = result["versions"]

    def ms(e: dict[str, Any] | None) -> str:
        return "-" if not e else f"{e['median_ms']:.4g} [{e['p10_ms']:.4g}-{e['p90_ms']:.4g}]"

    lines = [
        "# Strategy micro-benchmark",
        "",
        f"Device: {result['device']} (tuning space of {result['arch']}); torch {v.get('torch')}, "
        f"Triton {v.get('triton')}; inputs: {result['inputs']}. `{result['command']}`.",
        "Times are medians [p10-p90] in ms of one interleaved `measure` call per task; the error is the "
        "relative L2 error against the module in float64 on inputs never timed.",
    ]
    for row in result["tasks"]:
        lines += [
            "",
            f"## {row['task']} {row['inputs']} ({row['clock']})",
            "",
            f"eager {ms(row['eager'])} (error {row['eager_rel_error']:.1e}); torch.compile "
            f"{ms(row['compile'])}; a candidate passes below {row['error_bound']:.1e}.",
            "",
            "| candidate | params | ms | vs eager | vs compile | error |",
            "|---|---|---|---|---|---|",
        ]
        for c in row["candidates"]:
            params = ", ".join(f"{k}={x}" for k, x in c["params"].items()) or "-"
            err = c["error"][:80] if "error" in c else f"{c['rel_error']:.1e}" + ("" if c["ok"] else " FAIL")
            speed = [f"{c[k]:.2f}x" if c.get(k) else "-" for k in ("vs_eager", "vs_compile")]
            timed = ms(c if "median_ms" in c else None)
            lines.append(f"| {c['name']} | {params} | {timed} | {' | '.join(speed)} | {err} |")
        for strategy, why in row["not_applicable"].items():
            lines.append(f"| {strategy} | does not apply: {why[:100]} | | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
