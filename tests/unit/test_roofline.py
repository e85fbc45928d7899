"""Peaks per GPU model with sources, calibration preferred, floors, speed of light, the diagnosis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelcrew.agents.diagnosis import assess, render
from kernelcrew.agents.profiler import _check_floor
from kernelcrew.agents.state import Candidate, CrewState, Options
from kernelcrew.config import Settings
from kernelcrew.records import Baseline, BenchmarkRequest, BenchmarkResult
from kernelcrew.tools import ncu, roofline

FIXTURES = Path(__file__).parent.parent / "fixtures" / "ncu"
H100 = {"device": "cuda", "model": "h100-sxm", "arch": "sm_90"}


def ncu_result(name: str, calls: int = 3) -> dict:
    records = ncu.parse_csv((FIXTURES / name).read_text())
    return {"available": True, "summary": ncu.summarize(records, calls), "version": "2025.3.1"}


def test_every_datasheet_figure_has_a_source_and_models_differ_within_an_arch(tmp_path):
    s = Settings(data_dir=tmp_path)
    for model, sheet in roofline.DATASHEET.items():
        assert sheet["source"] and sheet["dram_gbs"] > 0, model
        peaks = roofline.peaks_for({"device": "cuda", "model": model, "arch": "sm_90"}, s)
        assert peaks.basis == "datasheet"
        for figure in ("dram_gbs", *(k for k, v in sheet["compute"].items() if v)):
            assert peaks.sources[figure], (model, figure)
        assert "calibration" in peaks.sources["l2_gbs"]  # never an invented L2 figure
    dram = {
        m: roofline.peaks_for({"device": "cuda", "model": m}, s).dram_gbs
        for m in ("h100-pcie", "h100-sxm", "h200")
    }
    assert dram == {"h100-pcie": 2000, "h100-sxm": 3350, "h200": 4800}


def test_unknown_models_fall_back_and_say_so(tmp_path):
    s = Settings(data_dir=tmp_path)
    mig = roofline.peaks_for({"device": "cuda", "model": "h100-sxm-mig-1g-10gb", "arch": "sm_90"}, s)
    assert mig.basis == "parent model (h100-sxm)"
    other = roofline.peaks_for({"device": "cuda", "model": "gh200", "arch": "sm_90"}, s)
    assert other.basis == "architecture fallback (h100-sxm)"
    unknown = roofline.peaks_for({"device": "cuda", "model": "t4", "arch": "sm_75"}, s)
    assert unknown.basis == "unknown" and unknown.dram_gbs is None
    assert roofline.peaks_for({"device": "cpu", "model": "cpu"}, s).basis == "unknown"


def test_calibration_is_preferred_over_the_datasheet(tmp_path):
    s = Settings(data_dir=tmp_path)
    path = roofline.calibration_path("h100-sxm", s)
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "model": "h100-sxm",
                "version": roofline.CALIBRATION_VERSION,
                "device_name": "NVIDIA H100 80GB HBM3",
                "measured_at": "2026-11-22",
                "measured": {"dram_gbs": 2950.0, "l2_gbs": 9000.0, "compute": {"fp16": 730.0}},
            }
        )
    )
    peaks = roofline.peaks_for(H100, s)
    assert peaks.dram_gbs == 2950.0 and peaks.l2_gbs == 9000.0 and peaks.compute["fp16"] == 730.0
    assert peaks.datasheet_dram_gbs == 3350
    assert "calibrated" in peaks.sources["dram_gbs"] and "datasheet" in peaks.sources["fp8"]
    assert peaks.basis == "calibrated"  # over this model's own datasheet: nothing more to say
    path.write_text("{not json")  # a corrupt file is ignored, not fatal
    assert roofline.peaks_for(H100, s).basis == "datasheet"


def test_a_calibration_of_an_older_method_is_measured_again(tmp_path):
    """Version 1 timed the host's launch gap with each copy (its bandwidth read low): a stored
    record without the current version is not used, so the bench calibrates again."""
    s = Settings(data_dir=tmp_path)
    path = roofline.calibration_path("h100-sxm", s)
    path.parent.mkdir(parents=True)
    record = {"model": "h100-sxm", "measured": {"dram_gbs": 2903.0, "compute": {}}}
    path.write_text(json.dumps(record))
    assert roofline.load_calibration("h100-sxm", s) is None
    assert roofline.peaks_for(H100, s).basis == "datasheet"
    path.write_text(json.dumps({**record, "version": roofline.CALIBRATION_VERSION}))
    assert roofline.load_calibration("h100-sxm", s)["measured"]["dram_gbs"] == 2903.0


def test_each_timed_calibration_rep_queues_a_lead_before_its_start_event():
    """The host launches a rep's work while the device spins, so the events time the device alone
    (without it the H100's copy figure also counted the host's launch gap)."""
    log, made = [], []

    class FakeEvent:  # made in pairs: start, end
        def __init__(self, enable_timing):
            assert enable_timing
            self.name = ("start", "end")[len(made) % 2]
            made.append(self)

        def record(self):
            log.append(f"{self.name} recorded")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 2.0

    class Cuda:
        Event = FakeEvent

        @staticmethod
        def synchronize():
            log.append("sync")

        @staticmethod
        def _sleep(cycles):
            log.append(f"lead {cycles}")

    times = roofline.timed_reps(lambda: log.append("work"), 2, Cuda)
    assert times == [0.002, 0.002]
    lead = f"lead {roofline._LEAD_CYCLES}"
    rep = [lead, "start recorded", "work", "end recorded"]
    assert log == ["work"] * 3 + ["sync"] + rep + rep
    log.clear()  # lead_cycles 0: version 1's reps (bench/calibration_lead.py times both)
    roofline.timed_reps(lambda: log.append("work"), 1, Cuda, lead_cycles=0)
    assert log == ["work"] * 3 + ["sync", "start recorded", "work", "end recorded"]


def test_floor_is_the_larger_of_memory_and_compute_time(tmp_path):
    peaks = roofline.peaks_for(H100, Settings(data_dir=tmp_path))
    mem = roofline.floor({"bytes": 3.35e9, "matmul_flops": 0, "other_flops": 1e6}, peaks)
    assert mem["bound"] == "memory" and mem["floor_ms"] == pytest.approx(1.0)  # 3.35 GB at 3.35 TB/s
    mm = roofline.floor(
        {
            "bytes": 3 * 8192 * 8192 * 2,
            "matmul_flops": 2 * 8192**3,
            "other_flops": 0,
            "compute_class": "fp16",
        },
        peaks,
    )
    assert mm["bound"] == "compute"
    assert mm["floor_ms"] == pytest.approx(2 * 8192**3 / 989.5e12 * 1e3)
    assert mm["intensity"] > mm["ridge"]
    none = roofline.floor({"bytes": 10}, roofline.Peaks(model="cpu", basis="unknown"))
    assert none["floor_ms"] is None and "no peaks" in none["reason"]


def test_suspect_and_fraction():
    assert roofline.sol_fraction(1.0, 2.0) == 0.5
    assert roofline.sol_fraction(None, 2.0) is None
    assert roofline.is_suspect(1.0, 0.8) and not roofline.is_suspect(1.0, 0.95)
    assert not roofline.is_suspect(None, 0.1)


def test_measure_work_counts_matmul_flops_and_compulsory_bytes():
    import torch

    from kernelcrew.tools.harness import measure_work

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()).eval()
    x = torch.randn(16, 64)
    work = measure_work(model, [x], "strict")
    assert work["matmul_flops"] == 2 * 16 * 64 * 32
    assert work["bytes"] == 4 * (16 * 64 + 64 * 32 + 32 + 16 * 32)
    assert work["compute_class"] == "fp32" and work["other_flops"] >= 16 * 32
    assert measure_work(model, [x], "relaxed")["compute_class"] == "tf32"


def baseline_for(name: str, eager_ms: float, work: dict) -> Baseline:
    peaks = roofline.peaks_for(H100, Settings(data_dir=Path("/nonexistent")))
    return Baseline(
        ncu=ncu_result(name), floor=roofline.floor(work, peaks), eager_ms=eager_ms, clock="cuda-event"
    )


def test_diagnosis_reads_each_kernel_from_its_own_metrics():
    n = 4096 * 4096
    pointwise = baseline_for("elementwise_chain_ref.csv", 0.25, {"bytes": 3 * n * 4, "other_flops": 5 * n})
    gemm = baseline_for(
        "matmul_epilogue_ref.csv",
        0.21,
        {"bytes": 4 * (1024 * 1024 * 3), "matmul_flops": 2 * 1024**3, "compute_class": "fp32"},
    )
    a, b = assess(pointwise), assess(gemm)
    assert a["bound"] == "memory" and b["bound"] == "compute"
    assert 3 <= len(a["evidence"]) <= 5 and 3 <= len(b["evidence"]) <= 5
    assert any("fusing" in r for r in a["remedies"])  # moves ~4x the compulsory bytes
    assert any("relaxed" in r and "TF32x3" in r for r in b["remedies"])  # fp32 SIMT gemm, idle tensor pipe
    assert render(a, pointwise) != render(b, gemm)
    assert "floor" in render(a, pointwise) and a["sol_fraction"] < 1


def test_a_float32_matmuls_floor_counts_tf32x3():
    """Float32 accuracy on the tensor cores (three TF32 products) beats the H100's CUDA cores:
    a strict float32 GEMM's floor uses a third of the TF32 peak, not the 67 TFLOP/s of FP32."""
    peaks = roofline.Peaks("H100", "datasheet", dram_gbs=3350.0, compute={"fp32": 67.0, "tf32": 494.5})
    work = {"bytes": 4 * 3 * 4096**2, "matmul_flops": 2 * 4096**3, "compute_class": "fp32"}
    assert roofline.floor(work, peaks)["compute_tflops"] == pytest.approx(494.5 / 3)
    no_tf32 = roofline.Peaks("old", "datasheet", dram_gbs=900.0, compute={"fp32": 15.7})
    assert roofline.floor(work, no_tf32)["compute_tflops"] == 15.7


def test_launch_bound_when_the_gpu_idles():
    base = baseline_for("softmax_cand.csv", 0.5, {"bytes": 1e6})  # 41 us of kernels in a 500 us call
    a = assess(base)
    assert a["bound"] == "launch overhead"
    assert any("CUDA graph" in r for r in a["remedies"])


def test_without_ncu_the_roofline_predicts_and_says_why(tmp_path):
    peaks = roofline.peaks_for(H100, Settings(data_dir=tmp_path))
    base = Baseline(
        ncu={"available": False, "reason": "ncu (Nsight Compute) is not installed on this machine"},
        floor=roofline.floor({"bytes": 1e8, "other_flops": 1e7}, peaks),
        eager_ms=0.1,
        clock="cuda-event",
    )
    a = assess(base)
    assert a["bound"] == "memory" and a["predicted"]
    assert "not installed" in render(a, base) and "predicted" in render(a, base)
    cpu = assess(base.model_copy(update={"clock": "cpu-wall", "eager_ms": 200.0}))
    assert cpu["sol_fraction"] is None and cpu["floor_ms"] == base.floor_ms


class _Bench:
    """Answers benchmark requests with fixed timings (the executor's contract)."""

    def __init__(self, ms: float) -> None:
        self.ms, self.calls = ms, 0

    def benchmark(self, request: BenchmarkRequest) -> BenchmarkResult:
        self.calls += 1
        ms = self.ms
        stats = {"median_ms": ms, "mean_ms": ms, "p10_ms": ms, "p90_ms": ms, "iqr_ms": 0.0, "spread_pct": 0.0,
                 "reps": 10, "wall_median_ms": ms, "host_median_ms": 0.0, "graph_median_ms": None,
                 "warmup_calls": 2, "samples": 0, "lead_us": 0.0, "lead_short_reps": 0}  # fmt: skip
        ratio = {"median": 2.0, "ci_low": 1.5, "ci_high": 2.5, "ci_coverage": 0.95, "significant": True,
                 "wall_median": 2.0, "graph_median": None}  # fmt: skip
        return BenchmarkResult.model_validate(
            {"results": {"c": stats}, "ratios": {"c": ratio}, "clock": "cuda-event"}
        )


class _Ctx:
    def __init__(self, bench: _Bench) -> None:
        self.executor = bench

    def request(self, kind, state, **extra):
        return extra


@pytest.mark.parametrize(("second_ms", "confirmed"), [(0.5, True), (1.5, False)])
def test_a_time_below_the_floor_is_measured_again(second_ms, confirmed):
    state = CrewState(task_source="", options=Options(device="cuda"), baseline={"floor": {"floor_ms": 1.0}})
    bench = _Bench(second_ms)
    cand = Candidate(id="c", strategy="s", source_kind="kernel", source="", time_ms=0.5, speedup_eager=4.0)
    out = _check_floor(state, _Ctx(bench), cand)
    assert bench.calls == 1
    assert any("suspect" in f for f in out.flags)
    assert out.time_ms == (0.5 if confirmed else 1.5)
    assert ("confirmed (" in out.flags[-1]) is confirmed
    normal = Candidate(id="c", strategy="s", source_kind="kernel", source="", time_ms=2.0)
    assert _check_floor(state, _Ctx(bench), normal).flags == [] and bench.calls == 1


def test_hotspots_rank_kernels_and_leave_out_the_profilers_own_time():
    """CUPTI's activity-buffer time and aten CPU rows are not the module's kernels: the shares are of
    the kernels alone (the CUPTI row showed up among a LayerNorm's hotspots on the H100)."""
    from types import SimpleNamespace

    from kernelcrew.tools.harness import rank_hotspots

    def evt(key, device_us, count=5):
        return SimpleNamespace(key=key, self_device_time_total=device_us, count=count)

    rows = rank_hotspots(
        [
            evt("layer_norm_kernel", 600.0),
            evt("Activity Buffer Request", 130.0, 0),
            evt("aten::add", 50.0),
            evt("add_kernel", 200.0),
        ],
        on_gpu=True,
        reps=5,
    )
    assert [r["name"] for r in rows] == ["layer_norm_kernel", "add_kernel"]
    assert rows[0]["time_us"] == 120.0 and rows[0]["calls"] == 1
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-12
