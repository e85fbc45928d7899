"""`kernelcrew bench`: a row per task in the agreed format, resumable across shards."""

from __future__ import annotations

import io
import json
import os
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
    "params",
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
    assert isinstance(rows["pointwise"]["params"], dict)  # the answer can be generated again from its row
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


def test_a_row_says_what_the_run_answered_and_where_its_seconds_went():
    """The answer (own candidate, the compiler fallback, or the reference) and the budget's account
    travel into the row; the summary counts answers and runs past their budget plus 20 %."""
    from kernelcrew.benchmark import summarize
    from kernelcrew.records import Report

    budget = {"baseline_s": 30.0, "steps_s": 40.0, "fallback_s": 0.0, "final_timing_s": 9.0, "total_s": 80.0}
    report = Report.model_validate(
        {
            "status": "no_significant_gain",
            "answer": {"answer": "reference", "why": "nothing measured beat eager"},
            "budget": {**budget, "within_tolerance": True, "steps": []},
        }
    )
    row = row_from_report("t", report, 81.0)
    assert row["answer"] == "reference" and row["budget_s"] == budget and row["within_budget"] is True
    late = {**row, "task": "u", "answer": "compiler", "within_budget": False}
    summary = summarize([row, late])
    assert (
        summary["answers"] == {"candidate": 0, "compiler": 1, "reference": 1} and summary["over_budget"] == 1
    )
    table = markdown({"suite": "s", "rows": [row, late], "summary": summary, "versions": {}})
    assert "Answers: 0 candidate, 1 compiler, 1 reference; runs past their budget plus 20 %: 1." in table


ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "bench" / "suite"


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


WRONG = """import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1) * 1.01
"""


def test_micro_checks_and_times_every_configuration_on_cpu(tmp_path):
    """bench/micro.py's CPU path (Triton interpreter, test shapes): every configuration of the row
    strategy is checked against float64 and timed with eager; a wrong candidate (one more
    configuration, patched in) is flagged, not timed. In a fresh process: Triton must be imported in
    interpreter mode."""
    import subprocess
    import sys

    out = tmp_path / "micro"
    task = FIXTURES / "tasks" / "softmax.py"
    script = f"""
from kernelcrew.agents import playbook
from bench import micro

space, generate = playbook.tuning_space, playbook.generate
playbook.tuning_space = lambda s, a, arch: [*space(s, a, arch), {{"wrong": True}}]
playbook.generate = lambda s, src, a, p=None: {WRONG!r} if (p or {{}}).get("wrong") else generate(s, src, a, p)
micro.main([{str(task)!r}, "--device", "cpu", "--compile", "none", "--strategies",
            "row_reduction,fused_pointwise", "--out", {str(out)!r}])
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "micro.json").read_text())
    assert data["arch"] == "cpu" and data["inputs"] == "test"
    (row,) = data["tasks"]
    assert row["task"] == "softmax" and row["eager"]["median_ms"] > 0
    *good, wrong = row["candidates"]
    assert good and all(c["strategy"] == "row_reduction" and c["ok"] for c in good), good
    assert all(c["rel_error"] < row["error_bound"] and c["median_ms"] > 0 and c["vs_eager"] > 0 for c in good)
    assert wrong["ok"] is False and wrong["rel_error"] > 1e-3 and "median_ms" not in wrong
    assert set(row["not_applicable"]) == {"fused_pointwise"}
    table = (out / "micro.md").read_text()
    assert "| row_reduction/0 |" in table and "FAIL" in table and "fused_pointwise | does not apply" in table


def test_run_suite_deals_tasks_to_gpus_and_merges_their_tables_in_suite_order():
    from bench.run_suite import deal, merge

    assert deal(["a", "b", "c", "d", "e"], 2) == [["a", "c", "e"], ["b", "d"]]
    header = {"suite": "s", "device": "H100", "arch": "sm_90", "versions": {}}
    rows = {t: {"task": t, "verified": True, "speedup_eager": 2.0, "source_kind": "kernel"} for t in "abc"}
    peaks = {"basis": "calibrated", "dram_gbs": 3000.0}
    shards = [
        {**header, "gpu": "0", "rows": [rows["a"], rows["c"]], "peaks": peaks},
        {**header, "gpu": "1", "rows": [rows["b"]], "peaks": {**peaks, "dram_gbs": 2990.0}},
    ]
    data = merge(["a", "b", "c"], shards)
    assert [r["task"] for r in data["rows"]] == ["a", "b", "c"]
    assert data["summary"]["tasks"] == 3 and data["summary"]["geomean_eager"] == pytest.approx(2.0)
    assert [(s["gpu"], s["tasks"]) for s in data["shards"]] == [("0", ["a", "c"]), ("1", ["b"])]
    assert markdown(data).count("| a |") == 1


def _kb_row(
    task, *, verified=True, eager=2.0, compile_=1.0, kind="kernel", significant=True, wall=50.0, **extra
):
    return {
        "task": task,
        "status": "improved" if verified else "no_verified_candidate",
        "verified": verified,
        "speedup_eager": eager if verified else None,
        "speedup_compile": compile_ if verified else None,
        "significant": significant if verified else None,
        "source_kind": kind if verified else None,
        "wall_s": wall,
        **extra,
    }


def test_kernelbench_summary_and_targets_on_a_fabricated_row_list():
    """The summary's arithmetic (unit test of the summary code, not a result): shares of all rows,
    geomeans over the verified, fast_1 needs significance, own kernels are ``kernel`` only, walls over
    budget x 1.2, errors, per level; then the targets with met / missed and their margins."""
    from bench.kernelbench import result

    order = ["l1_a", "l1_b", "l2_c", "l2_d", "l2_e", "l3_f"]
    rows = [
        _kb_row("l1_a", eager=4.0, compile_=2.0, kind="library"),
        _kb_row("l1_b", eager=1.0, significant=False, wall=108.5),  # verified, not fast_1; 108.5 > 1.2 x 90
        _kb_row("l2_c", eager=2.0, compile_=1.0),
        _kb_row("l2_d", eager=8.0, compile_=4.0, kind="hybrid"),
        _kb_row("l2_e", verified=False),
        {"task": "l3_f", "verified": False, "status": "error", "wall_s": 3.0, "error": "out of memory"},
    ]
    shard = {"suite": "s", "device": "H100", "settings": {"time_budget_s": 90.0}, "rows": rows}
    data = result(order, [shard])
    assert [r["level"] for r in data["rows"]] == [1, 1, 2, 2, 2, 3]
    assert data["rows"][2]["file"] == "level2/c.py" and data["rows"][5]["verdict"] == "error"
    s = data["summary"]
    assert (s["tasks"], s["verified"], s["fast_1"], s["own_kernels"]) == (6, 4, 3, 2)
    assert s["verified_share"] == pytest.approx(4 / 6) and s["fast_1_share"] == pytest.approx(0.5)
    assert s["geomean_eager"] == pytest.approx((4 * 1 * 2 * 8) ** 0.25)
    assert s["geomean_compile"] == pytest.approx((2 * 1 * 1 * 4) ** 0.25)
    assert s["kinds"] == {"hybrid": 1, "kernel": 2, "library": 1}
    assert (s["errored"], s["no_answer"], s["over_budget"]) == (["l3_f"], ["l2_e"], ["l1_b"])
    l2 = s["levels"]["2"]
    assert (l2["tasks"], l2["verified"], l2["own_kernels"]) == (3, 2, 1)
    assert l2["geomean_compile"] == pytest.approx(2.0) and l2["own_kernels_share"] == pytest.approx(1 / 3)
    assert s["levels"]["3"]["verified"] == 0 and s["levels"]["3"]["geomean_eager"] is None
    t = {row["target"]: row for row in data["targets"]}
    assert t["tasks that errored"]["met"] is False and t["tasks that errored"]["margin"] == 1
    assert t["verified answer"]["met"] is False and t["verified answer"]["margin"] == pytest.approx(
        4 / 6 - 0.97
    )
    assert t["level 2 geomean over torch.compile"]["met"] is True
    assert t["level 2 own-kernel answers"]["met"] is False
    assert t["tasks over their budget + 20 %"]["value"] == 1
    assert t["tasks run (a sample of at least 60)"]["met"] is False
    from bench.kernelbench import markdown

    page = markdown({**data, "versions": {}})
    assert "| 2 | level2/e.py | other/pointwise | none |" in page  # the stratum comes from the file name
    assert "| 3 | level3/f.py | other | error |" in page
    assert "| verified answer | 66.7% | 97.0% | missed | -30.3 points |" in page
    assert page.count("| missed |") == 6 and page.count("| met |") == 1


def test_kernelbench_sample_is_stratified_seeded_and_covers_every_stratum(tmp_path):
    """The sample draws from every stratum (one seat each, then proportionally), the same for the
    same seed, and copies into one flat folder with its manifest."""
    from bench.kernelbench import allocate, main, sample, stratum

    assert (
        stratum(1, "19_ReLU.py") == "pointwise"
        and stratum(1, "97_ScaledDotProductAttention.py") == "attention"
    )
    assert (
        stratum(1, "72_conv_transposed_3D_x.py") == "conv_transposed"
        and stratum(1, "3_Batched_matrix_multiplication.py") == "matmul"
    )
    assert (
        stratum(2, "28_BMM_InstanceNorm_Sum.py") == "gemm/norm"
        and stratum(2, "24_Conv3d_Min_Softmax.py") == "conv3d/reduce"
    )
    assert stratum(2, "26_ConvTranspose3d_Add_HardSwish.py") == "conv_transposed3d/pointwise"
    assert stratum(3, "35_LSTM.py") == "rnn" and stratum(3, "8_ResNetBasicBlock.py") == "cnn_block"
    assert allocate({"a": 10, "b": 5, "c": 1}, 4) == {"a": 2, "b": 1, "c": 1}
    assert allocate({"a": 1, "b": 1}, 5) == {"a": 1, "b": 1}
    root = tmp_path / "kb"
    names = {
        1: ["1_Matmul_x", "2_Matmul_y", "19_ReLU", "23_Softmax", "41_Max_Pooling_1D"],
        2: ["1_Gemm_ReLU"],
        3: [],
    }
    for level, files in names.items():
        (root / f"level{level}").mkdir(parents=True)
        for name in files:
            (root / f"level{level}" / f"{name}.py").write_text(f"# {name}\n")
    first = main(["--root", str(root), "--counts", "4,1,0", "--seed", "7", "--copy-to", str(tmp_path / "s")])
    assert first == main(["--root", str(root), "--counts", "4,1,0", "--seed", "7", "--list"])
    assert {e["stratum"] for e in first if e["level"] == 1} == {"matmul", "pointwise", "norm", "pooling"}
    copied = sorted(p.name for p in (tmp_path / "s").glob("*.py"))
    assert copied == sorted(f"{e['task']}.py" for e in first) and "l2_1_Gemm_ReLU.py" in copied
    manifest = json.loads((tmp_path / "s" / "sample.json").read_text())
    assert manifest["seed"] == 7 and len(manifest["tasks"]) == 5
    picks = {e["file"] for seed in range(20) for e in sample(root, (1, 0, 0), seed)}
    assert {"level1/1_Matmul_x.py", "level1/2_Matmul_y.py"} <= picks  # the seed picks within a stratum


TINY_RELU = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(16, 40)]


def get_init_inputs():
    return []
"""
TINY_SCALE = TINY_RELU.replace("torch.relu(x)", "torch.sigmoid(x * 2.0 + 1.0)")


def _step_failures(out: Path) -> list[tuple[str, str, str]]:
    """Each failed step of the runs under ``out`` (task, stage, message): what a failed dry run says."""
    found = []
    for report in sorted(out.glob("gpu*/runs/*/report.json")):
        for it in json.loads(report.read_text()).get("iterations") or []:
            if it.get("verdict") != "pass":
                found.append((report.parent.name, it.get("stage"), (it.get("message") or "")[:400]))
    return found


def test_kernelbench_cpu_dry_run_shards_resumes_and_writes_the_result(tmp_path, capfd):
    """The plumbing on a CPU (two tiny tasks of our own, not KernelBench): sample and copy, two shards
    at once, the result files, a second call that runs nothing, a fresh machine (no shard tables)
    that resumes from the result file, and a command with too little time left that starts nothing."""
    from bench.kernelbench import main

    root = tmp_path / "kb"
    for level, name, text in [(1, "19_ReLU", TINY_RELU), (2, "1_Gemm_Sigmoid", TINY_SCALE)]:
        (root / f"level{level}").mkdir(parents=True)
        (root / f"level{level}" / f"{name}.py").write_text(text)
    (root / "level3").mkdir()
    sample_dir, out, results = tmp_path / "sample", tmp_path / "out", tmp_path / "results"
    main(["--root", str(root), "--counts", "1,1,0", "--copy-to", str(sample_dir)])
    run = [
        "--run",
        str(sample_dir),
        "--device",
        "cpu",
        "--gpus",
        "0,1",
        "--out",
        str(out),
        "--results",
        str(results),
    ]
    run += [
        "--name",
        "dry",
        "--wall-limit",
        "580",
        "--",
        "--max-iters",
        "1",
        "--compile-modes",
        "none",
        "--quick",
    ]
    data = main(run)
    assert data["device_kind"] == "cpu" and data["clock"].startswith("cpu-wall")
    assert [(r["task"], r["level"], r["stratum"]) for r in data["rows"]] == [
        ("l1_19_ReLU", 1, "pointwise"),
        ("l2_1_Gemm_Sigmoid", 2, "gemm/pointwise"),
    ]
    assert all(r["verdict"] == "verified" for r in data["rows"]), _step_failures(out)
    assert [s["tasks"] for s in data["shards"]] == [["l1_19_ReLU"], ["l2_1_Gemm_Sigmoid"]]
    assert data["summary"]["tasks"] == 2 and data["summary"]["errored"] == []
    saved = json.loads((results / "dry.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(data["rows"], default=str))
    page = (results / "dry.md").read_text()
    assert "| 2 | level2/1_Gemm_Sigmoid.py | gemm/pointwise | verified" in page
    # where each task's seconds went, phase by phase, in the row and on the page
    relu = data["rows"][0]["phases"]
    assert relu["baseline"] and relu["golden"] and relu["final_timing"] is not None
    assert [(s["strategy"], s["verdict"]) for s in relu["steps"]] == [("fused_pointwise", "pass")]
    assert "## Where the time went" in page and "- l1_19_ReLU: baseline " in page
    assert "fused_pointwise " in page.split("- l1_19_ReLU:")[1].splitlines()[0]
    capfd.readouterr()
    again = main(run)
    assert capfd.readouterr().err.count("skipped") == 2 and again["rows"] == saved["rows"]
    shutil.rmtree(out)  # a fresh machine: only the result file came along
    fresh = main(run)
    err = capfd.readouterr().err
    assert (
        "2 finished tasks taken from" in err and err.count("skipped") == 2 and fresh["rows"] == saved["rows"]
    )
    late = main([*run[: run.index("--wall-limit")], "--wall-limit", "60", "--", "--quick"])
    assert "no task starts" in capfd.readouterr().err and late["rows"] == saved["rows"]
    assert len(late["commands"]) == 4 and late["commands"][-1].endswith("--wall-limit 60 -- --quick")


def test_run_suite_collect_stops_a_shard_still_running_at_the_deadline(tmp_path):
    """A shard that outlives the deadline is stopped (its whole process group) and the tables the
    others wrote are still collected."""
    import subprocess
    import time

    from bench.run_suite import collect

    (tmp_path / "gpu1").mkdir()
    (tmp_path / "gpu1" / "suite.json").write_text(json.dumps({"rows": [{"task": "a"}]}))
    slow = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    done = subprocess.Popen(["true"], start_new_session=True)
    t0 = time.monotonic()
    shards = collect([("0", tmp_path / "gpu0", slow), ("1", tmp_path / "gpu1", done)], deadline=t0 + 1)
    assert time.monotonic() - t0 < 15 and slow.returncode is not None and slow.returncode < 0
    assert shards == [{"rows": [{"task": "a"}], "gpu": "1"}]
    for _ in range(50):  # its background child got the signal too: gone once it has been scheduled
        if not _live_members(slow.pid):
            break
        time.sleep(0.1)
    assert _live_members(slow.pid) == []


def _live_members(pgid: int) -> list[int]:
    """Processes of a process group that are still alive (not zombies), from /proc."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def test_kernelbench_run_order_keeps_a_partial_run_stratified():
    from bench.kernelbench import run_order

    names = [f"l1_{i}_Sigmoid" for i in range(20)] + [f"l2_{i}_Gemm_ReLU" for i in range(30)]
    names += [f"l2_{i}_Conv2d_GroupNorm" for i in range(30, 40)] + [f"l3_{i}_MLP" for i in range(10)]
    order = run_order(names)
    assert sorted(order) == sorted(names)
    first = order[:14]  # a tenth of a run stopped early has every level in about its share
    assert [sum(n.startswith(f"l{k}_") for n in first) for k in (1, 2, 3)] == [4, 8, 2]
    level2 = [n for n in order if n.startswith("l2_")][:4]  # the strata of a level take turns
    assert {"Gemm" in n for n in level2} == {True, False}


def test_kernelbench_rows_of_tasks_run_again_are_not_seeded(tmp_path):
    """``--first`` re-runs a task after a fix: its old row is not handed to the shard to skip."""
    from bench.kernelbench import seed_shards

    results = tmp_path / "kb.json"
    rows = [{"task": "l1_a"}, {"task": "l2_b"}]
    results.write_text(json.dumps({"device_kind": "cuda", "rows": rows}))
    assert seed_shards(results, ["l2_b", "l1_a"], ["0"], tmp_path / "out", "cuda", frozenset({"l2_b"})) == 1
    table = json.loads((tmp_path / "out" / "gpu0" / "suite.json").read_text())
    assert [r["task"] for r in table["rows"]] == ["l1_a"]


def test_kernelbench_tasks_run_again_that_did_not_start_keep_their_rows(tmp_path):
    """A call's wall limit can end before a task of ``--first`` starts: the result keeps its earlier
    row instead of losing it (of the same GPU model only)."""
    from bench.kernelbench import earlier_rows

    results = tmp_path / "kb.json"
    rows = [{"task": "l1_a"}, {"task": "l2_b"}, {"task": "l3_gone"}]
    results.write_text(json.dumps({"device_kind": "cuda", "model": "h100-sxm", "rows": rows}))
    order = ["l1_a", "l2_b"]
    assert earlier_rows(results, order, {"l1_a"}, "cuda", "h100-sxm") == [{"task": "l2_b"}]
    assert earlier_rows(results, order, {"l1_a"}, "cuda", "h200") == []
    assert earlier_rows(tmp_path / "none.json", order, set(), "cuda", "h100-sxm") == []


def test_kernelbench_rows_of_another_gpu_model_are_not_seeded(tmp_path):
    """A multi-GPU call may land on H200s: an H100 result file's rows must not join their run."""
    from bench.kernelbench import seed_shards

    results = tmp_path / "kb.json"
    results.write_text(json.dumps({"device_kind": "cuda", "model": "h100-sxm", "rows": [{"task": "l1_a"}]}))
    out = tmp_path / "out"
    assert seed_shards(results, ["l1_a"], ["0"], out, "cuda", model="h200") == 0
    assert not (out / "gpu0" / "suite.json").exists()
    assert seed_shards(results, ["l1_a"], ["0"], out, "cuda", model="h100-sxm") == 1


def test_a_fault_of_the_crew_on_one_task_is_its_rows_error_and_the_suite_goes_on(tmp_path, monkeypatch):
    from kernelcrew.agents import run
    from kernelcrew.benchmark import run_bench

    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("a", "b"):
        shutil.copy(FIXTURES / "tasks" / "pointwise.py", suite / f"{name}.py")
    optimize = run.run_optimize

    def faulty(request, **kw):
        if request.task.stem == "a":
            raise RuntimeError("a plan the crew could not hold")
        return optimize(request, **kw)

    monkeypatch.setattr(run, "run_optimize", faulty)
    data = run_bench(suite, tmp_path / "out", device="cpu", max_iters=1, compile_modes="none", quick=True)
    rows = {r["task"]: r for r in data["rows"]}
    assert rows["a"]["status"] == "error" and not rows["a"]["verified"]
    assert rows["a"]["error"] == "internal error: RuntimeError: a plan the crew could not hold"
    assert rows["b"]["verified"], rows["b"]
