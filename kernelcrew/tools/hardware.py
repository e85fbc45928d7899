"""Describe the machine a measurement runs on: GPU or CPU model, architecture, memory, versions."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

_GIB = 1024**3

#: The work queue of machines without a GPU; GPU queues are ``gpu.<model>`` and ``gpu.<arch>``.
CPU_QUEUE = "cpu"
GPU_QUEUE_PREFIX = "gpu."

#: Architecture of the GPU models :func:`model_slug` knows, so a request for a model no worker has can
#: fall back to a worker of the same architecture.
MODEL_ARCH = {
    "h100-sxm": "sm_90",
    "h100-pcie": "sm_90",
    "h100-nvl": "sm_90",
    "h100": "sm_90",
    "h200": "sm_90",
    "h200-nvl": "sm_90",
    "gh200": "sm_90",
    "h800-sxm": "sm_90",
    "h800-pcie": "sm_90",
    "h800": "sm_90",
    "a100-sxm": "sm_80",
    "a100-pcie": "sm_80",
    "a100": "sm_80",
    "a800-sxm": "sm_80",
    "a800-pcie": "sm_80",
    "a800": "sm_80",
    "a10": "sm_86",
    "a40": "sm_86",
    "rtx-a6000": "sm_86",
    "rtx-3090": "sm_86",
    "rtx-3090-ti": "sm_86",
    "l4": "sm_89",
    "l40": "sm_89",
    "l40s": "sm_89",
    "rtx-4090": "sm_89",
    "rtx-6000-ada-generation": "sm_89",
    "t4": "sm_75",
    "v100-sxm": "sm_70",
    "v100-pcie": "sm_70",
    "v100": "sm_70",
    "b200": "sm_100",
    "gb200": "sm_100",
    "rtx-5090": "sm_120",
}


@dataclass
class HardwareInfo:
    """One device: a CUDA GPU or the host CPU (GPU-only fields are ``None`` on the CPU)."""

    device: str  # "cuda" or "cpu"
    name: str  # "NVIDIA H100 80GB HBM3", or the CPU model name
    model: str  # slug used in queue names and reports: "h100-sxm", "a100-pcie", "cpu", ...
    arch: str  # "sm_90", "sm_80", ... or "cpu"
    compute_capability: tuple[int, int] | None
    sm_count: int | None
    memory_bytes: int | None
    l2_bytes: int | None
    cpu_count: int
    index: int | None = None  # CUDA device index; None on the CPU

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the compute capability becomes a list)."""
        data = asdict(self)
        if self.compute_capability is not None:
            data["compute_capability"] = list(self.compute_capability)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareInfo:
        """The inverse of :meth:`to_dict` (unknown keys are ignored)."""
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if values.get("compute_capability") is not None:
            values["compute_capability"] = tuple(values["compute_capability"])
        return cls(**values)


def _slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def model_slug(name: str, memory_bytes: int | None = None) -> str:
    """The model slug of a GPU from its CUDA device name (and memory, to break ties).

    Known data-centre parts get a form factor (``h100-sxm``, ``h100-pcie``, ``h100-nvl``,
    ``a100-sxm``, ``a100-pcie``, ``h200``, ``h200-nvl``); memory size suffixes are dropped; a MIG
    slice keeps its profile (``h100-sxm-mig-1g-10gb``) since it is a different machine to time on.
    Anything else becomes the lowercase slug of its name without the vendor words (``NVIDIA
    GeForce RTX 4090`` -> ``rtx-4090``, ``NVIDIA L40S`` -> ``l40s``).
    """
    if not name.strip():
        raise ValueError("model_slug: empty device name")
    text = name.lower().strip()
    mig = ""
    mig_match = re.search(r"\bmig\b\s*(.*)$", text)
    if mig_match:
        profile = _slugify(mig_match.group(1))
        mig = "-mig" + (f"-{profile}" if profile else "")
        text = text[: mig_match.start()].strip()
    for vendor in ("nvidia", "geforce", "tesla"):
        text = re.sub(rf"\b{vendor}\b", " ", text)
    text = " ".join(text.split())
    memory_gib = memory_bytes / _GIB if memory_bytes else None

    def has(pattern: str) -> bool:
        return re.search(pattern, text) is not None

    def form_factor(family: str) -> str:
        if has(r"\bnvl\b"):
            return f"{family}-nvl"
        if has(r"pcie"):
            return f"{family}-pcie"
        if has(r"sxm|hbm3"):
            return f"{family}-sxm"
        return family

    slug: str
    if has(r"\bgh200\b"):
        slug = "gh200"
    elif has(r"\bh200\b"):
        slug = "h200-nvl" if has(r"\bnvl\b") else "h200"
    elif has(r"\bh100\b"):
        slug = form_factor("h100")
        # "NVIDIA H100" alone: the NVL part is the only one with 94 GB.
        if slug == "h100" and memory_gib is not None and memory_gib > 90:
            slug = "h100-nvl"
    elif has(r"\b(h800|a100|a800)\b"):
        family = re.search(r"\b(h800|a100|a800)\b", text).group(1)  # type: ignore[union-attr]
        slug = form_factor(family)
    elif has(r"\bv100\b"):
        slug = form_factor("v100")
    else:
        # Drop memory sizes ("-40gb", " 48gb") and keep the rest as it is.
        slug = _slugify(re.sub(r"\b\d+\s*gb\b", " ", text)) or _slugify(name)
    return slug + mig


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _parse_device(device: str | None) -> tuple[str, int | None]:
    if device is None:
        return ("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else ("cpu", None)
    match = re.fullmatch(r"(cuda|cpu)(?::(\d+))?", device.strip())
    if match is None:
        raise ValueError(f"unknown device {device!r}: expected 'cuda', 'cuda:N' or 'cpu'")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ValueError(f"unknown device {device!r}: the CPU has no index other than 0")
        return "cpu", None
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support (a CPU-only build)"
        raise ValueError(
            f"device {device!r} requested but no CUDA GPU is available "
            f"(torch {torch.__version__} built with {build}); use device='cpu' or run on a GPU machine"
        )
    count = torch.cuda.device_count()
    idx = int(index) if index is not None else torch.cuda.current_device()
    if idx >= count:
        raise ValueError(f"device {device!r} requested but only {count} CUDA device(s) are visible")
    return "cuda", idx


def detect(device: str | None = None) -> HardwareInfo:
    """Describe ``device`` ("cuda", "cuda:N", "cpu"; None: the current GPU if there is one, else the CPU).

    Raises ``ValueError`` when a CUDA device is asked for and none is available.
    """
    kind, index = _parse_device(device)
    if kind == "cpu":
        return HardwareInfo(
            device="cpu",
            name=_cpu_name(),
            model="cpu",
            arch="cpu",
            compute_capability=None,
            sm_count=None,
            memory_bytes=_cpu_memory_bytes(),
            l2_bytes=None,
            cpu_count=_cpu_count(),
        )
    index = index if index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    l2 = getattr(props, "L2_cache_size", None)
    return HardwareInfo(
        device="cuda",
        name=props.name,
        model=model_slug(props.name, props.total_memory),
        arch=f"sm_{props.major}{props.minor}",
        compute_capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        memory_bytes=props.total_memory,
        l2_bytes=int(l2) if l2 else None,
        cpu_count=_cpu_count(),
        index=index,
    )


def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        return None
    return lines[0]


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None)


def _cudnn_version() -> int | None:
    if not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


def versions() -> dict[str, Any]:
    """Software versions for reports: python, torch, triton, cuda, driver, cudnn, platform (never raises)."""
    return {
        "python": platform.python_version(),
        "python_implementation": sys.implementation.name,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "driver": _driver_version(),
        "cudnn": _cudnn_version(),
        "platform": platform.platform(),
    }


def detect_all() -> list[HardwareInfo]:
    """Every visible CUDA GPU in index order, or the CPU alone on a machine without one."""
    if not torch.cuda.is_available():
        return [detect("cpu")]
    return [detect(f"cuda:{index}") for index in range(torch.cuda.device_count())]


def arch_of_model(model: str) -> str | None:
    """The architecture (``sm_90``) of a GPU model slug, MIG slices included; None when unknown."""
    base = re.sub(r"-mig(-.*)?$", "", model.strip().lower())
    return MODEL_ARCH.get(base)


def queue_names(info: HardwareInfo) -> list[str]:
    """Work queues a worker on this device serves: by model, then by architecture (``["cpu"]`` on the CPU)."""
    if info.device == "cpu":
        return [CPU_QUEUE]
    return [f"{GPU_QUEUE_PREFIX}{info.model}", f"{GPU_QUEUE_PREFIX}{info.arch}"]


_MODEL_SLUG = re.compile(r"[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True)
class GpuRequest:
    """What a job asks for: any GPU, a model (``h100-sxm``), an architecture (``sm_90``) or the CPU."""

    kind: Literal["any", "model", "arch", "cpu"]
    value: str | None = None

    @classmethod
    def parse(cls, gpu: str | None) -> GpuRequest:
        """Read ``None``/``""``/``"any"``, a model slug, a device name (``NVIDIA H100 80GB HBM3``), an
        architecture (``sm_90``, ``SM90``), ``cpu``, or a queue name (``gpu.h100-sxm``)."""
        if gpu is None or not gpu.strip() or gpu.strip().lower() == "any":
            return cls("any")
        text = gpu.strip()
        if text.lower().startswith(GPU_QUEUE_PREFIX):
            text = text[len(GPU_QUEUE_PREFIX) :]
        low = text.lower()
        if low == CPU_QUEUE:
            return cls("cpu", CPU_QUEUE)
        arch = re.fullmatch(r"sm_?(\d+[a-z]?)", low)
        if arch:
            return cls("arch", f"sm_{arch.group(1)}")
        if _MODEL_SLUG.fullmatch(low):
            return cls("model", low)
        return cls("model", model_slug(text))

    def __str__(self) -> str:
        return self.value or "any GPU"
