"""The prompts' sections built from a run's facts: device, history, knowledge, guidance; each capped.

Every section has a size cap in characters (about 4 characters a token): a source over its cap
keeps its head and tail around a marker line that says how much was left out, so a 225 KB best
makes a prompt of a few thousand tokens, not 58k.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

#: Characters of each section at most (about a quarter as many tokens).
CAPS = {
    "task_source": 16_000,
    "best_source": 24_000,
    "base_source": 24_000,
    "kb_source": 6_000,
    "kb_sources": 12_000,
    "history": 6_000,
    "diagnosis": 4_000,
    "user_messages": 3_000,
    "last_failure": 3_000,
    "strategies": 6_000,
    "kb_hits": 3_000,
}

#: How many of the latest steps the history lists one by one.
HISTORY_STEPS = 20

#: How many knowledge-base sources the coder sees.
KB_SOURCES = 2


def cap(text: str, limit: int, what: str) -> str:
    """``text`` if it fits ``limit`` characters, else its head and tail around a marker line."""
    if len(text) <= limit:
        return text
    head = int(limit * 0.7)
    tail = limit - head
    left_out = len(text) - head - tail
    marker = f"\n# [... {left_out} characters of {what} left out here to keep the prompt short ...]\n"
    return text[:head] + marker + text[-tail:]


def capped(name: str, text: str) -> str:
    """``text`` under the cap of section ``name``."""
    return cap(text, CAPS[name], name.replace("_", " "))


def device_facts(
    device: str, hardware: dict[str, Any], peaks: dict[str, Any] | None, versions: dict[str, Any]
) -> str:
    """The device, its peaks and the software versions, as the profiler measured them."""
    if device == "cpu" or hardware.get("device") == "cpu":
        head = (
            f"CPU ({hardware.get('name') or 'unknown'}): timings are CPU wall-clock, kernels run interpreted"
        )
    else:
        parts = [
            str(hardware.get("name") or hardware.get("model") or "unknown GPU"),
            f"architecture {hardware.get('arch') or 'unknown'}",
        ]
        if hardware.get("sm_count"):
            parts.append(f"{hardware['sm_count']} SMs")
        if hardware.get("memory_bytes"):
            parts.append(f"{hardware['memory_bytes'] / 2**30:.0f} GiB")
        if hardware.get("l2_bytes"):
            parts.append(f"L2 {hardware['l2_bytes'] / 2**20:.0f} MiB")
        head = "GPU: " + ", ".join(parts)
    lines = [head]
    if peaks:
        roofs = []
        if peaks.get("dram_gbs"):
            roofs.append(f"DRAM {peaks['dram_gbs']:.0f} GB/s")
        if peaks.get("l2_gbs"):
            roofs.append(f"L2 {peaks['l2_gbs']:.0f} GB/s")
        roofs += [f"{k} {v:g} TFLOP/s" for k, v in (peaks.get("compute") or {}).items() if v]
        if roofs:
            lines.append(f"Peaks ({peaks.get('basis') or 'unknown basis'}): " + ", ".join(roofs))
    if versions:
        lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if v))
    return "\n".join(lines)


def ncu_text(ncu: dict[str, Any] | None) -> str:
    """One line of Nsight Compute evidence: the top kernels with their throughputs and occupancy."""
    if not ncu or not ncu.get("available"):
        return ""
    summary = ncu.get("summary") or {}
    kernels = []
    for k in (summary.get("kernels") or [])[:3]:
        fields = [f"{k.get('short_name') or k.get('name')}"]
        for key, label in (
            ("duration_us", "us"),
            ("dram_pct", "% DRAM"),
            ("sm_pct", "% SM"),
            ("achieved_occupancy_pct", "% occupancy"),
            ("registers_per_thread", " regs"),
        ):
            value = k.get(key)
            if value is not None:
                fields.append(f"{value:.3g}{label}")
        kernels.append(" ".join(fields))
    return "ncu: " + "; ".join(kernels) if kernels else ""


def history(iterations: list[dict[str, Any]]) -> str:
    """The ideas tried, with their outcome: verdict, time, speedups, and Nsight Compute evidence."""
    if not iterations:
        return "none"
    lines = []
    skipped = max(0, len(iterations) - HISTORY_STEPS)
    if skipped:
        lines.append(f"({skipped} earlier steps left out)")
    for r in iterations[skipped:]:
        params = json.dumps(r.get("params") or {}, sort_keys=True)
        line = f"- step {r.get('step')}: {r.get('strategy')} {params} -> {r.get('verdict') or 'no candidate'}"
        if r.get("verdict") == "pass":
            if r.get("time_ms") is not None:
                line += f", {r['time_ms']:.4g} ms"
            if r.get("speedup_eager") is not None:
                line += f", {r['speedup_eager']:.3g}x eager"
            if r.get("speedup_compile") is not None:
                line += f", {r['speedup_compile']:.3g}x torch.compile"
            if r.get("kind"):
                line += f" ({r['kind']})"
            if r.get("new_best"):
                line += ", new best"
        elif r.get("stage") or r.get("message"):
            line += f" at {r.get('stage') or '?'}: {str(r.get('message') or '')[:200]}"
        if r.get("ncu_text"):
            line += f"; {r['ncu_text']}"
        if r.get("seconds") is not None:
            line += f" [{r['seconds']:g} s]"
        lines.append(line)
    return capped("history", "\n".join(lines))


def user_text(messages: list[str]) -> str:
    """The user's messages, newest last."""
    return capped("user_messages", "\n".join(f"- {m}" for m in messages)) if messages else "none"


def kb_sources(hits: list[dict[str, Any]], fetch: Callable[[str], dict[str, Any] | None] | None) -> str:
    """The sources of the knowledge base's best hits (``fetch`` reads one record by id)."""
    if not hits or fetch is None:
        return "none"
    blocks = []
    for hit in hits:
        if len(blocks) >= KB_SOURCES:
            break
        record = fetch(hit["id"]) if hit.get("id") else None
        source = (record or {}).get("candidate_source")
        if not source:
            continue
        blocks.append(
            f"{hit.get('line') or hit.get('strategy')}\n```python\n{capped('kb_source', source)}\n```"
        )
    return capped("kb_sources", "\n\n".join(blocks)) if blocks else "none"
