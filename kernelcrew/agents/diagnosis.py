"""The profiler agent's reading: what bounds the module, the few metrics that show it, the floor and
the gap, and the remedies that fit. It is what the planner reads.

Rules, in order, on the subject's measurements (the best verified candidate once it has Nsight
Compute records, else the reference):

* **launch overhead**: the GPU is busy for less than half of the measured call (kernel time from
  Nsight Compute or torch.profiler against the CUDA-event time);
* **memory**: DRAM (or the memory hierarchy) runs at >= 60% of its peak and above the SMs;
* **compute**: the SMs or the tensor pipe run at >= 60% of peak;
* **latency**: neither is busy: too little parallelism, or warps waiting on something;
* without Nsight Compute, the roofline predicts memory or compute from the task's arithmetic
  intensity and says that it is a prediction.

The remedies come from the metrics (spills, occupancy limits, the top stall reason, traffic above
the compulsory bytes, an idle tensor pipe), so two kernels with different problems read differently.
With an LLM configured the planner gets this reading and ranks the remedies itself.
"""

from __future__ import annotations

from typing import Any

from kernelcrew.records import Baseline

BUSY_FLOOR = 0.5
HIGH = 60.0


def _metric(name: str, value: Any, unit: str, meaning: str) -> dict[str, Any]:
    return {"metric": name, "value": value, "unit": unit, "meaning": meaning}


def assess(
    baseline: Baseline,
    subject_ncu: dict[str, Any] | None = None,
    time_ms: float | None = None,
    subject: str = "reference",
) -> dict[str, Any]:
    """The bound class, evidence, floor, gap and remedies of ``subject`` (the reference by default)."""
    floor = baseline.floor or {}
    ncu = subject_ncu if subject_ncu is not None else baseline.ncu
    summary = ncu.get("summary") if ncu.get("available") else None
    time_ms = time_ms if time_ms is not None else baseline.eager_ms
    if baseline.clock == "cpu-wall":
        time_ms = None  # CPU wall clock against a GPU floor means nothing
    floor_ms = floor.get("floor_ms")
    out: dict[str, Any] = {
        "subject": subject,
        "time_ms": time_ms,
        "floor_ms": floor_ms,
        "floor_bound": floor.get("bound"),
        "sol_fraction": floor_ms / time_ms if floor_ms and time_ms else None,
        "metrics_source": "nsight compute" if summary else "timing + torch.profiler + roofline",
        "ncu_reason": None if summary else ncu.get("reason"),
    }
    if out["sol_fraction"]:
        out["gap_x"] = 1 / out["sol_fraction"]
    evidence: list[dict[str, Any]] = []
    remedies: list[str] = []
    kernel_us = summary["kernel_time_us"] if summary else _profiler_kernel_us(baseline, subject)
    busy = kernel_us / (time_ms * 1e3) if kernel_us and time_ms else None
    launches = summary.get("launches_per_call") if summary else _profiler_launches(baseline, subject)

    if busy is not None and busy < BUSY_FLOOR:
        bound = "launch overhead"
        evidence.append(
            _metric("gpu_busy", round(busy, 3), "fraction", "share of the call the GPU spends in kernels")
        )
        if launches:
            evidence.append(
                _metric("launches_per_call", launches, "kernels", "each costs a few us to launch")
            )
        remedies += [
            f"fuse the {launches:g} kernels of a call into fewer" if launches and launches > 1 else "",
            "capture the forward in a CUDA graph (one launch for the whole call)",
            "torch.compile with mode='reduce-overhead' as a baseline to beat",
        ]
    elif summary:
        bound = _bound_from_ncu(summary)
        evidence += _ncu_evidence(summary, bound)
        remedies += _ncu_remedies(summary, bound, floor, baseline)
    elif floor.get("floor_ms"):
        bound = floor["bound"]
        out["predicted"] = True
        evidence.append(
            _metric(
                "arithmetic_intensity",
                round(floor["intensity"], 3) if floor.get("intensity") is not None else None,
                "flop/byte",
                f"ridge point of this device: {floor.get('ridge', 0):.1f} flop/byte",
            )
        )
        remedies += _roofline_remedies(floor, baseline)
    else:
        bound = "unknown"
        remedies.append("no GPU metrics here: run on a GPU (with ncu) for a measured diagnosis")
    if busy is not None and not any(e["metric"] == "gpu_busy" for e in evidence):
        evidence.append(_metric("gpu_busy", round(busy, 3), "fraction", "share of the call in kernels"))
    if out["sol_fraction"]:
        evidence.append(
            _metric(
                "sol_fraction",
                round(out["sol_fraction"], 3),
                "fraction",
                f"floor {floor_ms:.4g} ms ({floor.get('bound')}-bound) over measured {time_ms:.4g} ms",
            )
        )
    out.update(bound=bound, evidence=evidence[:5], remedies=[r for r in dict.fromkeys(remedies) if r][:5])
    return out


def _profiler_kernel_us(baseline: Baseline, subject: str) -> float | None:
    if subject != "reference" or not str(baseline.hotspot_clock or "").startswith("cuda"):
        return None
    return sum(h.time_us for h in baseline.hotspots) or None


def _profiler_launches(baseline: Baseline, subject: str) -> float | None:
    if subject != "reference" or not str(baseline.hotspot_clock or "").startswith("cuda"):
        return None
    return sum(h.calls for h in baseline.hotspots) or None


def _bound_from_ncu(s: dict[str, Any]) -> str:
    dram = s.get("dram_pct") or 0.0
    mem = max(dram, s.get("memory_pct") or 0.0)
    sm = max(s.get("sm_pct") or 0.0, s.get("tensor_pct") or 0.0)
    if mem >= HIGH and mem >= sm:
        return "memory"
    if sm >= HIGH:
        return "compute"
    return "latency"


def _ncu_evidence(s: dict[str, Any], bound: str) -> list[dict[str, Any]]:
    ev = []
    if s.get("dram_pct") is not None:
        ev.append(_metric("dram_throughput", round(s["dram_pct"], 1), "% of peak", "DRAM bandwidth in use"))
    if s.get("sm_pct") is not None:
        ev.append(_metric("sm_throughput", round(s["sm_pct"], 1), "% of peak", "busiest SM pipeline"))
    if bound == "compute" and s.get("tensor_pct") is not None:
        ev.append(_metric("tensor_pipe", round(s["tensor_pct"], 1), "% active", "tensor-core utilization"))
    occupancy = s.get("achieved_occupancy_pct")
    if occupancy is not None and (bound == "latency" or occupancy < 30):
        ev.append(_metric("achieved_occupancy", round(occupancy, 1), "%", "warps resident per SM"))
    if s.get("top_stalls"):
        top = s["top_stalls"][0]
        ev.append(
            _metric(
                "top_stall",
                f"{top['reason']} ({(top.get('share') or 0):.0%})",
                "of stall cycles",
                STALL_MEANING.get(top["reason"], "warps waiting"),
            )
        )
    if s.get("spills"):
        ev.append(_metric("spills", s["spills"], "local ld/st per call", "registers spilled to local memory"))
    return ev


STALL_MEANING = {
    "long_scoreboard": "waiting on global/local memory loads",
    "short_scoreboard": "waiting on shared memory or special-function results",
    "barrier": "waiting at __syncthreads / tl.debug_barrier",
    "mio_throttle": "memory-instruction queue full (shared memory or many small accesses)",
    "lg_throttle": "global/local load-store queue full (many narrow accesses)",
    "math_pipe_throttle": "a math pipe is saturated",
    "wait": "fixed-latency dependencies",
    "not_selected": "eligible warps not picked (plenty of parallelism)",
    "no_instruction": "instruction cache misses or branch targets",
    "gmma": "waiting on warpgroup matrix-multiply (wgmma)",
    "drain": "waiting for memory stores to drain at exit",
}


def _ncu_remedies(s: dict[str, Any], bound: str, floor: dict[str, Any], baseline: Baseline) -> list[str]:
    rem: list[str] = []
    dram_bytes = s.get("dram_bytes")
    must = floor.get("bytes")
    if dram_bytes and must and dram_bytes > 1.3 * must:
        rem.append(
            f"the kernels move {dram_bytes / 1e6:.1f} MB per call against {must / 1e6:.1f} MB compulsory: "
            f"fusing producers into consumers can cut DRAM traffic {dram_bytes / must:.1f}x"
        )
    if s.get("launches_per_call", 1) > 1 and bound == "memory":
        rem.append(f"{s['launches_per_call']:g} kernels per call each read and write DRAM: one fused pass")
    if bound == "memory":
        rem.append("keep one pass over memory: vectorized (128-bit) loads and stores, no re-reads of inputs")
    if bound == "compute":
        tensor = s.get("tensor_pct") or 0.0
        if floor.get("matmul_flops") and tensor < 10:
            if floor.get("compute_class") == "fp32":
                rem.append(
                    "matmuls run on FP32 SIMT units (tensor pipe idle): three TF32 tensor-core products "
                    "per term (TF32x3) keep float32 accuracy; plain TF32 or bf16 need --precision relaxed"
                )
            else:
                rem.append("matmuls do not use the tensor cores: a tensor-core (tl.dot) kernel")
        rem.append("fuse the epilogue (bias, activation, residual) into the matmul so it costs no extra pass")
        rem.append("autotune tile sizes (BLOCK_M/N/K, warps, stages) for this shape")
    occ = s.get("achieved_occupancy_pct")
    kernels = s.get("kernels") or []
    regs = max((k.get("registers_per_thread") or 0 for k in kernels), default=0)
    waves = min((k.get("waves_per_sm") or 99 for k in kernels[:1]), default=99)
    if occ is not None and occ < 30:
        if regs >= 128:
            rem.append(
                f"{regs:.0f} registers/thread limit occupancy: smaller tiles or fewer values per thread"
            )
        elif waves < 1:
            rem.append(f"{waves:.2f} waves per SM: the grid is too small to fill the GPU; split the work")
        else:
            rem.append("low occupancy: more blocks in flight (smaller BLOCK, fewer warps per block)")
    if s.get("spills"):
        rem.append("registers spill to local memory: reduce BLOCK or the values kept live per thread")
    stall = (s.get("top_stalls") or [{}])[0].get("reason")
    if stall == "long_scoreboard" and bound != "memory":
        rem.append("loads stall the warps: more loads in flight (num_stages, software pipelining)")
    elif stall == "barrier":
        rem.append("warps wait at barriers: fewer synchronizations per tile, or larger work per barrier")
    elif stall in ("mio_throttle", "lg_throttle"):
        rem.append("memory instruction queues are full: wider accesses (vectorize), fewer shared-memory ops")
    if bound == "latency":
        rem.append("neither memory nor compute is busy: more independent work per SM (parallelism)")
    return rem


def _roofline_remedies(floor: dict[str, Any], baseline: Baseline) -> list[str]:
    if floor.get("bound") == "memory":
        return [
            "memory-bound by arithmetic intensity: fuse the ops into one pass so each byte moves once",
            "vectorized loads and stores; no intermediate tensors in DRAM",
        ]
    return [
        "compute-bound by arithmetic intensity: keep the matmuls on tensor cores and fuse the epilogue",
        "autotune tile sizes for this shape",
    ]


def render(a: dict[str, Any], baseline: Baseline | None = None, best_line: str = "") -> str:
    """The reading as a few lines of text for the planner's prompt (numbers, not adjectives)."""
    how = "predicted from the arithmetic intensity" if a.get("predicted") else a["metrics_source"]
    lines = [f"{a['subject']}: {a['bound']}-bound ({how})"]
    for e in a["evidence"]:
        lines.append(f"- {e['metric']} = {e['value']} {e['unit']}: {e['meaning']}")
    if a.get("floor_ms") and a.get("time_ms"):
        lines.append(
            f"speed of light: floor {a['floor_ms']:.4g} ms ({a.get('floor_bound')}-bound), measured "
            f"{a['time_ms']:.4g} ms = {a['sol_fraction']:.0%} of the floor, {a.get('gap_x', 0):.1f}x to gain at most"
        )
    if a.get("ncu_reason"):
        lines.append(f"no Nsight Compute metrics: {a['ncu_reason']}")
    if a["remedies"]:
        lines.append("remedies that fit:")
        lines += [f"  {i}. {r}" for i, r in enumerate(a["remedies"], 1)]
    if best_line:
        lines.append(best_line)
    return "\n".join(lines)
