"""Few long rows on a GPU: one program per row against a row split over programs.

The row_reduction strategy gives each row to one program. GroupNorm makes few, long rows (a
(sample, group) pair of an SD-VAE block is 262144 elements; 256 of them fill 132 SMs poorly), so
the candidate splits such rows: SPLITS programs per row each reduce one part and store its partial
states, then a second launch merges a row's states and writes each part, walking the programs in
reverse so that the parts the first launch read last are still in L2.

For each task and each tuning configuration of ``sm_90`` this script times the candidate with the
split off, at 4 (the default), 16 and 64 programs per SM, and at 4 without the reverse walk;
checks every variant against a float64 reference on fresh inputs; and times eager and
``torch.compile`` (default mode). Writes ``split_rows.json`` and ``split_rows.md`` to OUT_DIR.

    python bench/split_rows.py OUT_DIR [TASK.py ...]
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernelcrew.agents.playbook.analysis import TaskAnalysis, analyze_child  # noqa: E402
from kernelcrew.agents.playbook.rows import generate_rowwise, match, tuning_space  # noqa: E402
from kernelcrew.task import import_source, load_task  # noqa: E402

TASKS = [ROOT / "bench/suite/groupnorm_silu_fp16.py", ROOT / "bench/kb/groupnorm_silu_unet_bf16.py"]
WORK = Path(tempfile.mkdtemp(prefix="split_rows_"))
REPEATS = 5  # do_bench medians per variant; the spread is over these


def build_candidate(text: str, stem: str, task, model):
    """Candidate source ``text`` imported from ``WORK/<stem>.py`` (Triton reads a kernel's source
    from its file), and its ``ModelNew`` on the GPU with ``model``'s weights."""
    file = WORK / f"{stem}.py"
    file.write_text(text)
    module = import_source(text, file.stem, str(file))
    new = module.ModelNew(*task.get_init_inputs()).cuda()
    new.load_state_dict(model.state_dict())
    return module, new


def bench(fn) -> dict[str, float]:
    runs = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(REPEATS)]
    return {"median_ms": statistics.median(runs), "min_ms": min(runs), "max_ms": max(runs)}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    if torch.isnan(o).any():
        return float("nan")
    return float((o - r).norm() / r.norm())


def variants(candidate: str, sms: int) -> dict[str, str]:
    assert "SPLIT_TARGET = None" in candidate, "the plan cannot split its rows"

    def at(per_sm: int) -> str:
        return candidate.replace("SPLIT_TARGET = None", f"SPLIT_TARGET = {per_sm * sms}")

    no_reverse = at(4).replace("    pid = tl.num_programs(0) - 1 - pid", "    pid = pid")
    assert no_reverse != at(4)
    return {
        "per_row": at(0),
        "split_4_per_sm": at(4),
        "split_16_per_sm": at(16),
        "split_64_per_sm": at(64),
        "split_4_no_reverse": no_reverse,
    }


def row_plan(path: Path, match=match):
    """The task's source, its graph analysis and its plan of ``match``'s strategy (row_reduction
    unless told; exits when it does not apply)."""
    source = path.read_text()
    analysis = TaskAnalysis(
        analyze_child({"task_source": source, "task_path": str(path), "seed": 0}, Path(".")),
        task_source=source,
        task_path=str(path),
    )
    plan, reason = match(analysis)
    if plan is None:
        raise SystemExit(f"{path.name}: {match.__module__} does not apply: {reason}")
    return source, analysis, plan


def row_setup(path: Path, match=match):
    """The task's plan (of ``match``'s strategy), its model on the GPU (weights away from ones and
    zeros), a float64 copy, the timed inputs and fresh inputs (checked on, never timed)."""
    source, analysis, plan = row_plan(path, match)
    task = load_task(source, path.name)
    torch.manual_seed(0)
    model = task.model_cls(*task.get_init_inputs()).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1)
    ref64 = task.model_cls(*task.get_init_inputs()).cuda().eval().double()
    ref64.load_state_dict(model.state_dict())
    inputs = [t.cuda() for t in task.get_inputs()]
    fresh = [t.cuda() for t in task.get_inputs()]
    return analysis, plan, task, model, ref64, inputs, fresh


def run_task(path: Path, sms: int) -> dict:
    analysis, plan, task, model, ref64, inputs, fresh = row_setup(path)
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    with torch.no_grad():
        golden = ref64(*[t.double() for t in fresh])
        out_bytes = model(*inputs)
        nbytes += out_bytes.numel() * out_bytes.element_size()
        row = {"task": path.stem, "bytes": nbytes, "eager": bench(lambda: model(*inputs))}
        compiled = torch.compile(model)
        compiled(*inputs)
        row["compile"] = bench(lambda: compiled(*inputs))
        row["configs"] = []
        for i, params in enumerate(tuning_space(plan, "sm_90")):
            if params.get("SPLIT_PER_SM") == 0:  # the unsplit config: every config's per_row variant is that
                continue
            candidate = generate_rowwise(analysis, plan, params)
            entry = {"params": params, "variants": {}}
            for name, text in variants(candidate, sms).items():
                _module, new = build_candidate(text, f"split_{path.stem}_{i}_{name}", task, model)
                out = new(*fresh)
                err = rel_error(out, golden)
                timing = bench(lambda new=new: new(*inputs))
                entry["variants"][name] = {**timing, "rel_error": err}
                print(
                    f"{path.stem} cfg{i} {name}: {timing['median_ms']:.4f} ms, rel err {err:.2e}", flush=True
                )
            row["configs"].append(entry)
    return row


def markdown(result: dict) -> str:
    lines = [
        "# Few long rows: one program per row vs. rows split over programs",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}. `python bench/split_rows.py`; each figure is the median of "
        f"{REPEATS} `do_bench` medians (min-max in brackets), in ms. Effective bandwidth counts each input "
        "read once and the output written once.",
        "",
    ]
    for row in result["rows"]:
        gb = row["bytes"] / 1e9
        lines += [
            f"## {row['task']} ({row['bytes'] / 1e6:.0f} MB moved at least)",
            "",
            f"eager {row['eager']['median_ms']:.4f} ms, torch.compile {row['compile']['median_ms']:.4f} ms "
            f"({gb / row['compile']['median_ms']:.2f} TB/s)",
            "",
            "| config (MAX_SINGLE, CHUNK, TILE, warps) | variant | ms [min-max] | TB/s | vs compile | rel. error |",
            "|---|---|---|---|---|---|",
        ]
        for c in row["configs"]:
            p = c["params"]
            cfg = f"{p['MAX_SINGLE']}, {p['CHUNK']}, {p['TILE']}, {p['num_warps']}"
            for name, v in c["variants"].items():
                lines.append(
                    f"| {cfg} | {name} | {v['median_ms']:.4f} [{v['min_ms']:.4f}-{v['max_ms']:.4f}] | "
                    f"{gb / v['median_ms']:.2f} | {row['compile']['median_ms'] / v['median_ms']:.2f}x | "
                    f"{v['rel_error']:.1e} |"
                )
        lines.append("")
    return "\n".join(lines)


def run_suite(name: str, tasks: list[Path], run_task, markdown, **extra: str) -> None:
    """Run ``run_task`` on each task (argv's, else ``tasks``); write OUT/<name>.json and .md after each."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench/results"
    tasks = [Path(a) for a in sys.argv[2:]] or tasks
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        **extra,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [],
    }
    for t in tasks:  # written after each task, so a call that runs out of time keeps what it measured
        result["rows"].append(run_task(t, props.multi_processor_count))
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


def main() -> None:
    run_suite("split_rows", TASKS, run_task, markdown)


if __name__ == "__main__":
    main()
