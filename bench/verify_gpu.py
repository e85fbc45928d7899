"""GPU evidence for the verifier and timer, in one device call.

Runs ``kernelcrew verify --json`` on the examples' Triton candidates, on a CUDA C++ candidate
(with compute-sanitizer memcheck), and on cheating candidates that must fail on the GPU too; then
times one candidate twice to measure the timer's repeatability. Writes ``verify_h100.json`` and
``verify_h100.md`` to the folder given (default bench/results).

    python bench/verify_gpu.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    # name, task, candidate, extra options, expected verdict
    (
        "elementwise_chain / triton",
        "examples/elementwise_chain.py",
        "examples/elementwise_chain_triton.py",
        [],
        "pass",
    ),
    ("softmax / triton", "examples/softmax.py", "examples/softmax_triton.py", [], "pass"),
    (
        "elementwise_chain / cuda c++",
        "examples/elementwise_chain.py",
        "examples/elementwise_chain_cuda.py",
        ["--memcheck", "--compile-modes", "default"],
        "pass",
    ),
    (
        "cheat: partial write",
        "tests/fixtures/tasks/softmax.py",
        "tests/fixtures/candidates/partial_write.py",
        [],
        "fail",
    ),
    (
        "cheat: cache by pointer",
        "tests/fixtures/tasks/softmax.py",
        "tests/fixtures/candidates/cache_by_ptr.py",
        [],
        "fail",
    ),
    (
        "cheat: one shape",
        "tests/fixtures/tasks/softmax.py",
        "tests/fixtures/candidates/hardcoded_shape.py",
        [],
        "fail",
    ),
    ("cheat: zeros", "tests/fixtures/tasks/softmax.py", "tests/fixtures/candidates/zeros.py", [], "fail"),
]
REPEAT = (
    "elementwise_chain / triton",
    "examples/elementwise_chain.py",
    "examples/elementwise_chain_triton.py",
)


def run_verify(task: str, candidate: str, extra: list[str], timeout: int = 420) -> tuple[dict, float]:
    cmd = [
        sys.executable,
        "-m",
        "kernelcrew",
        "verify",
        task,
        candidate,
        "--device",
        "cuda",
        "--json",
        *extra,
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    try:
        return json.loads(proc.stdout), wall
    except json.JSONDecodeError:
        return {"verdict": "error", "stage": "harness", "message": (proc.stderr or proc.stdout)[-2000:]}, wall


def summarize(name: str, report: dict, wall: float, expected: str) -> dict:
    timing = report.get("timing") or {}
    results = timing.get("results", {})

    def spread(key: str) -> float | None:
        return results.get(key, {}).get("spread_pct")

    return {
        "case": name,
        "expected": expected,
        "verdict": report.get("verdict"),
        "stage": report.get("stage"),
        "message": report.get("message"),
        "kind": report.get("kind"),
        "max_rel_error": report.get("max_rel_error"),
        "eager_ms": report.get("baseline_ms"),
        "eager_spread_pct": spread("eager"),
        "compile_ms": report.get("compile_ms"),
        "compile_results": {k: v for k, v in results.items() if k.startswith("compile:")},
        "compile_s": report.get("compile_s"),
        "candidate_ms": report.get("candidate_ms"),
        "candidate_spread_pct": spread("candidate"),
        "candidate_wall_ms": results.get("candidate", {}).get("wall_median_ms"),
        "speedup_vs_eager": report.get("speedup"),
        "speedup_ci": report.get("speedup_ci"),
        "speedup_vs_compile": report.get("speedup_vs_compile"),
        "flags": report.get("flags"),
        "checks": [{"name": c["name"], "passed": c["passed"]} for c in report.get("checks", [])],
        "wall_s": round(wall, 1),
        "seed": report.get("seed"),
        "isolation": report.get("isolation"),
    }


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, env_report = [], {}
    for name, task, cand, extra, expected in CASES:
        report, wall = run_verify(task, cand, extra)
        env_report = env_report or {k: report.get(k) for k in ("versions", "gpu")}
        rows.append(summarize(name, report, wall, expected))
        (out_dir / "verify_h100.partial.json").write_text(json.dumps({"rows": rows, **env_report}, indent=2))
        print(
            f"{name}: {report.get('verdict')} ({report.get('stage')}) in {wall:.0f} s: {str(report.get('message'))[:160]}"
        )
        sys.stdout.flush()

    # Repeatability: the same candidate timed in two separate runs (fresh processes, fresh seeds).
    runs = []
    for _ in range(2):
        report, _wall = run_verify(REPEAT[1], REPEAT[2], ["--compile-modes", "none"])
        runs.append(report)
    medians = [r.get("candidate_ms") for r in runs]
    eager = [r.get("baseline_ms") for r in runs]
    repeat = {
        "case": REPEAT[0],
        "candidate_ms": medians,
        "eager_ms": eager,
        "candidate_diff_pct": (
            abs(medians[0] - medians[1]) / statistics.mean(medians) * 100 if all(medians) else None
        ),
        "eager_diff_pct": abs(eager[0] - eager[1]) / statistics.mean(eager) * 100 if all(eager) else None,
        "within_run_spread_pct": [
            (r.get("timing") or {}).get("results", {}).get("candidate", {}).get("spread_pct") for r in runs
        ],
    }
    data = {
        "device": (env_report.get("gpu") or {}).get("name"),
        "gpu": env_report.get("gpu"),
        "versions": env_report.get("versions"),
        "command": "python bench/verify_gpu.py",
        "rows": rows,
        "repeatability": repeat,
        "all_as_expected": all(r["verdict"] == r["expected"] for r in rows),
    }
    (out_dir / "verify_h100.json").write_text(json.dumps(data, indent=2))
    (out_dir / "verify_h100.md").write_text(markdown(data))
    print(markdown(data))


def fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def markdown(data: dict) -> str:
    v = data.get("versions") or {}
    lines = [
        "# verify on the GPU",
        "",
        f"Device: {data.get('device')}; torch {v.get('torch')}, Triton {v.get('triton')}, CUDA {v.get('cuda')}, "
        f"driver {v.get('driver')}, Python {v.get('python')}. Produced by `{data['command']}`.",
        "Times are medians of CUDA-event timings (interleaved, L2 flushed); spread = (p90 - p10) / median.",
        f"Sandbox: {(data['rows'][0].get('isolation') or {})}.",
        "",
        "| case | verdict (stage) | kind | eager ms (spread %) | compile ms | candidate ms (spread %) "
        "| speedup vs eager [95% CI] | vs compile | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        ci = r.get("speedup_ci")
        speed = f"{fmt(r['speedup_vs_eager'])} [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "-"
        lines.append(
            f"| {r['case']} | {r['verdict']} ({r['stage']}) | {fmt(r['kind'])} | {fmt(r['eager_ms'])} "
            f"({fmt(r['eager_spread_pct'], 2)}) | {fmt(r['compile_ms'])} | {fmt(r['candidate_ms'])} "
            f"({fmt(r['candidate_spread_pct'], 2)}) | {speed} | {fmt(r['speedup_vs_compile'])} | {r['wall_s']} |"
        )
    rep = data["repeatability"]
    lines += [
        "",
        "Failures of the cheating candidates:",
        "",
        *[
            f"- {r['case']}: {r['stage']}: {str(r['message'])[:200]}"
            for r in data["rows"]
            if r["expected"] == "fail"
        ],
        "",
        "Checks and flags of the passing candidates:",
        "",
        *[
            f"- {r['case']}: "
            + ", ".join(f"{c['name']}={c['passed']}" for c in r["checks"])
            + (f"; flags: {r['flags']}" if r["flags"] else "")
            for r in data["rows"]
            if r["expected"] == "pass"
        ],
        "",
        f"Repeatability ({rep['case']}, two separate runs): candidate {fmt(rep['candidate_ms'][0])} and "
        f"{fmt(rep['candidate_ms'][1])} ms ({fmt(rep['candidate_diff_pct'], 2)} % apart); eager "
        f"{fmt(rep['eager_ms'][0])} and {fmt(rep['eager_ms'][1])} ms ({fmt(rep['eager_diff_pct'], 2)} % apart); "
        f"within-run spread {rep['within_run_spread_pct']} %.",
        "",
        f"All verdicts as expected: {data['all_as_expected']}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
