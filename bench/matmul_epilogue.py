"""Linear layers with an elementwise epilogue on a GPU: the playbook's Triton matmul against the rest.

For each of the suite's matmul-epilogue tasks this script times, in one interleaved ``measure``
call (the crew's protocol), eager, ``torch.compile`` (default mode), the ``cublaslt_epilogue``
candidate where it applies, and the ``matmul_epilogue`` candidate at every ``sm_90`` tuning
configuration. Each is checked against a float64 reference on inputs the timing never saw; eager's
own error is reported beside it (float32 tasks: the TF32x3 products must stay at float32 accuracy).
Writes ``matmul_epilogue.json`` and ``.md``.

    python bench/matmul_epilogue.py OUT_DIR [TASK.py ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import WORK, rel_error, row_setup, run_suite  # noqa: E402

from kernelcrew.agents.playbook import epilogue, matmul  # noqa: E402
from kernelcrew.task import import_source  # noqa: E402
from kernelcrew.tools.timing import TimingConfig, measure  # noqa: E402

TASKS = [
    ROOT / "bench/suite/linear_residual_fp32.py",
    ROOT / "bench/suite/linear_swiglu_fp16.py",
    ROOT / "bench/suite/linear_gelu_bf16.py",
    ROOT / "bench/suite/vit_mlp_relu_fp16.py",
]
TIMING = TimingConfig(min_reps=30, max_reps=200, max_time_s=60.0)
#: Configurations timed beside the tuning space's, per kind of plan (exploration for its order).
EXTRA = {
    "tf32x3": [(128, 64, 32, 4, 3), (64, 64, 32, 4, 4), (128, 64, 64, 4, 3), (256, 64, 32, 8, 3)],
    "dual": [(128, 128, 32, 8, 5), (256, 64, 64, 8, 3), (128, 128, 32, 8, 4)],
    "half": [(128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4)],
}


def load(text: str, name: str, task, model):
    file = WORK / f"{name}.py"  # Triton reads a kernel's source from its file
    file.write_text(text)
    new = import_source(text, file.stem, str(file)).ModelNew(*task.get_init_inputs()).cuda()
    new.load_state_dict(model.state_dict())
    return new


def run_task(path: Path, sms: int) -> dict:
    del sms
    analysis, plan, task, model, ref64, inputs, fresh = row_setup(path, matmul.match)
    with torch.no_grad():  # row_setup's weights near 1 would overflow a float16 GEMM's output
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        ref64.load_state_dict(model.state_dict())
    source = path.read_text()
    flop = 2 * plan.rows * plan.in_features * plan.out_features * len(plan.layers)
    as64 = [t.double() if t.is_floating_point() else t for t in fresh]
    row = {"task": path.stem, "gflop": flop / 1e9, "candidates": {}}
    with torch.no_grad():
        golden = ref64(*as64)
        row["eager_rel_error"] = rel_error(model(*fresh), golden)
        compiled = torch.compile(model)
        row["compile_rel_error"] = rel_error(compiled(*fresh), golden)
        callables = {"eager": lambda xs: model(*xs), "compile": lambda xs: compiled(*xs)}
        candidates = {}
        lt_plan, _ = epilogue.match(analysis)
        if lt_plan is not None:
            candidates["cublaslt_epilogue"] = ({}, epilogue.generate(source, analysis, lt_plan, {}))
        configs = matmul.tuning_space(plan, "sm_90")
        for bm, bn, bk, w, st in EXTRA[matmul._kind(plan)]:
            extra = dict(zip(matmul.PARAMS, (bm, bn, bk, 8, w, st), strict=True))
            if extra not in configs:  # the tuning space took some of them in, in measured order
                configs.append(extra)
        for i, params in enumerate(configs):
            candidates[f"matmul_epilogue/{i}"] = (params, matmul.generate(source, analysis, plan, params))
        for name, (params, text) in candidates.items():
            new = load(text, f"mm_{path.stem}_{name.replace('/', '_')}", task, model)
            row["candidates"][name] = {"params": params, "rel_error": rel_error(new(*fresh), golden)}
            callables[name] = lambda xs, new=new: new(*xs)
            print(f"{path.stem} {name}: rel err {row['candidates'][name]['rel_error']:.2e}", flush=True)
        timing = measure(callables, [inputs], device="cuda", config=TIMING)["results"]
    row["eager"], row["compile"] = _figures(timing["eager"]), _figures(timing["compile"])
    for name, entry in row["candidates"].items():
        entry.update(_figures(timing[name]))
        print(f"{path.stem} {name}: {entry['median_ms']:.4f} ms", flush=True)
    return row


def _figures(result: dict) -> dict[str, float]:
    keys = ("median_ms", "p10_ms", "p90_ms", "reps")
    return {k: result[k] for k in keys}


def markdown(result: dict) -> str:
    lines = [
        "# Matmul epilogues: the playbook's Triton matmul against cuBLAS(Lt), eager and torch.compile",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result['commit']}. `python bench/matmul_epilogue.py`, "
        "timed by the crew's protocol (`kernelcrew.tools.timing.measure`: every candidate of a task "
        "interleaved, L2 flushed before each call, CUDA events). ms is the median [p10-p90]. The error is "
        "the relative L2 error against the module run in float64 on inputs the timing never saw.",
        "",
    ]
    for row in result["rows"]:
        gflop = row["gflop"]
        eager, comp = row["eager"]["median_ms"], row["compile"]["median_ms"]
        lines += [
            f"## {row['task']} ({gflop:.0f} GFLOP per call)",
            "",
            f"eager {eager:.4f} ms ({gflop / eager:.0f} TFLOP/s, error {row['eager_rel_error']:.1e}), "
            f"torch.compile {comp:.4f} ms ({gflop / comp:.0f} TFLOP/s, error {row['compile_rel_error']:.1e})",
            "",
            "| candidate | params (BM, BN, BK, group, warps, stages) | ms [p10-p90] | TFLOP/s | vs eager "
            "| vs compile | rel. error |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, c in row["candidates"].items():
            p = ", ".join(str(v) for v in c["params"].values()) or "-"
            ms = c["median_ms"]
            lines.append(
                f"| {name} | {p} | {ms:.4f} [{c['p10_ms']:.4f}-{c['p90_ms']:.4f}] | {gflop / ms:.0f} | "
                f"{eager / ms:.2f}x | {comp / ms:.2f}x | {c['rel_error']:.1e} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    # the device's copy has no .git: the caller says which commit ran
    run_suite(
        "matmul_epilogue", TASKS, run_task, markdown, commit=os.environ.get("KERNELCREW_COMMIT", "unknown")
    )


if __name__ == "__main__":
    main()
