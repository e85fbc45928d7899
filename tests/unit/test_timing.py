"""Tests of kernelcrew.tools.timing on the CPU: real callables, real clocks, no mocks of torch."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kernelcrew.tools.timing import CLOCK_CPU, TimingConfig, compile_baseline, measure, median_ci

torch.manual_seed(0)
A64 = torch.randn(64, 64)
A128 = torch.randn(128, 128)
A256 = torch.randn(256, 256)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a small, busy CPU two threads spinning against each other make timings erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def matmuls(a: torch.Tensor, times: int):
    def fn(inputs: Sequence[Any]) -> torch.Tensor:
        out = a
        for _ in range(times):
            out = torch.mm(a, a)
        return out

    return fn


def quick(**overrides: Any) -> TimingConfig:
    config = TimingConfig.quick()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_quick_config() -> None:
    q = TimingConfig.quick()
    d = TimingConfig()
    assert q.min_reps <= q.max_reps
    assert q.min_reps < d.min_reps and q.max_reps < d.max_reps and q.max_time_s < d.max_time_s
    assert q.warmup_calls < d.warmup_calls and q.warmup_ms < d.warmup_ms
    q.validate()
    d.validate()
    assert (d.warmup_calls, d.warmup_ms, d.min_reps, d.max_reps) == (10, 100.0, 100, 1000)
    assert (d.max_time_s, d.flush_l2, d.graph_threshold_us, d.seed) == (10.0, True, 20.0, 0)


def test_speedup_and_slowdown_are_detected() -> None:
    callables = {
        "base": matmuls(A128, 10),
        "fast": matmuls(A64, 1),
        "slow": matmuls(A256, 5),
    }
    out = measure(callables, [[A128]], device="cpu", config=quick(min_reps=20, max_reps=40), baseline="base")
    json.dumps(out)  # JSON-serializable, no NaN or numpy types
    assert out["clock"] == CLOCK_CPU == "cpu-wall"
    assert out["device"] == "cpu"
    assert out["graph"]["used"] is False and out["graph"]["reason"]
    assert out["l2_flush_bytes"] == 0
    assert set(out["results"]) == {"base", "fast", "slow"}
    assert set(out["ratios"]) == {"fast", "slow"}  # the baseline is not compared with itself

    res = out["results"]
    assert res["slow"]["median_ms"] > res["base"]["median_ms"] > res["fast"]["median_ms"] > 0
    for entry in res.values():
        assert 20 <= entry["reps"] <= 40
        assert entry["reps"] == out["rounds"]
        assert entry["p10_ms"] <= entry["median_ms"] <= entry["p90_ms"]
        assert entry["iqr_ms"] >= 0 and entry["spread_pct"] >= 0
        assert entry["wall_median_ms"] == entry["median_ms"]  # the CPU has only the wall clock
        assert entry["graph_median_ms"] is None
        spread = (entry["p90_ms"] - entry["p10_ms"]) / entry["median_ms"] * 100
        assert entry["spread_pct"] == pytest.approx(spread)

    fast, slow = out["ratios"]["fast"], out["ratios"]["slow"]
    assert fast["median"] > 3
    assert 1 < fast["ci_low"] <= fast["median"] <= fast["ci_high"]
    assert fast["significant"] is True
    assert fast["ci_coverage"] >= 0.95
    assert slow["median"] < 0.5
    assert slow["ci_low"] <= slow["median"] <= slow["ci_high"] < 1
    assert slow["significant"] is False
    assert fast["graph_median"] is None and fast["wall_median"] == pytest.approx(fast["median"])


def test_no_baseline_means_no_ratios() -> None:
    out = measure({"a": matmuls(A64, 1)}, [[A64]], device="cpu", config=quick())
    assert out["ratios"] == {} and out["baseline"] is None
    assert out["config"] == TimingConfig.quick().__dict__
    assert out["stop_reason"] in ("max_reps", "stable", "time_budget")


def test_rounds_are_interleaved_in_random_order_and_rotate_inputs() -> None:
    seen: list[tuple[str, int]] = []
    last_input: dict[str, int] = {}

    def tagged(name: str):
        def fn(inputs: Sequence[Any]) -> int:
            last_input[name] = inputs[0]
            return inputs[0]

        return fn

    names = ["a", "b", "c", "d"]
    input_sets = [[i] for i in range(3)]

    def run(seed: int) -> list[tuple[str, int]]:
        seen.clear()
        measure(
            {n: tagged(n) for n in names},
            input_sets,
            device="cpu",
            config=quick(seed=seed, min_reps=12, max_reps=12),
            check_call=lambda name: seen.append((name, last_input[name])),
        )
        return list(seen)

    log = run(0)
    assert len(log) == 12 * len(names)
    rounds = [log[i : i + len(names)] for i in range(0, len(log), len(names))]
    orders = []
    for r, chunk in enumerate(rounds):
        assert sorted(name for name, _ in chunk) == names  # every callable once per round
        assert {idx for _, idx in chunk} == {r % len(input_sets)}  # one input set per round, rotating
        orders.append(tuple(name for name, _ in chunk))
    assert len(set(orders)) > 1  # the order is shuffled between rounds
    assert run(0) == log  # the same seed gives the same order
    assert run(1) != log


def test_sample_outputs_come_from_timed_calls() -> None:
    input_sets = [[torch.full((4,), float(i))] for i in range(3)]
    callables = {
        "double": lambda inputs: inputs[0] * 2,
        "triple": lambda inputs: inputs[0] * 3,
    }
    samples: list[tuple[str, int, torch.Tensor]] = []
    out = measure(
        callables,
        input_sets,
        device="cpu",
        config=quick(),
        sample_outputs=4,
        on_sample=lambda name, idx, value: samples.append((name, idx, value)),
    )
    for name, factor in (("double", 2), ("triple", 3)):
        mine = [(idx, value) for n, idx, value in samples if n == name]
        assert 4 <= len(mine) <= 8 and len(mine) == out["results"][name]["samples"]
        for idx, value in mine:
            assert 0 <= idx < len(input_sets)
            assert torch.equal(value, input_sets[idx][0] * factor)


def test_sample_outputs_are_secret_and_capped() -> None:
    def run(k: int, seed: int = 0) -> list[tuple[str, int, int]]:
        got: list[tuple[str, int, int]] = []
        measure(
            {"a": lambda x: x[0], "b": lambda x: x[0]},
            [[i] for i in range(7)],
            device="cpu",
            config=quick(min_reps=10, max_reps=10, seed=seed),
            sample_outputs=k,
            on_sample=lambda name, idx, value: got.append((name, idx, value)),
        )
        return got

    first = run(3)
    assert len(first) == 6
    assert all(idx == value for _, idx, value in first)  # the output of the call on that input set
    # The judged reps come from a secret source, not from the configuration's seed: a candidate
    # that read the seed cannot tell which of its calls are judged.
    assert any(run(3) != first for _ in range(4))
    capped = run(50)  # more samples than reps: every rep is sampled once
    assert [idx for name, idx, _ in capped if name == "a"] == [r % 7 for r in range(10)]


def _judged_rounds_of_an_unsteady_run() -> list[int]:
    """The rounds whose output was kept for judging in a run that is never stable (each call
    slower than the last), so it goes on to ``max_reps``, past its 6 planned rounds."""
    calls = {"n": 0}

    def unsteady(inputs):
        calls["n"] += 1
        time.sleep(0.0003 * calls["n"])
        return inputs[0] * 0 + calls["n"]

    got: list[int] = []
    out = measure(
        {"a": unsteady},
        [[torch.zeros(2)]],
        device="cpu",
        config=quick(min_reps=6, max_reps=40, max_time_s=30.0),
        sample_outputs=3,
        on_sample=lambda name, idx, value: got.append(int(value[0])),
    )
    assert out["results"]["a"]["reps"] > 6
    warm = out["results"]["a"]["warmup_calls"]
    return [call - warm - 1 for call in got]


def test_rounds_past_the_planned_ones_are_judged_too() -> None:
    """A run that goes on until its timings are stable judges its late rounds as well: a candidate
    honest in its first rounds only (a memo that starts hitting later) is still sampled there."""
    judged = [r for _ in range(5) for r in _judged_rounds_of_an_unsteady_run()]
    assert any(r >= 6 for r in judged)


def test_check_call_exceptions_propagate() -> None:
    calls = []

    def check(name: str) -> None:
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError(f"global state changed by {name}")

    with pytest.raises(RuntimeError, match="global state changed"):
        measure(
            {"a": lambda x: None, "b": lambda x: None}, [[]], device="cpu", config=quick(), check_call=check
        )
    assert len(calls) == 3


def test_callable_and_on_sample_exceptions_propagate() -> None:
    def broken(inputs: Sequence[Any]) -> None:
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError):
        measure({"a": broken}, [[]], device="cpu", config=quick())

    def reject(name: str, idx: int, value: Any) -> None:
        raise AssertionError("wrong output")

    with pytest.raises(AssertionError, match="wrong output"):
        measure({"a": lambda x: 1}, [[]], device="cpu", config=quick(), sample_outputs=1, on_sample=reject)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": quick(min_reps=30, max_reps=20)}, "max_reps"),
        ({"config": quick(warmup_calls=0)}, "warmup_calls"),
        ({"config": quick(max_time_s=0)}, "max_time_s"),
        ({"callables": {}}, "no callables"),
        ({"input_sets": []}, "no input sets"),
        ({"input_sets": [7]}, "input set 0"),
        ({"baseline": "nope"}, "baseline 'nope'"),
        ({"sample_outputs": -1}, "sample_outputs"),
        ({"sample_outputs": 2}, "on_sample"),
        ({"device": "tpu"}, "device"),
        ({"callables": {"a": 3}}, "not callable"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "callables": {"a": lambda x: None},
        "input_sets": [[]],
        "device": "cpu",
        "config": quick(),
    }
    args.update(kwargs)
    callables = args.pop("callables")
    input_sets = args.pop("input_sets")
    with pytest.raises(ValueError, match=message):
        measure(callables, input_sets, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_gpu_raises() -> None:
    with pytest.raises(ValueError, match="no CUDA GPU"):
        measure({"a": lambda x: None}, [[]], device="cuda", config=quick())


def test_time_budget_caps_the_rounds() -> None:
    def sleepy(inputs: Sequence[Any]) -> None:
        time.sleep(0.02)

    config = quick(min_reps=200, max_reps=400, max_time_s=0.6)
    started = time.perf_counter()
    out = measure({"a": sleepy, "b": sleepy}, [[]], device="cpu", config=config, baseline="a")
    elapsed = time.perf_counter() - started
    assert out["stop_reason"] == "time_budget"
    assert 6 <= out["rounds"] < 200
    assert elapsed < 2.0
    assert out["ratios"]["b"]["ci_low"] <= 1.05  # the same work: no convincing speedup either way


def test_median_ci() -> None:
    low, high, coverage = median_ci(np.arange(1, 101))
    assert (low, high) == (40.0, 61.0)  # the textbook order statistics for n = 100
    assert 0.95 <= coverage < 0.97
    low, high, coverage = median_ci([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (low, high) == (1.0, 5.0) and coverage < 0.95  # n = 5 cannot reach 95 %
    low, high, coverage = median_ci(list(range(10)))
    assert (low, high) == (1.0, 8.0) and coverage >= 0.95
    with pytest.raises(ValueError):
        median_ci([])
    with pytest.raises(ValueError):
        median_ci([1.0], level=1.5)


def test_compile_baseline_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        compile_baseline(torch.nn.ReLU(), "fastest", [torch.randn(2)])


@pytest.mark.slow  # inductor's first compile on a cold cache takes about 30 s on a small CPU
def test_compile_baseline_on_cpu() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(4, 8)
    fn, compile_s = compile_baseline(model, "default", [x])
    assert compile_s > 0
    with torch.no_grad():
        torch.testing.assert_close(fn([x]), model(x))
    out = measure(
        {"eager": lambda inputs: model(*inputs), "compiled": fn}, [[x]], device="cpu", config=quick()
    )
    assert set(out["results"]) == {"eager", "compiled"}


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _add_chain(n: int):
    def fn(inputs: Sequence[Any]) -> torch.Tensor:
        y = inputs[0]
        for _ in range(n):
            y = y + 1
        return y

    return fn


@pytest.mark.gpu
@cuda
def test_cuda_events_flush_and_graphs() -> None:
    x = torch.randn(1 << 20, device="cuda")
    callables = {"chain": _add_chain(30), "one": _add_chain(1)}
    out = measure(callables, [[x], [x.clone()]], device="cuda", config=quick(min_reps=20), baseline="chain")
    json.dumps(out)
    assert out["clock"] == "cuda-event"
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    assert out["l2_flush_bytes"] == 2 * l2
    one, chain = out["results"]["one"], out["results"]["chain"]
    assert one["median_ms"] * 1e3 < 20  # one small kernel: device time, launch gaps hidden by the lead
    assert chain["wall_median_ms"] > chain["median_ms"]  # 30 launches: the wall clock shows them
    assert out["graph"]["used"] is True
    assert set(out["graph"]["replays"]) == {"chain", "one"}
    assert one["graph_median_ms"] is not None and chain["graph_median_ms"] is not None
    ratio = out["ratios"]["one"]
    assert ratio["significant"] is True and ratio["ci_low"] > 1 and ratio["graph_median"] > 1


@pytest.mark.gpu
@cuda
def test_cuda_failed_capture_means_no_graph_timings() -> None:
    x = torch.randn(1 << 16, device="cuda")
    callables = {"ok": _add_chain(1), "syncs": lambda inputs: inputs[0] * float(inputs[0].sum().item())}
    out = measure(callables, [[x]], device="cuda", config=quick())
    assert out["graph"]["used"] is False
    assert "'syncs'" in out["graph"]["reason"]
    assert all(entry["graph_median_ms"] is None for entry in out["results"].values())
    torch.randn(8, device="cuda")  # the failed capture left the random generator usable
    torch.cuda.synchronize()


@pytest.mark.gpu
@cuda
def test_cuda_compile_baseline() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()
    x = torch.randn(16, 64, device="cuda")
    fn, compile_s = compile_baseline(model, "default", [x])
    assert compile_s > 0
    with torch.no_grad():
        torch.testing.assert_close(fn([x]), model(x))


def test_timing_sets_fit_the_gpu_memory_of_both_processes():
    """Attention over 512 tokens of 1024 features in fp32 (6.4 GB of inputs a set) ran out of an
    H100's memory timing on four sets in each process; it gets one. Small sets keep four."""
    from kernelcrew.tools.timing import timing_sets

    def meta(set_bytes, output_bytes, memory):
        sets = [{"index": i, "origin": "seed", "bytes": set_bytes} for i in range(5)]
        sets += [
            {"index": 5, "origin": "test", "bytes": 1},
            {"index": 6, "origin": "signed", "bytes": set_bytes},
        ]
        return {"sets": sets, "output_bytes": output_bytes, "device_memory": memory}

    h100 = 80 * 10**9
    assert timing_sets(meta(6.4e9, 2.1e9, h100)) == [0]
    assert timing_sets(meta(4.0e9, 2.0e9, h100)) == [0, 1]  # (24 - 6) GB // 4 GB, less 2 fresh copies
    assert timing_sets(meta(1e6, 1e6, h100)) == [0, 1, 2, 3]
    assert timing_sets(meta(1e6, 1e6, None)) == [0, 1, 2, 3]  # a CPU golden: no device memory
    assert timing_sets(meta(50e9, 1e6, h100)) == [0]  # never none


class ScriptedLane:
    """A GPU process's lane as the parent sees it (no GPU here): each rep takes ``seen_ms`` of the
    parent's clock and reports ``clock_ms`` of device time and ``host_ms`` of launches."""

    def __init__(self, name: str, clock_ms: float, host_ms: float, seen_ms: float) -> None:
        self.names = [name]
        self.clock_ms, self.host_ms, self.seen_ms = clock_ms, host_ms, seen_ms

    def info(self) -> dict[str, Any]:
        return {"names": self.names, "l2_flush_bytes": 0, "lead_kernel": True, "sync_gap_ms": 0.0}

    def warm_up(self, name: str, budget_s: float) -> dict[str, Any]:
        return {"calls": 2, "est_ms": self.seen_ms, "lead_us": 50.0}

    def rep(self, name: str, set_index: int, seed: int | None, lead_us: float) -> dict[str, Any]:
        time.sleep((self.seen_ms + lead_us / 1e3) / 1e3)  # the device spins the lead first
        return {"clock_ms": self.clock_ms, "wall_ms": self.clock_ms + self.host_ms, "host_ms": self.host_ms}

    def check(self, name: str) -> None:
        pass

    def keep(self, name: str, key: str, pick: int | None) -> None:
        pass


def test_a_launch_bound_call_is_timed_by_its_launches_and_not_taken_for_a_lie() -> None:
    from kernelcrew.tools.timing import run_rounds

    # eager: 4 ms on the device, launched in 0.2 ms; the candidate: 0.5 ms on the device but 3 ms
    # of launches per call, two calls a rep (what the parent sees), and a lead sized from those
    # launches ahead of the timed call. Its time is its launches.
    eager = ScriptedLane("eager", clock_ms=4.0, host_ms=0.2, seen_ms=9.0)
    cand = ScriptedLane("cand", clock_ms=0.5, host_ms=3.0, seen_ms=7.0)
    stats = run_rounds(
        [eager, cand], device="cuda", config=quick(), baseline="eager", n_sets=1, trusted=["eager"]
    )
    assert stats["clock_lies"] == {}
    assert stats["results"]["cand"]["median_ms"] == pytest.approx(3.0)
    assert stats["ratios"]["cand"]["median"] == pytest.approx(4.0 / 3.0)
    # 12 ms seen by the parent, reported as 0.5 ms with 0.4 ms of launches: a clock that lies
    liar = ScriptedLane("cand", clock_ms=0.5, host_ms=0.4, seen_ms=12.0)
    stats = run_rounds(
        [eager, liar], device="cuda", config=quick(), baseline="eager", n_sets=1, trusted=["eager"]
    )
    assert "not trusted" in stats["clock_lies"]["cand"]
