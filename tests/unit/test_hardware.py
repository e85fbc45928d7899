"""Tests of kernelcrew.tools.hardware: device detection, model slugs, versions, queue names."""

from __future__ import annotations

import json

import pytest
import torch

from kernelcrew.tools import hardware
from kernelcrew.tools.hardware import HardwareInfo, detect, model_slug, queue_names, versions

GIB = 1024**3

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")


@pytest.mark.parametrize(
    ("name", "memory_gib", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", 80, "h100-sxm"),
        ("NVIDIA H100 PCIe", 80, "h100-pcie"),
        ("NVIDIA H100 NVL", 94, "h100-nvl"),
        ("NVIDIA H100", 94, "h100-nvl"),
        ("NVIDIA H100", None, "h100"),
        ("NVIDIA H200", 141, "h200"),
        ("NVIDIA H200 NVL", 141, "h200-nvl"),
        ("NVIDIA GH200 480GB", 96, "gh200"),
        ("NVIDIA A100-SXM4-80GB", 80, "a100-sxm"),
        ("NVIDIA A100-SXM4-40GB", 40, "a100-sxm"),
        ("NVIDIA A100-PCIE-40GB", 40, "a100-pcie"),
        ("NVIDIA A100 80GB PCIe", 80, "a100-pcie"),
        ("NVIDIA L40S", 48, "l40s"),
        ("NVIDIA L40", 48, "l40"),
        ("NVIDIA L4", 24, "l4"),
        ("NVIDIA GeForce RTX 4090", 24, "rtx-4090"),
        ("NVIDIA GeForce RTX 3090 Ti", 24, "rtx-3090-ti"),
        ("NVIDIA B200", 180, "b200"),
        ("Tesla V100-SXM2-16GB", 16, "v100-sxm"),
        ("Tesla T4", 16, "t4"),
        ("NVIDIA RTX A6000", 48, "rtx-a6000"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 10, "h100-sxm-mig-1g-10gb"),
        ("Some Future GPU X1", 64, "some-future-gpu-x1"),
    ],
)
def test_model_slug(name: str, memory_gib: int | None, slug: str) -> None:
    assert model_slug(name, memory_gib * GIB if memory_gib else None) == slug


def test_model_slug_rejects_empty_name() -> None:
    with pytest.raises(ValueError):
        model_slug("  ")


def test_detect_cpu() -> None:
    info = detect("cpu")
    assert info.device == "cpu"
    assert info.model == "cpu"
    assert info.arch == "cpu"
    assert info.compute_capability is None
    assert info.sm_count is None and info.l2_bytes is None and info.index is None
    assert info.name and isinstance(info.name, str)
    assert info.cpu_count >= 1
    assert info.memory_bytes is None or info.memory_bytes > 0
    assert not info.is_cuda
    data = info.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert queue_names(info) == ["cpu"]


@no_cuda
def test_detect_default_falls_back_to_cpu() -> None:
    assert detect().device == "cpu"
    assert detect(None) == detect("cpu")


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_detect_cuda_without_gpu_raises(device: str) -> None:
    with pytest.raises(ValueError, match="no CUDA GPU"):
        detect(device)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", "cpu:1", ""])
def test_detect_rejects_unknown_devices(device: str) -> None:
    with pytest.raises(ValueError):
        detect(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_detect_cuda() -> None:
    info = detect("cuda")
    major, minor = torch.cuda.get_device_capability()
    assert info.device == "cuda" and info.index == torch.cuda.current_device()
    assert info.arch == f"sm_{major}{minor}"
    assert info.compute_capability == (major, minor)
    assert info.sm_count and info.sm_count > 0
    assert info.model == model_slug(info.name, info.memory_bytes)
    assert queue_names(info) == [f"gpu.{info.model}", f"gpu.{info.arch}"]


def test_queue_names_for_a_gpu() -> None:
    info = HardwareInfo(
        device="cuda",
        name="NVIDIA H100 80GB HBM3",
        model="h100-sxm",
        arch="sm_90",
        compute_capability=(9, 0),
        sm_count=132,
        memory_bytes=80 * GIB,
        l2_bytes=50 * 1024**2,
        cpu_count=16,
        index=0,
    )
    assert queue_names(info) == ["gpu.h100-sxm", "gpu.sm_90"]
    assert info.to_dict()["compute_capability"] == [9, 0]


def test_versions() -> None:
    v = versions()
    assert {"python", "torch", "triton", "cuda", "driver", "cudnn", "platform"} <= set(v)
    assert v["torch"] == torch.__version__
    assert v["cuda"] == torch.version.cuda
    assert v["python"].count(".") == 2
    json.dumps(v)


def test_versions_without_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    assert versions()["driver"] is None


@pytest.mark.parametrize(
    ("model", "arch"),
    [
        ("h100-sxm", "sm_90"),
        ("h200", "sm_90"),
        ("a100-pcie", "sm_80"),
        ("l40s", "sm_89"),
        ("rtx-4090", "sm_89"),
        ("h100-sxm-mig-1g-10gb", "sm_90"),
        ("t4", "sm_75"),
        ("some-future-gpu-x1", None),
    ],
)
def test_arch_of_model(model: str, arch: str | None) -> None:
    assert hardware.arch_of_model(model) == arch


def test_every_known_model_slug_has_an_architecture() -> None:
    for name, memory_gib in [("NVIDIA H100 80GB HBM3", 80), ("NVIDIA A100-SXM4-80GB", 80), ("NVIDIA L4", 24)]:
        assert hardware.arch_of_model(model_slug(name, memory_gib * GIB)) is not None


def test_hardware_info_round_trips_through_json() -> None:
    info = HardwareInfo(
        "cuda", "NVIDIA H100 80GB HBM3", "h100-sxm", "sm_90", (9, 0), 132, 80 * GIB, None, 16, 0
    )
    again = HardwareInfo.from_dict(json.loads(json.dumps({**info.to_dict(), "extra": 1})))
    assert again == info
    assert HardwareInfo.from_dict(detect("cpu").to_dict()) == detect("cpu")


@no_cuda
def test_detect_all_without_gpu_is_the_cpu() -> None:
    assert hardware.detect_all() == [detect("cpu")]
