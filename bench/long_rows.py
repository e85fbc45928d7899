"""Rows longer than one register block on a GPU: what each lever of the row kernel is worth.

The suite's row tasks that miss the DRAM floor have long rows: ``log_softmax`` (32000 columns,
read twice: statistics, then output), ``cross_entropy`` (128256 columns, one online pass) and
GroupNorm (262144 columns, few rows, split over programs). For each task and each ``sm_90`` tuning
configuration (plus, for rows that fit, a single pass of up to 32768 columns) this script times the
candidate as generated and with one lever undone:

- ``no_hint``: without the L2 eviction hint (``evict_last``) on the loads of a pass whose row a
  later pass reads again;
- ``no_evict_first``: without the hint (``evict_first``) on the loads of the pass that writes;
- ``forward``: every pass walks its columns forward (as generated, each pass after the first starts
  on the chunks the pass before read last);
- ``as_before``: the last two together (the kernel before they were levers);
- for split rows, ``split_back``: the output launch with those two levers too (as generated: not);
- for plans whose rows split over programs: ``per_row`` (never split), ``split_16_per_sm``.

A configuration that splits rows in one launch of waiting parts (``WAIT_PART``, GroupNorm's second)
is timed as generated: the levers above belong to the two-launch kernel.

Every variant is checked against a float64 reference on inputs the timing never saw; eager and
``torch.compile`` (default mode) are timed alike, all in one interleaved ``measure`` call. Writes
``long_rows.json`` and ``long_rows.md``.

    python bench/long_rows.py OUT_DIR [TASK.py ...]
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import build_candidate, rel_error, row_setup, run_suite  # noqa: E402

from kernelcrew.agents.playbook.rows import generate_rowwise, splittable, tuning_space  # noqa: E402
from kernelcrew.tools.timing import TimingConfig, measure  # noqa: E402

TASKS = [
    ROOT / "bench/suite/log_softmax_vocab_bf16.py",
    ROOT / "bench/suite/cross_entropy_llm_vocab_bf16.py",
    ROOT / "bench/suite/groupnorm_silu_fp16.py",
]
#: Single-pass configurations for rows of up to 32768 columns, beside the tuning space's.
LONG_SINGLE = [
    {"MAX_SINGLE": 32768, "CHUNK": 4096, "TILE": 4096, "num_warps": 8},
    {"MAX_SINGLE": 32768, "CHUNK": 4096, "TILE": 2048, "num_warps": 4},
]
TIMING = TimingConfig(min_reps=60, max_reps=300, max_time_s=60.0)


def split_back(candidate: str) -> str:
    """The split rows' output launch with the one-program passes' levers: each part walked from its
    last chunk, its loads hinted ``evict_first`` (the generated launch walks forward, unhinted)."""
    head, _, loop = candidate.rpartition("for start in range(lo, hi, BLOCK_N):")
    indent = head[head.rindex("\n") + 1 :]
    back = f"last = lo + (hi - lo - 1) // BLOCK_N * BLOCK_N\n{indent}for k in range(lo, hi, BLOCK_N):\n"
    body, rest = loop.split("\n\n\n", 1)  # the loop ends the kernel
    body = f"{indent}    start = last - (k - lo)" + body.replace(
        "mask=mask, other=0)", 'mask=mask, other=0, eviction_policy="evict_first")'
    )
    return head + back + body + "\n\n\n" + rest


def variants(candidate: str, plan, sms: int) -> dict[str, str]:
    out = {"as_generated": candidate}
    if re.search(r"^WAIT_PART = [1-9]", candidate, flags=re.M):  # one launch of waiting parts: no levers
        return out
    levers = {  # each undoes one lever of the generated kernel where it applies
        "no_hint": (', eviction_policy="evict_last"', ""),
        "no_evict_first": (', eviction_policy="evict_first"', ""),
        "forward": ("start = last - k", "start = k"),
    }
    for name, (old, new) in levers.items():
        if old in candidate:
            out[name] = candidate.replace(old, new)
    if "forward" in out:  # both levers of the one-program passes undone: the kernel before them
        out["as_before"] = out["forward"].replace(*levers["no_evict_first"])
    if splittable(plan):
        out["split_back"] = split_back(candidate)
        out["per_row"] = candidate.replace("SPLIT_TARGET = None", "SPLIT_TARGET = 0")
        out["split_16_per_sm"] = candidate.replace("SPLIT_TARGET = None", f"SPLIT_TARGET = {16 * sms}")
    return out


def run_task(path: Path, sms: int) -> dict:
    analysis, plan, task, model, ref64, inputs, fresh = row_setup(path)
    as64 = [t.double() if t.is_floating_point() else t for t in fresh]
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    configs = [c for c in tuning_space(plan, "sm_90") if c.get("SPLIT_PER_SM") != 0]
    n_cols = inputs[0].shape[-1] if plan.groups is None else inputs[0][0].numel() // plan.groups
    if n_cols <= 32768:
        configs += LONG_SINGLE
    with torch.no_grad():
        golden = ref64(*as64)
        out = model(*inputs)
        nbytes += out.numel() * out.element_size()
        compiled = torch.compile(model)
        compiled(*inputs)
        callables = {"eager": lambda xs: model(*xs), "compile": lambda xs: compiled(*xs)}
        row = {"task": path.stem, "bytes": nbytes, "n_cols": n_cols, "configs": []}
        for i, params in enumerate(configs):
            entry = {"params": params, "variants": {}}
            for name, text in variants(generate_rowwise(analysis, plan, params), plan, sms).items():
                _module, new = build_candidate(text, f"long_{path.stem}_{i}_{name}", task, model)
                entry["variants"][name] = {"rel_error": rel_error(new(*fresh), golden)}
                callables[f"{i}/{name}"] = lambda xs, new=new: new(*xs)
            row["configs"].append(entry)
        timing = measure(callables, [inputs], device="cuda", config=TIMING)["results"]
    row["eager"], row["compile"] = _figures(timing["eager"]), _figures(timing["compile"])
    for i, entry in enumerate(row["configs"]):
        for name, v in entry["variants"].items():
            v.update(_figures(timing[f"{i}/{name}"]))
            print(
                f"{path.stem} cfg{i} {name}: {v['median_ms']:.4f} ms, rel err {v['rel_error']:.2e}",
                flush=True,
            )
    return row


def _figures(result: dict) -> dict[str, float]:
    keys = ("median_ms", "p10_ms", "p90_ms", "wall_median_ms", "reps")
    return {k: result[k] for k in keys}


def markdown(result: dict) -> str:
    lines = [
        "# Long rows: what each lever of the row kernel is worth",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result['commit']}. `python bench/long_rows.py`, timed "
        "by the crew's protocol (`kernelcrew.tools.timing.measure`: every variant of a task interleaved, L2 "
        "flushed before each call, CUDA events behind a lead, so launch overhead is not counted; `wall` is "
        "a call on an idle device timed by the host, launches included). ms is the median [p10-p90]. "
        "Bandwidth counts each input read once and the output written once (the DRAM floor's traffic).",
        "",
    ]
    for row in result["rows"]:
        gb = row["bytes"] / 1e9
        lines += [
            f"## {row['task']} ({row['n_cols']} columns per row, {row['bytes'] / 1e6:.0f} MB moved at least)",
            "",
            f"eager {row['eager']['median_ms']:.4f} ms, torch.compile {row['compile']['median_ms']:.4f} ms "
            f"({gb / row['compile']['median_ms']:.2f} TB/s)",
            "",
            "| config (MAX_SINGLE, CHUNK, TILE, warps) | variant | ms [p10-p90] | wall ms | TB/s | vs compile "
            "| rel. error |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in row["configs"]:
            p = c["params"]
            cfg = f"{p['MAX_SINGLE']}, {p['CHUNK']}, {p['TILE']}, {p['num_warps']}"
            if p.get("WAIT_PART"):
                cfg += f"; waiting parts of {p['WAIT_PART']}"
            for name, v in c["variants"].items():
                lines.append(
                    f"| {cfg} | {name} | {v['median_ms']:.4f} [{v['p10_ms']:.4f}-{v['p90_ms']:.4f}] | "
                    f"{v['wall_median_ms']:.4f} | {gb / v['median_ms']:.2f} | "
                    f"{row['compile']['median_ms'] / v['median_ms']:.2f}x | {v['rel_error']:.1e} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    # the device's copy has no .git: the caller says which commit ran
    run_suite("long_rows", TASKS, run_task, markdown, commit=os.environ.get("KERNELCREW_COMMIT", "unknown"))


if __name__ == "__main__":
    main()
