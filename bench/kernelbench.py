"""The KernelBench evidence run: a seeded stratified sample of levels 1-3 through ``kernelcrew bench``.

Sampling (``--list``, ``--copy-to DIR``). Every task file of ``ROOT/level{1,2,3}`` is put in one stratum by
its file name alone (the rule tables below; the first matching rule wins):

* level 1 by operator family: matmul, conv, conv_transposed, pointwise, norm (norms and softmax),
  reduction (reductions, arg-reductions and scans), pooling, loss, attention, other;
* level 2 by the leading anchor (conv2d, conv3d, conv_transposed2d, conv_transposed3d, gemm: Gemm,
  Matmul or BMM) and what follows it: ``norm`` when a normalization follows, else ``reduce`` when a
  softmax, logsumexp, pool, sum, mean or max follows, else ``pointwise``;
* level 3 by architecture family: mlp, cnn_block, cnn_net, rnn, attention, other.

A level's quota (``--counts``, 20,30,10 by default) is allocated one seat per non-empty stratum, then seat
by seat to the stratum whose proportional share (quota x stratum size / level size) is furthest above
the seats it has, ties broken by name; no stratum gets more seats than files. Within a stratum the
files are drawn with ``random.Random(f"{seed}/level{N}/{stratum}").sample`` over the sorted names, so a
change to one stratum leaves the others' draws alone. Nothing is chosen by how well the crew does.

``--copy-to DIR`` copies the sample into one flat folder, each task renamed ``l{level}_{file}`` (the
levels reuse numbers), with ``sample.json`` beside it; keep DIR out of git (the files are KernelBench's).

Running (``--run DIR``): the folder's tasks through ``kernelcrew bench`` with its defaults, in an order
that keeps a run stopped early stratified (``run_order``), one shard per GPU (``bench/run_suite.py``'s ``launch``), resumable: each shard resumes from its own table and, on a
fresh machine, from the rows of the canonical result file, so a second command continues where the
first stopped. ``--wall-limit S`` (counted from ``--started``, an epoch time, default now) is the
command's limit: no task starts when fewer than ``--reserve`` seconds (120) are left, and shards still
running 15 s before the limit are stopped, so the result file is always written. The result is
``RESULTS/NAME.json`` and ``.md``: per task the level, file, stratum, verdict, eager, compile and best
times, the answer's kind, SOL and wall time; the summary (overall and per level) and the issue's
targets with met / missed. Shares are of all tasks run (an errored task or one without an answer counts
against them); ``fast_1`` is a verified answer whose speedup over eager is significant; the geomeans
are over the verified answers; an own-kernel answer is one of kind ``kernel`` (not ``hybrid``).

    python bench/kernelbench.py --copy-to .kb
    python bench/kernelbench.py --run .kb --gpus 0,1 --wall-limit 570 --started "$T0"
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from kernelcrew.benchmark import geomean, suite_tasks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run_suite import collect, deal, launch, merge

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_COUNTS = (20, 30, 10)
DEFAULT_SEED = 31
#: Seconds before the command's limit after which no task starts (a task takes its budget, 90 s).
RESERVE_S = 120.0
#: Seconds before the limit at which shards still running are stopped, to leave time to write results.
STOP_BEFORE_S = 15.0
#: A task's wall time counts as over budget above this multiple of the budget (the issue's "+20 %").
OVER_BUDGET = 1.2

LEVEL1_FAMILIES = [
    ("pointwise", r"matrix_scalar|relu|sigmoid|tanh|swish|gelu|selu|softplus|softsign|elu"),
    ("conv_transposed", r"conv_transposed"),
    ("conv", r"conv"),
    ("matmul", r"matmul|matrix|gemm"),
    ("norm", r"norm|softmax"),
    ("pooling", r"pool"),
    ("loss", r"loss"),
    ("attention", r"attention"),
    ("reduction", r"reduction|argmax|argmin|cumsum|cumprod|product"),
]
LEVEL2_ANCHORS = [
    ("conv_transposed3d", r"convtranspose3d"),
    ("conv_transposed2d", r"convtranspose2d"),
    ("conv3d", r"conv3d"),
    ("conv2d", r"conv2d"),
    ("gemm", r"gemm|matmul|bmm"),
]
LEVEL2_NORMS = r"batchnorm|instancenorm|groupnorm|layernorm"
LEVEL2_REDUCTIONS = r"softmax|logsumexp|pool|sum|mean|max"
LEVEL3_FAMILIES = [
    ("rnn", r"rnn|lstm|gru"),
    ("attention", r"transformer|attention|swin|gpt|vit"),
    ("mlp", r"mlp"),
    ("cnn_block", r"module|block|layer|unit|mbconv"),
    (
        "cnn_net",
        r"resnet|vgg|densenet|squeezenet|mobilenet|efficientnet|shufflenet|regnet|googlenet|lenet|alexnet|unet",
    ),
]


def _first(rules: list[tuple[str, str]], text: str, default: str = "other") -> str:
    return next((name for name, pattern in rules if re.search(pattern, text)), default)


def stratum(level: int, filename: str) -> str:
    """The stratum of a KernelBench task file, from its level and file name (module docstring)."""
    stem = Path(filename).stem.lower()
    name = stem.split("_", 1)[1] if "_" in stem else stem  # drop the task number
    if level == 1:
        return _first(LEVEL1_FAMILIES, name)
    if level == 2:
        anchor_token, _, rest = name.partition("_")
        anchor = _first(LEVEL2_ANCHORS, anchor_token)
        tail = (
            "norm"
            if re.search(LEVEL2_NORMS, rest)
            else "reduce"
            if re.search(LEVEL2_REDUCTIONS, rest)
            else "pointwise"
        )
        return f"{anchor}/{tail}"
    if level == 3:
        return _first(LEVEL3_FAMILIES, name)
    raise ValueError(f"KernelBench has levels 1-3, not {level}")


def allocate(sizes: dict[str, int], quota: int) -> dict[str, int]:
    """Seats per stratum: one each (while seats last), then to the largest shortfall of the
    proportional share, ties by name, never more than a stratum's size."""
    total = sum(sizes.values())
    quota = min(quota, total)
    seats = {s: 0 for s in sizes}
    share = {s: quota * n / total for s, n in sizes.items()} if total else {}
    for s in sorted(sizes, key=lambda s: (-share[s], s))[:quota]:
        seats[s] = 1 if sizes[s] else 0
    while sum(seats.values()) < quota:
        open_ = [s for s in sizes if seats[s] < sizes[s]]
        seats[min(open_, key=lambda s: (seats[s] - share[s], s))] += 1
    return seats


def sample(
    root: Path, counts: tuple[int, ...] = DEFAULT_COUNTS, seed: int = DEFAULT_SEED
) -> list[dict[str, Any]]:
    """The stratified sample: one entry per task (level, file, stratum, name in the flat folder)."""
    chosen = []
    for level, quota in enumerate(counts, start=1):
        folder = root / f"level{level}"
        if not folder.is_dir():
            raise SystemExit(f"{folder} is not a folder of KernelBench tasks (--root)")
        strata: dict[str, list[str]] = {}
        for path in sorted(folder.glob("*.py")):
            strata.setdefault(stratum(level, path.name), []).append(path.name)
        seats = allocate({s: len(files) for s, files in strata.items()}, quota)
        for name in sorted(strata):
            rng = random.Random(f"{seed}/level{level}/{name}")
            for filename in sorted(rng.sample(strata[name], seats[name])):
                chosen.append(
                    {
                        "level": level,
                        "file": f"level{level}/{filename}",
                        "stratum": name,
                        "task": f"l{level}_{Path(filename).stem}",
                    }
                )
    return sorted(chosen, key=lambda e: (e["level"], e["stratum"], e["task"]))


def copy_sample(root: Path, entries: list[dict[str, Any]], dest: Path, seed: int) -> None:
    """The sampled files in one flat folder (renamed ``l{level}_{file}``) with ``sample.json``."""
    dest.mkdir(parents=True, exist_ok=True)
    stale = [p for p in dest.glob("*.py") if p.stem not in {e["task"] for e in entries}]
    if stale:
        raise SystemExit(
            f"{dest} holds tasks outside this sample ({', '.join(p.name for p in stale[:3])}): use a new folder"
        )
    for e in entries:
        shutil.copyfile(root / e["file"], dest / f"{e['task']}.py")
    manifest = {"root": str(root), "seed": seed, "tasks": entries}
    (dest / "sample.json").write_text(json.dumps(manifest, indent=2) + "\n")


def describe(task: str) -> dict[str, Any]:
    """Level, KernelBench file and stratum of a task named ``l{level}_{file}``; ``{}`` for another name."""
    m = re.fullmatch(r"l([123])_(.+)", task)
    if not m:
        return {}
    level, stem = int(m.group(1)), m.group(2)
    return {"level": level, "file": f"level{level}/{stem}.py", "stratum": stratum(level, f"{stem}.py")}


def verdict(row: dict[str, Any]) -> str:
    """``error`` (the task did not run), ``verified`` (an answer) or ``none`` (ran, nothing verified)."""
    if row.get("status") == "error" or row.get("error"):
        return "error"
    return "verified" if row.get("verified") else "none"


def fast_1(row: dict[str, Any]) -> bool:
    """A verified answer significantly faster than eager (its interval's lower bound above 1)."""
    return bool(row.get("verified") and row.get("significant") and (row.get("speedup_eager") or 0) > 1)


def stats(rows: list[dict[str, Any]], budget_s: float | None) -> dict[str, Any]:
    """The summary of some rows: counts, shares of the rows, geomeans over the verified answers."""
    n = len(rows)
    verified = [r for r in rows if verdict(r) == "verified"]

    def share(k: int) -> float | None:
        return k / n if n else None

    over = [r for r in rows if budget_s and (r.get("wall_s") or 0) > OVER_BUDGET * budget_s]
    own = [r for r in verified if r.get("source_kind") == "kernel"]
    fast = [r for r in rows if fast_1(r)]
    return {
        "tasks": n,
        "verified": len(verified),
        "verified_share": share(len(verified)),
        "fast_1": len(fast),
        "fast_1_share": share(len(fast)),
        "geomean_eager": geomean([r.get("speedup_eager") for r in verified]),
        "geomean_compile": geomean([r.get("speedup_compile") for r in verified]),
        "own_kernels": len(own),
        "own_kernels_share": share(len(own)),
        "kinds": {
            k: sum(1 for r in verified if r.get("source_kind") == k)
            for k in sorted({str(r.get("source_kind")) for r in verified})
        },
        "errored": [r["task"] for r in rows if verdict(r) == "error"],
        "no_answer": [r["task"] for r in rows if verdict(r) == "none"],
        "over_budget": [r["task"] for r in over],
    }


def summarize(rows: list[dict[str, Any]], budget_s: float | None) -> dict[str, Any]:
    """Overall and per level (levels as strings, the JSON's keys)."""
    levels = sorted({r["level"] for r in rows if r.get("level")})
    return {
        **stats(rows, budget_s),
        "budget_s": budget_s,
        "levels": {str(lv): stats([r for r in rows if r.get("level") == lv], budget_s) for lv in levels},
    }


def targets(summary: dict[str, Any], planned: int) -> list[dict[str, Any]]:
    """The issue's targets against the summary: value, goal, met, and the margin (value - goal; for a
    share in percentage points of the tasks)."""
    l2 = summary["levels"].get("2") or {}

    def row(name: str, unit: str, value: float | None, goal: float, at_most: bool = False) -> dict[str, Any]:
        met = value is not None and (value <= goal if at_most else value >= goal)
        margin = None if value is None else value - goal
        return {"target": name, "unit": unit, "value": value, "goal": goal, "met": met, "margin": margin}

    return [
        row("tasks run (a sample of at least 60)", "count", summary["tasks"], max(60, planned)),
        row("tasks that errored", "count", len(summary["errored"]), 0, at_most=True),
        row("verified answer", "share", summary["verified_share"], 0.97),
        row("fast_1 over eager (significant)", "share", summary["fast_1_share"], 0.85),
        row("level 2 geomean over torch.compile", "ratio", l2.get("geomean_compile"), 1.10),
        row("level 2 own-kernel answers", "share", l2.get("own_kernels_share"), 0.5),
        row("tasks over their budget + 20 %", "count", len(summary["over_budget"]), 0, at_most=True),
    ]


def _f(x: Any, spec: str = ".4g", suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def _top(phases: dict[str, Any], n: int = 4) -> str:
    """The ``n`` longest phases, longest first: ``golden 40 s, benchmark 31 s``."""
    ranked = sorted(((k, v) for k, v in phases.items() if isinstance(v, int | float)), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:.0f} s" for k, v in ranked[:n])


def time_line(row: dict[str, Any]) -> str:
    """One task's account in a line (from the row's ``phases``): the baseline's longest phases and
    its golden child's, each step with its verdict and phases, the fallback and the final timing."""
    ph, spent = row.get("phases"), row.get("budget_s") or {}
    if not ph:
        return ""
    parts = [f"baseline {_f(spent.get('baseline_s'), '.0f')} s ({_top(ph['baseline'])})"]
    if ph.get("golden"):
        parts.append(f"golden child ({_top(ph['golden'])})")
    for step in ph.get("steps") or []:
        stage = f" at {step['stage']}" if step.get("verdict") != "pass" and step.get("stage") else ""
        inner = _top(step.get("phase_s") or {})
        parts.append(
            f"{step.get('strategy')} {_f(step.get('seconds'), '.0f')} s {step.get('verdict') or '-'}{stage}"
            + (f" ({inner})" if inner else "")
        )
    fallback = ph.get("fallback") or {}
    if fallback.get("seconds"):
        inner = _top(fallback.get("phase_s") or {})
        parts.append(f"fallback {fallback['seconds']:.0f} s" + (f" ({inner})" if inner else ""))
    elif fallback.get("skipped"):
        parts.append(f"fallback skipped: {fallback['skipped'][:120]}")
    if ph.get("final_timing") is not None:
        parts.append(f"final timing {ph['final_timing']:.0f} s")
    return f"- {row['task']}: " + "; ".join(parts)


def markdown(data: dict[str, Any]) -> str:
    """The result as a page: header, one row per task, summary lines, the targets table."""
    v = data.get("versions") or {}
    s = data["summary"]
    peaks = data.get("peaks") or {}
    lines = [
        f"# KernelBench sample: {s['tasks']} of {data['planned']} tasks"
        + ("" if s["tasks"] >= data["planned"] else " (partial: run the command again to continue)"),
        "",
        f"Device: {data.get('device')} ({data.get('arch')}); torch {v.get('torch')}, Triton {v.get('triton')}; "
        f"clock: {data.get('clock')}. `kernelcrew bench` settings: {json.dumps(data.get('settings'))}.",
        f"Sample: seed {data.get('seed')}, stratified by file name (bench/kernelbench.py says how).",
        *(
            [f"SOL against {peaks['dram_gbs']:.0f} GB/s of DRAM bandwidth ({peaks.get('basis')})."]
            if peaks
            else []
        ),
        *(f"Command: `{c}`" for c in data.get("commands", [])),
        "",
        "| level | file | stratum | verdict | eager ms | compile ms | best ms | vs eager | vs compile | kind | SOL | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        mark = "" if not r.get("verified") else " (fast_1)" if fast_1(r) else ""
        lines.append(
            f"| {r.get('level', '-')} | {r.get('file', r['task'])} | {r.get('stratum', '-')} | {verdict(r)}{mark} | "
            f"{_f(r.get('eager_ms'))} | {_f(r.get('compile_ms'))} | {_f(r.get('best_ms'))} | "
            f"{_f(r.get('speedup_eager'), '.3g')} | {_f(r.get('speedup_compile'), '.3g')} | {r.get('source_kind') or '-'} | "
            f"{_f(r.get('sol_fraction'), '.0%')} | {r.get('wall_s')} |"
        )
    lines += ["", "## Summary", ""]
    for label, st in [("all levels", s), *((f"level {lv}", st) for lv, st in s["levels"].items())]:
        lines.append(
            f"- {label}: {st['tasks']} tasks; verified answer {st['verified']} ({_f(st['verified_share'], '.0%')}); "
            f"fast_1 over eager {st['fast_1']} ({_f(st['fast_1_share'], '.0%')}); geomean over the verified "
            f"{_f(st['geomean_eager'], '.3g', 'x')} over eager, {_f(st['geomean_compile'], '.3g', 'x')} over torch.compile; "
            f"own-kernel answers {st['own_kernels']} ({_f(st['own_kernels_share'], '.0%')}; kinds {st['kinds']}); "
            f"errored {len(st['errored'])}; over budget + 20 % {len(st['over_budget'])}"
        )
    for key, label in [
        ("errored", "errored"),
        ("no_answer", "no verified answer"),
        ("over_budget", "over budget + 20 %"),
    ]:
        if s[key]:
            lines.append(f"- {label}: {', '.join(s[key])}")
    account = [line for r in data["rows"] if (line := time_line(r))]
    if account:
        lines += ["", "## Where the time went", "", *account]
    lines += [
        "",
        "## Targets (issue 31)",
        "",
        "| target | value | goal | result | margin |",
        "|---|---|---|---|---|",
    ]
    specs = {"count": ("d", "+d", ""), "share": (".1%", "+.1f", " points"), "ratio": (".3g", "+.3g", "x")}
    for t in data["targets"]:
        spec, margin_spec, suffix = specs[t["unit"]]
        margin = None if t["margin"] is None else t["margin"] * (100 if t["unit"] == "share" else 1)
        lines.append(
            f"| {t['target']} | {_f(t['value'], spec)} | {_f(t['goal'], spec)} | {'met' if t['met'] else 'missed'} | "
            f"{_f(margin, margin_spec, suffix)} |"
        )
    return "\n".join(lines) + "\n"


def result(order: list[str], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The canonical result from the shards' tables: rows in sample order, each with its level, file
    and stratum and verdict; the summary; the targets."""
    data = merge(order, shards) if shards else {"rows": []}
    data["rows"] = [{**r, **describe(r["task"]), "verdict": verdict(r)} for r in data["rows"]]
    budget = (data.get("settings") or {}).get("time_budget_s")
    data["planned"] = len(order)
    data["summary"] = summarize(data["rows"], budget)
    data["targets"] = targets(data["summary"], len(order))
    return data


def earlier_rows(
    results: Path, order: list[str], ran: set[str], device: str, model: str
) -> list[dict[str, Any]]:
    """The result file's rows (same device kind and GPU model) of the sample's tasks that no shard
    has a row for: a task named by ``--first`` that the wall limit left unstarted keeps its row."""
    if not results.exists():
        return []
    previous = json.loads(results.read_text())
    if previous.get("device_kind") != device or previous.get("model") != model:
        return []
    return [r for r in previous.get("rows", []) if r["task"] in order and r["task"] not in ran]


def seed_shards(
    results: Path,
    order: list[str],
    gpus: list[str],
    out: Path,
    device: str,
    again: frozenset[str] = frozenset(),
    model: str | None = None,
) -> int:
    """On a machine without the shards' tables, give each shard the rows the result file already has
    (same device kind and GPU model: an H100's rows never join an H200's) but those of ``again``, so
    ``kernelcrew bench --resume`` skips them; returns how many were seeded."""
    if not results.exists():
        return 0
    previous = json.loads(results.read_text())
    if previous.get("device_kind") != device or (model is not None and previous.get("model") != model):
        return 0
    rows = {r["task"]: r for r in previous.get("rows", []) if r["task"] in order and r["task"] not in again}
    header = {
        k: v
        for k, v in previous.items()
        if k in ("suite", "device", "model", "arch", "clock", "versions", "settings", "peaks")
    }
    seeded = 0
    for gpu, names in zip(gpus, deal(order, len(gpus)), strict=True):
        table = out / f"gpu{gpu}" / "suite.json"
        mine = [rows[n] for n in names if n in rows]
        if table.exists() or not mine:
            continue
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(json.dumps({**header, "rows": mine}, indent=2, default=str))
        seeded += len(mine)
    return seeded


def machine_model(device: str, gpus: list[str]) -> str:
    """The model of the GPUs the shards run on (``kernelcrew.tools.hardware.model_slug``: ``h100``,
    ``h200``...; ``cpu`` for a dry run): a result file holds one model's rows."""
    if device == "cpu":
        return "cpu"
    import torch

    from kernelcrew.tools.hardware import model_slug

    props = torch.cuda.get_device_properties(int(gpus[0]) if gpus else 0)
    return model_slug(props.name, props.total_memory)


def run(args: argparse.Namespace, extra: list[str], argv: list[str]) -> dict[str, Any]:
    """Run (or continue) the sample in ``args.run`` and write the result files."""
    limit_at = None if args.wall_limit is None else (args.started or time.time()) + args.wall_limit
    order = run_order([p.stem for p in suite_tasks(args.run)])
    first = [t for t in (args.first or "").split(",") if t]
    unknown = sorted(set(first) - set(order))
    if unknown:
        raise SystemExit(f"--first names tasks that are not in the sample: {', '.join(unknown)}")
    launched = [*first, *(t for t in order if t not in first)]
    gpus = [g for g in args.gpus.split(",") if g]
    model = machine_model(args.device, gpus)
    family = model.split("-")[0]  # h100-sxm -> h100
    results = args.results / f"{args.name or f'kernelbench_{family}'}.json"
    seeded = seed_shards(results, launched, gpus, args.out, args.device, frozenset(first), model)
    if seeded:
        print(f"{seeded} finished tasks taken from {results}", file=sys.stderr)
    left = None if limit_at is None else limit_at - time.time()
    if left is not None and left < args.reserve:
        print(f"{left:.0f} s left of --wall-limit: no task starts (run again to continue)", file=sys.stderr)
    else:
        more = [] if left is None else ["--max-wall", f"{left - args.reserve:.0f}"]
        deadline = None if left is None else time.monotonic() + left - STOP_BEFORE_S
        collect(
            launch(args.run, launched, gpus, args.out, [*more, *extra], device=args.device), deadline=deadline
        )
    tables = [args.out / f"gpu{gpu}" / "suite.json" for gpu in gpus]
    shards = [json.loads(t.read_text()) | {"gpu": t.parent.name[3:]} for t in tables if t.exists()]
    ran = {r["task"] for shard in shards for r in shard.get("rows", [])}
    kept = earlier_rows(results, order, ran, args.device, model)
    if kept:
        header = {k: v for k, v in json.loads(results.read_text()).items() if k not in ("rows", "summary")}
        shards.append({**header, "rows": kept, "gpu": "earlier"})
    data = result(order, shards)
    data["device_kind"] = args.device
    data["seed"] = _manifest_seed(args.run)
    command = " ".join(["python", "bench/kernelbench.py", *argv])
    previous = json.loads(results.read_text()) if results.exists() else {}
    same = previous.get("device_kind") == args.device and previous.get("model") == data.get("model", model)
    earlier = previous.get("commands", []) if same else []
    data["commands"] = [*earlier, command]  # a run continued over several calls lists each
    args.results.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(data, indent=2, default=str) + "\n")
    results.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))
    return data


def run_order(names: list[str]) -> list[str]:
    """The order tasks run in, so that a run stopped early is still a stratified sample: within a level
    the strata take turns (each in name order), and the levels are merged by position, a task at the
    k-th of n places of its level going at (k + 0.5) / n of the run."""
    levels: dict[str, dict[str, list[str]]] = {}
    for name in sorted(names):
        where = describe(name)
        level, part = (str(where["level"]), where["stratum"]) if where else ("other", "other")
        levels.setdefault(level, {}).setdefault(part, []).append(name)
    placed = []
    for strata in levels.values():
        queues = [list(q) for _, q in sorted(strata.items())]
        turns = []
        while any(queues):
            turns.extend(q.pop(0) for q in queues if q)
        placed.extend(((k + 0.5) / len(turns), name) for k, name in enumerate(turns))
    return [name for _, name in sorted(placed)]


def _manifest_seed(folder: Path) -> int | None:
    manifest = folder / "sample.json"
    return json.loads(manifest.read_text()).get("seed") if manifest.exists() else None


def main(argv: list[str] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--root", type=Path, default=ROOT.parent / "shared" / "kernelbench", help="KernelBench's levels"
    )
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--counts", default=",".join(map(str, DEFAULT_COUNTS)), help="tasks of levels 1,2,3")
    ap.add_argument("--list", action="store_true", help="print the sample")
    ap.add_argument("--copy-to", type=Path, help="copy the sample into this (git-ignored) folder")
    ap.add_argument("--run", type=Path, help="run the tasks of this folder (what --copy-to wrote)")
    ap.add_argument("--gpus", default="0,1", help="comma list of CUDA device indices, one shard each")
    ap.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the plumbing"
    )
    ap.add_argument("--out", type=Path, default=Path("bench-out/kernelbench"), help="the shards' folders")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument(
        "--name", help="the result's file name (default: kernelbench_<GPU model>, e.g. kernelbench_h100)"
    )
    ap.add_argument("--wall-limit", type=float, help="seconds this command may run (from --started)")
    ap.add_argument(
        "--first",
        help="comma list of the sample's tasks to run first, and again where the result file has them "
        "(a task re-run after a fix)",
    )
    ap.add_argument("--started", type=float, help="epoch seconds the limit counts from (default: now)")
    ap.add_argument("--reserve", type=float, default=RESERVE_S, help="start no task with fewer seconds left")
    args = ap.parse_args(ours)
    if args.run:
        return run(args, extra, argv)
    if not (args.list or args.copy_to):
        ap.error("nothing to do: --list, --copy-to DIR or --run DIR")
    counts = tuple(int(c) for c in args.counts.split(","))
    entries = sample(args.root, counts, args.seed)
    if args.list:
        for e in entries:
            print(f"{e['level']}  {e['stratum']:<28} {e['file']}")
        print(f"{len(entries)} tasks (seed {args.seed})")
    if args.copy_to:
        copy_sample(args.root, entries, args.copy_to, args.seed)
        print(f"{len(entries)} tasks copied to {args.copy_to}", file=sys.stderr)
    return entries


if __name__ == "__main__":
    main()
