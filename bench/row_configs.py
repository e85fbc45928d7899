"""Every tuning configuration of a row task on a GPU, timed, with its kernel's registers.

The planner tries the row_reduction strategy's tuning space in order and keeps the fastest within
the task's budget, so a configuration that comes first and runs slow costs a run its time. For
each task this script builds the candidate of every ``sm_90`` configuration (with this checkout's
generator and, with ``--generator FILE``, an older copy of ``rowwise.py`` too, labelled
``--label``), checks it against a float64 reference on inputs the timing never saw, reads each
compiled kernel's registers and spills from Triton, and times all of them with eager and
``torch.compile`` (default mode) in one interleaved ``measure`` call. Writes ``row_configs.json``
and ``row_configs.md``.

    python bench/row_configs.py OUT_DIR [--generator OLD_ROWWISE.py --label OLD] [TASK.py ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import WORK, rel_error, row_setup, run_suite  # noqa: E402
from waiting_rows import TIMING, generators, kernel_registers  # noqa: E402

from kernelcrew.task import import_source  # noqa: E402
from kernelcrew.tools.timing import measure  # noqa: E402

TASKS = [ROOT / f"bench/kb/groupnorm_silu_{name}_bf16.py" for name in ("unet", "narrow", "deep")]


def config_label(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def run_task(path: Path, sms: int, gens: dict[str, object]) -> dict:
    del sms
    analysis, plan, task, model, ref64, inputs, fresh = row_setup(path)
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    with torch.no_grad():
        golden = ref64(*[t.double() for t in fresh])
        out = model(*inputs)
        nbytes += out.numel() * out.element_size()
        compiled = torch.compile(model)
        compiled(*inputs)
        callables = {"eager": lambda xs: model(*xs), "compile": lambda xs: compiled(*xs)}
        row = {"task": path.stem, "bytes": nbytes, "candidates": {}}
        for label, gen in gens.items():
            for i, params in enumerate(gen.tuning_space(plan, "sm_90")):
                text = gen.generate_rowwise(analysis, plan, params)
                file = (
                    WORK / f"configs_{path.stem}_{label}_{i}.py"
                )  # Triton reads a kernel's source from its file
                file.write_text(text)
                module = import_source(text, file.stem, str(file))
                new = module.ModelNew(*task.get_init_inputs()).cuda()
                new.load_state_dict(model.state_dict())
                entry = {"generator": label, "order": i, "params": params}
                entry["rel_error"] = rel_error(new(*fresh), golden)
                entry["kernels"] = kernel_registers(module)
                key = f"{label}/{i}"
                row["candidates"][key] = entry
                callables[key] = lambda xs, new=new: new(*xs)
        timing = measure(callables, [inputs], device="cuda", config=TIMING)["results"]
    keys = ("median_ms", "p10_ms", "p90_ms", "wall_median_ms", "reps")
    row["eager"] = {k: timing["eager"][k] for k in keys}
    row["compile"] = {k: timing["compile"][k] for k in keys}
    for key, entry in row["candidates"].items():
        entry.update({k: timing[key][k] for k in keys})
        print(
            f"{path.stem} {key} {entry['params']}: {entry['median_ms']:.4f} ms, {entry['kernels']}",
            flush=True,
        )
    return row


def markdown(result: dict) -> str:
    lines = [
        "# Row tasks: every tuning configuration, with its kernel's registers",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result['commit']}"
        + (f", against `{result['old']}`" if result.get("old") else "")
        + ". `python bench/row_configs.py`, timed by the crew's protocol (`kernelcrew.tools.timing.measure`: "
        "every candidate of a task interleaved, L2 flushed before each call, CUDA events; ms is the median "
        "[p10-p90]). `order` is the place the planner tries the configuration in. TB/s counts each input "
        "read once and the output written once (the DRAM floor's traffic). Registers per thread and "
        "spills are Triton's, per compiled kernel.",
        "",
    ]
    for row in result["rows"]:
        gb = row["bytes"] / 1e9
        compile_ms = row["compile"]["median_ms"]
        lines += [
            f"## {row['task']} ({row['bytes'] / 1e6:.0f} MB moved at least)",
            "",
            f"eager {row['eager']['median_ms']:.4f} ms, torch.compile {compile_ms:.4f} ms ({gb / compile_ms:.2f} TB/s)",
            "",
            "| generator | order | configuration | ms [p10-p90] | TB/s | vs compile | registers (spills) | warps | rel. error |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in row["candidates"].values():
            regs = ", ".join(f"{k['regs']} ({k['spills']})" for k in c["kernels"])
            warps = ", ".join(str(k["num_warps"]) for k in c["kernels"])
            lines.append(
                f"| {c['generator']} | {c['order']} | {config_label(c['params'])} | "
                f"{c['median_ms']:.4f} [{c['p10_ms']:.4f}-{c['p90_ms']:.4f}] | {gb / c['median_ms']:.2f} | "
                f"{compile_ms / c['median_ms']:.2f}x | {regs} | {warps} | {c['rel_error']:.1e} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tasks", nargs="*")
    parser.add_argument("--generator", help="an older rowwise.py to time beside this checkout's")
    parser.add_argument("--label", default="old")
    args = parser.parse_args()
    gens = generators(args)
    sys.argv = [sys.argv[0], args.out, *args.tasks]  # run_suite reads OUT and tasks from argv
    run_suite(
        "row_configs",
        TASKS,
        lambda path, sms: run_task(path, sms, gens),
        markdown,
        commit=os.environ.get("KERNELCREW_COMMIT", "unknown"),
        old=args.label if args.generator else "",
    )


if __name__ == "__main__":
    main()
