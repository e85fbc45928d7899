"""`kernelcrew bench`: a row per task in the agreed format, resumable across shards."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kernelcrew.benchmark import geomean, markdown, roofline_peaks, row_from_report, suite_tasks
from kernelcrew.cli import app
from tests.conftest import FIXTURES

runner = CliRunner()
ROW_KEYS = {
    "task",
    "eager_ms",
    "compile_ms",
    "best_ms",
    "speedup_eager",
    "speedup_compile",
    "sol_fraction",
    "strategy",
    "source_kind",
    "verified",
    "wall_s",
}


def test_bench_writes_rows_and_resumes(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(FIXTURES / "tasks" / "pointwise.py", suite / "pointwise.py")
    (suite / "broken.py").write_text("import torch\nclass Model(:\n")
    out = tmp_path / "out"
    args = ["bench", str(suite), "--device", "cpu", "--out", str(out), "--max-iters", "1"]
    args += ["--compile-modes", "none", "--quick"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads((out / "suite.json").read_text())
    assert {"device", "arch", "versions", "rows"} <= set(data)
    rows = {r["task"]: r for r in data["rows"]}
    assert set(rows["pointwise"]) >= ROW_KEYS
    assert rows["pointwise"]["verified"] and rows["pointwise"]["source_kind"] in (
        "kernel",
        "library",
        "compiler",
    )
    assert rows["broken"]["verified"] is False and "broken.py:2: syntax error" in rows["broken"]["error"]
    assert (out / "suite.md").read_text().count("| pointwise |") == 1
    again = runner.invoke(app, [*args, "--resume"])
    assert again.exit_code == 0 and again.output.count("skipped") == 2
    assert json.loads((out / "suite.json").read_text())["rows"] == data["rows"]


def test_unknown_task_names_and_empty_suites_are_clear_errors(tmp_path):
    res = runner.invoke(app, ["bench", str(tmp_path), "--device", "cpu"])
    assert res.exit_code == 2 and "no task files" in res.output
    (tmp_path / "a.py").write_text("x = 1\n")
    res = runner.invoke(app, ["bench", str(tmp_path), "--device", "cpu", "--tasks", "b"])
    assert res.exit_code == 2 and "unknown task(s) b" in res.output
    assert [p.name for p in suite_tasks(tmp_path)] == ["a.py"]


def test_a_gpu_suite_is_measured_against_this_gpus_calibrated_bandwidth(tmp_path, monkeypatch):
    """The SOL column's floor uses the copy bandwidth measured on the GPU (the issue's "measured
    bandwidth"), calibrated once per model and reused by later shards; the table names both."""
    from rich.console import Console

    from kernelcrew.config import Settings
    from kernelcrew.tools import roofline

    s = Settings(data_dir=tmp_path)
    hw = {"device": "cuda", "model": "h100-sxm", "arch": "sm_90", "name": "NVIDIA H100 80GB HBM3"}
    calls = []

    def calibrate(hardware, *, quick=False, settings=None):  # what the GPU child would store
        calls.append(hardware["model"])
        path = roofline.calibration_path(hardware["model"], settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"model": "h100-sxm", "version": roofline.CALIBRATION_VERSION}
        path.write_text(json.dumps({**record, "measured": {"dram_gbs": 2956.3, "compute": {}}}))

    monkeypatch.setattr(roofline, "calibrate", calibrate)
    quiet = Console(file=io.StringIO())
    peaks = roofline_peaks(hw, quiet, s)
    assert calls == ["h100-sxm"] and peaks["dram_gbs"] == 2956.3 and peaks["datasheet_dram_gbs"] == 3350
    assert peaks["basis"].startswith("calibrated")
    assert roofline_peaks(hw, quiet, s) == peaks and calls == ["h100-sxm"]  # stored: not measured again
    table = markdown({"suite": "s", "rows": [], "summary": {}, "peaks": peaks, "versions": {}})
    assert "at 2956 GB/s of DRAM bandwidth" in table and "datasheet 3350 GB/s" in table


def test_rows_and_geomean():
    assert row_from_report("t", None, 1.0)["verified"] is False
    assert geomean([2.0, 8.0]) == 4.0 and geomean([]) is None


SUITE = Path(__file__).resolve().parents[2] / "bench" / "suite"


@pytest.mark.parametrize("task", sorted(p.stem for p in SUITE.glob("*.py")))
def test_every_suite_task_runs_on_its_test_inputs_in_its_own_dtypes(task):
    """The reference of each suite task builds and runs on its test inputs as written (weights in
    the inputs' dtype), so a GPU shard never loses a task to a task file's own error."""
    import runpy

    import torch

    module = runpy.run_path(str(SUITE / f"{task}.py"))
    model = module["Model"](*module["get_init_inputs"]()).eval()
    for inputs in module["get_test_inputs"]():
        with torch.no_grad():
            out = model(*inputs)
        assert torch.isfinite(out).all()
