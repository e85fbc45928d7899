"""Few long rows in one launch of waiting parts against two launches, with each kernel's registers.

GroupNorm makes few, long rows (262144 columns in the SD-VAE block), split over programs. The
two-launch path reads every part twice from DRAM: a stats launch, then an output launch. The
waiting path (``WAIT_PART``) is one launch in which each program reduces its part and posts its
partial states, then waits for the row of the part it writes and writes it, reading it again from
L2: its own part (``WAIT_LAG`` 0), or one read by programs started earlier (the reads since span
``WAIT_LAG`` % of L2).

For each GroupNorm task this script builds the candidate of the two-launch configuration (the
tuning space's first) and of the waiting one at several part sizes and lags, with the generator of this
checkout and, with ``--generator FILE``, with an older copy of ``rowwise.py`` too (its rows are
labelled ``--label``), so that a change is timed against what it replaced in one call. Every
candidate is checked against a float64 reference on inputs the timing never saw; eager and
``torch.compile`` (default mode) are timed alike, all in one interleaved ``measure`` call. Each
compiled kernel's registers and spills are read from Triton. Writes ``waiting_rows.json`` and
``waiting_rows.md``.

    python bench/waiting_rows.py OUT_DIR [--generator OLD_ROWWISE.py --label OLD] [TASK.py ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import build_candidate, rel_error, row_setup, run_suite  # noqa: E402

from kernelcrew.agents.playbook import rows as rowwise  # noqa: E402
from kernelcrew.tools.timing import TimingConfig, measure  # noqa: E402

TASKS = [ROOT / "bench/suite/groupnorm_silu_fp16.py", ROOT / "bench/kb/groupnorm_silu_unet_bf16.py"]
WAIT_PARTS = (4096, 8192)  # 2048 would make 128 parts of a GroupNorm row: over MAX_SPLITS
WAIT_LAGS = (20, 24, 28)  # % of L2
TIMING = TimingConfig(min_reps=60, max_reps=300, max_time_s=60.0)


def generators(args: argparse.Namespace) -> dict[str, object]:
    out = {"head": rowwise}
    if args.generator:
        spec = importlib.util.spec_from_file_location("rowwise_old", args.generator)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old  # dataclasses look their module up
        spec.loader.exec_module(old)
        out[args.label] = old
    return out


def kernel_registers(module) -> list[dict]:
    """Registers and spills of each compiled specialization of the candidate's row kernel."""
    found = []
    for cache in module.row_reduction_kernel.device_caches.values():
        for kernel in cache[0].values():
            kernel._init_handles()
            found.append(
                {"num_warps": kernel.metadata.num_warps, "regs": kernel.n_regs, "spills": kernel.n_spills}
            )
    return found


def wait_configs(gen, plan) -> dict[str, dict]:
    """The two-launch configuration and the waiting one at each part size (and lag, where the
    generator has one)."""
    # the first configuration without waiting parts (the generator of 39f5e3e tried them second)
    base = next(c for c in gen.tuning_space(plan, "sm_90") if "WAIT_PART" not in c)
    configs = {"two_launch": base, **{f"wait_{p}": {**base, "WAIT_PART": p} for p in WAIT_PARTS}}
    if "WAIT_LAG" in gen.DEFAULT_PARAMS:  # older generators have no lag
        for p in WAIT_PARTS:
            configs |= {f"wait_{p}_lag{lag}": {**base, "WAIT_PART": p, "WAIT_LAG": lag} for lag in WAIT_LAGS}
    return configs


def time_generated(path: Path, gens: dict[str, object], configs_of, prefix: str) -> dict:
    """Eager, torch.compile and, per generator, the candidate of each configuration that
    ``configs_of(generator, plan)`` names (keyed ``label/name``), each checked against the float64
    reference on fresh inputs and its kernels' registers read, all timed in one ``measure`` call."""
    analysis, plan, task, model, ref64, inputs, fresh = row_setup(path)
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    with torch.no_grad():
        golden = ref64(*[t.double() if t.is_floating_point() else t for t in fresh])  # indices stay
        out = model(*inputs)
        nbytes += out.numel() * out.element_size()
        compiled = torch.compile(model)
        compiled(*inputs)
        callables = {"eager": lambda xs: model(*xs), "compile": lambda xs: compiled(*xs)}
        row = {"task": path.stem, "bytes": nbytes, "candidates": {}}
        for label, gen in gens.items():
            for name, params in configs_of(gen, plan).items():
                text = gen.generate_rowwise(analysis, plan, params)
                key = f"{label}/{name}"
                module, new = build_candidate(text, f"{prefix}_{path.stem}_{label}_{name}", task, model)
                entry = {"params": params, "rel_error": rel_error(new(*fresh), golden)}
                entry["kernels"] = kernel_registers(module)
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


def candidates_markdown(result: dict, title: str, script: str, note: str, columns: list[str], cells) -> str:
    """The tables of a script that times generated row candidates: one per task, a row per
    candidate, named by ``columns`` whose values ``cells(name, candidate)`` gives. ``note`` ends
    the header's sentence on registers."""
    lines = [
        f"# {title}",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result['commit']}"
        + (f", against `{result['old']}`" if result.get("old") else "")
        + f". `python bench/{script}`, timed by the crew's protocol (`kernelcrew.tools.timing.measure`: "
        "every candidate of a task interleaved, L2 flushed before each call, CUDA events; ms is the median "
        f"[p10-p90]). {note}",
        "",
    ]
    header = [
        "generator",
        *columns,
        "ms [p10-p90]",
        "TB/s",
        "vs compile",
        "registers (spills)",
        "warps",
        "rel. error",
    ]
    for row in result["rows"]:
        gb = row["bytes"] / 1e9
        compile_ms = row["compile"]["median_ms"]
        lines += [
            f"## {row['task']} ({row['bytes'] / 1e6:.0f} MB moved at least)",
            "",
            f"eager {row['eager']['median_ms']:.4f} ms, torch.compile {compile_ms:.4f} ms ({gb / compile_ms:.2f} TB/s)",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for key, c in row["candidates"].items():
            label, name = key.split("/", 1)
            regs = ", ".join(f"{k['regs']} ({k['spills']})" for k in c["kernels"])
            warps = ", ".join(str(k["num_warps"]) for k in c["kernels"])
            values = [
                label,
                *cells(name, c),
                f"{c['median_ms']:.4f} [{c['p10_ms']:.4f}-{c['p90_ms']:.4f}]",
                f"{gb / c['median_ms']:.2f}",
                f"{compile_ms / c['median_ms']:.2f}x",
                regs,
                warps,
                f"{c['rel_error']:.1e}",
            ]
            lines.append("| " + " | ".join(values) + " |")
        lines.append("")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    return candidates_markdown(
        result,
        "Few long rows: one launch of waiting parts against two launches",
        "waiting_rows.py",
        "TB/s counts each input read once and the output written once (the DRAM floor's traffic). "
        "Registers per thread and spills are Triton's, per compiled kernel (a two-launch candidate has two).",
        ["candidate"],
        lambda name, c: [name],
    )


def main_for(name: str, tasks: list[Path], configs_of, markdown) -> None:
    """The command line of a script that times ``configs_of``'s candidates of row tasks."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tasks", nargs="*")
    parser.add_argument("--generator", help="an older rowwise.py to time beside this checkout's")
    parser.add_argument("--label", default="old")
    args = parser.parse_args()
    gens = generators(args)
    sys.argv = [sys.argv[0], args.out, *args.tasks]  # run_suite reads OUT and tasks from argv
    run_suite(
        name,
        tasks,
        lambda path, sms: time_generated(path, gens, configs_of, name),
        markdown,
        commit=os.environ.get("KERNELCREW_COMMIT", "unknown"),
        old=args.label if args.generator else "",
    )


def main() -> None:
    main_for("waiting_rows", TASKS, wait_configs, markdown)


if __name__ == "__main__":
    main()
