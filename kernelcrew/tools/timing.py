"""The timing protocol: interleaved, L2-flushed, event- and wall-clocked timings of several callables.

:func:`measure` runs inside an already sandboxed child process (no subprocesses here) and times a
baseline and its candidates in the same process:

* **Warm-up**: each callable, in turn, until it has run at least ``warmup_calls`` times and for at
  least ``warmup_ms`` (capped at a quarter of the time budget, shared between the callables, once
  it has run twice: a first call may spend seconds compiling or autotuning).
* **Rounds**: one timed rep of every callable per round, in a fresh random order each round
  (seeded), so clock and thermal drift hits every callable alike. Round ``r`` feeds every callable
  input set ``r % len(input_sets)``, so the rounds rotate through the input buffers and the
  callables of one round see the same inputs.
* **Each rep**: on a GPU, a write of a buffer twice the L2 size (allocated once) flushes the cache
  before every call, and a rep is two calls of the callable on the same inputs:

  - the first is timed by CUDA events (``median_ms``, ``"clock": "cuda-event"``). It is queued
    behind the flush and a *lead*, a ``torch.cuda._sleep`` spin sized from the call's recent host
    launch times (50 us + 2x their 90th percentile, at most 5 ms), so the host launches everything
    before the device reaches the start event and the events measure device time, not launch
    gaps. ``lead_short_reps`` counts the reps whose launches took longer than their lead (their
    event time may include launch gaps). A call whose launches took longer than the events saw
    (launch-bound) is timed by its host time instead: a loop of calls waits for the longer of
    the two;
  - the second starts on an idle, flushed device and is timed by ``perf_counter`` around the call
    and a ``synchronize`` (``wall_median_ms``), so host-side launch overhead is not hidden.
    ``host_median_ms`` is how long the first call took to return on the host (its launches).

  On the CPU a rep is one call timed by ``perf_counter`` (``"clock": "cpu-wall"``), no cache flush.
* **Stopping**: at ``max_reps`` rounds; or from ``min_reps`` on, once the median of every callable
  moves less than 0.5 % over the last 10 rounds; or when the time budget ``max_time_s`` (the whole
  call, warm-up included) is spent, but never before ``min(min_reps, 6)`` rounds (6 rounds is the
  fewest for which a 95 % median interval exists) nor before every sampled output was taken.
* **CUDA graphs**: when any callable's event median is under ``graph_threshold_us``, every
  callable is also captured as a CUDA graph (warmed up on a side stream first, as the torch docs
  say) on the first input set and timed as a batch of back-to-back replays between two events,
  after one flush and a lead, interleaved like the rounds (``graph_median_ms`` is per replay, warm
  L2 after the first); if any capture fails, no callable gets graph timings and the reason is
  recorded.
* **Ratios**: with a baseline, each round gives a paired ratio ``baseline / candidate`` (a speedup
  above 1). Its point estimate is the median over rounds; its 95 % confidence interval is the
  distribution-free order-statistic interval of the median (the sign-test interval: the k-th
  smallest and k-th largest ratios, k from the Binomial(n, 1/2) distribution), exact for any
  distribution of the per-round ratios and deterministic. A candidate is ``significant`` only when
  the lower bound is above 1 (and n is large enough for the interval to reach 95 %).

All calls run under ``torch.no_grad()``, with Python's cyclic garbage collector paused.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kernelcrew.config import Settings
from kernelcrew.records import BenchmarkResult, TimingFailure

if TYPE_CHECKING:
    from kernelcrew.tools.correctness import Golden

CLOCK_CUDA = "cuda-event"
CLOCK_CPU = "cpu-wall"
CI_LEVEL = 0.95
CI_METHOD = "order-statistic (sign-test) 95% interval of the median per-round ratio baseline/candidate"
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def parse_compile_modes(spec: str, device: str) -> list[str]:
    """The ``torch.compile`` baselines a ``--compile-modes`` value names.

    ``auto`` is ``default`` and ``max-autotune-no-cudagraphs`` on a GPU and none on a CPU (where
    timings are labelled and never drive a decision, and compiling costs minutes); ``none`` is none;
    otherwise a comma list of modes. Raises ``ValueError`` for an unknown mode.
    """
    if spec == "auto":
        return ["default", "max-autotune-no-cudagraphs"] if device.startswith("cuda") else []
    if spec == "none":
        return []
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in COMPILE_MODES]
    if bad:
        raise ValueError(f"unknown torch.compile mode(s) {bad}: use auto, none or {', '.join(COMPILE_MODES)}")
    return modes


_MIN_ROUNDS = 6  # fewest rounds for which a 95 % order-statistic interval of the median exists
_STABLE_EVERY = 10  # rounds between checks of the medians
_STABLE_REL = 0.005  # a median that moves less than this over _STABLE_EVERY rounds is stable
_WARMUP_BUDGET_SHARE = 0.25  # most of the time budget the warm-up may use once each callable ran twice
_FALLBACK_L2_BYTES = 128 * 1024**2  # when the device does not report its L2 size
_GRAPH_CAPTURE_WARMUP = 3  # calls on the side stream before a capture
_GRAPH_TARGET_US = 1000.0  # replays per graph rep are chosen to last about this long
_GRAPH_MIN_REPLAYS = 10
_GRAPH_MAX_REPLAYS = 1000
_GRAPH_MAX_ROUNDS = 100
_TIME_FLOOR_MS = 1e-6  # times are clamped to this before ratios are taken (an empty call may time as 0)
_LEAD_BASE_US = 50.0  # device-side lead before an event-timed call: this, plus
_LEAD_FACTOR = 2.0  # this times the 90th percentile of the call's recent host launch times,
_LEAD_MAX_US = 5000.0  # at most this
_LEAD_WINDOW = 20  # recent reps the lead is sized from
_SLEEP_CALIBRATION_CYCLES = 2_000_000
_SYNC_GAP_SAMPLES = 20  # idle synchronizations that calibrate the device-wide span
_OFF_STREAM_ABS_MS = 0.005  # a span this much longer than the events (and
_OFF_STREAM_REL = 0.05  # this share of them) means work the events did not see
#: The parent's own clock bounds what a process may report: a callable whose reps the parent saw
#: last longer (less the trusted process's overhead per request) than this multiple of the time
#: reported, plus _CLOCK_SLACK_MS and three times the spread of that overhead, was timed by a
#: clock that lies (a candidate's process can patch its own timers).
_CLOCK_TRUST_FACTOR = 2.0
_CLOCK_SLACK_MS = 0.2
_FRESH_SPREAD = 0.25  # fresh data: each element scaled by a factor in [1 - this, 1 + this]
_FRESH_PROBE = 4096  # elements looked at to tell a mask or labels from data
_FRESH_FEW_VALUES = 16  # at most this many distinct values: a mask or labels, kept as is


@dataclass
class TimingConfig:
    """How long and how carefully :func:`measure` times (see the module docstring)."""

    warmup_calls: int = 10
    warmup_ms: float = 100.0
    min_reps: int = 100
    max_reps: int = 1000
    max_time_s: float = 10.0  # per whole measure() call, all callables, warm-up included
    flush_l2: bool = True
    graph_threshold_us: float = 20.0
    seed: int = 0

    @classmethod
    def quick(cls) -> TimingConfig:
        """Few reps and a short warm-up, for tests and smoke runs (never for reported numbers)."""
        return cls(warmup_calls=2, warmup_ms=0.0, min_reps=10, max_reps=20, max_time_s=2.0)

    def validate(self) -> None:
        """Raise ``ValueError`` on settings :func:`measure` cannot honour."""
        if self.warmup_calls < 1:
            raise ValueError(f"warmup_calls must be at least 1, got {self.warmup_calls}")
        if self.warmup_ms < 0:
            raise ValueError(f"warmup_ms must be >= 0, got {self.warmup_ms}")
        if self.min_reps < 1:
            raise ValueError(f"min_reps must be at least 1, got {self.min_reps}")
        if self.max_reps < self.min_reps:
            raise ValueError(f"max_reps ({self.max_reps}) must be >= min_reps ({self.min_reps})")
        if not self.max_time_s > 0:
            raise ValueError(f"max_time_s must be > 0, got {self.max_time_s}")
        if self.graph_threshold_us < 0:
            raise ValueError(f"graph_threshold_us must be >= 0, got {self.graph_threshold_us}")


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def median_ci(values: Sequence[float] | np.ndarray, level: float = CI_LEVEL) -> tuple[float, float, float]:
    """Distribution-free confidence interval of the median: ``(low, high, coverage)``.

    The interval is ``[x_(k), x_(n-k+1)]`` of the sorted values, with the largest ``k`` for which
    ``P(Binomial(n, 1/2) <= k - 1) <= (1 - level) / 2``; ``coverage`` is its exact coverage
    ``1 - 2 P(B <= k - 1)`` for independent draws of any continuous distribution. When ``n`` is too
    small for ``level`` (n < 6 at 95 %) it is ``[min, max]`` and ``coverage`` says how far it falls
    short.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    if n == 0:
        raise ValueError("median_ci: no values")
    total = 2**n
    tail = Fraction(1 - Fraction(level).limit_denominator(10**6), 2) * total  # allowed tail count
    cum = 0  # sum of comb(n, i) for i <= j
    k = 1
    for j in range(n):
        cum_next = cum + math.comb(n, j)
        if cum_next > tail:
            break
        cum = cum_next
        k = j + 1  # P(B <= k - 1) = cum / 2**n <= tail
    k = min(k, (n + 1) // 2)
    below = sum(math.comb(n, i) for i in range(k))  # P(B <= k - 1) * 2**n
    coverage = float(1 - Fraction(2 * below, total))
    return float(x[k - 1]), float(x[n - k]), coverage


def _summary(times_ms: np.ndarray) -> dict[str, float | None]:
    median = float(np.median(times_ms))
    p10, p25, p75, p90 = (float(v) for v in np.percentile(times_ms, [10, 25, 75, 90]))
    return {
        "median_ms": median,
        "mean_ms": float(np.mean(times_ms)),
        "p10_ms": p10,
        "p90_ms": p90,
        "iqr_ms": p75 - p25,
        "spread_pct": (p90 - p10) / median * 100 if median > 0 else None,
    }


def _paired_ratios(base: np.ndarray, cand: np.ndarray) -> np.ndarray:
    return np.maximum(base, _TIME_FLOOR_MS) / np.maximum(cand, _TIME_FLOOR_MS)


# ----------------------------------------------------------------------------------------------
# Clocks
# ----------------------------------------------------------------------------------------------


@dataclass
class _Rep:
    """One timed rep: the output of the event-timed call and its times in ms."""

    out: Any
    clock_ms: float  # CUDA event time on a GPU, wall time on the CPU
    wall_ms: float  # synchronized wall time from an idle device
    host_ms: float  # time for the call to return on the host (launches, no synchronize)
    span_ms: float | None = None  # device-wide: start event to all work of the process done


def lead_for(host_ms: Sequence[float]) -> float:
    """Microseconds of device-side lead that let the host launch a call ahead of the device.

    Sized from the 90th percentile of the last host launch times ``host_ms`` of that call.
    """
    recent = np.asarray(host_ms[-_LEAD_WINDOW:], dtype=float)
    host_us = float(np.percentile(recent, 90)) * 1e3 if recent.size else 0.0
    return min(_LEAD_MAX_US, _LEAD_BASE_US + _LEAD_FACTOR * host_us)


class _Timer:
    """Times calls on one device; owns the L2 flush buffer, the CUDA events and the lead kernel."""

    def __init__(self, device: torch.device, flush_l2: bool) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.flush_buffer: torch.Tensor | None = None
        self.cycles_per_us: float | None = None
        self.sync_gap_ms = 0.0
        if self.is_cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.after = torch.cuda.Event(enable_timing=True)
            if flush_l2:
                props = torch.cuda.get_device_properties(device)
                l2 = int(getattr(props, "L2_cache_size", 0) or 0) or _FALLBACK_L2_BYTES
                self.flush_buffer = torch.empty(2 * l2, dtype=torch.uint8, device=device)
            self.cycles_per_us = self._calibrate_sleep()
            self.sync_gap_ms = self._calibrate_sync_gap()

    def _calibrate_sleep(self) -> float | None:
        """GPU clock cycles per microsecond of ``torch.cuda._sleep`` (None where torch lacks it)."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return None
        rate = None
        for _ in range(2):  # the first run loads the kernel
            self.sync()
            self.start.record()
            sleep(_SLEEP_CALIBRATION_CYCLES)
            self.end.record()
            self.sync()
            ms = self.start.elapsed_time(self.end)
            rate = _SLEEP_CALIBRATION_CYCLES / (ms * 1e3) if ms > 0 else None
        return rate

    def _calibrate_sync_gap(self) -> float:
        """Device time between an event whose work is done and one recorded right after the host
        saw the device idle: what a device-wide span adds to an honest call's event time."""
        gaps = []
        for _ in range(_SYNC_GAP_SAMPLES):
            self.sync()
            self.end.record()
            self.sync()
            self.after.record()
            self.sync()
            gaps.append(self.end.elapsed_time(self.after))
        return float(np.median(gaps))

    @property
    def flush_bytes(self) -> int:
        return 0 if self.flush_buffer is None else self.flush_buffer.numel()

    def sync(self) -> None:
        """Wait for all work of this process on the device, on every stream."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        """Overwrite the L2 cache (a no-op on the CPU or with ``flush_l2=False``); asynchronous on a GPU."""
        if self.flush_buffer is not None:
            self.flush_buffer.zero_()

    def lead(self, lead_us: float) -> None:
        """Keep the device busy for about ``lead_us`` so the launches that follow queue up behind it."""
        if self.cycles_per_us is not None and lead_us > 0:
            torch.cuda._sleep(int(lead_us * self.cycles_per_us))

    def time_call(
        self,
        fn: Callable[[Sequence[Any]], Any],
        inputs: Sequence[Any],
        lead_us: float,
        again_inputs: Sequence[Any] | None = None,
    ) -> _Rep:
        """One timed rep (see the module docstring): one call on the CPU, two on a GPU.

        On a GPU the wall-clocked call (on ``again_inputs``, fresh data of its own, when given)
        comes first and the event-timed call last: the rep's output, the one that may be judged,
        is the last thing the candidate ran, so work it defers to a later call is missing from it."""
        if not self.is_cuda:
            t0 = time.perf_counter()
            out = fn(inputs)
            wall_ms = (time.perf_counter() - t0) * 1e3
            return _Rep(out, wall_ms, wall_ms, wall_ms)
        self.sync()
        self.flush()
        self.sync()
        t0 = time.perf_counter()
        again = fn(inputs if again_inputs is None else again_inputs)
        self.sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
        del again

        self.flush()
        self.lead(lead_us)
        self.start.record()
        t0 = time.perf_counter()
        out = fn(inputs)
        host_ms = (time.perf_counter() - t0) * 1e3
        self.end.record()
        self.sync()  # device-wide: work the call left on other streams is waited for too
        self.after.record()
        self.sync()
        clock_ms = self.start.elapsed_time(self.end)
        span_ms = max(clock_ms, self.start.elapsed_time(self.after) - self.sync_gap_ms)
        return _Rep(out, clock_ms, wall_ms, host_ms, span_ms)

    def replay_host_ms(self, graph: torch.cuda.CUDAGraph, replays: int) -> float:
        """Host time to launch ``replays`` replays of ``graph`` (the lead their timing needs)."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        host_ms = (time.perf_counter() - t0) * 1e3
        self.sync()
        return host_ms

    def time_replays(self, graph: torch.cuda.CUDAGraph, replays: int, lead_us: float) -> float:
        """Milliseconds per replay of ``graph``: ``replays`` back-to-back replays after one flush and a lead."""
        self.sync()
        self.flush()
        self.lead(lead_us)
        self.start.record()
        for _ in range(replays):
            graph.replay()
        self.end.record()
        self.sync()
        self.after.record()
        self.sync()
        clock = self.start.elapsed_time(self.end)
        span = max(clock, self.start.elapsed_time(self.after) - self.sync_gap_ms)
        return span / replays


def _resolve_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"unsupported device {device!r}: expected 'cuda', 'cuda:N' or 'cpu'")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but no CUDA GPU is available; use device='cpu'")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
        )
    return torch.device("cuda", index)


@contextlib.contextmanager
def _on_device(dev: torch.device) -> Iterator[None]:
    """No autograd, the device current, and Python's cyclic garbage collector paused (as ``timeit`` does)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            if dev.type == "cuda":
                with torch.cuda.device(dev):
                    yield
            else:
                yield
    finally:
        if gc_was_enabled:
            gc.enable()


# ----------------------------------------------------------------------------------------------
# Fresh inputs: every timed call gets data no earlier call saw
# ----------------------------------------------------------------------------------------------


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor, int], Any], counter: list[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        counter[0] += 1
        return fn(obj, counter[0])
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(o, fn, counter) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, counter) for k, v in obj.items()}
    return obj


def _has_few_values(t: torch.Tensor) -> bool:
    """Whether a tensor looks like a mask, labels or one-hot data (few distinct values): its values
    carry meaning, so fresh data keeps them."""
    sample = t.detach().reshape(-1)[:_FRESH_PROBE]
    return int(torch.unique(sample).numel()) <= _FRESH_FEW_VALUES


def fresh_inputs(inputs: Sequence[Any], seed: int) -> list[Any]:
    """New data of the same distribution for one timed call: each floating tensor scaled
    elementwise by factors drawn uniformly from [0.75, 1.25] under ``seed`` (signs, zeros, masks
    and labels kept), every other tensor copied. Deterministic for a seed on a device, so the
    reference's process makes the same data to compute the golden of a judged call."""

    def one(t: torch.Tensor, index: int) -> torch.Tensor:
        if not t.is_floating_point() or t.numel() == 0 or _has_few_values(t):
            return t.clone()
        generator = torch.Generator(device=t.device)
        generator.manual_seed((seed * 1_000_003 + index) % 2**63)
        factor = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        factor.uniform_(1 - _FRESH_SPREAD, 1 + _FRESH_SPREAD, generator=generator)
        return (t.to(torch.float32) * factor).to(t.dtype) if t.dtype != torch.float64 else t * factor.double()

    return list(_map_tensors(list(inputs), one, [0]))


def pick_elements(tensors: Sequence[torch.Tensor], pick: int | None) -> list[dict[str, Any]]:
    """What is judged of an output: each tensor's shape and dtype, and all of its elements or, for a
    tensor of more than ``JUDGED_ELEMENTS``, that many at positions drawn from ``pick`` (on the
    CPU's generator: the reference's process draws the same ones for the golden). The positions
    are chosen after the call returned, so a wrong element anywhere is as likely to be judged as
    any other; every element of the verification's input-set calls is judged in full."""
    kept = []
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        if pick is not None and flat.numel() > JUDGED_ELEMENTS:
            generator = torch.Generator().manual_seed((pick * 1_000_003 + i) % 2**63)
            index = torch.randint(0, flat.numel(), (JUDGED_ELEMENTS,), generator=generator)
            flat = flat[index.to(flat.device)]
        kept.append({"values": flat.to("cpu").clone(), "shape": list(t.shape), "dtype": str(t.dtype)})
    return kept


def again_seed(seed: int) -> int:
    """The fresh-data seed of a rep's second (wall-clock) call."""
    return (seed ^ 0x5BD1E995) % 2**62


# ----------------------------------------------------------------------------------------------
# A lane: the callables of one process, timed on request
# ----------------------------------------------------------------------------------------------


def _validate_inputs(
    callables: dict[str, Callable[[Sequence[Any]], Any]],
    input_sets: list[list[Any]],
    config: TimingConfig,
    baseline: str | None,
    sample_outputs: int,
    on_sample: Callable[[str, int, Any], None] | None,
) -> None:
    config.validate()
    if not callables:
        raise ValueError("measure: no callables to time")
    for name, fn in callables.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"measure: callable names must be non-empty strings, got {name!r}")
        if not callable(fn):
            raise ValueError(f"measure: {name!r} is not callable")
    if not input_sets:
        raise ValueError("measure: no input sets")
    for i, inputs in enumerate(input_sets):
        if not isinstance(inputs, (list, tuple)):
            raise ValueError(f"measure: input set {i} must be a list of positional arguments")
    if baseline is not None and baseline not in callables:
        raise ValueError(f"measure: baseline {baseline!r} is not one of the callables {sorted(callables)}")
    if sample_outputs < 0:
        raise ValueError(f"measure: sample_outputs must be >= 0, got {sample_outputs}")
    if sample_outputs and on_sample is None:
        raise ValueError("measure: sample_outputs > 0 needs an on_sample callback")


class Lane:
    """The callables of one process, its input sets and its timer: one side of a benchmark.

    The parent (:func:`run_rounds`) decides everything else: the order of the reps, the input set
    and fresh-data seed of each, which outputs are kept for judging (told only after the rep),
    and when to stop. A lane in the candidates' process answers over a sandbox session
    (:meth:`handle`); in tests it is called directly.
    """

    def __init__(
        self,
        callables: dict[str, Callable[[Sequence[Any]], Any]],
        input_sets: list[list[Any]],
        dev: torch.device,
        config: TimingConfig,
        *,
        fresh: bool = True,
        check_call: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.callables = callables
        self.input_sets = input_sets
        self.dev = dev
        self.config = config
        self.fresh = fresh
        self.check_call = check_call
        self.timer = _Timer(dev, config.flush_l2)
        self.last: dict[str, Any] = {}
        self.kept: dict[str, list[torch.Tensor]] = {}
        self.graphs: dict[str, tuple[torch.cuda.CUDAGraph, Any]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.callables)

    def info(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "l2_flush_bytes": self.timer.flush_bytes,
            "lead_kernel": self.timer.cycles_per_us is not None,
            "sync_gap_ms": self.timer.sync_gap_ms,
        }

    def inputs_for(self, set_index: int, seed: int | None) -> list[Any]:
        inputs = self.input_sets[set_index]
        return fresh_inputs(inputs, seed) if self.fresh and seed is not None else inputs

    def warm_up(self, name: str, budget_s: float) -> dict[str, Any]:
        """Run ``name`` until it is warm (see the module docstring); sizes its lead."""
        fn = self.callables[name]
        calls = 0
        costs: list[float] = []  # ms per rep, flush, lead and synchronizations included
        hosts: list[float] = []
        lead_us = _LEAD_BASE_US
        started = time.perf_counter()
        recent = slice(None)
        while True:
            t0 = time.perf_counter()
            rep = self.timer.time_call(fn, self.input_sets[calls % len(self.input_sets)], lead_us)
            rep.out = None  # drop the output now
            costs.append((time.perf_counter() - t0) * 1e3)
            hosts.append(rep.host_ms)
            calls += 1
            recent = slice(max(1, calls // 2), None) if calls > 1 else slice(None)  # the first may compile
            lead_us = lead_for(hosts[recent])
            elapsed = time.perf_counter() - started
            if calls >= self.config.warmup_calls and elapsed * 1e3 >= self.config.warmup_ms:
                break
            if calls >= 2 and elapsed >= budget_s:
                break
        return {"calls": calls, "est_ms": float(np.median(costs[recent])), "lead_us": lead_us}

    def rep(self, name: str, set_index: int, seed: int | None, lead_us: float) -> dict[str, Any]:
        """One timed rep of ``name`` on fresh data of input set ``set_index``."""
        self.last.pop(name, None)
        inputs = self.inputs_for(set_index, seed)
        again = self.inputs_for(set_index, again_seed(seed)) if seed is not None and self.fresh else None
        rep = self.timer.time_call(self.callables[name], inputs, lead_us, again)
        del inputs, again
        self.last[name] = rep.out
        return {
            "clock_ms": rep.clock_ms,
            "wall_ms": rep.wall_ms,
            "host_ms": rep.host_ms,
            "span_ms": rep.span_ms,
        }

    def check(self, name: str) -> None:
        """The checks of ``name``'s last call (``check_call``), asked for apart from the rep, so the
        parent's clock around a rep sees the same work in every process (:func:`untrusted_clocks`)."""
        if self.check_call is not None and name in self.last:
            self.check_call(name, self.last[name])

    def keep(self, name: str, key: str, pick: int | None) -> None:
        """Keep what is judged of ``name``'s last output (:func:`pick_elements`) under ``key``."""
        self.kept[key] = pick_elements(_flat_tensors(self.last.pop(name)), pick)

    def output(self, name: str) -> Any:
        return self.last.get(name)

    def capture_graphs(self) -> str:
        """Capture every callable as a CUDA graph on input set 0; the reason when one fails."""
        self.graphs, failure = _capture_graphs(self.callables, self.input_sets[0], self.dev)
        return failure

    def graph_host_ms(self, name: str, replays: int) -> float:
        return self.timer.replay_host_ms(self.graphs[name][0], replays)

    def graph_rep(self, name: str, replays: int, lead_us: float) -> float:
        ms = self.timer.time_replays(self.graphs[name][0], replays, lead_us)
        if self.check_call is not None:
            self.check_call(name, self.graphs[name][1])
        return ms

    def keep_graph(self, name: str, key: str, pick: int | None) -> None:
        """Keep what is judged of the static output of ``name``'s graph (input set 0)."""
        self.kept[key] = pick_elements(_flat_tensors(self.graphs[name][1]), pick)

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.timer.sync()

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """Serve one request of :class:`RemoteLane` (a sandbox session's message)."""
        op = message["op"]
        for key, name, pick in message.get("keep", []):
            self.keep(name, key, pick)
        if op == "info":
            return self.info()
        if op == "warm_up":
            return self.warm_up(message["name"], float(message["budget_s"]))
        if op == "rep":
            return self.rep(message["name"], int(message["set"]), message["seed"], float(message["lead_us"]))
        if op == "check":
            self.check(message["name"])
            return {}
        if op == "capture_graphs":
            return {"failure": self.capture_graphs()}
        if op == "graph_host_ms":
            return {"ms": self.graph_host_ms(message["name"], int(message["replays"]))}
        if op == "graph_rep":
            return {"ms": self.graph_rep(message["name"], int(message["replays"]), float(message["lead_us"]))}
        if op == "keep_graph":
            self.keep_graph(message["name"], message["key"], message["pick"])
            return {}
        if op == "drop_graphs":
            self.drop_graphs()
            return {}
        if op == "keep":
            return {}
        raise ValueError(f"unknown lane request {op!r}")


class RemoteLane:
    """A :class:`Lane` in a sandboxed child, driven through its session (same methods)."""

    def __init__(self, session: Any, info: dict[str, Any]) -> None:
        self.session = session
        self.names: list[str] = list(info["names"])
        self._info = info
        self._keep: list[tuple[str, str, int | None]] = []

    def _ask(self, op: str, **fields: Any) -> dict[str, Any]:
        keep, self._keep = self._keep, []
        return self.session.request({"op": op, "keep": keep, **fields})

    def info(self) -> dict[str, Any]:
        return self._info

    def warm_up(self, name: str, budget_s: float) -> dict[str, Any]:
        return self._ask("warm_up", name=name, budget_s=budget_s)

    def rep(self, name: str, set_index: int, seed: int | None, lead_us: float) -> dict[str, Any]:
        return self._ask("rep", name=name, set=set_index, seed=seed, lead_us=lead_us)

    def check(self, name: str) -> None:
        self._ask("check", name=name)

    def keep(self, name: str, key: str, pick: int | None) -> None:
        self._keep.append((key, name, pick))  # sent with the next request, after the rep it is about

    def flush_keeps(self) -> None:
        if self._keep:
            self._ask("keep")

    def capture_graphs(self) -> str:
        return self._ask("capture_graphs")["failure"]

    def graph_host_ms(self, name: str, replays: int) -> float:
        return self._ask("graph_host_ms", name=name, replays=replays)["ms"]

    def graph_rep(self, name: str, replays: int, lead_us: float) -> float:
        return self._ask("graph_rep", name=name, replays=replays, lead_us=lead_us)["ms"]

    def keep_graph(self, name: str, key: str, pick: int | None) -> None:
        self._ask("keep_graph", name=name, key=key, pick=pick)

    def drop_graphs(self) -> None:
        self._ask("drop_graphs")


def _flat_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in _flat_tensors(o)]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flat_tensors(out[k])]
    if isinstance(out, bool | int | float):
        return [torch.tensor(out)]
    if out is None:
        return []
    raise TypeError(f"forward returned {type(out).__name__}; expected tensors")


def _capture_graphs(
    callables: dict[str, Callable[[Sequence[Any]], Any]],
    inputs: Sequence[Any],
    dev: torch.device,
) -> tuple[dict[str, tuple[torch.cuda.CUDAGraph, Any]], str]:
    """Capture every callable on ``inputs``; ``({}, reason)`` as soon as one capture fails."""
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, Any]] = {}
    current = torch.cuda.current_stream(dev)
    # A capture that fails leaves the device's default generator in capture mode (every later
    # random op raises "Offset increment outside graph capture"); its state is put back then.
    generator = torch.cuda.default_generators[dev.index if dev.index is not None else 0]
    saved_rng = generator.clone_state()
    for name, fn in callables.items():
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(_GRAPH_CAPTURE_WARMUP):
                    fn(inputs)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = fn(inputs)
        except Exception as exc:  # not swallowed: the reason is recorded and no graph timings are reported
            graphs.clear()
            torch.cuda.synchronize(dev)
            generator.graphsafe_set_state(saved_rng)
            return {}, f"capture of {name!r} failed: {_describe(exc)}; no graph timings"
        graphs[name] = (graph, static_out)
    torch.cuda.synchronize(dev)
    return graphs, ""


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of an exception and of the exceptions it was raised from or during."""
    parts = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 4:
        seen.add(id(current))
        lines = str(current).strip().splitlines()
        parts.append(f"{type(current).__name__}: {lines[0] if lines else ''}".strip())
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


# ----------------------------------------------------------------------------------------------
# The rounds: decided here, run by the lanes
# ----------------------------------------------------------------------------------------------


def measure(
    callables: dict[str, Callable[[Sequence[Any]], Any]],
    input_sets: list[list[Any]],
    *,
    device: str,
    config: TimingConfig,
    baseline: str | None = None,
    sample_outputs: int = 0,
    on_sample: Callable[[str, int, Any], None] | None = None,
    check_call: Callable[[str], None] | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Time every callable (called as ``fn(input_set)``) in this process by the protocol of the
    module docstring (:func:`run_rounds` over one :class:`Lane`).

    ``sample_outputs=k``: for each callable, ``k`` timed reps chosen at random hand
    ``(name, input_set_index, output)`` to ``on_sample`` right after the rep, outside the timed
    region. ``check_call(name)`` runs after every timed rep (and graph rep), outside the timed
    region; whatever either raises propagates. ``fresh`` gives every timed call fresh data
    (:func:`fresh_inputs`); off, the rounds rotate through ``input_sets`` as they are.

    Returns a JSON-serializable dict: ``clock``, ``device``, ``results`` (per callable: median,
    mean, p10, p90, IQR in ms, ``spread_pct``, ``reps``, ``wall_median_ms``, ``graph_median_ms``,
    ``host_median_ms``, ``lead_us``, ``lead_short_reps``, ``warmup_calls``, ``samples``,
    ``off_stream_ms``), ``ratios`` (per candidate, only with a baseline: ``median``, ``ci_low``,
    ``ci_high``, ``ci_coverage``, ``significant``, ``wall_median``, ``graph_median``), ``graph``,
    ``config``, ``l2_flush_bytes``, and how the run went (``rounds``, ``stop_reason``,
    ``elapsed_s``).
    """
    _validate_inputs(callables, input_sets, config, baseline, sample_outputs, on_sample)
    dev = _resolve_device(device)
    with _on_device(dev):
        lane = Lane(
            callables,
            input_sets,
            dev,
            config,
            fresh=fresh,
            check_call=(lambda name, out: check_call(name)) if check_call is not None else None,
        )

        def sampled(name: str, key: str, set_index: int) -> None:
            assert on_sample is not None
            on_sample(name, set_index, lane.output(name))

        return run_rounds(
            [lane],
            device=str(dev),
            config=config,
            baseline=baseline,
            sample_outputs=sample_outputs,
            n_sets=len(input_sets),
            on_sample=sampled if on_sample is not None else None,
            seeded=fresh,
        )


def run_rounds(
    lanes: Sequence[Lane | RemoteLane],
    *,
    device: str,
    config: TimingConfig,
    baseline: str | None,
    n_sets: int,
    sample_outputs: int = 0,
    sample_names: Sequence[str] | None = None,
    on_sample: Callable[[str, str, int], None] | None = None,
    seeded: bool = True,
    trusted: Sequence[str] = (),
) -> dict[str, Any]:
    """Warm up, then time every callable of every lane in interleaved rounds (module docstring).

    With ``trusted`` (the callables of a process that runs no candidate code), every other
    callable's reported times are checked against this process's own clock around each request
    (:func:`untrusted_clocks`); ``stats["clock_lies"]`` names those that fail.

    Each round picks an input set and, with ``seeded``, a fresh-data seed from a secret random
    source; every callable of the round gets the same. ``sample_outputs`` reps of each callable in
    ``sample_names`` (all when None) among the planned rounds, and up to as many again among the
    rounds past them, chosen from the secret source, are kept for judging: the lane
    hears which only after the rep (``lane.keep(name, key, pick)``), and ``on_sample(name, key,
    set_index)`` is called then. ``stats["samples_taken"]`` maps each key to ``(name, set_index,
    seed, pick)``, what the golden of that output needs (a CUDA graph's output too: key
    ``graph:NAME``, input set 0, no fresh data).
    """
    import secrets as _secrets

    secret = random.Random(_secrets.randbits(64))
    order_rng = random.Random(config.seed)
    started = time.perf_counter()
    owner: dict[str, Lane | RemoteLane] = {name: lane for lane in lanes for name in lane.names}
    names = list(owner)
    if baseline is not None and baseline not in owner:
        raise ValueError(f"measure: baseline {baseline!r} is not one of the callables {sorted(owner)}")
    floor_rounds = min(_MIN_ROUNDS, config.min_reps)
    is_cuda = device.startswith("cuda")

    # Warm-up, one callable after the other; it also sizes each callable's lead.
    warmup_calls: dict[str, int] = {}
    lead_us: dict[str, float] = {}
    round_ms = 0.0
    share_s = _WARMUP_BUDGET_SHARE * config.max_time_s / len(names)
    for name in names:
        warm = owner[name].warm_up(name, share_s)
        warmup_calls[name], lead_us[name] = int(warm["calls"]), float(warm["lead_us"])
        round_ms += float(warm["est_ms"])

    # Rounds planned within the budget; the judged reps are drawn from those, secretly.
    remaining_ms = (config.max_time_s - (time.perf_counter() - started)) * 1e3
    planned = int(remaining_ms / max(round_ms, 1e-3))
    planned = max(floor_rounds, min(config.min_reps, planned))
    judged = [n for n in names if sample_names is None or n in sample_names]
    samples: dict[str, set[int]] = {
        name: set(secret.sample(range(planned), min(sample_outputs, planned))) for name in judged
    }
    last_sample = max((max(s) for s in samples.values() if s), default=-1)
    # A run goes on past the planned rounds until its timings are stable: those rounds are judged
    # too, each rep with the planned rounds' rate, up to as many again, so a candidate honest only
    # in its first rounds is as likely to be caught as one honest only in its last.
    late_rate = min(1.0, sample_outputs / planned) if planned else 0.0
    late_left = dict.fromkeys(judged, sample_outputs)
    taken: dict[str, tuple[str, int, int | None]] = {}

    clock_ms: dict[str, list[float]] = {name: [] for name in names}
    span_ms: dict[str, list[float]] = {name: [] for name in names}
    wall_ms: dict[str, list[float]] = {name: [] for name in names}
    host_ms: dict[str, list[float]] = {name: [] for name in names}
    device_ms: dict[str, list[float]] = {name: [] for name in names}  # the events alone
    seen_ms: dict[str, list[float]] = {name: [] for name in names}  # by this process's clock
    leads_used: dict[str, list[float]] = {name: [] for name in names}
    lead_short: dict[str, int] = dict.fromkeys(names, 0)
    rounds = 0
    stop_reason = ""
    while not stop_reason:
        order = names[:]
        order_rng.shuffle(order)
        set_index = rounds % n_sets
        seed = secret.randrange(2**62) if seeded else None
        for name in order:
            asked = time.perf_counter()
            rep = owner[name].rep(name, set_index, seed, lead_us[name])
            seen_ms[name].append((time.perf_counter() - asked) * 1e3)
            owner[name].check(name)
            # A launch-bound call (its launches outlast its device work) takes its host time: a
            # loop of calls waits for that, and the lead would hide it from the events.
            launched = float(rep["host_ms"])
            device_ms[name].append(float(rep["clock_ms"]))
            clock_ms[name].append(max(device_ms[name][-1], launched))
            span = rep["span_ms"] if rep.get("span_ms") is not None else rep["clock_ms"]
            span_ms[name].append(max(float(span), launched))
            wall_ms[name].append(float(rep["wall_ms"]))
            host_ms[name].append(float(rep["host_ms"]))
            leads_used[name].append(lead_us[name])
            if rep["host_ms"] * 1e3 > lead_us[name]:
                lead_short[name] += 1
            lead_us[name] = lead_for(host_ms[name])
            late = rounds >= planned and late_left.get(name, 0) > 0 and secret.random() < late_rate
            if late:
                late_left[name] -= 1
                samples[name].add(rounds)
            if name in samples and rounds in samples[name]:
                key = f"timed:{name}:{rounds}"
                pick = secret.randrange(2**62)
                taken[key] = (name, set_index, seed, pick)
                if on_sample is not None:
                    on_sample(name, key, set_index)
                owner[name].keep(name, key, pick)
        rounds += 1
        if rounds >= config.max_reps:
            stop_reason = "max_reps"
        elif (
            rounds >= max(config.min_reps, 2)
            and (rounds - config.min_reps) % _STABLE_EVERY == 0
            and all(_is_stable(clock_ms[name]) for name in names)
        ):
            stop_reason = "stable"
        if (
            not stop_reason
            and time.perf_counter() - started >= config.max_time_s
            and rounds >= floor_rounds
            and rounds > last_sample
        ):
            stop_reason = "time_budget"
    for lane in lanes:
        if isinstance(lane, RemoteLane):
            lane.flush_keeps()

    # Work the events did not see (left running on another stream, or deferred) shows as a
    # device-wide span longer than the event time: then the span is the time.
    off_stream: dict[str, float] = {}
    for name in names:
        excess = float(np.median(np.asarray(span_ms[name]) - np.asarray(clock_ms[name])))
        if is_cuda and excess > max(_OFF_STREAM_ABS_MS, _OFF_STREAM_REL * float(np.median(clock_ms[name]))):
            off_stream[name] = excess
            clock_ms[name] = span_ms[name]
    clock_arr = {name: np.asarray(clock_ms[name]) for name in names}
    wall_arr = {name: np.asarray(wall_ms[name]) for name in names}
    lead_kernel = all(lane.info()["lead_kernel"] for lane in lanes)
    leads_ms = (
        {name: [us / 1e3 for us in leads_used[name]] for name in names} if is_cuda and lead_kernel else None
    )
    lies = untrusted_clocks(seen_ms, clock_ms, trusted, leads_ms)
    graph_arr, graph_info, graph_seen = _graph_phase(
        lanes,
        owner,
        is_cuda,
        config,
        order_rng,
        {n: np.asarray(t) for n, t in device_ms.items()},
        started,
        floor_rounds,
    )
    if graph_info["used"]:
        claimed = {n: [ms * graph_info["replays"][n] for ms in graph_arr[n]] for n in graph_arr}
        graph_leads = graph_info["lead_us"]
        spins = {n: [graph_leads[n] / 1e3] * len(graph_seen[n]) for n in graph_seen} if graph_leads else None
        for name, message in untrusted_clocks(graph_seen, claimed, trusted, spins).items():
            lies.setdefault(name, f"CUDA graph replays: {message}")
    if graph_info["used"]:
        for name in judged:
            pick = secret.randrange(2**62)
            owner[name].keep_graph(name, f"graph:{name}", pick)
            taken[f"graph:{name}"] = (name, 0, None, pick)
        for lane in lanes:
            lane.drop_graphs()

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        entry: dict[str, Any] = _summary(clock_arr[name])
        entry["reps"] = rounds
        entry["wall_median_ms"] = float(np.median(wall_arr[name]))
        entry["host_median_ms"] = float(np.median(host_ms[name]))
        entry["graph_median_ms"] = float(np.median(graph_arr[name])) if name in graph_arr else None
        entry["warmup_calls"] = warmup_calls[name]
        entry["samples"] = len(samples.get(name, ()))
        entry["lead_us"] = float(np.median(leads_used[name])) if lead_kernel else 0.0
        entry["lead_short_reps"] = lead_short[name] if lead_kernel else 0
        entry["off_stream_ms"] = off_stream.get(name)
        results[name] = entry

    ratios: dict[str, dict[str, Any]] = {}
    if baseline is not None:
        for name in names:
            if name == baseline:
                continue
            paired = _paired_ratios(clock_arr[baseline], clock_arr[name])
            low, high, coverage = median_ci(paired)
            graph_ratio = None
            if name in graph_arr and baseline in graph_arr:
                graph_ratio = float(np.median(_paired_ratios(graph_arr[baseline], graph_arr[name])))
            ratios[name] = {
                "median": float(np.median(paired)),
                "ci_low": low,
                "ci_high": high,
                "ci_coverage": coverage,
                "significant": bool(low > 1.0 and coverage >= CI_LEVEL),
                "wall_median": float(np.median(_paired_ratios(wall_arr[baseline], wall_arr[name]))),
                "graph_median": graph_ratio,
            }

    return {
        "clock": CLOCK_CUDA if is_cuda else CLOCK_CPU,
        "device": device,
        "baseline": baseline,
        "results": results,
        "ratios": ratios,
        "ci_method": CI_METHOD,
        "graph": graph_info,
        "config": asdict(config),
        "l2_flush_bytes": max(int(lane.info()["l2_flush_bytes"]) for lane in lanes),
        "input_sets": n_sets,
        "rounds": rounds,
        "stop_reason": stop_reason,
        "elapsed_s": time.perf_counter() - started,
        "samples_taken": {k: list(v) for k, v in taken.items()},
        "clock_lies": lies,
    }


def untrusted_clocks(
    seen_ms: dict[str, Sequence[float]],
    clock_ms: dict[str, Sequence[float]],
    trusted: Sequence[str],
    leads_ms: dict[str, Sequence[float]] | None = None,
) -> dict[str, str]:
    """Callables whose reported times this process's clock contradicts, with why.

    ``seen_ms`` are this process's times of each request (the round trip), ``clock_ms`` the times
    the lane reported for the same requests. The trusted callables' difference of the two is the
    overhead of a request (fresh data, the channel, the checks, their lead); another callable is
    caught when the parent saw, less that overhead, more than ``_CLOCK_TRUST_FACTOR`` times what
    it reported plus ``_CLOCK_SLACK_MS`` and three times the overhead's interquartile spread. A lie
    smaller than that (tens of microseconds on a quiet machine) is below what the parent can see.

    ``leads_ms`` are the leads this process asked for, per request: the device spins that long
    before the timed call, outside what the lane reports. A callable given a longer lead than the
    trusted ones' median (its launches took longer: it is charged those, :func:`run_rounds`) has
    the difference taken off what the parent saw.
    """
    base = [s - c for n in trusted if n in seen_ms for s, c in zip(seen_ms[n], clock_ms[n], strict=True)]
    if not base:
        return {}
    overhead = float(np.median(base))
    leads_ms = leads_ms or {}
    trusted_leads = [lead for n in trusted for lead in leads_ms.get(n, ())]
    usual_lead = float(np.median(trusted_leads)) if trusted_leads else 0.0
    q1, q3 = np.percentile(base, [25, 75])
    slack = _CLOCK_SLACK_MS + 3.0 * float(q3 - q1)
    lies = {}
    for name, seen in seen_ms.items():
        if name in trusted or not len(seen):
            continue
        extra_lead = np.maximum(np.asarray(leads_ms.get(name, np.zeros(len(seen)))) - usual_lead, 0.0)
        observed = float(np.median(np.asarray(seen) - extra_lead - overhead))
        reported = float(np.median(clock_ms[name]))
        if observed > _CLOCK_TRUST_FACTOR * reported + slack:
            lies[name] = (
                f"its process reported {reported:.4g} ms per call; this process saw {observed:.4g} ms "
                f"beyond the reference's {overhead:.4g} ms of overhead per request: its clock is not trusted"
            )
    return lies


def _is_stable(times: list[float]) -> bool:
    """Whether the median moved less than ``_STABLE_REL`` over the last ``_STABLE_EVERY`` reps (or half of them)."""
    step = min(_STABLE_EVERY, len(times) // 2)
    now = float(np.median(times))
    before = float(np.median(times[: len(times) - step]))
    return before > 0 and abs(now - before) / before < _STABLE_REL


def _graph_phase(
    lanes: Sequence[Lane | RemoteLane],
    owner: dict[str, Lane | RemoteLane],
    is_cuda: bool,
    config: TimingConfig,
    rng: random.Random,
    device_arr: dict[str, np.ndarray],
    started: float,
    floor_rounds: int,
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, list[float]]]:
    """CUDA-graph replay timings of every callable, or of none; ``(times per name, info, this
    process's time of each request)``.

    ``device_arr`` are the callables' event times (launches not included): a graph serves the
    calls whose device work is short. Each graph's static output is kept for judging
    (``graph:NAME``, input set 0)."""
    info: dict[str, Any] = {"used": False, "reason": "", "replays": {}, "lead_us": {}, "rounds": 0}
    if not is_cuda:
        info["reason"] = "CPU: no CUDA graphs"
        return {}, info, {}
    medians_us = {name: float(np.median(times)) * 1e3 for name, times in device_arr.items()}
    fastest = min(medians_us, key=medians_us.__getitem__)
    if medians_us[fastest] >= config.graph_threshold_us:
        info["reason"] = f"every callable's median is at least {config.graph_threshold_us:g} us"
        return {}, info, {}
    for lane in lanes:
        failure = lane.capture_graphs()
        if failure:
            for other in lanes:
                other.drop_graphs()
            info["reason"] = failure
            return {}, info, {}

    replays = {
        name: int(
            min(_GRAPH_MAX_REPLAYS, max(_GRAPH_MIN_REPLAYS, math.ceil(_GRAPH_TARGET_US / max(us, 0.1))))
        )
        for name, us in medians_us.items()
    }
    leads = {name: lead_for([owner[name].graph_host_ms(name, replays[name])]) for name in owner}
    max_rounds = min(_GRAPH_MAX_ROUNDS, max(config.min_reps, floor_rounds))
    times: dict[str, list[float]] = {name: [] for name in owner}
    seen: dict[str, list[float]] = {name: [] for name in owner}
    rounds = 0
    while rounds < max_rounds:
        order = list(owner)
        rng.shuffle(order)
        for name in order:
            asked = time.perf_counter()
            times[name].append(owner[name].graph_rep(name, replays[name], leads[name]))
            seen[name].append((time.perf_counter() - asked) * 1e3)
        rounds += 1
        if rounds >= floor_rounds and time.perf_counter() - started >= config.max_time_s:
            break
    info.update(
        used=True,
        reason=(
            f"{fastest!r} median {medians_us[fastest]:.2f} us < {config.graph_threshold_us:g} us: "
            "every callable also timed as CUDA graph replays (input set 0, one L2 flush per batch)"
        ),
        replays=replays,
        lead_us=leads if all(lane.info()["lead_kernel"] for lane in lanes) else {},
        rounds=rounds,
    )
    return {name: np.asarray(t) for name, t in times.items()}, info, seen


# ----------------------------------------------------------------------------------------------
# torch.compile baseline
# ----------------------------------------------------------------------------------------------


def compile_baseline(
    model: torch.nn.Module, mode: str, example_inputs: Sequence[Any]
) -> tuple[Callable[[Sequence[Any]], Any], float]:
    """``torch.compile`` ``model`` (``dynamic=False``, after ``torch._dynamo.reset()``) and compile it now.

    Returns ``(fn, compile_s)``: ``fn(input_set)`` calls the compiled model as ``measure`` expects,
    and ``compile_s`` is the wall time of the first call on ``example_inputs`` (under
    ``torch.no_grad()``, as in :func:`measure`, so the guards match), GPU work included.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown torch.compile mode {mode!r}: expected one of {COMPILE_MODES}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"compile_baseline needs an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (list, tuple)):
        raise ValueError("compile_baseline: example_inputs must be a list of positional arguments")
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode, dynamic=False)
    uses_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs) or any(
        p.is_cuda for p in model.parameters()
    )
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(*example_inputs)
        if uses_cuda:
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0

    def call(inputs: Sequence[Any]) -> Any:
        return compiled(*inputs)

    return call, compile_s


# ----------------------------------------------------------------------------------------------
# Parent side: the reference's process and the candidates' process, timed in lockstep
# ----------------------------------------------------------------------------------------------

#: Judged timed calls per candidate. A candidate that is wrong on half of its calls (the least
#: that moves a median) escapes 12 secret samples with probability 2**-12.
JUDGED_CALLS = 12
JUDGED_ELEMENTS = 65536  # elements judged of each tensor of a judged timed call, at most
#: Inputs and weights up to this size let the timing's processes start while the candidate is still
#: being verified (:func:`start_benchmark`); larger ones would be held by three processes at once.
OVERLAP_INPUT_BYTES = 1 << 30


def benchmark(
    task_source: str,
    candidates: dict[str, tuple[str, str]],
    *,
    device: str = "cpu",
    precision: str = "strict",
    seed: int | None = None,
    compile_modes: Sequence[str] = (),
    quick: bool = False,
    golden: Golden | None = None,
    task_path: str = "task.py",
    sample_outputs: int = JUDGED_CALLS,
    hotspots: bool = False,
    settings: Settings | None = None,
) -> BenchmarkResult:
    """Time eager, the ``torch.compile`` baselines and ``candidates`` ({name: (source, path)}).

    The reference (eager and compiled) runs in a sandboxed process that never imports candidate
    code; the candidates run in another. This process decides the rounds and asks each side for
    one rep at a time, so the two are interleaved rep by rep and drift still cancels. Every timed
    call gets fresh data; ``sample_outputs`` timed calls of each candidate, chosen from a secret
    random source and named to the candidates' process only after they ran, are judged against
    the float64 golden of the same data, computed afterwards in the reference's process. A
    candidate that is wrong when not checked fails here (``failure``).

    With a ``golden`` (:func:`kernelcrew.tools.correctness.make_golden`) the timing uses its input
    sets and weights (its device, precision and seed apply); without one, inputs come from
    ``get_inputs()`` under ``seed``. With ``hotspots`` the reference's process then ranks the
    reference's kernels (:func:`kernelcrew.tools.harness.profile_reference`, under ``"profile"``).
    """
    with start_benchmark(
        task_source,
        candidates,
        device=device,
        precision=precision,
        seed=seed,
        compile_modes=compile_modes,
        quick=quick,
        golden=golden,
        task_path=task_path,
        settings=settings,
    ) as pending:
        return pending.result(sample_outputs=sample_outputs, hotspots=hotspots)


def start_benchmark(
    task_source: str,
    candidates: dict[str, tuple[str, str]],
    *,
    device: str = "cpu",
    precision: str = "strict",
    seed: int | None = None,
    compile_modes: Sequence[str] = (),
    quick: bool = False,
    golden: Golden | None = None,
    task_path: str = "task.py",
    settings: Settings | None = None,
) -> PendingBenchmark:
    """Start the two processes of :func:`benchmark` and return at once: they load the task, build
    the candidates and compile the baselines while the caller does other work (verification, say).
    ``result()`` then times; leaving the ``with`` block (or ``close()``) ends them either way."""
    import secrets

    if golden is not None:
        device, precision, seed = golden.device, golden.precision, golden.seed
    seed = secrets.randbits(31) if seed is None else int(seed)
    payload: dict[str, Any] = {
        "device": device,
        "seed": seed,
        "precision": precision,
        "task_source": task_source,
        "task_path": task_path,
        "quick": quick,
    }
    if golden is not None:
        payload["set_indices"] = timing_sets(golden.meta)
    sides = _Sides(task_source, candidates, payload, compile_modes, golden, settings)
    try:
        launched = sides.launch()
    except BaseException:
        sides.close()
        raise
    return PendingBenchmark(sides, launched)


#: Input sets a benchmark times on, at most.
TIMING_SETS = 4
#: Share of the GPU's memory each of a benchmark's two processes plans for: they share the GPU,
#: and the reference's process computes float64 goldens of judged calls besides.
TIMING_MEMORY_SHARE = 0.3


def timing_sets(meta: dict[str, Any]) -> list[int]:
    """The golden's input sets a benchmark times on: the seed sets of the task's main shape (the
    test sets are for correctness), as many as each process can hold on the GPU.

    A process holds its sets on the device, plus two fresh copies of one set for the rep it runs
    and a few outputs. A task whose set is GBs (attention over long sequences) ran out of GPU
    memory with four sets in each process; it gets fewer, one at least."""
    seeds = [r for r in meta["sets"] if r["origin"] == "seed"][:TIMING_SETS]
    memory, set_bytes = meta.get("device_memory"), max((r.get("bytes", 0) for r in seeds), default=0)
    if memory and set_bytes:
        room = TIMING_MEMORY_SHARE * memory - 3 * meta.get("output_bytes", 0)
        seeds = seeds[: max(1, int(room // set_bytes) - 2)]
    return [r["index"] for r in seeds]


class PendingBenchmark:
    """A benchmark whose processes are loading (:func:`start_benchmark`)."""

    def __init__(self, sides: _Sides, launch_failure: TimingFailure | None) -> None:
        self.sides = sides
        self.launch_failure = launch_failure

    def __enter__(self) -> PendingBenchmark:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sides.close()

    def result(self, *, sample_outputs: int = JUDGED_CALLS, hotspots: bool = False) -> BenchmarkResult:
        """Wait for both processes, time, judge the sampled timed calls; see :func:`benchmark`."""
        from kernelcrew.tools.correctness import op_class
        from kernelcrew.tools.sandbox import ChannelError

        sides = self.sides
        payload, golden, candidates = sides.payload, sides.golden, sides.candidates
        device, precision, seed = payload["device"], payload["precision"], payload["seed"]
        failure = self.launch_failure or sides.wait_ready()
        if failure is not None:
            return BenchmarkResult(failure=failure, seed=seed)
        ref_info, cand_info = sides.infos
        config = TimingConfig.quick() if payload["quick"] else TimingConfig()
        try:
            stats = run_rounds(
                sides.lanes,
                device=device,
                config=config,
                baseline="eager",
                n_sets=len(payload.get("set_indices", ())) or 3,
                sample_outputs=sample_outputs,
                sample_names=list(candidates),
                seeded=True,
                trusted=ref_info["names"],
            )
            judged = dict(stats.pop("samples_taken"))
            lies = stats.pop("clock_lies")
            kinds = _profiled_kinds(sides, stats, device, candidates)
            profile = None
            if judged:
                sides.reference.request({"op": "golden", "samples": judged})
            if hotspots:
                profile = sides.reference.request({"op": "profile"})
        except ChannelError as exc:  # a side that broke explains itself in its record
            return BenchmarkResult(failure=sides.failure(exc), seed=seed)
        closing = sides.finish()
        if closing is not None:
            return BenchmarkResult(failure=closing, seed=seed)
        result = BenchmarkResult.model_validate(
            {
                **stats,
                "seed": seed,
                "compile_s": ref_info["compile_s"],
                "compile_errors": ref_info["compile_errors"],
                "builds": cand_info.get("builds", {}),
                "hardware": ref_info["hardware"],
                "versions": ref_info["versions"],
                "kinds": kinds,
                **({"profile": profile} if profile is not None else {}),
            }
        )
        if lies:
            name, message = next(iter(lies.items()))
            result.failure = TimingFailure(stage="timing", message=f"{name}: {message}")
            return result
        if judged:
            cls = golden.op_class if golden is not None else op_class(ref_info["reference_ops"])
            checked, failure = sides.judge(judged, cls, precision)
            result.samples_checked = checked
            if failure is not None:
                result.failure = failure
        return result


#: Calls of each candidate profiled for its kind, on fresh data (the Triton interpreter is slow).
KIND_CALLS = {"cuda": 10, "cpu": 2}
#: The profiled calls may take at most this much longer than the timed median (plus 20 us) before
#: the profile is taken not to show what was timed.
_KIND_TIME_SLACK = 1.5


def _profiled_kinds(
    sides: _Sides, stats: dict[str, Any], device: str, candidates: dict[str, Any]
) -> dict[str, Any]:
    """Each candidate's kind from a profile of its calls on fresh data, cross-checked with the
    timing: a candidate whose profiled calls take much longer than its timed ones ran something
    else when profiled, and its own kernels do not count."""
    import secrets

    if not candidates:
        return {}
    reps = KIND_CALLS["cuda" if device.startswith("cuda") else "cpu"]
    found = sides.candidate.request({"op": "kinds", "seeds": [secrets.randbits(62) for _ in range(reps)]})
    for name, entry in found.items():
        evidence = entry["evidence"]
        calls = evidence.get("calls_profiled") or 0
        per_call_us = float(evidence.get("total_us", 0.0)) / calls if calls else 0.0
        timed_us = float(stats["results"][name]["median_ms"]) * 1e3
        evidence["profiled_us_per_call"], evidence["timed_us"] = per_call_us, timed_us
        # On a CPU the profiler's own cost (it times every interpreted launch) is too large for this.
        on_gpu = device.startswith("cuda")
        if (
            on_gpu
            and entry["kind"] in ("kernel", "hybrid")
            and per_call_us > _KIND_TIME_SLACK * timed_us + 20
        ):
            entry["kind"] = "library"
            evidence["note"] = (
                f"the profiled calls took {per_call_us:.1f} us each, the timed ones {timed_us:.1f} us: "
                "the profile does not show what was timed"
            )
    return found


class _Sides:
    """The two sandboxed processes of a benchmark and their work directories."""

    def __init__(
        self,
        task_source: str,
        candidates: dict[str, tuple[str, str]],
        payload: dict[str, Any],
        compile_modes: Sequence[str],
        golden: Golden | None,
        settings: Settings | None,
    ) -> None:
        from kernelcrew.tools import sandbox

        self.candidates = candidates
        self.payload = payload
        self.compile_modes = list(compile_modes)
        self.golden = golden
        self.settings = settings
        self.ref_dir = sandbox.make_workdir("kc-ref-")
        self.cand_dir = sandbox.make_workdir("kc-bench-")
        self.reference: Any = None
        self.candidate: Any = None
        self.lanes: list[RemoteLane] = []
        self.infos: tuple[dict[str, Any], dict[str, Any]] = ({}, {})

    def close(self) -> None:
        """End both processes, whatever state they are in, and remove their folders."""
        import shutil

        for session in (self.reference, self.candidate):
            if session is not None and session.result is None:
                session.kill("the benchmark ended")
        shutil.rmtree(self.ref_dir, ignore_errors=True)
        shutil.rmtree(self.cand_dir, ignore_errors=True)

    def launch(self) -> TimingFailure | None:
        """Start both processes; they load, compile and build at the same time, without waiting."""
        from kernelcrew.tools import sandbox
        from kernelcrew.tools.build import (
            cache_dirs,
            reference_build_env,
            reference_cache_dirs,
            seed_from_reference,
        )
        from kernelcrew.tools.correctness import child_env, share_inputs

        device, task_source = self.payload["device"], self.payload["task_source"]
        # Two processes take turns: OpenMP threads of the idle one must sleep, not spin on the
        # cores the other one is being timed on.
        env = {"OMP_WAIT_POLICY": "PASSIVE"}
        if self.golden is not None:
            share_inputs(self.golden, self.ref_dir, self.settings)
            share_inputs(self.golden, self.cand_dir, self.settings)
        sources = [src for src, _ in self.candidates.values()]
        started = sandbox.start(
            "kernelcrew.tools.harness:reference_server",
            {**self.payload, "compile_modes": self.compile_modes},
            workdir=self.ref_dir,
            env={**child_env(device), **reference_build_env(task_source), **env},
            settings=self.settings,
            writable=(reference_cache_dirs(task_source)["root"],),
        )
        if isinstance(started, sandbox.SandboxResult):
            return _side_failure("reference", started)
        self.reference = started
        for src in sources:
            seed_from_reference(task_source, src)
        started = sandbox.start(
            "kernelcrew.tools.harness:candidate_server",
            {
                **self.payload,
                "candidates": {
                    name: {"source": src, "path": path} for name, (src, path) in self.candidates.items()
                },
            },
            workdir=self.cand_dir,
            env={**child_env(device, *sources), **env},
            settings=self.settings,
            writable=tuple(cache_dirs(src)["root"] for src in sources),
        )
        if isinstance(started, sandbox.SandboxResult):
            return _side_failure("candidates", started)
        self.candidate = started
        return None

    def wait_ready(self) -> TimingFailure | None:
        """Wait until both processes are ready to time; the lanes that drive them."""
        from kernelcrew.tools import sandbox

        try:
            ref_info = self.reference.request({"op": "ready"})
            cand_info = self.candidate.request({"op": "ready"}) if self.candidates else {"names": []}
        except sandbox.ChannelError as exc:
            return self.failure(exc)
        self.infos = (ref_info, cand_info)
        self.lanes = [RemoteLane(self.reference, ref_info)]
        if self.candidates:
            self.lanes.append(RemoteLane(self.candidate, cand_info))
        return None

    def failure(self, exc: BaseException) -> TimingFailure:
        """What went wrong, from the record of the side that broke (or from ``exc``)."""
        for side, session in (("candidates", self.candidate), ("reference", self.reference)):
            if session is None:
                continue
            alive = session.result is None and session._child.proc.poll() is None
            if alive:
                continue
            return _side_failure(side, session.close())
        return TimingFailure(stage="timing", message=f"timing run failed: {_describe(exc)}")

    def finish(self) -> TimingFailure | None:
        """Let both processes end as they should; the failure of the first that did not."""
        for side, session in (("reference", self.reference), ("candidates", self.candidate)):
            result = session.close()
            if not result.ok:
                return _side_failure(side, result)
        return None

    def judge(self, judged: dict[str, Any], cls: str, precision: str) -> tuple[int, TimingFailure | None]:
        """Every kept output of a timed call against the golden of the same data."""
        from kernelcrew.tools.correctness import compare_output, tolerance_for

        samples_path = self.cand_dir / "child" / "samples.pt"
        goldens_path = self.ref_dir / "child" / "judged.pt"
        try:
            samples = torch.load(samples_path, weights_only=True) if samples_path.exists() else {}
        except Exception as exc:  # the candidates' process wrote it: anything may be in it
            samples = exc
        goldens = torch.load(goldens_path, weights_only=True)
        checked = 0
        for key, (name, set_index, _seed, _pick) in judged.items():
            where = "its CUDA graph's output" if key.startswith("graph:") else "the output of a timed call"
            outs, gold = _kept_entry(samples, key), goldens[key]
            if isinstance(outs, str):
                return checked, TimingFailure(stage="timed_output", message=f"{name}: {where} {outs}")
            if len(outs) != len(gold["golden"]):
                return checked, TimingFailure(
                    stage="timed_output",
                    message=f"{name}: {where} has {len(outs)} tensors; the reference gives {len(gold['golden'])}",
                )
            for c, g, n in zip(outs, gold["golden"], gold["native"], strict=True):
                if c["shape"] != n["shape"] or c["dtype"] != n["dtype"]:
                    return checked, TimingFailure(
                        stage="timed_output",
                        message=f"{name}: {where} is {c['dtype']} of shape {c['shape']}; the reference "
                        f"gives {n['dtype']} of shape {n['shape']}",
                    )
                tol = tolerance_for(n["dtype"].replace("torch.", ""), cls, precision)
                verdict = compare_output(c["values"], g["values"], n["values"], tol)
                checked += 1
                if not verdict["ok"]:
                    return checked, TimingFailure(
                        stage="timed_output",
                        message=f"{name}: {where} on input set {set_index} (fresh data) is wrong: "
                        f"{verdict['message']}",
                    )
        return checked, None


def _kept_entry(samples: Any, key: str) -> list[dict[str, Any]] | str:
    """The kept output ``key`` from the candidates' process's ``samples.pt``, or what is wrong
    with it: the file is that process's, so its structure is checked before anything is read."""
    if isinstance(samples, BaseException):
        return f"could not be read back ({type(samples).__name__})"
    if not isinstance(samples, dict) or key not in samples:
        return "was not kept"
    outs = samples[key]
    fields = {"shape": list, "dtype": str, "values": torch.Tensor}
    if not isinstance(outs, list) or not all(
        isinstance(o, dict) and all(isinstance(o.get(f), t) for f, t in fields.items()) for o in outs
    ):
        return "was kept in a form the harness never writes (the file was rewritten)"
    return outs


def _side_failure(side: str, res: Any) -> TimingFailure:
    stage = (res.value or {}).get("stage") or {"timeout": "timeout", "crashed": "crash"}.get(
        res.status, "timing"
    )
    return TimingFailure(stage=stage, message=f"timing run failed ({side}): {res.message}")
