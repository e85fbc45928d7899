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
    event time may include launch gaps);
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


def lead_for(host_ms: Sequence[float]) -> float:
    """Microseconds of device-side lead that let the host launch a call ahead of the device.

    Sized from the 90th percentile of the last host launch times ``host_ms`` of that call.
    """
    recent = np.asarray(host_ms[-_LEAD_WINDOW:], dtype=float)
    host_us = float(np.percentile(recent, 90)) * 1e3 if recent.size else 0.0
    return min(_LEAD_MAX_US, _LEAD_BASE_US + _LEAD_FACTOR * host_us)


class _Timer:
    """Times calls on one device; owns the L2 flush buffer, the two CUDA events and the lead kernel."""

    def __init__(self, device: torch.device, flush_l2: bool) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.flush_buffer: torch.Tensor | None = None
        self.cycles_per_us: float | None = None
        if self.is_cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            if flush_l2:
                props = torch.cuda.get_device_properties(device)
                l2 = int(getattr(props, "L2_cache_size", 0) or 0) or _FALLBACK_L2_BYTES
                self.flush_buffer = torch.empty(2 * l2, dtype=torch.uint8, device=device)
            self.cycles_per_us = self._calibrate_sleep()

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

    @property
    def flush_bytes(self) -> int:
        return 0 if self.flush_buffer is None else self.flush_buffer.numel()

    def sync(self) -> None:
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

    def time_call(self, fn: Callable[[Sequence[Any]], Any], inputs: Sequence[Any], lead_us: float) -> _Rep:
        """One timed rep (see the module docstring): one call on the CPU, two on a GPU."""
        if not self.is_cuda:
            t0 = time.perf_counter()
            out = fn(inputs)
            wall_ms = (time.perf_counter() - t0) * 1e3
            return _Rep(out, wall_ms, wall_ms, wall_ms)
        self.sync()
        self.flush()
        self.lead(lead_us)
        self.start.record()
        t0 = time.perf_counter()
        out = fn(inputs)
        host_ms = (time.perf_counter() - t0) * 1e3
        self.end.record()
        self.sync()
        clock_ms = self.start.elapsed_time(self.end)

        self.flush()
        self.sync()
        t0 = time.perf_counter()
        again = fn(inputs)
        self.sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
        del again
        return _Rep(out, clock_ms, wall_ms, host_ms)

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
        return self.start.elapsed_time(self.end) / replays


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
# The protocol
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


def _warm_up(
    timer: _Timer,
    fn: Callable[[Sequence[Any]], Any],
    input_sets: list[list[Any]],
    config: TimingConfig,
    budget_s: float,
) -> tuple[int, float, float]:
    """Run ``fn`` until warm; returns ``(calls, estimated ms per timed rep, lead in us)``."""
    calls = 0
    costs: list[float] = []  # ms per rep, flush, lead and synchronizations included
    hosts: list[float] = []
    lead_us = _LEAD_BASE_US
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        rep = timer.time_call(fn, input_sets[calls % len(input_sets)], lead_us)
        rep.out = None  # drop the output now
        costs.append((time.perf_counter() - t0) * 1e3)
        hosts.append(rep.host_ms)
        calls += 1
        recent = slice(max(1, calls // 2), None) if calls > 1 else slice(None)  # the first may compile
        lead_us = lead_for(hosts[recent])
        elapsed = time.perf_counter() - started
        if calls >= config.warmup_calls and elapsed * 1e3 >= config.warmup_ms:
            break
        if calls >= 2 and elapsed >= budget_s:
            break
    return calls, float(np.median(costs[recent])), lead_us


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
) -> dict[str, Any]:
    """Time every callable (called as ``fn(input_set)``) by the protocol of the module docstring.

    ``sample_outputs=k``: for each callable, ``k`` timed reps (at most the reps planned) chosen at
    random (seeded) hand ``(name, input_set_index, output)`` to ``on_sample`` right after the rep,
    outside the timed region. ``check_call(name)`` runs after every timed rep (and graph rep),
    outside the timed region; whatever either raises propagates.

    Returns a JSON-serializable dict: ``clock``, ``device``, ``results`` (per callable: median,
    mean, p10, p90, IQR in ms, ``spread_pct``, ``reps``, ``wall_median_ms``, ``graph_median_ms``,
    ``host_median_ms``, ``lead_us``, ``lead_short_reps``, ``warmup_calls``, ``samples``),
    ``ratios`` (per candidate, only with a baseline: ``median``, ``ci_low``, ``ci_high``,
    ``ci_coverage``, ``significant``, ``wall_median``, ``graph_median``), ``graph``, ``config``,
    ``l2_flush_bytes``, and how the run went (``rounds``, ``stop_reason``, ``elapsed_s``).
    """
    _validate_inputs(callables, input_sets, config, baseline, sample_outputs, on_sample)
    dev = _resolve_device(device)
    started = time.perf_counter()
    names = list(callables)
    rng = random.Random(config.seed)
    floor_rounds = min(_MIN_ROUNDS, config.min_reps)

    with _on_device(dev):
        timer = _Timer(dev, config.flush_l2)

        # Warm-up, one callable after the other; it also sizes each callable's lead.
        warmup_calls: dict[str, int] = {}
        lead_us: dict[str, float] = {}
        round_ms = 0.0
        share_s = _WARMUP_BUDGET_SHARE * config.max_time_s / len(names)
        for name in names:
            warmup_calls[name], est_ms, lead_us[name] = _warm_up(
                timer, callables[name], input_sets, config, share_s
            )
            round_ms += est_ms

        # Rounds planned within the budget; sampled reps are drawn from those.
        remaining_ms = (config.max_time_s - (time.perf_counter() - started)) * 1e3
        planned = int(remaining_ms / max(round_ms, 1e-3))
        planned = max(floor_rounds, min(config.min_reps, planned))
        samples: dict[str, set[int]] = {
            name: set(rng.sample(range(planned), min(sample_outputs, planned))) for name in names
        }
        last_sample = max((max(s) for s in samples.values() if s), default=-1)

        clock_ms: dict[str, list[float]] = {name: [] for name in names}
        wall_ms: dict[str, list[float]] = {name: [] for name in names}
        host_ms: dict[str, list[float]] = {name: [] for name in names}
        leads_used: dict[str, list[float]] = {name: [] for name in names}
        lead_short: dict[str, int] = dict.fromkeys(names, 0)
        rounds = 0
        stop_reason = ""
        while not stop_reason:
            order = names[:]
            rng.shuffle(order)
            set_index = rounds % len(input_sets)
            inputs = input_sets[set_index]
            for name in order:
                rep = timer.time_call(callables[name], inputs, lead_us[name])
                clock_ms[name].append(rep.clock_ms)
                wall_ms[name].append(rep.wall_ms)
                host_ms[name].append(rep.host_ms)
                leads_used[name].append(lead_us[name])
                if rep.host_ms * 1e3 > lead_us[name]:
                    lead_short[name] += 1
                lead_us[name] = lead_for(host_ms[name])
                if on_sample is not None and rounds in samples[name]:
                    on_sample(name, set_index, rep.out)
                del rep
                if check_call is not None:
                    check_call(name)
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

        clock_arr = {name: np.asarray(clock_ms[name]) for name in names}
        wall_arr = {name: np.asarray(wall_ms[name]) for name in names}
        graph_arr, graph_info = _graph_phase(
            callables, input_sets, dev, timer, config, rng, clock_arr, started, floor_rounds, check_call
        )
        l2_flush_bytes = timer.flush_bytes
        lead_kernel = timer.cycles_per_us is not None
        del timer

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        entry: dict[str, Any] = _summary(clock_arr[name])
        entry["reps"] = rounds
        entry["wall_median_ms"] = float(np.median(wall_arr[name]))
        entry["host_median_ms"] = float(np.median(host_ms[name]))
        entry["graph_median_ms"] = float(np.median(graph_arr[name])) if name in graph_arr else None
        entry["warmup_calls"] = warmup_calls[name]
        entry["samples"] = len(samples[name])
        entry["lead_us"] = float(np.median(leads_used[name])) if lead_kernel else 0.0
        entry["lead_short_reps"] = lead_short[name] if lead_kernel else 0
        results[name] = entry

    ratios: dict[str, dict[str, Any]] = {}
    if baseline is not None:
        for name in names:
            if name == baseline:
                continue
            paired = _paired_ratios(clock_arr[baseline], clock_arr[name])
            low, high, coverage = median_ci(paired)
            graph_ratio = None
            if name in graph_arr:
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
        "clock": CLOCK_CUDA if dev.type == "cuda" else CLOCK_CPU,
        "device": str(dev),
        "baseline": baseline,
        "results": results,
        "ratios": ratios,
        "ci_method": CI_METHOD,
        "graph": graph_info,
        "config": asdict(config),
        "l2_flush_bytes": l2_flush_bytes,
        "input_sets": len(input_sets),
        "rounds": rounds,
        "stop_reason": stop_reason,
        "elapsed_s": time.perf_counter() - started,
    }


def _is_stable(times: list[float]) -> bool:
    """Whether the median moved less than ``_STABLE_REL`` over the last ``_STABLE_EVERY`` reps (or half of them)."""
    step = min(_STABLE_EVERY, len(times) // 2)
    now = float(np.median(times))
    before = float(np.median(times[: len(times) - step]))
    return before > 0 and abs(now - before) / before < _STABLE_REL


def _graph_phase(
    callables: dict[str, Callable[[Sequence[Any]], Any]],
    input_sets: list[list[Any]],
    dev: torch.device,
    timer: _Timer,
    config: TimingConfig,
    rng: random.Random,
    clock_arr: dict[str, np.ndarray],
    started: float,
    floor_rounds: int,
    check_call: Callable[[str], None] | None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """CUDA-graph replay timings of every callable, or of none; ``(times per name, info)``."""
    info: dict[str, Any] = {"used": False, "reason": "", "replays": {}, "lead_us": {}, "rounds": 0}
    if dev.type != "cuda":
        info["reason"] = "CPU: no CUDA graphs"
        return {}, info
    medians_us = {name: float(np.median(times)) * 1e3 for name, times in clock_arr.items()}
    fastest = min(medians_us, key=medians_us.__getitem__)
    if medians_us[fastest] >= config.graph_threshold_us:
        info["reason"] = f"every callable's median is at least {config.graph_threshold_us:g} us"
        return {}, info
    graphs, failure = _capture_graphs(callables, input_sets[0], dev)
    if failure:
        info["reason"] = failure
        return {}, info

    replays = {
        name: int(
            min(_GRAPH_MAX_REPLAYS, max(_GRAPH_MIN_REPLAYS, math.ceil(_GRAPH_TARGET_US / max(us, 0.1))))
        )
        for name, us in medians_us.items()
    }
    leads = {
        name: lead_for([timer.replay_host_ms(graph, replays[name])]) for name, (graph, _) in graphs.items()
    }
    max_rounds = min(_GRAPH_MAX_ROUNDS, max(config.min_reps, floor_rounds))
    times: dict[str, list[float]] = {name: [] for name in graphs}
    rounds = 0
    while rounds < max_rounds:
        order = list(graphs)
        rng.shuffle(order)
        for name in order:
            times[name].append(timer.time_replays(graphs[name][0], replays[name], leads[name]))
            if check_call is not None:
                check_call(name)
        rounds += 1
        if rounds >= floor_rounds and time.perf_counter() - started >= config.max_time_s:
            break
    graphs.clear()
    torch.cuda.synchronize(dev)
    info.update(
        used=True,
        reason=(
            f"{fastest!r} median {medians_us[fastest]:.2f} us < {config.graph_threshold_us:g} us: "
            "every callable also timed as CUDA graph replays (input set 0, one L2 flush per batch)"
        ),
        replays=replays,
        lead_us=leads if timer.cycles_per_us is not None else {},
        rounds=rounds,
    )
    return {name: np.asarray(t) for name, t in times.items()}, info


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
# Parent side: one sandboxed child times the baselines and the candidates together
# ----------------------------------------------------------------------------------------------


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
    sample_outputs: int = 3,
    hotspots: bool = False,
    settings: Settings | None = None,
) -> BenchmarkResult:
    """Time eager, the ``torch.compile`` baselines and ``candidates`` ({name: (source, path)}) together.

    With ``hotspots`` the same child then ranks the reference's kernels and measures its work
    (:func:`kernelcrew.tools.harness.profile_reference`, under ``"profile"``): one process start
    and one load of the inputs fewer than a separate profile run.

    With a ``golden`` (:func:`kernelcrew.tools.correctness.make_golden`), the timing uses the
    verified input sets and weights (its device, precision and seed apply), and the outputs of
    randomly chosen timed calls are judged against it: a candidate that is right only when checked
    fails here (``failure``). Without one, inputs come from ``get_inputs()`` under ``seed``.
    """
    import secrets
    import shutil

    from kernelcrew.tools import sandbox
    from kernelcrew.tools.build import cache_dirs
    from kernelcrew.tools.correctness import child_env, compare_output, share_inputs, tolerance_for

    if golden is not None:
        device, precision, seed = golden.device, golden.precision, golden.seed
    seed = secrets.randbits(31) if seed is None else int(seed)
    workdir = sandbox.make_workdir("kc-bench-")
    env = child_env(device, *(source for source, _ in candidates.values()))
    payload: dict[str, Any] = {
        "device": device,
        "seed": seed,
        "precision": precision,
        "task_source": task_source,
        "task_path": task_path,
        "compile_modes": list(compile_modes),
        "candidates": {name: {"source": src, "path": path} for name, (src, path) in candidates.items()},
        "quick": quick,
        "sample_outputs": sample_outputs if golden else 0,
        "hotspots": hotspots,
    }
    set_indices: list[int] = []
    writable = tuple(cache_dirs(src)["root"] for src, _ in candidates.values())
    try:
        if golden is not None:
            # Time on the seed sets of the task's main shape (the test sets are for correctness).
            set_indices = [r["index"] for r in golden.meta["sets"] if r["origin"] == "seed"][:4]
            payload["set_indices"] = set_indices
            share_inputs(golden, workdir, settings)
        res = sandbox.run(
            "kernelcrew.tools.harness:benchmark_child",
            payload,
            workdir=workdir,
            env=env,
            settings=settings,
            writable=writable,
        )
        if not res.ok:
            stage = (res.value or {}).get("stage") or {"timeout": "timeout", "crashed": "crash"}.get(
                res.status, "timing"
            )
            failure = TimingFailure(stage=stage, message=f"timing run failed: {res.message}")
            return BenchmarkResult(failure=failure, seed=seed)
        result = BenchmarkResult.model_validate({**(res.value or {}), "seed": seed})
        samples_path = workdir / "child" / "samples.pt"
        if golden is not None and samples_path.exists():
            samples = torch.load(samples_path, weights_only=True, mmap=True)
            gold = torch.load(golden.path / "golden.pt", weights_only=True, mmap=True)
            native = torch.load(golden.path / "native.pt", weights_only=True, mmap=True)
            checked = 0
            for key, outs in samples.items():
                name, _, local = key.rsplit(":", 2)
                idx = set_indices[int(local)]
                for c, g, n in zip(outs, gold[idx], native[idx], strict=False):
                    tol = tolerance_for(str(n.dtype).replace("torch.", ""), golden.op_class, precision)
                    verdict = compare_output(c, g, n, tol)
                    checked += 1
                    if not verdict["ok"]:
                        result.failure = TimingFailure(
                            stage="timed_output",
                            message=f"{name}: the output of a timed call on input set {idx} is wrong: {verdict['message']}",
                        )
                        break
            result.samples_checked = checked
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
