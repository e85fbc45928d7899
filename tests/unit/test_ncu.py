"""The Nsight Compute parser on CSV captured on an H100 (tests/fixtures/ncu/, see its README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelcrew.tools import ncu

FIXTURES = Path(__file__).parent.parent / "fixtures" / "ncu"


def load(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_reference_with_several_kernels_is_summed_per_call():
    records = ncu.parse_csv(load("elementwise_chain_ref.csv"))
    assert len(records) == 15  # 5 kernels x 3 calls inside the NVTX range
    summary = ncu.summarize(records, calls=3)
    assert summary["launches_per_call"] == 5
    assert summary["kernel_time_us"] == pytest.approx(sum(k["duration_us"] for k in summary["kernels"]))
    assert summary["kernel_time_us"] == pytest.approx(sum(r.duration_us for r in records) / 3)
    assert summary["missing_metrics"] == []
    # Memory-bound elementwise kernels: DRAM busy, SMs idle, no spills, no tensor cores.
    assert summary["dram_pct"] > 60 and summary["sm_pct"] < 30
    assert summary["spills"] == 0
    top = summary["kernels"][0]
    assert top["share"] == max(k["share"] for k in summary["kernels"])
    assert sum(k["share"] for k in summary["kernels"]) == pytest.approx(1.0)
    assert top["grid"].startswith("(") and top["registers_per_thread"] > 0
    assert summary["top_stalls"][0]["reason"] == "long_scoreboard"


def test_thousands_separators_and_units_are_parsed():
    records = ncu.parse_csv(load("elementwise_chain_cand.csv"))
    rec = records[0]
    # 4096 x 4096 fp32, 6 tensors of this size move 100+ MB: only right if "67,117,568" is parsed whole.
    assert rec.dram_bytes > 50e6
    assert 1 < rec.duration_us < 10_000  # ns in the CSV, microseconds here
    assert rec.grid_size and rec.grid_size > 1000
    assert rec.name == "elementwise_chain_kernel"


def test_tensor_core_kernel_is_seen_through_the_fallback_metric():
    # Captured with the older hmma metric name only: the parser falls back to it.
    summary = ncu.summarize(ncu.parse_csv(load("mixed_fp16_matmul.csv")))
    gemm = summary["kernels"][0]
    assert "gemm" in gemm["name"] or "nvjet" in gemm["name"]
    assert gemm["tensor_pct"] > 50
    assert all((k["tensor_pct"] or 0) < 5 for k in summary["kernels"][1:])


def test_fp32_gemm_reports_low_occupancy_and_no_tensor_pipe():
    summary = ncu.summarize(ncu.parse_csv(load("matmul_epilogue_ref.csv")), calls=3)
    gemm = summary["kernels"][0]
    assert gemm["share"] > 0.8 and gemm["tensor_pct"] == 0
    assert gemm["registers_per_thread"] == 255 and gemm["theoretical_occupancy_pct"] <= 25


def test_na_values_units_rows_and_repeated_passes():
    text = load("softmax_cand.csv")
    lines = text.splitlines()
    header_at = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    header = lines[header_at].split('","')
    col = next(i for i, name in enumerate(header) if name.startswith("dram__throughput.avg"))
    # A first pass that could not read one metric ("n/a"), then the same launch again with it.
    first_row = lines[header_at + 2].split('","')
    na_row = list(first_row)
    na_row[col] = "n/a"
    doctored = [
        *lines[: header_at + 2],
        '","'.join(na_row),
        *lines[header_at + 2 :],
        "program output, not CSV",
    ]
    records = ncu.parse_csv("\n".join(doctored))
    assert len(records) == 3  # the repeated launch is merged, not counted twice
    assert records[0].dram_pct is not None


def test_time_units_are_scaled():
    assert ncu.parse_number("1,234.5", "ns") == pytest.approx(1.2345)
    assert ncu.parse_number("2.5", "msecond") == pytest.approx(2500)
    assert ncu.parse_number("3", "Mbyte") == 3e6
    assert ncu.parse_number("n/a", "ns") is None
    assert ncu.parse_number("", "") is None


def test_missing_metric_stays_missing_never_defaulted():
    text = load("softmax_cand.csv").replace("launch__registers_per_thread", "launch__renamed_metric")
    summary = ncu.summarize(ncu.parse_csv(text), calls=3)
    assert "registers_per_thread" in summary["missing_metrics"]
    assert summary["kernels"][0]["registers_per_thread"] is None


def test_ncu_errors_become_a_clear_message():
    text = (
        "==PROF== Connected to process 12\n"
        "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance "
        "Counters on the target device 0.\n"
    )
    with pytest.raises(ncu.NcuError, match="ERR_NVGPUCTRPERM"):
        ncu.parse_csv(text)
    with pytest.raises(ncu.NcuError, match="no kernel"):
        ncu.parse_csv("")


def test_short_names_drop_templates_and_arguments():
    assert ncu.short_name("void at::vectorized_elementwise_kernel<4, at::Foo<float>>(int, T2, T3)") == (
        "at::vectorized_elementwise_kernel"
    )
    assert ncu.short_name("void at::<unnamed>::cunn_SoftMaxForwardReg<float>(T1 *)") == (
        "at::anon::cunn_SoftMaxForwardReg"
    )
    assert ncu.short_name("softmax_kernel") == "softmax_kernel"


def test_wrapper_command_never_changes_clocks_by_default(monkeypatch):
    monkeypatch.setattr(ncu, "ncu_path", lambda: "/usr/bin/ncu")
    cmd = ncu.wrapper(Path("/tmp/x.csv"))
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert "--target-processes" in cmd and cmd[cmd.index("--nvtx-include") + 1] == "kernelcrew/"
    with pytest.raises(ValueError):
        ncu.wrapper(Path("/tmp/x.csv"), clock_control="max")


def test_profile_on_cpu_says_why_there_are_no_metrics():
    class CpuGolden:
        device = "cpu"

    result = ncu.profile(CpuGolden())
    assert result == {"available": False, "reason": result["reason"]}
    assert "CPU" in result["reason"]


def test_capability_without_ncu_or_gpu_says_why(monkeypatch):
    ncu.capability.cache_clear()
    monkeypatch.setattr(ncu, "ncu_version", lambda: None)
    assert ncu.capability() == {
        "available": False,
        "version": None,
        "reason": "ncu (Nsight Compute) is not installed",
    }
    ncu.capability.cache_clear()
    monkeypatch.setattr(ncu, "ncu_version", lambda: "2025.3.1.0")
    import torch

    if not torch.cuda.is_available():
        assert ncu.capability()["reason"] == "no CUDA GPU visible"
    ncu.capability.cache_clear()
