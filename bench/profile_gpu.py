"""GPU evidence for the profiler: calibration, Nsight Compute, floors and speed of light.

Calibrates the GPU once (copy bandwidth, L2, matmul rates), then for each example runs
``kernelcrew profile`` on the reference and on its best candidate: the hand-written Triton kernel
where the example ships one, else the playbook strategy that ``bench/optimize_gpu.py`` found best
on this GPU (bench/results/optimize_h100.json). Writes ``profile_h100.json`` and ``.md`` to the
folder given; rows already there are kept, so the script can run in shards (``--tasks``).

    python bench/profile_gpu.py [OUT_DIR] [--tasks a,b] [--compile-modes default]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ["elementwise_chain", "softmax", "layer_norm", "matmul_epilogue", "conv_block", "swish_residual"]
HAND_WRITTEN = {"elementwise_chain": "elementwise_chain_triton.py", "softmax": "softmax_triton.py"}


def best_candidate(name: str, tmp: Path) -> tuple[Path, str]:
    """The candidate file to profile and where it came from."""
    if name in HAND_WRITTEN:
        return ROOT / "examples" / HAND_WRITTEN[name], "hand-written Triton (examples/)"
    from kernelcrew.agents import playbook

    rows = json.loads((ROOT / "bench" / "results" / "optimize_h100.json").read_text())["rows"]
    strategy = next((r.get("strategy") for r in rows if r["task"] == name and r.get("strategy")), None)
    task_source = (ROOT / "examples" / f"{name}.py").read_text()
    analysis = playbook.analyze(task_source, f"examples/{name}.py", 0)
    if strategy is None:
        applicable = [s.name for s, _ in playbook.applicable(analysis)]
        strategy = "fused_pointwise" if "fused_pointwise" in applicable else "torch_compile"
    path = tmp / f"{name}_{strategy}.py"
    path.write_text(playbook.generate(strategy, task_source, analysis))
    return path, f"playbook {strategy}"


def compact(report: dict, origin: str, wall: float) -> dict:
    def ncu_part(result: dict | None) -> dict | None:
        if not result:
            return None
        if not result.get("available"):
            return {"available": False, "reason": result.get("reason")}
        s = dict(result["summary"])
        s["kernels"] = [{k: v for k, v in kern.items() if k != "name"} for kern in s["kernels"][:6]]
        return {
            "available": True,
            "version": result.get("version"),
            "clock_control": result.get("clock_control"),
            **s,
        }

    return {
        "task": Path(report["task"]).stem,
        "candidate": origin,
        "candidate_verdict": report.get("candidate_verdict"),
        "work": report["work"],
        "floor": report["floor"],
        "timing": report["timing"],
        "sol_fraction": report["sol_fraction"],
        "hotspots": report["hotspots"][:5],
        "ncu_reference": ncu_part(report["ncu"]["reference"]),
        "ncu_candidate": ncu_part(report["ncu"]["candidate"]),
        "diagnosis_reference": report["diagnosis"]["reference"],
        "diagnosis_candidate": report["diagnosis"]["candidate"],
        "wall_s": round(wall, 1),
    }


def fmt(v, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def markdown(data: dict) -> str:
    hw, v, cal = data["hardware"], data["versions"], data["calibration"]
    m = cal["measured"]
    lines = [
        "# kernelcrew profile on the GPU: Nsight Compute, floors, speed of light",
        "",
        f"Device: {hw['name']} ({hw['model']}, {hw['arch']}); torch {v.get('torch')}, Triton {v.get('triton')}, "
        f"CUDA {v.get('cuda')}, ncu {data.get('ncu_version')}. Produced by `{data['command']}`.",
        "",
        "## Calibration (measured on this GPU, median of repeated runs; max in brackets)",
        "",
        "| figure | measured | datasheet |",
        "|---|---|---|",
        f"| DRAM copy bandwidth | {fmt(m['dram_gbs'], '.0f')} GB/s [{fmt(cal['spread']['dram_gbs']['max'], '.0f')}] "
        f"| {data['datasheet']['dram_gbs']} GB/s |",
        f"| L2 read bandwidth | {fmt(m.get('l2_gbs'), '.0f')} GB/s [{fmt(cal['spread'].get('l2_gbs', {}).get('max'), '.0f')}] "
        "| not published |",
    ]
    for klass, value in m["compute"].items():
        sheet = data["datasheet"]["compute"].get(klass)
        lines.append(
            f"| {klass} matmul | {fmt(value, '.1f')} TFLOP/s [{fmt(cal['spread'][klass]['max'], '.1f')}] | "
            f"{fmt(sheet, '.1f')} TFLOP/s |"
        )
    lines += [
        "",
        f"Methods: {json.dumps(cal['method'])}",
        "",
        "## Per task (floor from the calibrated peaks; times are CUDA-event medians, interleaved)",
        "",
        "| task | candidate | floor ms (bound) | eager ms | compile ms | candidate ms | SOL eager | SOL compile | SOL candidate "
        "| diagnosis (reference -> candidate) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['task']} | error: {r['error'][:150]} |||||||||")
            continue
        t, f, sol = r["timing"], r["floor"], r["sol_fraction"]
        comp = min(t["compile_ms"].values()) if t["compile_ms"] else None
        sol_c = max((v for k, v in sol.items() if k.startswith("compile:") and v), default=None)
        dc = r.get("diagnosis_candidate") or {}
        lines.append(
            f"| {r['task']} | {r['candidate']} | {fmt(f.get('floor_ms'))} ({f.get('bound')}) | {fmt(t['eager_ms'])} | "
            f"{fmt(comp)} | {fmt(t['candidate_ms'])} | {fmt(sol['eager'], '.0%')} | {fmt(sol_c, '.0%')} | "
            f"{fmt(sol.get('candidate'), '.0%')} | {r['diagnosis_reference']['bound']} -> {dc.get('bound', '-')} |"
        )
    lines += ["", "## Nsight Compute, reference vs candidate (per forward call)", ""]
    lines += [
        "| task | kernels | kernel time us | DRAM MB | DRAM % | SM % | tensor % | occupancy % | top stall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        for who in ("reference", "candidate"):
            n = r.get(f"ncu_{who}")
            if not n:
                continue
            if not n.get("available"):
                lines.append(f"| {r['task']} {who} | ncu unavailable: {n.get('reason')} ||||||||")
                continue
            stall = (n.get("top_stalls") or [{}])[0]
            lines.append(
                f"| {r['task']} {who} | {fmt(n['launches_per_call'], 'g')} | {fmt(n['kernel_time_us'], '.1f')} | "
                f"{fmt((n['dram_bytes'] or 0) / 1e6, '.1f')} | {fmt(n['dram_pct'], '.1f')} | {fmt(n['sm_pct'], '.1f')} | "
                f"{fmt(n['tensor_pct'], '.1f')} | {fmt(n['achieved_occupancy_pct'], '.1f')} | "
                f"{stall.get('reason', '-')} {fmt(stall.get('share'), '.0%')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    from kernelcrew.cli import Device, run_profile
    from kernelcrew.tools import hardware, ncu, roofline

    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--compile-modes", default="default")
    parser.add_argument("--calibrate", action="store_true", help="Measure the GPU again, even if stored.")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "profile_h100.json"
    hw = hardware.detect("cuda").to_dict()
    earlier = ROOT / "bench" / "results" / json_path.name  # shards before this one, committed
    source = json_path if json_path.exists() else earlier
    previous = json.loads(source.read_text()) if source.exists() else {}
    if not args.calibrate and (previous.get("calibration") or {}).get("model") == hw["model"]:
        # Earlier shards' floors used that calibration: keep using it (a fresh machine has none stored).
        path = roofline.calibration_path(hw["model"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(previous["calibration"]))
    stored = None if args.calibrate else roofline.load_calibration(hw["model"])
    calibration = stored or roofline.calibrate(hw)
    print("calibration:", json.dumps(calibration["measured"]), flush=True)
    rows = {r["task"]: r for r in previous.get("rows", [])}
    tmp = Path(tempfile.mkdtemp(prefix="kc-bench-"))
    for name in args.tasks.split(","):
        started = time.monotonic()
        try:
            cand, origin = best_candidate(name, tmp)
            report = run_profile(
                ROOT / "examples" / f"{name}.py",
                cand,
                device=Device.cuda,
                precision="strict",
                seed=1,
                compile_modes=args.compile_modes,
            )
            rows[name] = compact(report, origin, time.monotonic() - started)
        except Exception as exc:  # one task's failure is a row, not the end of the run
            rows[name] = {
                "task": name,
                "error": f"{type(exc).__name__}: {exc}",
                "wall_s": time.monotonic() - started,
            }
        print(
            name,
            json.dumps({k: rows[name].get(k) for k in ("sol_fraction", "timing", "wall_s", "error")}),
            flush=True,
        )
        data = {
            "hardware": hw,
            "versions": hardware.versions(),
            "ncu_version": ncu.ncu_version(),
            "calibration": calibration,
            "datasheet": roofline.DATASHEET.get(hw["model"]),
            "command": f"python bench/profile_gpu.py --tasks {args.tasks} --compile-modes {args.compile_modes}"
            + (" --calibrate" if args.calibrate else "")
            + (
                f" (merged with earlier shards: {', '.join(sorted(set(rows) - set(args.tasks.split(','))))})"
                if set(rows) - set(args.tasks.split(","))
                else ""
            ),
            "rows": [rows[t] for t in TASKS if t in rows],
        }
        json_path.write_text(json.dumps(data, indent=2, default=str))
        (out_dir / "profile_h100.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
