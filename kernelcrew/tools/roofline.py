"""The hardware's speed of light: device peaks per GPU model, on-device calibration, floors.

Peaks are kept per GPU *model*, not per architecture: sm_90 alone covers the H100 PCIe (2.0 TB/s),
the H100 SXM (3.35 TB/s) and the H200 (4.8 TB/s). Every figure carries its source. Datasheet
tensor-core figures are the dense ones (NVIDIA prints them "with sparsity"; dense is half).
L2 bandwidth is not published by NVIDIA for any of these parts, so it comes only from calibration.
The architecture is used only for a model this table does not know, and says so.

A one-time calibration (:func:`calibrate`) measures what this GPU really sustains: a device-to-device
copy (DRAM), a copy that fits in L2, and large matmuls per dtype. It is stored per GPU model in the
data directory and preferred over the datasheet, so "fraction of speed of light" is relative to
what the hardware can be shown to do here.

A task's floor is the time a perfect implementation needs: ``max(bytes / DRAM bandwidth,
matmul flops / matmul peak + other flops / fp32 peak)``, with the bytes and flops measured from the
reference (:func:`kernelcrew.tools.harness.measure_work`). A float32 matmul's peak is the better of
the CUDA cores' and a third of TF32's: three TF32 tensor-core products per term (TF32x3) keep
float32 accuracy, as the playbook's ``matmul_epilogue`` does.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcrew.config import Settings, get_settings

_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021), dense figures"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023); tensor figures halved from 'with sparsity'"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024); tensor figures halved from 'with sparsity'"
_L40S = "NVIDIA L40S datasheet (2023); tensor figures halved from 'with sparsity'"
_ADA = "NVIDIA Ada Lovelace architecture whitepaper v1.0, RTX 4090 column, FP32 accumulate, dense"
_B200 = "NVIDIA HGX B200 datasheet (2024): platform figure / 8 GPUs; tensor halved from 'with sparsity'"

# model slug -> peaks. Bandwidth in GB/s, compute in TFLOP/s. None: not published / does not exist.
DATASHEET: dict[str, dict[str, Any]] = {
    "a100-sxm": {
        "name": "A100 SXM4 80GB",
        "dram_gbs": 2039,
        "compute": {"fp64": 9.7, "fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312, "fp8": None},
        "source": _A100,
    },
    "a100-pcie": {
        "name": "A100 PCIe 80GB",
        "dram_gbs": 1935,
        "compute": {"fp64": 9.7, "fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312, "fp8": None},
        "source": _A100,
    },
    "l40s": {
        "name": "L40S",
        "dram_gbs": 864,
        "compute": {"fp64": None, "fp32": 91.6, "tf32": 183, "fp16": 362.05, "bf16": 362.05, "fp8": 733},
        "source": _L40S,
    },
    "rtx-4090": {
        "name": "GeForce RTX 4090",
        "dram_gbs": 1008,
        "compute": {"fp64": None, "fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3},
        "source": _ADA,
    },
    "h100-sxm": {
        "name": "H100 SXM5 80GB",
        "dram_gbs": 3350,
        "compute": {"fp64": 34, "fp32": 67, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1979},
        "source": _H100,
    },
    "h100-pcie": {
        "name": "H100 PCIe 80GB",
        "dram_gbs": 2000,
        "compute": {"fp64": 26, "fp32": 51, "tf32": 378, "fp16": 756.5, "bf16": 756.5, "fp8": 1513},
        "source": _H100,
    },
    "h100-nvl": {
        "name": "H100 NVL 94GB",
        "dram_gbs": 3900,
        "compute": {"fp64": 30, "fp32": 60, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5, "fp8": 1670.5},
        "source": _H100,
    },
    "h200": {
        "name": "H200 SXM 141GB",
        "dram_gbs": 4800,
        "compute": {"fp64": 34, "fp32": 67, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1979},
        "source": _H200,
    },
    "h200-nvl": {
        "name": "H200 NVL 141GB",
        "dram_gbs": 4800,
        "compute": {"fp64": 30, "fp32": 60, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5, "fp8": 1670.5},
        "source": _H200,
    },
    "b200": {
        "name": "B200 (HGX)",
        "dram_gbs": 8000,
        "compute": {"fp64": 37, "fp32": 75, "tf32": 1100, "fp16": 2250, "bf16": 2250, "fp8": 4500},
        "source": _B200,
    },
}

#: The calibration's method; a stored calibration of an older one is measured again. 2: each timed
#: rep queues a lead before its start event, so the host's launch gap (about 20 us a copy) is not
#: counted (a measurement, see docs/benchmarks.md).
CALIBRATION_VERSION = 2
#: Cycles of ``torch.cuda._sleep`` queued before each timed calibration rep (about 1 ms at the
#: H100's clock), so the host has launched the rep's work before the device reaches its start event.
_LEAD_CYCLES = 2_000_000

# Used only for a model the table does not know: the representative part of the architecture.
ARCH_FALLBACK = {"sm_80": "a100-sxm", "sm_89": "l40s", "sm_90": "h100-sxm", "sm_100": "b200"}

COMPUTE_CLASSES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8")


@dataclass
class Peaks:
    """The roofs of one device, each with where it came from."""

    model: str
    basis: str  # "calibrated", "datasheet", "architecture fallback (<model>)" or "unknown"
    dram_gbs: float | None = None
    l2_gbs: float | None = None
    compute: dict[str, float | None] = field(default_factory=dict)  # TFLOP/s per class
    sources: dict[str, str] = field(default_factory=dict)  # figure -> source
    datasheet_dram_gbs: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def compute_peak(self, klass: str | None) -> float | None:
        """TFLOP/s of a compute class (``fp32`` when unknown)."""
        return self.compute.get(klass or "fp32") or self.compute.get("fp32")


def calibration_path(model: str, settings: Settings | None = None) -> Path:
    s = settings or get_settings()
    return Path(s.data_dir) / "calibration" / f"{model}.json"


def load_calibration(model: str, settings: Settings | None = None) -> dict[str, Any] | None:
    """The stored calibration of this GPU model, or None (an unreadable file is ignored, not fatal)."""
    path = calibration_path(model, settings)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("model") != model:
        return None
    return data if data.get("version") == CALIBRATION_VERSION else None  # older method: measure again


def peaks_for(hardware: dict[str, Any], settings: Settings | None = None) -> Peaks:
    """The peaks of the device described by ``hardware`` (:func:`kernelcrew.tools.hardware.detect`).

    Calibrated figures (this GPU, measured) win over the datasheet; the datasheet of the exact
    model wins over the architecture's representative part.
    """
    model = str(hardware.get("model") or "")
    arch = str(hardware.get("arch") or "")
    if hardware.get("device") == "cpu" or model == "cpu":
        return Peaks(model="cpu", basis="unknown", sources={"all": "no roofline for CPUs"})
    sheet = DATASHEET.get(model)
    basis = "datasheet"
    if sheet is None:
        # A MIG slice or an unknown form factor: the parent model's sheet with a clear label.
        parent = next((m for m in DATASHEET if model.startswith(m + "-")), None)
        fallback = parent or ARCH_FALLBACK.get(arch)
        if fallback is not None:
            sheet = DATASHEET[fallback]
            basis = f"{'parent model' if parent else 'architecture fallback'} ({fallback})"
    peaks = Peaks(model=model, basis=basis if sheet else "unknown")
    if sheet:
        peaks.dram_gbs = peaks.datasheet_dram_gbs = float(sheet["dram_gbs"])
        peaks.compute = {k: (float(v) if v is not None else None) for k, v in sheet["compute"].items()}
        peaks.sources = {k: sheet["source"] for k in ("dram_gbs", *sheet["compute"])}
        peaks.sources["l2_gbs"] = "not published by NVIDIA: measured by calibration only"
    cal = load_calibration(model, settings) if model else None
    if cal:
        measured = cal.get("measured", {})
        when = cal.get("measured_at", "")
        tag = f"calibrated on this GPU ({cal.get('device_name', model)}, {when})"
        for key in ("dram_gbs", "l2_gbs"):
            if measured.get(key):
                setattr(peaks, key, float(measured[key]))
                peaks.sources[key] = tag
        for klass, value in (measured.get("compute") or {}).items():
            if value:
                peaks.compute[klass] = float(value)
                peaks.sources[klass] = tag
        # the datasheet's basis only where it was not this model's own ("calibrated (datasheet:
        # datasheet)" read as a typo in every bench table)
        peaks.basis = "calibrated" + (
            "" if sheet is None or basis == "datasheet" else f" (datasheet: {basis})"
        )
    return peaks


def floor(work: dict[str, Any], peaks: Peaks) -> dict[str, Any]:
    """The speed-of-light time of a forward that must do ``work`` on a device with ``peaks``.

    ``bound`` says which roof sets the floor; ``intensity`` is flops per compulsory byte and
    ``ridge`` the intensity at which the two roofs meet.
    """
    nbytes = float(work.get("bytes") or 0)
    mm_flops = float(work.get("matmul_flops") or 0)
    other_flops = float(work.get("other_flops") or 0)
    klass = work.get("compute_class") or "fp32"
    mm_peak = peaks.compute_peak(klass)
    fp32_peak = peaks.compute_peak("fp32")
    tf32_peak = peaks.compute.get("tf32")
    if klass == "fp32" and mm_peak and tf32_peak:  # float32 accuracy on the tensor cores: TF32x3
        mm_peak = max(mm_peak, tf32_peak / 3)
    out: dict[str, Any] = {
        "bytes": nbytes,
        "flops": mm_flops + other_flops,
        "matmul_flops": mm_flops,
        "compute_class": klass,
        "intensity": (mm_flops + other_flops) / nbytes if nbytes else None,
        "basis": peaks.basis,
    }
    if not peaks.dram_gbs or not fp32_peak:
        out.update(floor_ms=None, reason=f"no peaks known for {peaks.model or 'this device'}")
        return out
    memory_ms = nbytes / (peaks.dram_gbs * 1e9) * 1e3
    compute_ms = (mm_flops / ((mm_peak or fp32_peak) * 1e12) + other_flops / (fp32_peak * 1e12)) * 1e3
    out.update(
        memory_ms=memory_ms,
        compute_ms=compute_ms,
        floor_ms=max(memory_ms, compute_ms),
        bound="memory" if memory_ms >= compute_ms else "compute",
        dram_gbs=peaks.dram_gbs,
        compute_tflops=mm_peak or fp32_peak,
        ridge=(mm_peak or fp32_peak) * 1e12 / (peaks.dram_gbs * 1e9),
    )
    return out


def sol_fraction(floor_ms: float | None, time_ms: float | None) -> float | None:
    """How close a measured time is to the floor (1.0 = at the speed of light)."""
    if not floor_ms or not time_ms:
        return None
    return floor_ms / time_ms


def sol_fractions(
    floor_ms: float | None, eager_ms: float | None, compile_ms: dict[str, float]
) -> dict[str, Any]:
    """The fraction of speed of light of eager and of each ``torch.compile`` mode (``compile:<mode>``)."""
    return {
        "eager": sol_fraction(floor_ms, eager_ms),
        **{f"compile:{mode}": sol_fraction(floor_ms, ms) for mode, ms in compile_ms.items()},
    }


def is_suspect(floor_ms: float | None, time_ms: float | None, ratio: float = 0.9) -> bool:
    """A time below ``ratio`` x the floor: faster than the hardware allows, so the measurement (or
    the floor, or the candidate) is wrong until a second measurement says otherwise."""
    return bool(floor_ms and time_ms and time_ms < ratio * floor_ms)


# ----------------------------------------------------------------------------------------------
# Calibration (runs in a sandbox child on the GPU)
# ----------------------------------------------------------------------------------------------


def calibrate_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Measure copy bandwidth (DRAM and L2) and matmul rates on this GPU; medians of repeated runs."""
    import torch

    props = torch.cuda.get_device_properties(0)
    quick = bool(payload.get("quick"))
    reps = 5 if quick else 20

    def timed(fn: Any, n: int) -> list[float]:
        return timed_reps(fn, n, torch.cuda)

    def copy_rate(nbytes: int, inner: int) -> dict[str, float]:
        n = max(nbytes // 4, 1024)
        src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
        dst = torch.empty_like(src)

        def run() -> None:
            for _ in range(inner):
                dst.copy_(src)

        times = timed(run, reps)
        moved = 2 * n * 4 * inner
        return {"median": moved / times[len(times) // 2] / 1e9, "max": moved / times[0] / 1e9}

    dram_bytes = min(1 << 30, props.total_memory // 8)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    measured: dict[str, Any] = {"compute": {}}
    spread: dict[str, Any] = {}
    r = copy_rate(dram_bytes, 1)
    measured["dram_gbs"], spread["dram_gbs"] = r["median"], r
    if l2:
        r = _l2_read_rate(l2 // 4, reps, timed)
        measured["l2_gbs"], spread["l2_gbs"] = r["median"], r
    n = 4096 if quick else 8192
    prev = torch.backends.cuda.matmul.allow_tf32
    for klass, dtype, tf32 in (
        ("fp32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("fp16", torch.float16, False),
        ("bf16", torch.bfloat16, False),
    ):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        times = timed(lambda a=a, b=b: a @ b, max(reps // 2, 3))
        flops = 2.0 * n**3
        measured["compute"][klass] = flops / times[len(times) // 2] / 1e12
        spread[klass] = {"median": measured["compute"][klass], "max": flops / times[0] / 1e12}
    torch.backends.cuda.matmul.allow_tf32 = prev
    return {
        "version": CALIBRATION_VERSION,
        "device_name": props.name,
        "measured": measured,
        "spread": spread,
        "method": {
            "dram_gbs": f"device copy of {dram_bytes >> 20} MiB, read + write bytes / time, median of {reps}",
            "timing": "CUDA events around each rep, queued behind a lead (a device spin) so that the host's "
            "launch gap is not counted",
            "l2_gbs": f"one Triton kernel re-reading {l2 // 4 >> 20} MiB (a quarter of L2) 64 times with "
            f"L1-bypassing loads (.cg), bytes read / time, median of {reps}",
            "compute": f"{n}x{n}x{n} matmul per dtype (fp32 with TF32 off, tf32 with it on), median",
        },
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }


def timed_reps(fn: Any, n: int, cuda: Any, lead_cycles: int = _LEAD_CYCLES) -> list[float]:
    """Seconds of ``n`` timed reps of ``fn`` (sorted) after 3 untimed ones, by CUDA events. Each rep
    queues a lead (``_sleep`` of ``lead_cycles``, a device spin) before its start event, so that the
    host launches ``fn``'s work while the device spins and the events time the device, not the
    launch gap (the timing protocol's lead, :mod:`kernelcrew.tools.timing`). ``cuda`` is
    ``torch.cuda``; ``lead_cycles`` 0 times as version 1 of the calibration did."""
    for _ in range(3):
        fn()
    cuda.synchronize()
    sleep = getattr(cuda, "_sleep", None) if lead_cycles else None
    out = []
    for _ in range(n):
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        if sleep is not None:
            sleep(lead_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return sorted(out)


def _l2_read_rate(nbytes: int, reps: int, timed: Any) -> dict[str, float]:
    """Read bandwidth of L2: one kernel whose programs re-read an L2-resident buffer, bypassing L1."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _reread(src, out, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = (pid * BLOCK) % n + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n, other=0.0, cache_modifier=".cg")
        tl.store(out + pid, tl.sum(x, axis=0))

    block, rounds = 4096, 64
    n = max(nbytes // 4 // block, 1) * block
    src = torch.randn(n, device="cuda")
    programs = rounds * (n // block)
    out = torch.empty(programs, device="cuda")
    times = timed(lambda: _reread[(programs,)](src, out, n, BLOCK=block, num_warps=8), reps)
    read = programs * block * 4
    return {"median": read / times[len(times) // 2] / 1e9, "max": read / times[0] / 1e9}


def calibrate(
    hardware: dict[str, Any], *, quick: bool = False, settings: Settings | None = None
) -> dict[str, Any]:
    """Measure this GPU's roofs in a sandboxed child and store them for :func:`peaks_for`."""
    from kernelcrew.tools import sandbox

    s = settings or get_settings()
    if hardware.get("device") != "cuda":
        raise ValueError("calibration measures a CUDA GPU; this device is a CPU")
    res = sandbox.run("kernelcrew.tools.roofline:calibrate_child", {"quick": quick}, settings=s)
    if not res.ok:
        raise RuntimeError(f"calibration failed: {res.message}")
    record = dict(res.value or {})
    record.update(model=hardware["model"], arch=hardware.get("arch"), measured_at=time.strftime("%Y-%m-%d"))
    path = calibration_path(hardware["model"], s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)
    return record
