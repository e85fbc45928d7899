"""Nsight Compute: run ``ncu`` on the reference or a candidate in the sandbox, parse what it says.

The runner (:func:`profile`) wraps a sandbox child (``harness:ncu_child``) in ``ncu``: the child
builds the module, warms it up outside any range (so Triton's JIT and autotuning are never
profiled), then calls it ``calls`` times inside the NVTX range ``kernelcrew``; ``ncu`` profiles only
the kernels in that range (``--nvtx --nvtx-include kernelcrew/``), every process
(``--target-processes all``), with the clocks left as they are (``--clock-control none`` by
default: we measure the GPU as it runs, and must never change its clocks). The CSV (``--csv --page
raw``) goes to a log file in the child's directory.

:func:`parse_csv` turns that CSV into one :class:`KernelRecord` per launch and survives what ncu
prints: ``==PROF==``/``==WARNING==`` lines, a units row, thousands separators, ``n/a``, units that
change scale (``ns``/``usecond``/``msecond``, ``byte``/``Kbyte``/``Mbyte``), several kernels, several
passes of the same kernel (merged), metrics a chip does not have (absent, never defaulted).
:func:`summarize` sums the launches of one call. Nothing here invents a number: a metric ncu did
not report is ``None`` and the summary says which ones were missing.
"""

from __future__ import annotations

import csv
import functools
import io
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kernelcrew.config import Settings, get_settings

NVTX_RANGE = "kernelcrew"

# field -> (metric names, first present wins; kind of unit)
METRICS: dict[str, tuple[tuple[str, ...], str]] = {
    "duration_us": (("gpu__time_duration.sum",), "time"),
    "dram_pct": (("dram__throughput.avg.pct_of_peak_sustained_elapsed",), "pct"),
    "l2_pct": (("lts__throughput.avg.pct_of_peak_sustained_elapsed",), "pct"),
    "l1_pct": (("l1tex__throughput.avg.pct_of_peak_sustained_active",), "pct"),
    "sm_pct": (("sm__throughput.avg.pct_of_peak_sustained_elapsed",), "pct"),
    "memory_pct": (("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",), "pct"),
    "achieved_occupancy_pct": (("sm__warps_active.avg.pct_of_peak_sustained_active",), "pct"),
    "theoretical_occupancy_pct": (("sm__maximum_warps_per_active_cycle_pct",), "pct"),
    "tensor_pct": (
        (
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
            "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        ),
        "pct",
    ),
    "registers_per_thread": (("launch__registers_per_thread",), "count"),
    "shared_static_bytes": (("launch__shared_mem_per_block_static",), "bytes"),
    "shared_dynamic_bytes": (("launch__shared_mem_per_block_dynamic",), "bytes"),
    "grid_size": (("launch__grid_size",), "count"),
    "block_size": (("launch__block_size",), "count"),
    "waves_per_sm": (("launch__waves_per_multiprocessor",), "count"),
    "dram_read_bytes": (("dram__bytes_read.sum",), "bytes"),
    "dram_write_bytes": (("dram__bytes_write.sum",), "bytes"),
    "l2_bytes": (("lts__t_bytes.sum",), "bytes"),
    "local_loads": (("smsp__sass_inst_executed_op_local_ld.sum",), "count"),
    "local_stores": (("smsp__sass_inst_executed_op_local_st.sum",), "count"),
}

# Warp stall reasons (cycles a warp waits per issued instruction), as ncu's WarpStateStats names them.
STALL_REASONS = (
    "long_scoreboard",
    "short_scoreboard",
    "barrier",
    "membar",
    "mio_throttle",
    "lg_throttle",
    "tex_throttle",
    "math_pipe_throttle",
    "wait",
    "not_selected",
    "selected",
    "no_instruction",
    "branch_resolving",
    "dispatch_stall",
    "drain",
    "imc_miss",
    "misc",
    "sleeping",
    "gmma",
)


def _stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


def metric_names() -> list[str]:
    """Every metric the runner asks ncu for (a chip that lacks one simply does not report it)."""
    names = [n for names, _ in METRICS.values() for n in names]
    return [*dict.fromkeys(names), *(_stall_metric(r) for r in STALL_REASONS)]


_TIME_SCALE_US = {
    "ns": 1e-3,
    "nsecond": 1e-3,
    "us": 1.0,
    "usecond": 1.0,
    "ms": 1e3,
    "msecond": 1e3,
    "s": 1e6,
    "second": 1e6,
}
_BYTE_SCALE = {
    "byte": 1,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    "kibyte": 1024,
    "mibyte": 1024**2,
    "gibyte": 1024**3,
}


class NcuError(Exception):
    """ncu did not run or its output could not be read; the message says which and why."""


@dataclass
class KernelRecord:
    """One kernel launch as ncu measured it (``None``: ncu did not report that metric)."""

    id: int
    name: str
    grid: str = ""
    block: str = ""
    duration_us: float | None = None
    dram_pct: float | None = None
    l2_pct: float | None = None
    l1_pct: float | None = None
    sm_pct: float | None = None
    memory_pct: float | None = None
    achieved_occupancy_pct: float | None = None
    theoretical_occupancy_pct: float | None = None
    tensor_pct: float | None = None
    registers_per_thread: float | None = None
    shared_static_bytes: float | None = None
    shared_dynamic_bytes: float | None = None
    grid_size: float | None = None
    block_size: float | None = None
    waves_per_sm: float | None = None
    dram_read_bytes: float | None = None
    dram_write_bytes: float | None = None
    l2_bytes: float | None = None
    local_loads: float | None = None
    local_stores: float | None = None
    stalls: dict[str, float] = field(default_factory=dict)

    @property
    def dram_bytes(self) -> float | None:
        if self.dram_read_bytes is None or self.dram_write_bytes is None:
            return None
        return self.dram_read_bytes + self.dram_write_bytes

    @property
    def spills(self) -> float | None:
        if self.local_loads is None and self.local_stores is None:
            return None
        return (self.local_loads or 0.0) + (self.local_stores or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"dram_bytes": self.dram_bytes, "spills": self.spills}


def parse_number(text: str, unit: str = "") -> float | None:
    """A metric value as ncu prints it (``1,677,939.20``, ``81.42``, ``n/a``) in base units."""
    value = text.strip().strip('"')
    if not value or value.lower() in ("n/a", "nan", "-", "(null)"):
        return None
    value = value.replace(",", "")
    try:
        number = float(value)
    except ValueError:
        return None
    unit = unit.strip().lower()
    if unit in _TIME_SCALE_US:
        return number * _TIME_SCALE_US[unit]
    if unit in _BYTE_SCALE:
        return number * _BYTE_SCALE[unit]
    return number


def _rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("==")]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def parse_csv(text: str) -> list[KernelRecord]:
    """Every kernel launch in ncu's ``--csv --page raw`` output, in launch order.

    Raises :class:`NcuError` when the text holds no table (ncu failed: its ``==ERROR==`` lines are
    in the message).
    """
    errors = [ln for ln in text.splitlines() if ln.startswith("==ERROR==")]
    rows = _rows(text)
    header: list[str] | None = None
    units: dict[str, str] = {}
    records: dict[tuple[str, int], KernelRecord] = {}
    for row in rows:
        if row and row[0] == "ID":
            header, units = row, {}
            continue
        if header is None or len(row) != len(header):
            continue  # program output mixed in, or a truncated line
        cells = dict(zip(header, row, strict=True))
        if not cells["ID"].strip():  # the units row under each header
            units = cells
            continue
        try:
            launch = int(cells["ID"].replace(",", ""))
        except ValueError:
            continue
        key = (cells.get("Process ID", ""), launch)
        rec = records.get(key)
        if rec is None:
            rec = records[key] = KernelRecord(
                id=launch,
                name=cells.get("Kernel Name", "").strip(),
                grid=cells.get("Grid Size", "").strip(),
                block=cells.get("Block Size", "").strip(),
            )
        for attr, (names, _kind) in METRICS.items():
            for name in names:
                if name in cells:
                    value = parse_number(cells[name], units.get(name, ""))
                    if value is not None:  # a later pass may report what an earlier one did not
                        setattr(rec, attr, value)
                    break
        for reason in STALL_REASONS:
            name = _stall_metric(reason)
            if name in cells:
                value = parse_number(cells[name])
                if value is not None:
                    rec.stalls[reason] = value
    if not records:
        detail = "; ".join(errors[:5]) or "no kernel was profiled (no CUDA kernel ran inside the NVTX range?)"
        raise NcuError(f"ncu produced no kernel records: {detail}")
    return sorted(records.values(), key=lambda r: (r.id, r.name))


def _weighted(records: list[KernelRecord], attr: str) -> float | None:
    """Duration-weighted mean of a percentage over the launches that report it."""
    pairs = [(getattr(r, attr), r.duration_us) for r in records]
    pairs = [(v, d) for v, d in pairs if v is not None and d]
    total = sum(d for _, d in pairs)
    return sum(v * d for v, d in pairs) / total if total else None


def summarize(records: list[KernelRecord], calls: int = 1) -> dict[str, Any]:
    """Per-call totals and the kernels ranked by time: what the diagnosis and the report read."""
    calls = max(int(calls), 1)
    timed = [r for r in records if r.duration_us is not None]
    total_us = sum(r.duration_us or 0.0 for r in timed) / calls

    def per_call(attr: str) -> float | None:
        values = [getattr(r, attr) for r in records]
        if any(v is None for v in values):
            return None
        return sum(values) / calls

    def spill_total() -> float | None:
        values = [r.spills for r in records]
        return None if all(v is None for v in values) else sum(v or 0.0 for v in values) / calls

    by_name: dict[str, dict[str, Any]] = {}
    for r in records:
        entry = by_name.setdefault(r.name, {"name": r.name, "launches": 0, "duration_us": 0.0, "records": []})
        entry["launches"] += 1
        entry["duration_us"] += r.duration_us or 0.0
        entry["records"].append(r)
    kernels = []
    for entry in sorted(by_name.values(), key=lambda e: e["duration_us"], reverse=True):
        recs = entry.pop("records")
        first = recs[0]
        kernels.append(
            {
                "name": entry["name"],
                "short_name": short_name(entry["name"]),
                "launches_per_call": entry["launches"] / calls,
                "duration_us": entry["duration_us"] / calls,
                "share": (entry["duration_us"] / calls) / total_us if total_us else None,
                "grid": first.grid,
                "block": first.block,
                "registers_per_thread": first.registers_per_thread,
                "shared_bytes": None
                if first.shared_static_bytes is None
                else (first.shared_static_bytes or 0) + (first.shared_dynamic_bytes or 0),
                "dram_pct": _weighted(recs, "dram_pct"),
                "l2_pct": _weighted(recs, "l2_pct"),
                "l1_pct": _weighted(recs, "l1_pct"),
                "sm_pct": _weighted(recs, "sm_pct"),
                "achieved_occupancy_pct": _weighted(recs, "achieved_occupancy_pct"),
                "theoretical_occupancy_pct": first.theoretical_occupancy_pct,
                "tensor_pct": _weighted(recs, "tensor_pct"),
                "waves_per_sm": first.waves_per_sm,
                "spills": None if first.spills is None else sum(r.spills or 0 for r in recs) / calls,
                "top_stalls": _top(_merge_stalls(recs)),
            }
        )
    present = {a for r in records for a, v in r.to_dict().items() if v is not None}
    missing = sorted(a for a in METRICS if a not in present)
    return {
        "calls": calls,
        "launches_per_call": len(records) / calls,
        "kernel_time_us": total_us,
        "dram_bytes": sum(r.dram_bytes or 0.0 for r in records) / calls
        if all(r.dram_bytes is not None for r in records)
        else None,
        "l2_bytes": per_call("l2_bytes"),
        "dram_pct": _weighted(records, "dram_pct"),
        "l2_pct": _weighted(records, "l2_pct"),
        "l1_pct": _weighted(records, "l1_pct"),
        "sm_pct": _weighted(records, "sm_pct"),
        "memory_pct": _weighted(records, "memory_pct"),
        "achieved_occupancy_pct": _weighted(records, "achieved_occupancy_pct"),
        "tensor_pct": _weighted(records, "tensor_pct"),
        "spills": spill_total(),
        "top_stalls": _top(_merge_stalls(records)),
        "kernels": kernels,
        "missing_metrics": missing,
    }


def _merge_stalls(records: list[KernelRecord]) -> dict[str, float]:
    weight = sum(r.duration_us or 0.0 for r in records if r.stalls)
    merged: dict[str, float] = {}
    for r in records:
        for reason, value in r.stalls.items():
            merged[reason] = merged.get(reason, 0.0) + value * (r.duration_us or 0.0) / (weight or 1.0)
    return merged


def _top(stalls: dict[str, float], n: int = 3) -> list[dict[str, Any]]:
    """The largest stall reasons, ``selected`` excluded (it is issuing, not waiting)."""
    waiting = {k: v for k, v in stalls.items() if k != "selected" and v > 0}
    total = sum(waiting.values())
    ranked = sorted(waiting.items(), key=lambda kv: kv[1], reverse=True)[:n]
    return [
        {"reason": k, "cycles_per_issue": round(v, 3), "share": v / total if total else None}
        for k, v in ranked
    ]


def short_name(name: str) -> str:
    """A kernel's name without templates and parameters (``void at::vectorized_elementwise_kernel<4,
    ...>(int, T2, T3)`` -> ``at::vectorized_elementwise_kernel``)."""
    text = re.sub(r"^void\s+", "", name.strip())
    text = text.replace("<unnamed>", "anon").replace("(anonymous namespace)", "anon")
    depth, out = 0, []
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or name[:80]


# ----------------------------------------------------------------------------------------------
# Capability and the runner
# ----------------------------------------------------------------------------------------------


def ncu_path() -> str | None:
    return shutil.which("ncu")


@functools.lru_cache(maxsize=1)
def ncu_version() -> str | None:
    tool = ncu_path()
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"Version\s+(\S+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1:][0] if out.strip() else None


_PERMISSION = re.compile(r"ERR_NVGPUCTRPERM|permission to access NVIDIA GPU Performance Counters", re.I)


def wrapper(log_file: Path, *, clock_control: str = "none", kernel_filter: str = "") -> tuple[str, ...]:
    """The ``ncu`` command line that prefixes the sandbox child's interpreter."""
    tool = ncu_path()
    if tool is None:
        raise NcuError("ncu (Nsight Compute) is not installed on this machine")
    if clock_control not in ("none", "base"):
        raise ValueError(f"clock_control must be 'none' or 'base', not {clock_control!r}")
    cmd = [
        tool,
        "--target-processes",
        "all",
        "--csv",
        "--page",
        "raw",
        "--nvtx",
        "--nvtx-include",
        f"{NVTX_RANGE}/",
        "--clock-control",
        clock_control,
        "--metrics",
        ",".join(metric_names()),
        "--log-file",
        str(log_file),
    ]
    if kernel_filter:
        cmd += ["--kernel-name", f"regex:{kernel_filter}"]
    return tuple(cmd)


def _run_under_ncu(
    target: str,
    payload: dict[str, Any],
    workdir: Path,
    *,
    wall_s: float,
    clock_control: str,
    settings: Settings,
    kernel_filter: str = "",
    env: dict[str, str] | None = None,
    writable: tuple[str, ...] = (),
) -> tuple[Any, str, bool]:
    """Run the sandbox ``target`` under ncu, its CSV written in the child's own directory.

    Returns the sandbox result, the CSV text ("" when ncu wrote none) and whether ncu was refused
    the hardware counters (ERR_NVGPUCTRPERM, in the CSV or in the child's output).
    """
    from kernelcrew.tools import sandbox

    log_file = workdir / "child" / "ncu.csv"
    res = sandbox.run(
        target,
        payload,
        limits=replace(sandbox.SandboxLimits.from_settings(settings), wall_s=wall_s),
        workdir=workdir,
        env=env,
        settings=settings,
        writable=writable,
        wrapper=wrapper(log_file, clock_control=clock_control, kernel_filter=kernel_filter),
    )
    text = log_file.read_text(errors="replace") if log_file.exists() else ""
    return res, text, bool(_PERMISSION.search(text) or _PERMISSION.search(res.output_tail))


def profile(
    golden: Any,
    candidate_source: str | None = None,
    *,
    candidate_path: str = "candidate.py",
    calls: int = 1,
    kernel_filter: str = "",
    clock_control: str | None = None,
    timeout_s: float | None = None,
    keep_csv: bool = False,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Nsight Compute records of one forward of the reference (``candidate_source`` None) or a
    candidate, on the golden's first input set and weights.

    Returns ``{"available": True, "records": [...], "summary": {...}, "version", "clock_control"}``,
    or ``{"available": False, "reason": ...}`` when ncu is missing, the device is a CPU, or the
    counters cannot be read here (the reason says which); never made-up metrics.
    """
    from kernelcrew.tools import sandbox
    from kernelcrew.tools.build import cache_dirs
    from kernelcrew.tools.correctness import child_env, share_inputs

    s = settings or get_settings()
    if not golden.device.startswith("cuda"):
        return {"available": False, "reason": "Nsight Compute profiles CUDA kernels; this run is on the CPU"}
    if ncu_path() is None:
        return {"available": False, "reason": "ncu (Nsight Compute) is not installed on this machine"}
    clock = clock_control or s.ncu_clock_control
    workdir = sandbox.make_workdir("kc-ncu-")
    wall_s = float(timeout_s or s.ncu_timeout_s)
    try:
        share_inputs(golden, workdir, s)
        payload = {
            "task_source": golden.task_source,
            "task_path": golden.task_path,
            "candidate_source": candidate_source,
            "candidate_path": candidate_path,
            "device": golden.device,
            "precision": golden.precision,
            "seed": golden.seed,
            "calls": int(calls),
        }
        res, text, denied = _run_under_ncu(
            "kernelcrew.tools.harness:ncu_child",
            payload,
            workdir,
            wall_s=wall_s,
            clock_control=clock,
            settings=s,
            kernel_filter=kernel_filter,
            env=child_env(golden.device, candidate_source) if candidate_source else {},
            writable=(cache_dirs(candidate_source)["root"],) if candidate_source else (),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if denied:
        return {
            "available": False,
            "reason": "ncu cannot read the GPU performance counters here (ERR_NVGPUCTRPERM: the driver "
            "restricts them to administrators, or the container hides them)",
        }
    if res.status == "timeout":
        return {"available": False, "reason": f"ncu timed out after {wall_s:g} s"}
    if not res.ok:
        tail = " | ".join(line for line in res.output_tail.strip().splitlines()[-6:] if line.strip())
        reason = f"the profiled run failed: {res.message}" + (f" (its output: {tail[-800:]})" if tail else "")
        return {"available": False, "reason": reason}
    try:
        records = parse_csv(text)
    except NcuError as exc:
        return {"available": False, "reason": str(exc)}
    return {
        "available": True,
        **({"csv": text} if keep_csv else {}),
        "version": ncu_version(),
        "clock_control": clock,
        "calls": int(calls),
        "records": [r.to_dict() for r in records],
        "summary": summarize(records, calls),
    }


def probe_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One tiny CUDA kernel inside the NVTX range (the capability probe)."""
    import torch

    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(NVTX_RANGE)
    (x * 2).sum().item()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    return {}


@functools.lru_cache(maxsize=8)
def capability(timeout_s: float = 180.0, visible_device: str | None = None) -> dict[str, Any]:
    """Whether ncu can read hardware counters here, as the sandbox user (workers advertise it).

    ``{"available": bool | None, "version": str | None, "reason": str}`` (None: could not tell);
    the probe profiles one tiny kernel on ``visible_device`` (a CUDA_VISIBLE_DEVICES value), since
    ncu being installed says nothing about counter permissions in a container. Cached per device.
    """
    from kernelcrew.tools import sandbox

    version = ncu_version()
    if version is None:
        return {"available": False, "version": None, "reason": "ncu (Nsight Compute) is not installed"}
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "version": version, "reason": "no CUDA GPU visible"}
    s = get_settings()
    env = {"CUDA_VISIBLE_DEVICES": visible_device} if visible_device is not None else None
    workdir = sandbox.make_workdir("kc-ncu-probe-")
    try:
        res, text, denied = _run_under_ncu(
            "kernelcrew.tools.ncu:probe_child",
            {},
            workdir,
            wall_s=timeout_s,
            clock_control=s.ncu_clock_control,
            settings=s,
            env=env,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if denied:
        return {
            "available": False,
            "version": version,
            "reason": "ERR_NVGPUCTRPERM: counters restricted here",
        }
    try:
        parse_csv(text)
    except NcuError as exc:
        return {
            "available": None,
            "version": version,
            "reason": f"inconclusive: {exc} ({res.message or res.status})",
        }
    return {"available": True, "version": version, "reason": "profiled a probe kernel"}
