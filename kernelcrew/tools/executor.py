"""Where GPU work runs: the Executor interface the crew calls, and LocalExecutor (this machine).

The graph never touches a GPU itself; it calls ``verify``, ``benchmark`` and ``profile`` with
JSON-serializable requests and gets JSON-serializable results back, so the same graph runs
against this machine (:class:`LocalExecutor`, each call in sandboxed children) or against remote
GPU workers (a Celery executor, in ``kernelcrew.worker``).

Requests carry the task source and the job's device, precision and secret seed; the executor
keeps one golden per (task, device, precision, seed), so every candidate of a job is judged
against the same inputs and reference outputs without recomputing them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import queue
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol

from kernelcrew.config import Settings, get_settings
from kernelcrew.records import (
    BenchmarkRequest,
    BenchmarkResult,
    ExecutorRequest,
    ProfileRequest,
    ProfileResult,
    ReferenceProfile,
    Verdict,
    VerifyRequest,
)
from kernelcrew.task import TaskError
from kernelcrew.tools import sandbox
from kernelcrew.tools.harness import Laps

log = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """The executor could not complete an operation for a reason that is not the task's fault:
    no worker online, a worker lost, a time limit hit. (A bad task or candidate is a ``TaskError``.)"""


class Executor(Protocol):
    """The three GPU operations of the crew; requests and results are the JSON-serializable
    records of :mod:`kernelcrew.records`."""

    def verify(self, request: VerifyRequest) -> Verdict:
        """The verdict of the verification protocol on the request's candidate."""
        ...

    def benchmark(self, request: BenchmarkRequest) -> BenchmarkResult:
        """The timing of eager, the torch.compile modes and the candidates
        (:func:`kernelcrew.tools.timing.benchmark`); with ``hotspots``, the reference's ranked
        kernels and work under ``profile``."""
        ...

    def profile(self, request: ProfileRequest) -> ProfileResult:
        """The reference's kernels ranked by time (``hotspots``, unless ``hotspots`` is false) and
        its ``work`` (or the request's), the device's ``peaks`` and the task's ``floor``
        (:mod:`kernelcrew.tools.roofline`), and with ``ncu`` the Nsight Compute summary of the
        reference or the candidate (:func:`kernelcrew.tools.ncu.profile`)."""
        ...

    def close(self) -> None:
        """Release what the executor holds (goldens, connections)."""
        ...


def branch(executor: Executor, index: int) -> Executor:
    """The executor a crew's ``index``-th evaluation side by side with others calls from its own
    thread: the executor's ``branch`` where it has one (a remote executor's calls from several threads
    need one connection each), else the executor itself (``LocalExecutor`` is safe across threads)."""
    make = getattr(executor, "branch", None)
    return executor if make is None or index == 0 else make(index)


def slots_for(device: str, requested: int | None = None) -> list[str | None]:
    """Evaluation slots for a :class:`LocalExecutor`: on a GPU device one per GPU the caller sees
    (``CUDA_VISIBLE_DEVICES`` values for the children, in the caller's numbering), at most
    ``requested``; on a CPU ``requested`` slots that change nothing (the children share the cores).
    One slot, whatever was asked, where only one GPU is visible."""
    import os

    if device == "cpu":
        return [None] * max(1, requested or 1)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = [v.strip() for v in visible.split(",") if v.strip()]
    else:
        import torch

        names = [str(i) for i in range(torch.cuda.device_count())]
    names = names[: requested or len(names)]
    return names if len(names) > 1 else [None]


def split_cores(parts: int) -> list[frozenset[int] | None]:
    """This process's cores in ``parts`` equal runs, one per slot; None each (no pinning) for one
    slot, or where there are fewer than two cores a part."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if parts < 2 or len(cores) < 2 * parts:
        return [None] * parts
    size = len(cores) // parts
    return [frozenset(cores[i * size : (i + 1) * size]) for i in range(parts)]


def _key(request: ExecutorRequest) -> tuple[str, str, str, int]:
    digest = hashlib.sha256(request.task_source.encode()).hexdigest()
    return digest, request.device, request.precision, request.seed


def compile_ahead(request: BenchmarkRequest, settings: Settings, timed_out: list[bool]) -> None:
    """Compile the task's reference in the request's modes into the reference's build cache
    (:func:`kernelcrew.tools.harness.compile_child`), for the timing run to load. Only an
    optimization: whatever goes wrong here, the timing run compiles as it would have, except past
    the request's ``compile_within_s``: then the child is stopped and ``timed_out`` gets True (the
    timing run leaves the mode out rather than compile it again)."""
    from kernelcrew.tools.build import reference_build_env, reference_cache_dirs
    from kernelcrew.tools.correctness import child_env

    payload = {
        "device": request.device,
        "seed": request.seed,
        "precision": request.precision,
        "task_source": request.task_source,
        "task_path": request.task_path,
        # default mode only: its tuning is Triton configurations the timing run times again
        # (forget_tuning); max-autotune's template choices would be kept as made under load
        "compile_modes": [m for m in request.compile_modes if m == "default"],
    }
    if not payload["compile_modes"]:
        return
    workdir = sandbox.make_workdir("kc-compile-")
    limit = request.compile_within_s
    try:
        result = sandbox.run(
            "kernelcrew.tools.harness:compile_child",
            payload,
            limits=None if limit is None else sandbox.SandboxLimits.from_settings(settings, wall_s=limit),
            workdir=workdir,
            env={**child_env(request.device), **reference_build_env(request.task_source)},
            settings=settings,
            writable=(reference_cache_dirs(request.task_source)["root"],),
        )
        if limit is not None and result.status == "timeout":
            timed_out.append(True)
    except Exception:  # the timing run compiles as it would have
        log.warning("compiling the reference ahead failed", exc_info=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class LocalExecutor:
    """Runs every operation on this machine, each in sandboxed child processes.

    ``max_goldens`` bounds the goldens kept (least recently used first out), for a long-lived
    process such as a GPU worker that serves many jobs; None keeps every golden until ``close``.

    ``slots`` are where calls run (:class:`~kernelcrew.tools.sandbox.Slot`): one ``CUDA_VISIBLE_DEVICES``
    value per GPU, or None for the caller's. Calls from several threads (a crew's round) each hold
    a slot for their whole duration, so no two share a GPU (a timing never overlaps another
    evaluation on its device), and with n slots each child gets 1/n of the children's memory.
    Calls past the slots wait for one. Goldens are made once per key, whichever thread asks first.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        max_goldens: int | None = None,
        slots: list[str | None] | None = None,
    ) -> None:
        if max_goldens is not None and max_goldens < 1:
            raise ValueError(f"max_goldens must be at least 1, got {max_goldens}")
        self.settings = settings or get_settings()
        self.max_goldens = max_goldens
        self.slots = list(slots or [None])
        self._free: queue.SimpleQueue[sandbox.Slot] = queue.SimpleQueue()
        for visible, cpus in zip(self.slots, split_cores(len(self.slots)), strict=True):
            self._free.put(sandbox.Slot(visible, 1.0 / len(self.slots), cpus))
        self._golden_lock = threading.Lock()
        #: Whether the reference's torch.compile modes are compiled while the golden is made; None:
        #: on a GPU only (there the golden works the device and the compile the CPU's cores; on a
        #: CPU both compete for the same cores, and on two cores that was slower).
        self.overlap_compile: bool | None = None
        self._goldens: OrderedDict[tuple[str, str, str, int], Any] = OrderedDict()

    def capacity(self, device: str) -> int:
        """How many calls can run at once: one per slot."""
        return len(self.slots)

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """Hold a free slot for the block (a slot this thread holds already is kept)."""
        if sandbox.current_slot() is not None:
            yield
            return
        slot = self._free.get()
        try:
            with sandbox.in_slot(slot):
                yield
        finally:
            self._free.put(slot)

    def golden(self, request: ExecutorRequest) -> Any:
        # made whole however little time the call that needs it first has: every later call needs it
        with self._slot(), self._golden_lock, sandbox.within(None):
            return self._golden(request)

    def _golden(self, request: ExecutorRequest) -> Any:
        from kernelcrew.tools.correctness import make_golden

        key = _key(request)
        if key in self._goldens:
            self._goldens.move_to_end(key)
        else:
            while self.max_goldens is not None and len(self._goldens) >= self.max_goldens:
                _, oldest = self._goldens.popitem(last=False)
                oldest.cleanup()
            for other, kept in list(self._goldens.items()):  # one golden's outputs in memory at a time
                try:
                    kept.spill()
                except OSError:  # its outputs are lost with the copy: a later call makes it again
                    log.warning("a golden's outputs could not be moved to the disk", exc_info=True)
                    del self._goldens[other]
                    kept.cleanup()
            self._goldens[key] = make_golden(
                request.task_source,
                device=request.device,
                precision=request.precision,
                seed=request.seed,
                task_path=request.task_path,
                settings=self.settings,
            )
        return self._goldens[key]

    def verify(self, request: VerifyRequest) -> Verdict:
        with self._slot(), sandbox.within(request.within_s):
            return self._verify(request)

    def _verify(self, request: VerifyRequest) -> Verdict:
        from kernelcrew.tools.correctness import verify

        golden = self.golden(request)
        return verify(
            request.task_source,
            request.candidate_source,
            candidate_path=request.candidate_path,
            task_path=request.task_path,
            golden=golden,
            settings=self.settings,
            profile_kind=request.profile_kind,
            mode_checks=request.mode_checks,
        )

    def benchmark(self, request: BenchmarkRequest) -> BenchmarkResult:
        with self._slot(), sandbox.within(request.within_s):
            return self._benchmark(request)

    def _benchmark(self, request: BenchmarkRequest) -> BenchmarkResult:
        from kernelcrew.tools.timing import benchmark

        lap = Laps()
        warming, timed_out = None, []
        overlap = self.overlap_compile if self.overlap_compile is not None else request.device != "cpu"
        if overlap and request.compile_modes and _key(request) not in self._goldens:
            # the compiles' CPU work overlaps the golden's; the timing run below loads their build
            warming = threading.Thread(  # in this thread's slot
                target=contextvars.copy_context().run,
                args=(compile_ahead, request, self.settings, timed_out),
                daemon=True,
            )
            warming.start()
        try:
            golden = self.golden(request)
        finally:
            golden_s = lap("golden")
            if warming is not None:  # never left compiling on the device after this call
                warming.join()
                lap("compile_ahead")
        candidates = {name: (source, f"{name}.py") for name, source in request.candidates.items()}
        modes = [m for m in request.compile_modes if not (timed_out and m == "default")]
        result = benchmark(
            request.task_source,
            candidates,
            compile_modes=modes,
            quick=request.quick,
            golden=golden,
            task_path=request.task_path,
            hotspots=request.hotspots,
            settings=self.settings,
        )
        lap("benchmark")
        if timed_out and result.failure is None:
            result.compile_errors = {
                **result.compile_errors,
                "default": f"not timed: not compiled within {request.compile_within_s:.0f} s, the run's "
                "limit for compiling the reference",
            }
        result.phase_s = lap.seconds
        if golden_s:
            result.golden_phase_s = golden.meta.get("phase_s", {})
        return result

    def profile(self, request: ProfileRequest) -> ProfileResult:
        """The reference's hotspots and work (no ``candidate_source``) or a candidate's, the device's
        peaks and the task's floor, and Nsight Compute's records when ``ncu`` is asked for."""
        with self._slot(), sandbox.within(request.within_s):
            return self._profile(request)

    def _profile(self, request: ProfileRequest) -> ProfileResult:
        from kernelcrew.tools import ncu, roofline
        from kernelcrew.tools.hardware import detect

        lap = Laps()
        golden = self.golden(request)  # validates the task and fixes the weights and inputs
        lap("golden")
        out = ProfileResult()
        if not request.candidate_source and request.hotspots:
            ranked = self._hotspots(golden, request)
            out = ProfileResult(**dict(ranked))
            lap("hotspots")
        out.hardware = detect(request.device).to_dict()
        peaks = roofline.peaks_for(out.hardware, self.settings)
        out.peaks = peaks.to_dict()
        work = out.work or request.work
        if work:
            out.work, out.floor = work, roofline.floor(work, peaks)
        if request.ncu:
            result = ncu.profile(
                golden,
                request.candidate_source,
                candidate_path=request.candidate_path,
                kernel_filter=request.kernel_filter,
                settings=self.settings,
            )
            result.pop("records", None)  # the per-launch records stay here; the summary travels
            out.ncu = result
            lap("ncu")
        out.phase_s = lap.seconds
        return out

    def _hotspots(self, golden: Any, request: ExecutorRequest) -> ReferenceProfile:
        from kernelcrew.tools.correctness import share_inputs

        workdir = sandbox.make_workdir("kc-profile-")
        try:
            share_inputs(golden, workdir, self.settings)
            payload = request.model_dump(include={"task_source", "task_path", "device", "precision", "seed"})
            res = sandbox.run(
                "kernelcrew.tools.harness:profile_child", payload, workdir=workdir, settings=self.settings
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if not res.ok:
            raise TaskError(f"profiling the reference failed: {res.message}", path=request.task_path)
        return ReferenceProfile.model_validate(res.value)

    def close(self) -> None:
        for golden in self._goldens.values():
            golden.cleanup()
        self._goldens.clear()
