"""`kernelcrew verify`: exit codes, the JSON report, and readable errors."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from kernelcrew.cli import app
from tests.conftest import FIXTURES

TASK = FIXTURES / "tasks" / "pointwise.py"
GOOD = FIXTURES / "candidates" / "pointwise_triton.py"
runner = CliRunner()

KEYS = {
    "verdict",
    "stage",
    "message",
    "max_rel_error",
    "baseline_ms",
    "compile_ms",
    "candidate_ms",
    "speedup",
    "device",
    "kind",
    "flags",
    "checks",
    "versions",
    "gpu",
    "seed",
    "reproduce",
}


def invoke(*args: str):
    return runner.invoke(app, ["verify", *map(str, args)])


def test_pass_with_timing_exits_0_and_reports_everything():
    result = invoke(TASK, GOOD, "--device", "cpu", "--json", "--quick", "--compile-modes", "default")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) >= KEYS
    assert report["verdict"] == "pass" and report["kind"] == "kernel"
    assert report["baseline_ms"] > 0 and report["candidate_ms"] > 0 and report["compile_ms"] > 0
    assert report["speedup"] > 0 and len(report["speedup_ci"]) == 2
    assert "CPU timings (wall clock): not GPU speedups" in report["flags"]
    assert report["timing"]["clock"] == "cpu-wall"
    assert report["compile_s"]["default"] > 0
    assert report["gpu"] is None and report["versions"]["torch"]
    assert {"golden", "verify", "timing"} == {k for k in report["phase_s"] if ":" not in k}
    assert {"verify:build", "verify:input_sets", "verify:judge"} <= set(report["phase_s"])
    assert (
        report["reproduce"].startswith("kernelcrew verify")
        and f"--seed {report['seed']}" in report["reproduce"]
    )
    timed = [c for c in report["checks"] if c["name"] == "timed outputs"]
    assert timed and timed[0]["passed"] and timed[0]["detail"] > 0


def test_fail_exits_1_with_a_readable_verdict():
    result = invoke(
        TASK.parent / "softmax.py", FIXTURES / "candidates" / "zeros.py", "--device", "cpu", "--no-timing"
    )
    assert result.exit_code == 1
    assert "FAIL (correctness)" in result.stdout
    assert "reproduce: kernelcrew verify" in result.stdout


def test_bad_task_exits_2():
    bad = FIXTURES / "tasks" / "bad" / "no_model.py"
    result = invoke(bad, GOOD, "--device", "cpu", "--json")
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert report["verdict"] == "error" and "missing top-level definition(s): Model" in report["message"]


def test_missing_and_binary_candidate_exit_2(tmp_path):
    assert invoke(TASK, tmp_path / "nope.py", "--device", "cpu").exit_code == 2
    binary = tmp_path / "bin.py"
    binary.write_bytes(b"\x7fELF\x00\x00")
    result = invoke(TASK, binary, "--device", "cpu")
    assert result.exit_code == 2 and "binary" in result.output


def test_cuda_without_gpu_exits_2():
    result = invoke(TASK, GOOD, "--device", "cuda")
    assert result.exit_code == 2 and "no CUDA GPU" in result.output


def test_python_dash_m_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "kernelcrew", "--help"], capture_output=True, text=True, check=True
    )
    assert "verify" in out.stdout


def test_profile_on_a_cpu_says_what_it_cannot_measure_and_gives_the_floor():
    res = runner.invoke(
        app,
        [
            "profile",
            str(TASK),
            "--candidate",
            str(GOOD),
            "--device",
            "cpu",
            "--json",
            "--quick",
            "--gpu",
            "h100-sxm",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["candidate_verdict"]["verdict"] == "pass"
    assert report["work"]["bytes"] > 0 and report["floor"]["floor_ms"] > 0
    assert report["peaks"]["model"] == "h100-sxm" and report["peaks"]["sources"]["dram_gbs"]
    assert any("no GPU here" in n for n in report["notes"])
    assert report["ncu"]["reference"] is None or report["ncu"]["reference"]["available"] is False
    assert all(v is None for v in report["sol_fraction"].values())  # CPU timings never against a GPU floor
    assert report["hotspots"] and report["hotspot_clock"].startswith("cpu")
    assert report["diagnosis"]["reference"]["bound"] in ("memory", "compute")


def test_profile_rejects_an_unknown_gpu_model():
    res = runner.invoke(app, ["profile", str(TASK), "--device", "cpu", "--gpu", "no-such-gpu"])
    assert res.exit_code == 2 and "unknown GPU model" in res.output
