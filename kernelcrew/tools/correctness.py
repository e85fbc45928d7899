"""The verification protocol: does a candidate compute the task's function, on inputs it never saw?

:func:`verify` runs, in order:

1. static checks of task and candidate (no code runs): bad files are ``TaskError`` (exit code 2);
2. the anti-cheat rules on the candidate's source (:mod:`kernelcrew.tools.anticheat`);
3. a golden child (sandboxed, before any candidate code exists anywhere): fresh inputs from
   ``get_inputs()`` under at least 5 seeds derived from a per-run secret seed, every
   ``get_test_inputs()`` set, signed variants of non-negative inputs where the reference stays
   finite, magnitude-scaled variants (x100, x1e-3) where it stays finite and PyTorch's own output
   stays well inside the tolerance;
   the reference in ``.eval()`` with constant parameters randomized, run in float64 on the device
   (golden) and in its own dtype (native, to measure PyTorch's own error);
4. a candidate child (sandboxed, separate directory, no golden outputs in reach): build, weights by
   state dict (or ``ModelNew.load_reference``), every input set with memory poisoned with NaN,
   global state and inputs checked around every call, the same inputs twice, and the caching
   sequence A, B, A at a new address, B's data at A's address;
5. the judgement here, in the parent: every output against the golden by the pass rule below (a
   large output of a re-check call at random positions the child drew after the call returned,
   :func:`harness.sample_outputs`).

Pass rule, per output: exact dtype and shape; every element judged against the float64 golden:
NaN only where it is NaN, Inf only where it is that Inf or beyond the dtype's range with that sign,
every finite value within ``atol + rtol*|golden|`` with ``atol`` scaled to the RMS of the
representable goldens (or twice PyTorch's own error at that element; or, when every element over
that is off by no more than PyTorch's own largest error on the output, that); and relative L2
error within ``max(floor, 4 x PyTorch's own error)``. PyTorch's own output is only that measure,
never a licence. Integer and boolean outputs must match exactly.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcrew.config import Settings, get_settings
from kernelcrew.records import Verdict
from kernelcrew.task import TaskError, check_source
from kernelcrew.tools import sandbox
from kernelcrew.tools.anticheat import static_check
from kernelcrew.tools.packaging import unpack

MATMUL_OPS = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "convolution",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "cudnn_convolution",
        "mkldnn_convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "scaled_dot_product_attention",
        "einsum",
        "_efficient_attention_forward",
    }
)


@dataclass(frozen=True)
class Tolerance:
    """Thresholds of the pass rule for one output."""

    rtol: float
    atol_rms: float
    l2_floor: float
    exact: bool = False


#: (dtype class, op class or policy) -> (rtol, atol x RMS, L2 floor).
TOLERANCES: dict[tuple[str, str], tuple[float, float, float]] = {
    ("fp32", "strict"): (1e-4, 1e-4, 1e-5),
    ("fp32", "relaxed"): (5e-3, 5e-3, 2e-3),
    ("fp16", "pointwise"): (2e-3, 2e-3, 1e-3),
    ("fp16", "matmul"): (1e-2, 1e-2, 5e-3),
    ("bf16", "pointwise"): (1.6e-2, 1.6e-2, 8e-3),
    ("bf16", "matmul"): (2e-2, 2e-2, 1e-2),
}


def tolerance_for(dtype: str, op_class: str, policy: str) -> Tolerance:
    """The thresholds for an output of ``dtype`` from a reference of ``op_class`` under ``policy``."""
    if dtype in ("float32", "float64", "complex64", "complex128"):
        return Tolerance(*TOLERANCES[("fp32", policy)])
    if dtype == "float16":
        return Tolerance(*TOLERANCES[("fp16", op_class)])
    if dtype == "bfloat16":
        return Tolerance(*TOLERANCES[("bf16", op_class)])
    if dtype.startswith("float8"):
        return Tolerance(*TOLERANCES[("bf16", "matmul")])
    return Tolerance(0.0, 0.0, 0.0, exact=True)


def op_class(reference_ops: dict[str, int]) -> str:
    """``matmul`` when the reference runs a matmul, convolution or attention op, else ``pointwise``."""
    return "matmul" if set(reference_ops) & MATMUL_OPS else "pointwise"


@dataclass
class Failure:
    """A structured verification failure the coder can act on."""

    stage: str
    message: str
    input_set: dict[str, Any] | None = None
    output_index: int | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    first_bad_index: list[int] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, {}, [])}


def compare_output(
    cand: Any, golden: Any, native: Any, tol: Tolerance, pool: Any = None, native_allowance: bool = True
) -> dict[str, Any]:
    """Judge one output tensor; returns metrics and ``ok`` (and ``stage``/``message`` when not ok).

    Every element is judged against the float64 golden; ``native`` (the reference in its own
    dtype) sets how much relative L2 error PyTorch itself makes, and lets an element be as wrong
    as twice PyTorch's own finite error at it (unless ``native_allowance`` is off: how much of the
    tolerance PyTorch's own output uses is measured without it). A large output is judged in ranges
    on ``pool`` (an executor) when one is given.
    """
    import torch

    result: dict[str, Any] = {"ok": False}
    if not isinstance(cand, torch.Tensor):
        return {**result, "stage": "dtype", "message": f"output is a {type(cand).__name__}, not a tensor"}
    if tuple(cand.shape) != tuple(native.shape):
        return {
            **result,
            "stage": "shape",
            "message": f"shape {tuple(cand.shape)} but the reference gives {tuple(native.shape)}",
        }
    if cand.dtype != native.dtype:
        return {
            **result,
            "stage": "dtype",
            "message": f"dtype {str(cand.dtype).replace('torch.', '')} but the reference gives "
            f"{str(native.dtype).replace('torch.', '')}",
        }
    if tol.exact or not (cand.is_floating_point() or cand.is_complex()):
        equal = cand.to(golden.device) == golden.to(cand.dtype)
        bad = (~equal).nonzero()
        if len(bad):
            idx = bad[0].tolist()
            return {
                **result,
                "stage": "correctness",
                "message": f"{len(bad)} of {cand.numel()} elements differ (exact match required)",
                "first_bad_index": idx,
                "max_abs_error": float((cand.double() - golden.double()).abs().max()),
            }
        return {"ok": True, "rel_l2": 0.0, "max_abs_error": 0.0, "max_rel_error": 0.0}

    if cand.is_complex():
        cand, golden, native = (torch.view_as_real(t) for t in (cand, golden, native))
    return _compare_float(cand, golden, native, tol, pool, native_allowance)


@dataclass
class _Metrics:
    """What one output's comparison found; :meth:`verdict` turns it into ``compare_output``'s answer."""

    rel_l2: float
    ref_l2: float
    max_abs: float
    max_rel: float
    atol: float
    over: int
    judged: int
    first_bad: list[int] | None
    #: elements whose NaN/Inf status is wrong (see :func:`_compare_float`), the first of them
    #: and what it holds against the golden
    nonfinite: int = 0
    first_nonfinite: list[int] | None = None
    nonfinite_values: tuple[float, float] | None = None
    #: elements whose golden is beyond the output dtype's range; the golden at ``first_bad`` when
    #: that element is one of them
    beyond_range: int = 0
    first_bad_beyond: float | None = None
    #: the largest error as a fraction of its element's limit (1.0: at the limit)
    used: float = 0.0
    dtype: str = "float32"
    #: the largest error of an element over its limit, and PyTorch's own largest error on the
    #: output (where its output is finite; measured only for an output with such elements): when
    #: the first is within the second, no element is off by more than PyTorch itself is somewhere,
    #: and those elements pass (``within_pytorch``)
    over_max: float = 0.0
    native_max: float | None = None
    within_pytorch: int = 0

    def verdict(self, tol: Tolerance) -> dict[str, Any]:
        l2_limit = max(tol.l2_floor, 4.0 * self.ref_l2)
        metrics = {
            "rel_l2": self.rel_l2,
            "rel_l2_limit": l2_limit,
            "pytorch_rel_l2": self.ref_l2,
            "max_abs_error": self.max_abs,
            "max_rel_error": self.max_rel,
            "atol": self.atol,
            "rtol": tol.rtol,
            "tolerance_used": self.used,
        }
        if self.beyond_range:
            metrics["beyond_range"] = self.beyond_range
        if self.within_pytorch:
            metrics["within_pytorch_max_error"] = self.within_pytorch
        if self.nonfinite:
            cand, gold = self.nonfinite_values or (math.nan, math.nan)
            return {
                "ok": False,
                **metrics,
                "stage": "nan",
                "message": f"{self.nonfinite} element(s) disagree with the float64 golden on NaN/Inf "
                f"(first at {self.first_nonfinite}: {cand:.4g} where the golden is {gold:.4g}); NaN "
                f"passes only where the golden is NaN, Inf only where the golden is that Inf or beyond "
                f"{self.dtype}'s range with its sign",
                "first_bad_index": self.first_nonfinite,
            }
        if self.over:
            where = (
                f"; there the golden {self.first_bad_beyond:.4g} is beyond {self.dtype}'s range, "
                "where only Inf of its sign or a value within tolerance passes"
                if self.first_bad_beyond is not None
                else ""
            )
            native = (
                ""
                if self.native_max is None
                else f", above PyTorch's own largest error {self.native_max:.3g}"
            )
            return {
                "ok": False,
                **metrics,
                "stage": "correctness",
                "message": f"{self.over} of {self.judged} elements outside atol {self.atol:.3g} + rtol "
                f"{tol.rtol:g}*|ref| and twice PyTorch's own error there (max abs error {self.max_abs:.3g}"
                f"{native}; relative L2 {self.rel_l2:.3g}; first at {self.first_bad}{where})",
                "first_bad_index": self.first_bad,
            }
        if self.rel_l2 > l2_limit:
            return {
                "ok": False,
                **metrics,
                "stage": "correctness",
                "message": f"relative L2 error {self.rel_l2:.3g} above {l2_limit:.3g} (PyTorch's own error "
                f"is {self.ref_l2:.3g})",
            }
        return {"ok": True, **metrics}


#: Elements per slice of the streaming comparison: a few float64 temporaries stay in the CPU's caches.
#: Each slice costs about 25 calls that hold the GIL; slices of 32K elements, faster on one thread,
#: made eight judging threads wait on the GIL (a large output's judging took 4x longer on an H200
#: host), so a slice stays long enough to keep the GIL mostly free.
JUDGE_CHUNK = 1 << 18
#: Elements per slice on a GPU, where each slice costs a few synchronizations instead.
JUDGE_CHUNK_GPU = 1 << 24


def _compare_float(
    cand: Any, golden: Any, native: Any, tol: Tolerance, pool: Any = None, native_allowance: bool = True
) -> dict[str, Any]:
    """``compare_output``'s floating-point judgement (:func:`_judge_float`), on one thread: its
    slices are small, and on a machine whose cores are busy (a GPU host's other children, a test
    run) every parallel op waited on descheduled threads, up to 20x slower than one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _judge_float(cand, golden, native, tol, pool, native_allowance)
    finally:
        torch.set_num_threads(threads)


#: An element also passes within this many times PyTorch's own error at it (plus atol).
NATIVE_ERROR_FACTOR = 2.0
#: An output of more elements than this is judged in ranges side by side (when given a pool).
JUDGE_RANGE = 1 << 24


def _judge_float(
    cand: Any, golden: Any, native: Any, tol: Tolerance, pool: Any = None, native_allowance: bool = True
) -> dict[str, Any]:
    """The floating-point judgement of one output, in slices; the slices of a large output in
    ranges on ``pool``'s threads (an executor), when one is given.

    Each element falls in one of four cases by its float64 golden ``g``, with ``limit = atol +
    rtol*|g|`` and ``atol`` scaled to the RMS of the goldens the dtype can represent:

    * ``g`` NaN: the candidate must be NaN;
    * ``g`` +-Inf: the candidate must be the same Inf;
    * ``g`` finite beyond the dtype's largest value: Inf of ``g``'s sign, or a finite value within
      ``limit`` (the largest value itself, just past the range);
    * otherwise: a finite value within ``limit``.

    Relative L2 errors (the candidate's, and PyTorch's own in its dtype, which sets the L2 bound)
    are taken over the representable goldens, PyTorch's where its output is finite.

    Outputs of memory-bound tasks are hundreds of megabytes; judged whole in float64, every step is
    a pass over DRAM. Here each slice is judged while it is in cache. A first pass finds the
    goldens' RMS (a sum of squares, in the same ranges, when every golden is finite and
    representable, which is the usual case), then each slice takes the fast path unless its error
    is not finite or the golden has values outside the range, where the four cases above are told
    apart with masks.
    """
    import torch

    dtype = str(cand.dtype).replace("torch.", "")
    top = float(torch.finfo(cand.dtype).max)
    where = golden.device  # the CPU, or a GPU where the golden child judges its own variants
    c, g, n = (t.detach().to(where).reshape(-1) for t in (cand, golden, native))
    chunk = JUDGE_CHUNK if where.type == "cpu" else JUDGE_CHUNK_GPU
    numel = g.numel()
    if numel == 0:
        return _Metrics(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, None, dtype=dtype).verdict(tol)

    if pool is not None and where.type == "cpu" and numel > JUDGE_RANGE:
        size = -(-numel // -(-numel // JUDGE_RANGE))  # even ranges of about JUDGE_RANGE elements
        step = -(-size // chunk) * chunk  # of whole slices
        spans = [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]
    else:
        spans = [(0, numel)]

    def squares(bounds: tuple[int, int]) -> float:
        """The sum of the squared goldens ``[lo, hi)`` in float64 (NaN or Inf if any is)."""
        total = 0.0
        for start in range(bounds[0], bounds[1], chunk):
            gs = g[start : min(start + chunk, bounds[1])].to(torch.float64)
            total += float(torch.dot(gs, gs))
        return total

    # The first pass in ranges too: one whole-output norm on one thread was most of a large
    # output's judging (1.6 billion elements: 9 s, while the ranges after it took 7 s on 8 threads).
    sq_all = sum(pool.map(squares, spans)) if len(spans) > 1 else squares(spans[0])
    norm_g = math.sqrt(sq_all) if math.isfinite(sq_all) else sq_all
    plain = math.isfinite(norm_g) and (
        norm_g <= top or float(torch.linalg.vector_norm(g, ord=math.inf, dtype=torch.float64)) <= top
    )
    if plain:
        sq_gold, representable = sq_all, numel
    else:
        sq_gold, representable = 0.0, 0
        for start in range(0, numel, chunk):
            gs = g[start : start + chunk].to(torch.float64)
            inside = gs.abs() <= top  # False for NaN and Inf
            kept = torch.where(inside, gs, 0.0)
            sq_gold += float(torch.dot(kept, kept))
            representable += int(inside.sum())
    rms = math.sqrt(sq_gold / representable) if representable else 0.0
    atol = tol.atol_rms * max(rms, 1e-30)

    def judge_range(bounds: tuple[int, int]) -> tuple[_Metrics, float, float, int | None]:
        """The metrics of elements ``[lo, hi)``, their squared L2 errors, and the first bad one."""
        m = _Metrics(0.0, 0.0, 0.0, 0.0, atol, 0, 0, None, dtype=dtype)
        sq_err = sq_ref = 0.0
        first = None
        for start in range(bounds[0], bounds[1], chunk):
            part = slice(start, min(start + chunk, bounds[1]))
            gs = g[part].to(torch.float64, copy=True)  # changed in place below: never the golden
            cs = c[part].to(torch.float64)
            ref = n[part].to(torch.float64, copy=True).sub_(gs)  # PyTorch's own error
            diff = cs - gs
            chunk_err = float(torch.dot(diff, diff))
            if plain and math.isfinite(chunk_err):  # every golden representable, every value finite
                judged = beyond = None
                err = diff.abs_()
                scale = gs.abs_()  # gs is not read again on this path
            else:
                g_fin, c_fin = torch.isfinite(gs), torch.isfinite(cs)
                beyond = g_fin & (gs.abs() > top)
                inside = g_fin & ~beyond
                right_nonfinite = (
                    (torch.isnan(gs) & torch.isnan(cs))
                    | (torch.isinf(gs) & (cs == gs))
                    | (beyond & torch.isinf(cs) & ((cs > 0) == (gs > 0)))
                )
                wrong = ~right_nonfinite & (~g_fin | ~c_fin)
                count = int(wrong.sum())
                if count:
                    if m.first_nonfinite is None:
                        at = int(wrong.nonzero()[0])
                        m.first_nonfinite = _unravel(start + at, tuple(golden.shape))
                        m.nonfinite_values = (float(cs[at]), float(gs[at]))
                    m.nonfinite += count
                m.beyond_range += int(beyond.sum())
                judged = g_fin & c_fin  # finite candidates: within tolerance, beyond the range too
                diff = torch.where(inside & c_fin, diff, 0.0)  # the L2 error: representable goldens
                chunk_err = float(torch.dot(diff, diff))
                err = torch.where(judged, (cs - gs).abs(), 0.0)
                scale = torch.where(g_fin, gs.abs(), 0.0)
            ref_sq = float(torch.dot(ref, ref))
            if not math.isfinite(ref_sq):  # PyTorch's own Inf/NaN: its error is measured where finite
                # (where the golden is finite and representable, ref is finite exactly where
                # PyTorch's output is)
                ref = torch.where(torch.isfinite(ref) & (gs.abs() <= top), ref, 0.0)
                ref_sq = float(torch.dot(ref, ref))
            sq_err += chunk_err
            sq_ref += ref_sq
            # Each slice is a few MB of float64: every pass below is a pass through the caches, so
            # the temporaries are reused in place.
            used = 0.0
            if err.numel():
                m.max_abs = max(m.max_abs, float(err.max()))
                ratio = scale.clamp_min(max(rms, 1e-30))
                m.max_rel = max(m.max_rel, float(torch.div(err, ratio, out=ratio).max()))
            limit = scale.mul_(tol.rtol).add_(atol)
            # Nor worse than twice PyTorch's own error there: an epilogue that shrinks values (a
            # min or GELU after a convolution) leaves near-zero outputs carrying the convolution's
            # rounding, far above an atol scaled to the outputs' RMS. Where PyTorch's output is
            # not finite, nothing is added (ref is finite by now, 0 there).
            if native_allowance:
                own = ref.abs_().mul_(NATIVE_ERROR_FACTOR).add_(atol)
                limit = torch.maximum(limit, own, out=limit)
            if err.numel():
                used = float(torch.div(err, limit, out=ratio).max())
                m.used = max(m.used, used)
            # limit >= atol > 0: an element over its limit makes the ratio at least 1
            bad = err > limit if used >= 1.0 else None  # err is 0 where not judged
            count = 0 if bad is None else int(bad.sum())
            if count:
                m.over_max = max(m.over_max, float(err[bad].max()))
            if count and first is None:
                at = int(bad.nonzero()[0])
                first = start + at
                if beyond is not None and bool(beyond[at]):
                    m.first_bad_beyond = float(gs[at])
            m.over += count
        return m, sq_err, sq_ref, first

    parts = list(pool.map(judge_range, spans)) if len(spans) > 1 else [judge_range(spans[0])]
    m = _Metrics(0.0, 0.0, 0.0, 0.0, atol, 0, numel, None, dtype=dtype)
    sq_err = sq_ref = 0.0
    first = None
    for part_m, part_err, part_ref, part_first in parts:  # in order: the first bad element is the first
        sq_err += part_err
        sq_ref += part_ref
        m.max_abs, m.max_rel, m.used = (
            max(m.max_abs, part_m.max_abs),
            max(m.max_rel, part_m.max_rel),
            max(m.used, part_m.used),
        )
        m.over += part_m.over
        m.over_max = max(m.over_max, part_m.over_max)
        m.nonfinite += part_m.nonfinite
        m.beyond_range += part_m.beyond_range
        if m.first_nonfinite is None and part_m.first_nonfinite is not None:
            m.first_nonfinite, m.nonfinite_values = part_m.first_nonfinite, part_m.nonfinite_values
        if first is None and part_first is not None:
            first, m.first_bad_beyond = part_first, part_m.first_bad_beyond
    denom = math.sqrt(sq_gold) if sq_gold > 0 else 1.0
    m.rel_l2, m.ref_l2 = math.sqrt(sq_err) / denom, math.sqrt(sq_ref) / denom
    if m.over and native_allowance:  # a second pass only for an output that failed the first
        m.native_max = _largest_error(n, g, top, chunk)
    if m.native_max is not None and m.over_max <= m.native_max:
        # Near-zero outputs of an ill-conditioned op (GELU's tail after a min, a difference of
        # nearly equal values) carry rounding that differs between two correct float32 codes by
        # more than twice PyTorch's error at that element, yet no more than PyTorch's own error
        # elsewhere on the output; the relative L2 bound still holds the output as a whole.
        m.within_pytorch, m.over, first = m.over, 0, None
    m.first_bad = None if first is None else _unravel(first, tuple(golden.shape))
    return m.verdict(tol)


def _largest_error(native: Any, golden: Any, top: float, chunk: int) -> float:
    """PyTorch's own largest absolute error on an output (flat ``native`` against flat ``golden``),
    where its output is finite and the golden representable, slice by slice."""
    import torch

    largest = 0.0
    for start in range(0, golden.numel(), chunk):
        gs = golden[start : start + chunk].to(torch.float64)
        ns = native[start : start + chunk].to(torch.float64)
        keep = torch.isfinite(ns) & (gs.abs() <= top)
        largest = max(largest, float(torch.where(keep, (ns - gs).abs(), 0.0).max()))
    return largest


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    index = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return index[::-1]


def _tf32_hint(failure: dict[str, Any], dtype: str, policy: str) -> str:
    if policy == "strict" and dtype == "float32" and 1e-4 < failure.get("rel_l2", 0) < 3e-3:
        return (
            " The error is typical of TF32 or reduced-precision accumulation: under the strict policy fp32 "
            "stays fp32 (use input_precision='ieee' in tl.dot), or verify with --precision relaxed."
        )
    return ""


def _sandbox_failure(res: sandbox.SandboxResult, default_stage: str) -> Failure:
    if res.status == "timeout":
        return Failure("timeout", res.message)
    if res.status == "crashed":
        return Failure("crash", res.message, details={"output_tail": res.output_tail[-2000:]})
    if res.status == "output_limit":
        return Failure("output", res.message)
    stage = (res.value or {}).get("stage", default_stage)
    details = {k: v for k, v in (res.value or {}).items() if k != "stage"}
    if not (res.value or {}).get("stage"):
        details["traceback"] = res.traceback[-3000:]
    return Failure(stage, res.message, details=details)


GOLDEN_FILES = ("inputs.pt", "state_dict.pt", "golden.pt", "native.pt")
#: What only the parent's judge reads: kept in the golden child's box while they fit
#: :func:`kept_golden_bytes` (every child gets the inputs and weights, so those go to the disk).
JUDGE_FILES = ("golden.pt", "native.pt")
#: What the parent's judge reads of a candidate child's folder, kept in its box until judged.
CANDIDATE_OUTPUTS = ("outputs.pt", "picks.pt")


def kept_golden_bytes() -> int:
    """Most bytes of golden and native outputs a golden keeps in memory (the golden child's box)
    instead of on disk: a quarter of a child's memory share. Beyond it they go to the disk as the
    rest of the golden does, where the page cache may let them go. What is kept comes out of every
    later child's memory limit (:func:`sandbox.kept_bytes`), so candidates keep three quarters of
    the share at least. An eighth kept the two float32 sets of a 6.4 GB pointwise task (26 GB) off
    a 128 GB host's memory, and copying them to the disk took 17-22 s of a 90 s budget."""
    return sandbox.machine_memory_limit() // 4


#: cuBLAS needs a fixed workspace to be deterministic; verification children only (never timing).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def child_env(device: str, *candidate_sources: str) -> dict[str, str]:
    """Extra environment of a child that runs these candidates: their build caches, and Triton's
    interpreter on a CPU."""
    from kernelcrew.tools.build import build_env

    env: dict[str, str] = {}
    for source in candidate_sources:
        env.update(build_env(source))  # one candidate per child in practice
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


@dataclass
class Golden:
    """Input sets, weights and golden outputs of one task, made once and judged against many times.

    ``path`` holds ``inputs.pt``, ``state_dict.pt``, ``golden.pt`` and ``native.pt``; it is private
    to the caller (candidate children only ever get copies of the inputs and weights).
    """

    path: Path
    seed: int
    device: str
    precision: str
    task_source: str
    task_path: str
    meta: dict[str, Any]
    notes: list[str]
    kept: sandbox.BoxFiles | None = None
    """The golden and native outputs, where they stayed in the golden child's box (memory)."""

    @property
    def op_class(self) -> str:
        return op_class(self.meta["reference_ops"])

    def file(self, name: str) -> Path:
        """Where the golden's file ``name`` is: in the box's memory or under ``path``."""
        return self.kept.path(name) if self.kept is not None and name in self.kept else self.path / name

    def spill(self) -> None:
        """Move the outputs kept in memory to ``path`` (a long-lived executor keeps one golden's in
        memory at a time)."""
        if self.kept is not None:
            kept, self.kept = self.kept, None
            kept.move_to(self.path)
            for name in kept.names:
                _make_private(self.path / name)

    @property
    def input_bytes(self) -> int:
        """Bytes of the saved inputs and weights (what every child loads)."""
        return sum((self.path / name).stat().st_size for name in ("inputs.pt", "state_dict.pt"))

    def cleanup(self) -> None:
        if self.kept is not None:
            self.kept.close()
            self.kept = None
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Golden:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def make_golden(
    task_source: str,
    *,
    device: str = "cpu",
    precision: str = "strict",
    seed: int | None = None,
    task_path: str = "task.py",
    settings: Settings | None = None,
) -> Golden:
    """Run the task's reference in a sandbox child; raises :class:`TaskError` for an unusable task."""
    s = settings or get_settings()
    if precision not in ("strict", "relaxed"):
        raise ValueError(f"unknown precision policy {precision!r} (strict or relaxed)")
    notes = check_source(task_source, "task", task_path)
    seed = secrets.randbits(31) if seed is None else int(seed)
    path = sandbox.make_workdir("kc-golden-")
    payload = {
        "device": device,
        "seed": seed,
        "precision": precision,
        "task_source": task_source,
        "task_path": task_path,
        "n_seeds": s.verify_seeds,
    }
    env = dict(DETERMINISTIC_ENV)
    res = sandbox.run(
        "kernelcrew.tools.harness:golden_child", payload, workdir=path, env=env, settings=s, keep=JUDGE_FILES
    )
    kept = res.kept
    try:
        if not res.ok:
            failure = _sandbox_failure(res, "task")
            raise TaskError(
                f"the task could not be evaluated ({failure.stage}): {failure.message}", path=task_path
            )
        copying = time.monotonic()
        if kept is not None and kept.nbytes() > kept_golden_bytes():
            moving, kept = kept, None
            try:
                moving.move_to(path / "child")
            except OSError as exc:
                raise TaskError(
                    f"the task could not be evaluated (output): its golden outputs could not be "
                    f"copied into {path}: {exc.strerror or exc}; point TMPDIR at a file system with "
                    "room for them",
                    path=task_path,
                ) from exc
        copy_out = res.copy_out_s + time.monotonic() - copying
        # Private to this user: no candidate child (the same sandbox user) can read it. Kept in the
        # box, it is reachable only through this process's descriptor.
        for name in GOLDEN_FILES:
            if kept is None or name not in kept:
                os.replace(path / "child" / name, path / name)
                _make_private(path / name)
    except BaseException:
        if kept is not None:
            kept.close()
        shutil.rmtree(path, ignore_errors=True)
        raise
    shutil.rmtree(path / "child", ignore_errors=True)
    path.chmod(0o700)
    meta = dict(res.value or {})
    meta["isolation"] = res.isolation
    meta.setdefault("phase_s", {})["child_wall"] = res.wall_s  # the rest of child_wall is its start
    meta["phase_s"]["copy_out"] = round(copy_out, 2)
    return Golden(path, seed, device, precision, task_source, task_path, meta, notes, kept)


def _make_private(path: Path) -> None:
    os.chown(path, os.geteuid(), os.getegid())
    os.chmod(path, 0o600)


def share_inputs(golden: Golden, dest: Path, settings: Settings | None = None) -> None:
    """Give a child the inputs and weights (never the golden outputs) in its work directory.

    When the child runs as another user, a read-only hard link (owned by us, in a directory it may
    not write) is as safe as a copy and costs nothing, where copying the inputs of a memory-bound
    task moved gigabytes per child. A child running as our own user could write through a link
    into every later candidate's inputs, so it gets a copy.
    """
    dropped = sandbox.privilege_drop(settings or get_settings())[0]
    for name in ("inputs.pt", "state_dict.pt"):
        source, target = golden.path / name, dest / name
        if dropped:
            os.chmod(source, 0o444)
            try:
                os.link(source, target)
                continue
            except OSError:  # another file system: copy
                pass
        shutil.copyfile(source, target)
        if dropped:
            os.chmod(target, 0o444)
    if dropped:
        os.chmod(dest, 0o755)


def verify(
    task_source: str,
    candidate_source: str,
    *,
    device: str = "cpu",
    precision: str = "strict",
    seed: int | None = None,
    task_path: str = "task.py",
    candidate_path: str = "candidate.py",
    settings: Settings | None = None,
    golden: Golden | None = None,
    profile_kind: bool = True,
    mode_checks: bool = True,
) -> Verdict:
    """Run the whole verification protocol; raises :class:`TaskError` for an unusable task file.

    Pass a ``golden`` from :func:`make_golden` to judge several candidates against one set of
    inputs and reference outputs (its device, precision and seed then apply). With
    ``profile_kind=False`` the candidate's kind is left to the timing that follows
    (:func:`kernelcrew.tools.timing.benchmark` profiles the timed candidate itself). With
    ``mode_checks=False`` the calls with autograd on and in inference mode are left out, for
    kernelcrew's own ``torch.compile`` of the reference only (the verdict flags it).
    """
    s = settings or get_settings()
    # A best.py's torch.compile packaging is not candidate code: off it comes, checked to be exactly
    # kernelcrew's, and the kernels are verified without it.
    candidate_source, packaged = unpack(candidate_source, candidate_path)
    check_source(candidate_source, "candidate", candidate_path)
    own_golden = golden is None
    if golden is None:
        check_source(task_source, "task", task_path)
    elif golden.task_source != task_source:
        raise ValueError("the golden was made for another task")
    seed = golden.seed if golden else (secrets.randbits(31) if seed is None else int(seed))
    device = golden.device if golden else device
    precision = golden.precision if golden else precision
    verdict = Verdict(verdict="fail", stage="", message="", seed=seed, device=device, precision=precision)

    if packaged:
        verdict.checks.append(
            {
                "name": "packaging",
                "passed": True,
                "detail": "the torch.compile packaging block is kernelcrew's own; verified without it",
            }
        )
    findings = static_check(candidate_source, candidate_path)
    verdict.checks.append(
        {
            "name": "static",
            "passed": not findings,
            "detail": [f.to_dict() for f in findings] or "no rule broken",
        }
    )
    if findings:
        first = findings[0]
        verdict.stage, verdict.message = "static", f"line {first.line}: {first.message}"
        verdict.failures = [Failure("static", f.message, details=f.to_dict()).to_dict() for f in findings]
        return verdict

    from kernelcrew.tools.build import cache_dirs, seed_from_reference

    if golden is None:
        golden = make_golden(
            task_source, device=device, precision=precision, seed=seed, task_path=task_path, settings=s
        )
    meta = golden.meta
    verdict.isolation = meta["isolation"]
    verdict.golden_mode = meta["golden_mode"]
    verdict.input_sets = meta["sets"]
    verdict.flags.extend(_flags(meta, golden.notes))
    if not mode_checks:
        verdict.flags.append("grad and inference modes not re-checked (kernelcrew's own torch.compile)")
    env = {**DETERMINISTIC_ENV, **child_env(device, candidate_source)}
    cand_dir = sandbox.make_workdir("kc-cand-")
    preparing = time.monotonic()
    res = None
    try:
        share_inputs(golden, cand_dir, s)
        cand_payload = {
            "device": device,
            "seed": seed,
            "precision": precision,
            "task_source": task_source,
            "task_path": task_path,
            "candidate_source": candidate_source,
            "candidate_path": candidate_path,
            "sets": meta["sets"],
            "reference_aliases": any(r["alias"] for r in meta["sets"]),
            "profile_kind": profile_kind,
            "mode_checks": mode_checks,
            "sampled_sets": sampled_sets(meta),
        }
        seed_from_reference(task_source, candidate_source)
        prepared = round(time.monotonic() - preparing, 2)
        res = sandbox.run(
            "kernelcrew.tools.harness:candidate_child",
            cand_payload,
            workdir=cand_dir,
            env=env,
            settings=s,
            writable=(cache_dirs(candidate_source)["root"],),
            keep=CANDIDATE_OUTPUTS,
        )
        if not res.ok:
            failure = _sandbox_failure(res, "runtime")
            verdict.stage, verdict.message = failure.stage, failure.message
            verdict.failures.append(failure.to_dict())
            verdict.checks.append({"name": failure.stage, "passed": False, "detail": failure.message})
            return verdict
        value = res.value or {}
        inside = {k: float(v) for k, v in (value.get("phase_s") or {}).items()}
        verdict.phase_s = {
            "prepare": prepared,
            **inside,
            "child_other": round(max(0.0, res.wall_s - sum(inside.values())), 2),
            "copy_out": res.copy_out_s,
        }
        verdict.checks.extend(value["checks"])
        verdict.kind, verdict.kind_evidence = value["kind"], value["kind_evidence"]
        verdict.flags.extend(value.get("notes", []))
        judging = time.monotonic()
        found = res  # the candidate's outputs: in its box, or copied out (no box)
        _judge(
            verdict,
            meta,
            lambda name: sandbox.child_file(found, cand_dir / "child", name),
            golden,
            value["nondeterministic"],
            cand_payload["sampled_sets"],
        )
        verdict.phase_s["judge"] = round(time.monotonic() - judging, 2)
        _closed(res.kept)  # judged: their memory goes before anything else runs
        if verdict.passed and s.compute_sanitizer and device.startswith("cuda"):
            _memcheck(verdict, cand_payload, cand_dir, env, s)
    finally:
        if res is not None:
            _closed(res.kept)
        shutil.rmtree(cand_dir, ignore_errors=True)
        if own_golden:
            golden.cleanup()
    return verdict


def _closed(kept: sandbox.BoxFiles | None) -> None:
    """Let a child's kept files go (closing twice is harmless)."""
    if kept is not None:
        kept.close()


def _memcheck(
    verdict: Verdict, payload: dict[str, Any], cand_dir: Path, env: dict[str, str], s: Settings
) -> None:
    """compute-sanitizer memcheck of the candidate on the smallest input set (GPU, opt-in)."""
    from kernelcrew.tools.build import cache_dirs

    tool = shutil.which("compute-sanitizer")
    if tool is None:
        verdict.flags.append("memcheck skipped: compute-sanitizer not found")
        return
    res = sandbox.run(
        "kernelcrew.tools.harness:memcheck_child",
        payload,
        workdir=cand_dir,
        # without PyTorch's caching allocator every tensor is its own allocation, so memcheck sees
        # a read past a tensor's end (inside a cached 2 MiB segment it would look legal)
        env={**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
        settings=s,
        wrapper=(tool, "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "20"),
        writable=(cache_dirs(payload["candidate_source"])["root"],),
    )
    summary = re.search(r"ERROR SUMMARY: (\d+) error", res.output_tail)
    errors = int(summary.group(1)) if summary else None
    if res.status == "timeout":
        verdict.flags.append("memcheck timed out (not judged)")
    elif errors or res.returncode == 86:
        lines = [ln for ln in res.output_tail.splitlines() if ln.startswith("=========") and "Invalid" in ln]
        failure = Failure(
            "memcheck", f"compute-sanitizer found {errors} memory error(s): {lines[0] if lines else ''}"
        )
        verdict.verdict, verdict.stage, verdict.message = "fail", "memcheck", failure.message
        verdict.failures.append(failure.to_dict())
    elif not res.ok:
        verdict.flags.append(f"memcheck did not complete: {res.message}")
    completed = res.ok or errors is not None
    verdict.checks.append(
        {
            "name": "memcheck",
            "passed": (errors == 0 and res.ok) if completed else None,
            "detail": f"compute-sanitizer: {errors} error(s)"
            if completed
            else f"not completed: {res.message}",
        }
    )


def _flags(meta: dict[str, Any], notes: list[str]) -> list[str]:
    flags = list(meta.get("notes", []))
    sets = meta["sets"]
    shapes = {tuple(r["shapes"]) for r in sets}
    if len(shapes) == 1:
        flags.append("verified at one shape")
    if meta["golden_mode"] != "float64":
        flags.append(f"golden computed in {meta['golden_mode']}")
    if all(r["constant_output"] for r in sets):
        flags.append("the reference output is constant on every input set: weak evidence")
    zero = [r["index"] for r in sets if r["zero_inputs"]]
    if zero:
        flags.append(f"input sets {zero} contain all-zero tensors")
    if any(r["origin"] == "signed" for r in sets):
        flags.append("signed variants of non-negative inputs tested")
    scaled = [f"x{r['factor']:g} of set {r['of']}" for r in sets if r["origin"] == "scaled"]
    if scaled:
        flags.append(f"scaled variants tested ({len(scaled)}): {', '.join(scaled)}")
    sampled = sampled_sets(meta)
    if sampled:
        flags.append(
            f"input sets {sorted(sampled)} judged on {SET_SAMPLE_ELEMENTS} elements of each output drawn "
            "at random (a large output; the first seed set is judged in full)"
        )
    flags.extend(n for n in notes if "get_test_inputs" not in n or len(shapes) > 1)
    return list(dict.fromkeys(flags))


def _fingerprint(outs: list[Any]) -> tuple[str, ...]:
    """Identifies a call's outputs cheaply: identical outputs (a candidate replaying an earlier
    answer) always match, different ones practically never do. Hashes the bytes of a strided
    sample of at most :data:`FINGERPRINT_ELEMENTS` elements, not every byte of outputs that can be
    gigabytes (a float64 sum of a 1.6 billion-element output took its judging thread 1.4 s before
    the judging began); a match only relabels a wrong output as stale, it never passes one."""
    import hashlib

    import torch

    parts = []
    for t in outs:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        sample = flat[:: max(1, -(-flat.numel() // FINGERPRINT_ELEMENTS))].contiguous()
        digest = hashlib.sha1(sample.view(torch.uint8).numpy().tobytes()).hexdigest()
        parts.append(f"{tuple(t.shape)}:{t.dtype}:{digest}")
    return tuple(parts)


#: Elements of an output that :func:`_fingerprint` hashes, at most.
FINGERPRINT_ELEMENTS = 1 << 20


#: Elements kept of each output of a re-check call (repeat, grad and inference modes, the cache
#: sequence), at most, at positions the child draws after the call returned
#: (:func:`harness.sample_outputs`): the input sets' own calls are kept, and judged, in full
#: (but see :func:`sampled_sets`).
RECHECK_ELEMENTS = 1 << 16
#: Output elements of one call from which a large task's later seed sets are judged on a sample.
LARGE_OUTPUT_ELEMENTS = 1 << 26
#: Elements of each output kept of such a set's call, at positions drawn after the call returned.
SET_SAMPLE_ELEMENTS = 1 << 24


def sampled_sets(meta: dict[str, Any]) -> dict[int, int]:
    """The input sets whose calls are judged on a random sample of each output, with its size.

    A memory-bound task's output is gigabytes (1.6 billion elements for a 6.4 GB pointwise task):
    judging, writing and copying every element of each input set took a verification 20-27 s on
    an H100 host. Where a call's outputs reach :data:`LARGE_OUTPUT_ELEMENTS`, the first seed set
    and every set of another shape (test sets, variants) are still judged in full; each further
    seed set of the first one's shapes, which only adds other values at the same positions, is
    judged on :data:`SET_SAMPLE_ELEMENTS` elements per output drawn by the child after the call
    returned, as re-check calls are. A wrong answer that differs from the first set's elsewhere
    than on a few dozen elements of billions is found as surely as in full; the parent alone
    decides which sets these are, so a child cannot have the first set sampled."""
    elements = sum(math.prod(o["shape"]) for o in meta.get("outputs") or [])
    seeds = [r for r in meta["sets"] if r["origin"] == "seed"]
    if elements < LARGE_OUTPUT_ELEMENTS or not seeds:
        return {}
    return {r["index"]: SET_SAMPLE_ELEMENTS for r in seeds[1:] if r["shapes"] == seeds[0]["shapes"]}


def _picked(
    pick: Any, g: Any, n: Any, count: int | None = None
) -> tuple[Any, Any, Any, dict[str, Any] | None]:
    """The golden and native elements at the positions a re-check call's output was kept at (the
    child drew them after the call: :func:`harness.sample_outputs`), the positions, and a failure
    when the kept shape is not the reference's or the record is not positions of it (the child's
    file: anything may be in it). ``count``: the number of positions a sampled input set's call
    must have (:func:`sampled_sets`); a re-check's are at most :data:`RECHECK_ELEMENTS`."""
    import torch

    malformed = {"ok": False, "stage": "output_type", "message": "malformed sample positions"}
    if not isinstance(pick, dict) or not isinstance(pick.get("shape"), list):
        return g, n, None, malformed
    shape = tuple(pick["shape"])
    if shape != tuple(n.shape):
        failure = {
            "ok": False,
            "stage": "shape",
            "message": f"shape {shape} but the reference gives {tuple(n.shape)}",
        }
        return g, n, None, failure
    positions = pick.get("positions")
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dtype != torch.int64
        or positions.dim() != 1
        or not (0 < positions.numel() <= RECHECK_ELEMENTS if count is None else positions.numel() == count)
        or int(positions.min()) < 0
        or int(positions.max()) >= n.numel()
    ):
        return g, n, None, malformed
    return g.reshape(-1)[positions], n.reshape(-1)[positions], positions, None


#: Threads that judge a verification's calls at once, at most (each on one torch thread).
JUDGE_THREADS = 8


@contextlib.contextmanager
def _judging_pools(calls: int) -> Iterator[tuple[Any, Any]]:
    """Two thread pools, torch held to one thread per op: one judges ``calls`` calls side by side,
    the other the ranges of their large outputs (a call's thread waits on its ranges, so one pool
    for both could have every thread waiting).

    A large task's output took one thread seconds. Independent threads scale with free cores and
    degrade gracefully on busy ones, where torch's own parallel ops waited on descheduled threads;
    so each pool has as many threads as torch would use (its ``OMP_NUM_THREADS``), at most
    :data:`JUDGE_THREADS`."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(JUDGE_THREADS, _one_thread_per_op.enter()))
    try:
        with (
            ThreadPoolExecutor(max_workers=max(1, min(workers, calls))) as per_call,
            ThreadPoolExecutor(max_workers=workers) as per_range,
        ):
            yield per_call, per_range
    finally:
        _one_thread_per_op.exit()


class _OneThreadPerOp:
    """torch held to one thread per op while any judge of this process runs (judges of a round's
    steps overlap), and given back its own count when the last ends. Each judge entering and
    restoring on its own left torch at one thread for good once two overlapped: the second saved
    the first's one, and every judge after that had one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._threads = 1

    def enter(self) -> int:
        """torch's own thread count, as it was before the first judge entered."""
        import torch

        with self._lock:
            if self._inside == 0:
                self._threads = torch.get_num_threads()
                torch.set_num_threads(1)
            self._inside += 1
            return self._threads

    def exit(self) -> None:
        import torch

        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                torch.set_num_threads(self._threads)


_one_thread_per_op = _OneThreadPerOp()


def _expected_set(key: str) -> int:
    return int(key.rsplit(":", 1)[1])


def _judge(
    verdict: Verdict,
    meta: dict[str, Any],
    child_file: Callable[[str], Path],
    made: Golden,
    nondet: bool,
    sampled: dict[int, int] | None = None,
) -> None:
    """Judge the candidate child's outputs (``child_file(name)``: where its file is) against the
    golden ``made``; the calls of the input sets in ``sampled`` (:func:`sampled_sets`) on the
    elements the child kept, every other set's in full."""
    import torch

    sampled = sampled or {}

    def unreadable(what: str) -> None:
        failure = Failure("output_type", f"{what} could not be read")
        verdict.failures = [failure.to_dict()]
        verdict.stage, verdict.message = failure.stage, failure.message

    try:  # the child wrote it: anything may be in it (or nothing readable)
        outputs = torch.load(child_file("outputs.pt"), weights_only=True, mmap=True)
    except Exception:
        outputs = None
    if not isinstance(outputs, dict) or not all(isinstance(v, list | tuple) for v in outputs.values()):
        unreadable("the candidate's outputs")
        return
    missing = [r["index"] for r in meta["sets"] if f"set:{r['index']}" not in outputs]
    if missing:  # every input set's call is judged, whatever the child's file leaves out
        unreadable(f"the candidate's outputs on input sets {missing}")
        return
    golden = torch.load(made.file("golden.pt"), weights_only=True, mmap=True)
    native = torch.load(made.file("native.pt"), weights_only=True, mmap=True)
    picks_path = child_file("picks.pt")
    try:
        picks = torch.load(picks_path, weights_only=True) if picks_path.exists() else {}
    except Exception:
        picks = None
    if not isinstance(picks, dict):
        unreadable("the re-check calls' sample positions")
        return
    cls = op_class(meta["reference_ops"])
    sets = {r["index"]: r for r in meta["sets"]}

    def judge_call(key: str, outs: list[Any]) -> tuple[tuple[str, ...], list[dict[str, Any]] | None]:
        """A call's fingerprint and each output's comparison (None: not as many outputs)."""
        idx = _expected_set(key)
        g_list, n_list, fingerprint = golden[idx], native[idx], _fingerprint(outs)
        if len(outs) != len(g_list):
            return fingerprint, None
        results = []
        whole = key.startswith("set:") and idx not in sampled  # whatever the child's picks say
        count = sampled.get(idx) if key.startswith("set:") else None
        kept = picks.get(key) if not whole else None
        kept = kept if isinstance(kept, list) else [None] * len(outs)
        if len(kept) != len(outs):
            return fingerprint, None
        for o, (c, g, n) in enumerate(zip(outs, g_list, n_list, strict=True)):
            dtype = str(n.dtype).replace("torch.", "")
            positions = None
            if kept[o] is not None:
                g, n, positions, failure = _picked(kept[o], g, n, count)
                if failure is not None:
                    results.append(failure)
                    continue
            res = compare_output(c, g, n, tolerance_for(dtype, cls, verdict.precision), ranges)
            if positions is not None and res.get("first_bad_index") is not None:
                at = int(positions[res["first_bad_index"][0]])
                res["first_bad_index"] = _unravel(at, tuple(g_list[o].shape))
                res["message"] = f"{res['message']} (of {len(positions)} elements drawn at random)"
            results.append(res)
        return fingerprint, results

    with _judging_pools(len(outputs)) as (pool, ranges):
        found = list(pool.map(judge_call, outputs.keys(), outputs.values()))

    worst = 0.0
    failures: list[Failure] = []
    judged = 0
    seen: dict[tuple[str, ...], int] = {}  # fingerprint of a call's outputs -> the input set it was for
    for (key, outs), (fingerprint, results) in zip(outputs.items(), found, strict=True):
        idx = _expected_set(key)
        stale_from = seen.get(fingerprint)
        seen.setdefault(fingerprint, idx)
        if results is None:
            failures.append(
                Failure(
                    "shape",
                    f"{key}: {len(outs)} outputs but the reference gives {len(golden[idx])}",
                    input_set=sets[idx],
                )
            )
            continue
        for o, res in enumerate(results):
            dtype = str(native[idx][o].dtype).replace("torch.", "")
            judged += 1
            if math.isfinite(res.get("rel_l2", 0.0)):
                worst = max(worst, res.get("max_rel_error", 0.0))
            if not res["ok"]:
                stage = res["stage"]
                message = f"{_label(key, sets[idx])}: {res['message']}" + _tf32_hint(
                    res, dtype, verdict.precision
                )
                if stale_from is not None and stale_from != idx:
                    stage = "cache"
                    message = (
                        f"{_label(key, sets[idx])}: returns the output it gave for input set {stale_from}"
                    )
                elif key.startswith("seq:") and stage == "correctness":
                    stage = "cache"
                failures.append(
                    Failure(
                        stage,
                        message,
                        input_set={
                            k: sets[idx][k]
                            for k in ("index", "origin", "seed", "shapes", "of", "factor")
                            if k in sets[idx]
                        },
                        output_index=o,
                        max_abs_error=res.get("max_abs_error"),
                        max_rel_error=res.get("max_rel_error"),
                        first_bad_index=res.get("first_bad_index"),
                    )
                )
    verdict.max_rel_error = worst
    for check in verdict.checks:
        if check["passed"] is None:  # judged here: the cache sequence
            check["passed"] = not any(f.stage == "cache" for f in failures)
    verdict.checks.append(
        {
            "name": "outputs",
            "passed": not failures,
            "detail": f"{judged} outputs judged against the float64 golden ({cls} thresholds, {verdict.precision})",
        }
    )
    if failures:  # in call order: the first wrong call explains the rest
        verdict.failures = [f.to_dict() for f in failures]
        verdict.stage, verdict.message = failures[0].stage, failures[0].message
        return
    verdict.verdict, verdict.stage = "pass", "done"
    verdict.message = (
        f"correct on {len(sets)} input sets ({len(outputs)} calls judged); worst relative error {worst:.3g}"
    )
    if nondet:
        verdict.flags.append("declared nondeterministic: repeat checked within tolerance")


def _label(key: str, rec: dict[str, Any]) -> str:
    names = {
        "set": "input set",
        "repeat": "second call on input set",
        "seq:A": "cache sequence A on set",
        "seq:B": "cache sequence B on set",
        "seq:A_new_address": "A's data at a new address, set",
        "seq:B_at_A_address": "B's data written into A's tensors, set",
        "grad": "autograd-enabled call on input set",
        "inference": "inference-mode call on input set",
    }
    prefix = key.rsplit(":", 1)[0]
    origin = rec["origin"]
    if origin == "scaled":
        origin = f"scaled x{rec['factor']:g} of set {rec['of']}"
    elif origin == "signed":
        origin = f"signed variant of set {rec['of']}"
    return f"{names.get(prefix, prefix)} {rec['index']} ({origin}, shapes {', '.join(rec['shapes'])})"


__all__ = [
    "Failure",
    "Golden",
    "Tolerance",
    "Verdict",
    "compare_output",
    "make_golden",
    "op_class",
    "tolerance_for",
    "verify",
]
