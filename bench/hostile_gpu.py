"""Hostile files and out-of-bounds kernels through the real verifier, on a GPU, in one device call.

Each hostile file of ``tests/fixtures/hostile`` runs twice through ``correctness.verify``: as a
candidate against a clean task (the candidate child) and as a task under a clean candidate (the
golden child). Then Triton candidates that read out of bounds: one unmasked at the tail (silent
without a checker: compute-sanitizer memcheck must catch it) and one far past the end (an illegal
address: the child dies, this process lives on). Last, an honest candidate, which must still pass,
with memcheck: the process and the GPU survived everything before it (and memcheck works inside the
sandbox's network namespace). A secret is put in this process's initial environment; no record may
show it. Writes ``hostile_<device>.json`` and ``.md`` to ``--out``.

    python bench/hostile_gpu.py --device cuda --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernelcrew.config import Settings  # noqa: E402
from kernelcrew.task import TaskError  # noqa: E402
from kernelcrew.tools import correctness, sandbox  # noqa: E402

HOSTILE = ROOT / "tests" / "fixtures" / "hostile"
SECRET = "kc-hostile-gpu-secret-d3adb33f"

TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2


def get_inputs():
    return [torch.randn(1823)]


def get_init_inputs():
    return []
"""

KERNEL = """import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def double_kernel(x_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs{LOAD})
    tl.store(out_ptr + offs, x * 2, mask=mask)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        double_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK_SIZE=1024)
        return out
"""
HONEST = KERNEL.replace("{LOAD}", ", mask=mask, other=0.0")
OOB_TAIL = KERNEL.replace("{LOAD}", "")  # 1823 elements, 2048 read: 225 past the end, no crash
OOB_FAR = KERNEL.replace("{LOAD}", " + (1 << 30)")  # 4 GiB past the start: an illegal address

#: hostile file -> what must be seen (a stage, or text in the message); None: only "nothing leaked".
EXPECT = {
    "import_loop.py": "timeout",
    "fork_bomb.py": "timeout",
    "allocate_100gb.py": "MemoryError",
    "read_environment.py": "parent environ: refused",
    "read_outside.py": "PermissionError",
    "write_outside.py": "PermissionError",
    "open_socket.py": "Network is unreachable",
    "print_gigabytes.py": "output",
}
#: Marks a hostile file prints only when its attack worked.
SUCCESS_MARKS = ("HOSTILE read:", "HOSTILE wrote", "HOSTILE connected", SECRET)


def verify_case(name: str, task: str, candidate: str, device: str, s: Settings) -> dict[str, Any]:
    started = time.monotonic()
    try:
        v = correctness.verify(task, candidate, device=device, settings=s, seed=11).model_dump()
        row = {
            "verdict": v["verdict"],
            "stage": v["stage"],
            "message": v["message"],
            "isolation": v["isolation"],
        }
        row["flags"] = v.get("flags", [])
    except TaskError as exc:  # the task itself was refused (its golden child failed)
        row = {"verdict": "task refused", "stage": "task", "message": str(exc), "isolation": {}}
    row["case"], row["wall_s"] = name, round(time.monotonic() - started, 1)
    return row


def judge(row: dict[str, Any], expect: str | None, verdict: str = "fail") -> dict[str, Any]:
    """Held: nothing leaked, and the verdict and message are the expected ones; a candidate that the
    static checks refused before it ran holds too (stage ``static``)."""
    text = f"{row['stage']} {row['message']}"
    leaked = [m for m in SUCCESS_MARKS if m in text]
    row["leaked"] = leaked
    row["expected"] = f"{verdict}" + (f", '{expect}' or refused before running" if expect else "")
    if verdict == "pass":
        row["held"] = not leaked and row["verdict"] == "pass"
    else:
        seen = expect is None or expect in text or row["stage"] == "static"
        row["held"] = not leaked and seen and row["verdict"] in ("fail", "task refused")
    row["message"] = row["message"][:600]
    return row


def process_limit(s: Settings) -> str:
    probe = sandbox.run(
        "kernelcrew.task:import_child", {"source": TASK, "kind": "task", "path": "t.py"}, settings=s
    )
    return probe.isolation.get("pids_limit", "unknown")


def run_all(device: str, s: Settings) -> list[dict[str, Any]]:
    rows = []
    limit = process_limit(s)
    for path in sorted(HOSTILE.glob("*.py")):
        if path.name == "fork_bomb.py" and "cgroup" not in limit and limit != "RLIMIT_NPROC":
            rows.append({"case": path.name, "held": None, "skipped": f"no process limit here: {limit}"})
            continue
        source = path.read_text()
        expect = EXPECT[path.name]
        rows.append(judge(verify_case(f"{path.name} as candidate", TASK, source, device, s), expect))
        rows.append(judge(verify_case(f"{path.name} as task", source, HONEST, device, s), expect))
    if s.compute_sanitizer:
        rows.append(judge(verify_case("triton: unmasked tail read", TASK, OOB_TAIL, device, s), "memcheck"))
    else:
        why = "a read past a tensor's end inside mapped memory is only seen by compute-sanitizer (GPU)"
        rows.append({"case": "triton: unmasked tail read", "held": None, "skipped": why})
    rows.append(judge(verify_case("triton: read 4 GiB past the end", TASK, OOB_FAR, device, s), None))
    rows.append(judge(verify_case("honest candidate afterwards", TASK, HONEST, device, s), None, "pass"))
    return rows


def environment(device: str) -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    env["compute_sanitizer"] = shutil.which("compute-sanitizer") or "not found"
    return env


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Hostile files and out-of-bounds kernels on {report['environment'].get('gpu', report['device'])}",
        "",
        f"Command: `{report['command']}`; {json.dumps(report['environment'])}",
        "",
        f"Sandbox: {json.dumps(report['isolation'])}",
        "",
        f"**{report['held']} of {report['judged']} held**, {report['skipped']} skipped.",
        "",
        "| case | held | expected | verdict | stage | message | s |",
        "|---|---|---|---|---|---|---:|",
    ]
    for r in report["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['case']} | skipped | | | | {r['skipped']} | |")
            continue
        msg = r["message"].replace("|", "\\|").replace("\n", " ")[:240]
        lines.append(
            f"| {r['case']} | {'yes' if r['held'] else '**NO**'} | {r['expected']} | {r['verdict']} "
            f"| {r['stage']} | {msg} | {r['wall_s']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--timeout", type=float, default=30.0, help="the sandbox's wall clock per child")
    args = ap.parse_args(argv)
    if os.environ.get("KC_HOSTILE_SECRET") != SECRET:  # in the initial environment: /proc/PID/environ
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "KC_HOSTILE_SECRET": SECRET})
    memcheck = args.device == "cuda" and shutil.which("compute-sanitizer") is not None
    s = Settings(sandbox_timeout_s=args.timeout, sandbox_memory_mb=16384, compute_sanitizer=memcheck)
    started = time.monotonic()
    rows = run_all(args.device, s)
    judged = [r for r in rows if r.get("held") is not None]
    report = {
        "command": " ".join(["python", *sys.argv]),
        "device": args.device,
        "environment": environment(args.device),
        "isolation": next((r["isolation"] for r in judged if r.get("isolation")), {}),
        "wall_s": round(time.monotonic() - started, 1),
        "held": sum(bool(r["held"]) for r in judged),
        "judged": len(judged),
        "skipped": len(rows) - len(judged),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"hostile_{args.device}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"hostile_{args.device}.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["held"] == report["judged"] else 1


if __name__ == "__main__":
    sys.exit(main())
