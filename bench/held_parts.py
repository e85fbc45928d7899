"""GroupNorm's parts held on chip: a persistent kernel whose programs keep a part in registers.

``groupnorm_silu_fp16``'s answer (``rowwise``'s waiting parts, ``WAIT_LAG``) reads each part from
DRAM, posts its statistics and reads it again from L2 to write it, once its row is whole: L2 is
the limit of that kernel (``suite_h100.md``). This script times the other way, the re-read
removed: a persistent launch of programs that each walk parts ``pid, pid + P, ...`` (P programs),
load a part, post its statistics and keep it in registers, and write it one step later, when its
row has posted (``post_first``: after posting the next part; ``write_first``: before). Every
program must be resident at once, or a program waits for one that cannot start: the script reads
each compiled kernel's registers and runs only the programs per SM that fit (all of them, and
half); a program that has polled ``SPIN`` times reduces the row itself, so none deadlocks.

The kernel is written for this task (contiguous NCHW, a part within one channel), beside the
suite's answer, both checked against a float64 reference on fresh inputs and timed by the crew's
protocol in one call. Writes ``held_parts.json`` and ``.md``.

    python bench/held_parts.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import build_candidate, rel_error, row_setup, run_suite  # noqa: E402
from waiting_rows import kernel_registers  # noqa: E402

from kernelcrew.agents.playbook import rows as rowwise  # noqa: E402
from kernelcrew.tools.timing import TimingConfig, measure  # noqa: E402

TASK = ROOT / "bench/suite/groupnorm_silu_fp16.py"
#: the suite's answer (suite_h100_runs/groupnorm_silu_fp16/report.json)
BEST = {"MAX_SINGLE": 16384, "CHUNK": 8192, "TILE": 4096, "num_warps": 4, "WAIT_PART": 8192, "WAIT_LAG": 28}
SHAPES = ((2048, 4), (4096, 4), (4096, 8), (8192, 8))  # (columns a part, warps)
SPIN = 1 << 14
TIMING = TimingConfig(min_reps=60, max_reps=300, max_time_s=60.0)


@triton.jit
def held_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, posted_ptr, n_rows, n_cols, groups, cpg, hw, eps, target,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, WRITE_FIRST: tl.constexpr, SPIN: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` loads part ``pid``, then each step loads part ``nxt`` (``P`` further on),
    posts its mean and squared deviations (and counts it in its row's ``posted``) and writes the
    part it holds once that part's row has counted ``target`` (the order per ``WRITE_FIRST``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = n_rows * SPLITS
    offs = tl.arange(0, BLOCK)
    flat = pid
    xh = tl.load(x_ptr + flat.to(tl.int64) * BLOCK + offs, mask=offs < tl.where(flat < total, BLOCK, 0))
    nxt = flat
    xn = xh
    steps = (total - pid + nprog - 1) // nprog  # parts of this program; the last step only writes
    for step in range(0, steps + 1):
        if step > 0:
            nxt = pid + step * nprog
            xn = tl.load(x_ptr + nxt.to(tl.int64) * BLOCK + offs, mask=offs < tl.where(nxt < total, BLOCK, 0))
        for phase in tl.static_range(2):
            if (phase == 0) == WRITE_FIRST:
                if step > 0:  # write the part held since the last step
                    row = flat // SPLITS
                    seen = tl.atomic_add(posted_ptr + row, 0, sem="acquire")
                    polls = 0
                    while (seen < target) & (polls < SPIN):
                        seen = tl.atomic_add(posted_ptr + row, 0, sem="acquire")
                        polls += 1
                    if seen < target:  # not all posted after SPIN polls: reduce the whole row here
                        acc = tl.zeros([BLOCK], tl.float32)
                        for s in range(0, n_cols, BLOCK):
                            acc += tl.load(x_ptr + row.to(tl.int64) * n_cols + s + offs).to(tl.float32)
                        mean = tl.sum(acc) / n_cols
                        acc = tl.zeros([BLOCK], tl.float32)
                        for s in range(0, n_cols, BLOCK):
                            d = tl.load(x_ptr + row.to(tl.int64) * n_cols + s + offs).to(tl.float32) - mean
                            acc += d * d
                        var = tl.sum(acc) / n_cols
                    else:  # Chan's merge of the parts' (mean, squared deviations), equal counts
                        parts = tl.arange(0, SPLITS)
                        means = tl.load(ws_ptr + (row * SPLITS + parts) * 2)
                        m2s = tl.load(ws_ptr + (row * SPLITS + parts) * 2 + 1)
                        mean = tl.sum(means) / SPLITS
                        dm = means - mean
                        var = (tl.sum(m2s) + BLOCK * tl.sum(dm * dm)) / n_cols
                    ch = (row % groups) * cpg + (flat % SPLITS) * BLOCK // hw
                    scale = tl.rsqrt(var + eps) * tl.load(w_ptr + ch).to(tl.float32)
                    y = (xh.to(tl.float32) - mean) * scale + tl.load(b_ptr + ch).to(tl.float32)
                    y = y / (1.0 + tl.exp(-y))  # SiLU
                    dst = y_ptr + flat.to(tl.int64) * BLOCK + offs
                    tl.store(dst, y.to(y_ptr.dtype.element_ty), cache_modifier=".cs")
            else:
                if nxt < total:  # post the part just loaded
                    xf = xn.to(tl.float32)
                    m = tl.sum(xf) / BLOCK
                    d = xf - m
                    tl.store(ws_ptr + nxt * 2, m)
                    tl.store(ws_ptr + nxt * 2 + 1, tl.sum(d * d))
                    tl.atomic_add(posted_ptr + nxt // SPLITS, 1, sem="release")
        xh = xn
        flat = nxt


def resident(regs: int, warps: int, shared: int, props) -> int:
    """Programs of a kernel that fit on one SM at once: registers (allocated per warp in 256s),
    warps, blocks and shared memory."""
    per_warp = -(-regs * 32 // 256) * 256
    fits = min(getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps), 64 // warps, 32)
    if shared:
        fits = min(fits, getattr(props, "shared_memory_per_multiprocessor", 233472) // shared)
    return fits


def launch(norm, x, block, warps, per_sm, write_first, state, grid=None):
    """Run the held kernel on ``x`` with ``per_sm`` programs per SM (its counters in ``state``);
    with ``grid`` (``triton`` ``warmup``'s keyword), compile it for those arguments and return it."""
    n, c = x.shape[:2]
    hw = x[0, 0].numel()
    groups = norm.num_groups
    n_rows, n_cols = n * groups, c // groups * hw
    assert x.is_contiguous() and hw % block == 0, "a part within one channel"
    splits = n_cols // block
    if state.get("rows") != n_rows:
        state.update(rows=n_rows, calls=0, posted=torch.zeros(n_rows, dtype=torch.int64, device=x.device))
    state["calls"] += 1  # each call adds SPLITS to every row's count
    ws = torch.empty(n_rows * splits * 2, dtype=torch.float32, device=x.device)
    y = torch.empty_like(x)
    args = (
        x,
        norm.weight,
        norm.bias,
        y,
        ws,
        state["posted"],
        n_rows,
        n_cols,
        groups,
        c // groups,
        hw,
        norm.eps,
    )
    args += (state["calls"] * splits,)
    meta = {"SPLITS": splits, "BLOCK": block, "WRITE_FIRST": write_first, "SPIN": SPIN, "num_warps": warps}
    if grid is not None:  # the same arguments, so the same specialization as the timed launches
        kernel = held_kernel.warmup(*args, **meta, grid=grid)
        kernel._init_handles()
        return kernel
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    held_kernel[(min(per_sm * sms, n_rows * splits),)](*args, **meta)
    return y


ANSWER = "waiting parts (the answer)"


def answer_row(path: Path, stem: str):
    """The task's setup and the suite's answer beside it: ``(model, inputs, fresh, golden, module,
    row, callables)``, the answer checked against the float64 reference on fresh inputs (``row``'s
    first candidate) and timed as ``callables``' first."""
    analysis, plan, task, model, ref64, inputs, fresh = row_setup(path)
    x = inputs[0]
    module, best = build_candidate(rowwise.generate_rowwise(analysis, plan, BEST), stem, task, model)
    with torch.no_grad():
        golden = ref64(*[t.double() for t in fresh])
        err = rel_error(best(*fresh), golden)
    row = {"task": path.stem, "bytes": 2 * x.numel() * x.element_size(), "best_params": BEST}
    row["candidates"] = {ANSWER: {"rel_error": err}}
    return model, inputs, fresh, golden, module, row, {ANSWER: lambda xs: best(*xs)}


def time_row(row: dict, callables: dict, inputs: list) -> dict:
    """Time every callable in one ``measure`` call and add the figures to ``row``'s candidates."""
    with torch.no_grad():
        timing = measure(callables, [inputs], device="cuda", config=TIMING)["results"]
    for name, entry in row["candidates"].items():
        entry.update({k: timing[name][k] for k in ("median_ms", "p10_ms", "p90_ms", "reps")})
        print(f"{name}: {entry['median_ms']:.4f} ms", flush=True)
    return row


def against_answer_markdown(result: dict, title: str, script: str, note: str, columns: dict, closing) -> str:
    """The table of a script that times kernels against the answer: a row per candidate, with the
    extra ``columns`` (header: cell of a candidate) before the error, and per task the line
    ``closing(row, answer_ms)``."""
    lines = [
        f"# {title}",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result['commit']}. `python bench/{script}`, "
        "timed by the crew's protocol (`kernelcrew.tools.timing.measure`: every candidate interleaved, L2 "
        "flushed before each call, CUDA events; ms is the median [p10-p90]). TB/s counts the input read once "
        f"and the output written once{note}",
        "",
    ]
    header = ["candidate", "ms [p10-p90]", "TB/s", *columns, "rel. error"]
    for row in result["rows"]:
        gb = row["bytes"] / 1e9
        lines += [
            f"## {row['task']} ({row['bytes'] / 1e6:.0f} MB moved at least)",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for name, c in row["candidates"].items():
            err = "" if c["rel_error"] is None else f"{c['rel_error']:.1e}"
            ms = f"{c['median_ms']:.4f} [{c['p10_ms']:.4f}-{c['p90_ms']:.4f}]"
            cells = [name, ms, f"{gb / c['median_ms']:.2f}", *(cell(c) for cell in columns.values()), err]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", closing(row, row["candidates"][ANSWER]["median_ms"]), ""]
    return "\n".join(lines)


def run_task(path: Path, sms: int) -> dict:
    model, inputs, fresh, golden, module, row, callables = answer_row(path, "held_parts_best")
    props = torch.cuda.get_device_properties(0)
    x = inputs[0]
    (regs,) = kernel_registers(module)
    row["candidates"][ANSWER].update(regs=regs["regs"], spills=regs["spills"])
    with torch.no_grad():
        for block, warps in SHAPES:
            for write_first in (False, True):
                kernel = launch(model.norm, x, block, warps, 0, write_first, {}, grid=(1,))
                fits = resident(kernel.n_regs, warps, kernel.metadata.shared, props)
                for per_sm in sorted({fits, max(1, fits // 2)}):
                    name = f"held {block} cols, {warps} warps, {per_sm}/SM, {'write' if write_first else 'post'} first"
                    state: dict = {}
                    err = rel_error(
                        launch(model.norm, fresh[0], block, warps, per_sm, write_first, state), golden
                    )
                    row["candidates"][name] = {
                        "block": block,
                        "warps": warps,
                        "per_sm": per_sm,
                        "resident_per_sm": fits,
                        "write_first": write_first,
                        "regs": kernel.n_regs,
                        "spills": kernel.n_spills,
                        "rel_error": err,
                    }
                    callables[name] = lambda xs, a=(block, warps, per_sm, write_first), s=state: launch(
                        model.norm, xs[0], *a, s
                    )
                    print(name, row["candidates"][name], flush=True)
    return time_row(row, callables, inputs)


def markdown(result: dict) -> str:
    def closing(row: dict, answer: float) -> str:
        held = {k: c for k, c in row["candidates"].items() if k.startswith("held")}
        fastest = min(held, key=lambda k: held[k]["median_ms"])
        regs = sorted(c["regs"] for c in held.values())
        return (
            f"Fastest held: {fastest}, {held[fastest]['median_ms']:.4f} ms, "
            f"{held[fastest]['median_ms'] / answer:.2f}x the waiting parts' time. Holding a part across a "
            f"step takes {regs[0]}-{regs[-1]} registers a thread, so few programs fit on an SM."
        )

    return against_answer_markdown(
        result,
        "GroupNorm's parts held in registers by persistent programs, against the waiting parts",
        "held_parts.py",
        ". Resident: the programs per SM that the kernel's registers allow.",
        {
            "registers (spills)": lambda c: f"{c['regs']} ({c['spills']})",
            "resident / SM": lambda c: str(c.get("resident_per_sm", "")),
        },
        closing,
    )


def main() -> None:
    run_suite("held_parts", [TASK], run_task, markdown, commit=os.environ.get("KERNELCREW_COMMIT", "unknown"))


if __name__ == "__main__":
    main()
