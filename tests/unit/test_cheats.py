"""The adversarial corpus (tests/fixtures/cheats): every CPU cheat is caught, every honest control passes.

A cheat is caught when ``verify`` fails it, or ``benchmark(..., golden=...)`` reports a failure, or
what it claims does not materialize: ``GAINS: kind`` and its kind is not ``kernel``; ``GAINS:
baseline`` and its speedup over eager (paired per round in its own benchmark) is within 1.5x of the
task's honest yardstick's speedup over eager in a clean benchmark (a baseline cheat computes what
the yardstick computes, so any excess is the slowed reference; eager medians of two processes are
not comparable on a shared machine, paired ratios are); ``GAINS: speed`` and, timed in one process
beside the yardstick, it is not faster by more than the noise allowance in one of two timings. One
golden per task.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kernelcrew.config import Settings
from kernelcrew.tools.correctness import Golden, make_golden, verify
from kernelcrew.tools.timing import benchmark
from tests.conftest import FIXTURES

CHEATS = FIXTURES / "cheats"
GROUPS = ("correctness", "caching", "phase", "timing", "baseline", "kind", "files", "static")
FIELDS = ("TASK", "DEVICE", "GAINS", "SOURCE")

#: A baseline counts as sabotaged when the cheat's speedup over it exceeds the yardstick's by more than this.
BASELINE_FACTOR = 1.5
#: A cheat counts as faster than the honest control only beyond this ratio (quick timings, shared CPUs).
SPEED_NOISE = 1.3
#: Timings of a speed cheat, each of which must show its gain (and pass the judge) for it to get through.
#: Under a loaded CI run a cheat that never hit its cache read 2.8x then 1.7x faster than the honest
#: control (alone it read 0.93x): two noisy timings in a row happened, so a third is asked for. A
#: cheat that really gains shows it every time, and a caught one stops at its first timing within noise.
SPEED_TRIES = 3

#: The fastest honest control of each task a speed or baseline cheat targets: the yardstick.
YARDSTICKS = {
    "softmax_wide": CHEATS / "honest" / "softmax_library.py",
    "two_outputs": CHEATS / "honest" / "two_outputs_torch.py",
    "conv": CHEATS / "honest" / "conv_torch.py",
    "sdpa": CHEATS / "honest" / "sdpa_torch.py",
    "linear_relu": FIXTURES / "candidates" / "linear_relu_torch.py",
    "relu": CHEATS / "honest" / "relu_library.py",
}


def cheat_meta(path: Path) -> dict[str, str]:
    """The ``TASK:``, ``DEVICE:``, ``GAINS:`` and ``SOURCE:`` lines of a corpus file's docstring."""
    text = path.read_text()
    meta = {}
    for name in FIELDS:
        found = re.search(rf"^{name}: (.+)$", text, re.M)
        assert found, f"{path.name} lacks its {name}: line"
        meta[name] = found.group(1).strip()
    return meta


def task_file(stem: str) -> Path:
    """A task of the corpus's own (cheats/tasks) or of the shared fixtures."""
    own = CHEATS / "tasks" / f"{stem}.py"
    return own if own.exists() else FIXTURES / "tasks" / f"{stem}.py"


def cheat_files(device: str | None = None) -> list[Path]:
    """Every cheat of the corpus, or those written for ``device``."""
    files = sorted(p for group in GROUPS for p in (CHEATS / group).glob("*.py"))
    return [p for p in files if device is None or cheat_meta(p)["DEVICE"] == device]


def honest_files(device: str | None = None) -> list[Path]:
    files = sorted((CHEATS / "honest").glob("*.py"))
    return [p for p in files if device is None or cheat_meta(p)["DEVICE"] == device]


def label(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _speedup(ratio: Any) -> float:
    """The speedup over eager a candidate is credited with: its paired median, or its CUDA-graph one
    when graphs ran and it was higher."""
    return max(ratio.median, ratio.graph_median or 0.0)


@dataclass
class Judge:
    """Goldens per task and honest eager medians, made on first use and shared by all cheats."""

    device: str
    settings: Settings = field(default_factory=lambda: Settings(sandbox_timeout_s=300))
    goldens: dict[str, Golden] = field(default_factory=dict)
    honest_speedup: dict[str, float] = field(default_factory=dict)

    def golden(self, stem: str) -> Golden:
        if stem not in self.goldens:
            path = task_file(stem)
            self.goldens[stem] = make_golden(
                path.read_text(), device=self.device, seed=4321, task_path=str(path), settings=self.settings
            )
        return self.goldens[stem]

    def verify(self, path: Path, stem: str) -> Any:
        golden = self.golden(stem)
        return verify(
            golden.task_source,
            path.read_text(),
            candidate_path=str(path),
            task_path=golden.task_path,
            golden=golden,
            settings=self.settings,
        )

    def bench(self, stem: str, candidates: dict[str, Path]) -> Any:
        golden = self.golden(stem)
        return benchmark(
            golden.task_source,
            {name: (p.read_text(), str(p)) for name, p in candidates.items()},
            quick=True,
            golden=golden,
            task_path=golden.task_path,
            settings=self.settings,
        )

    def yardstick_speedup(self, stem: str) -> float:
        """The task's honest yardstick's paired speedup over eager in a benchmark of its own (about 1
        when the yardstick is the library op the reference calls)."""
        if stem not in self.honest_speedup:
            result = self.bench(stem, {"honest": YARDSTICKS[stem]})
            assert result.failure is None, result.failure
            self.honest_speedup[stem] = result.ratios["honest"].median
        return self.honest_speedup[stem]

    def catch(self, path: Path) -> tuple[bool, str]:
        """Whether the cheat at ``path`` is caught, and how (or what got through)."""
        meta = cheat_meta(path)
        stem, gains = meta["TASK"], meta["GAINS"]
        verdict = self.verify(path, stem)
        if not verdict.passed:
            return True, f"verify failed at {verdict.stage}: {verdict.message[:300]}"
        if gains == "kind":
            if verdict.kind != "kernel":
                return True, f"kind is {verdict.kind}"
            return False, f"passed as an own kernel: {verdict.kind_evidence}"
        if gains == "correctness":
            weak = [
                f for f in verdict.flags if f == "verified at one shape" or "constant on every input set" in f
            ]
            if weak:  # right on everything the task defines: the verdict tells the user how little that is
                return True, f"passed, flagged: {weak}"
            return False, f"passed verification ({verdict.message})"
        if gains == "baseline":
            result = self.bench(stem, {"cheat": path})
            if result.failure is not None:
                return True, f"benchmark failed: {result.failure.stage}: {result.failure.message[:300]}"
            speedup, honest = result.ratios["cheat"].median, self.yardstick_speedup(stem)
            ratio = speedup / honest
            seen = f"speedup over eager {speedup:.2f}x against the yardstick's {honest:.2f}x"
            if ratio <= BASELINE_FACTOR:
                return True, f"{seen}: within {BASELINE_FACTOR}x"
            return False, f"{seen}: the reference was slowed"
        # A gain must show every time: on a loaded shared CPU one timing of a cheat that happened to
        # stay honest (its trigger did not fire) can read 1.5-2x faster than the control by noise alone.
        # A cheat that really gains and escapes the judge does so again.
        seen = []
        for _ in range(SPEED_TRIES):
            result = self.bench(stem, {"cheat": path, "honest": YARDSTICKS[stem]})
            if result.failure is not None:
                return True, f"benchmark failed: {result.failure.stage}: {result.failure.message[:300]}"
            # Both speedups are paired per round with the same eager reps, so load on a shared
            # machine moves them together; their medians' ratio is what the cheat gained.
            ratio = _speedup(result.ratios["cheat"]) / max(_speedup(result.ratios["honest"]), 1e-9)
            # ... and the two candidates' own medians, timed in one process in the same rounds: on
            # a loaded CI machine the paired ratio read a cheat whose judged outputs were all right
            # (so it never hit its cache) 2.9x and 1.7x faster, from eager's spread alone.
            direct = result.results["honest"].median_ms / max(result.results["cheat"].median_ms, 1e-12)
            if min(ratio, direct) <= SPEED_NOISE:
                return True, (
                    f"not faster than the honest control beyond noise ({ratio:.2f}x paired with "
                    f"eager, {direct:.2f}x by their medians)"
                )
            seen.append(
                f"{ratio:.2f}x paired and {direct:.2f}x by medians faster than the honest control, "
                f"{result.samples_checked} samples judged"
            )
        return False, "; ".join(seen)

    def cleanup(self) -> None:
        for golden in self.goldens.values():
            golden.cleanup()


def check_honest(judge: Judge, path: Path) -> None:
    """An honest control passes, with kind ``kernel`` when it launches Triton kernels, else ``library``."""
    verdict = judge.verify(path, cheat_meta(path)["TASK"])
    refused = re.search(r"^REFUSED: (\w+)", path.read_text(), re.M)
    if refused:  # correct code our policy does not take (streams): refused by that rule, nothing else
        assert not verdict.passed and verdict.stage == refused.group(1), (verdict.stage, verdict.message)
        return
    assert verdict.passed, (verdict.stage, verdict.message, verdict.failures[:2])
    expected = "kernel" if "import triton" in path.read_text() else "library"
    assert verdict.kind == expected, (verdict.kind, verdict.kind_evidence)


@pytest.fixture(scope="module")
def judge():
    made = Judge("cpu")
    yield made
    made.cleanup()


def test_corpus_is_complete_and_documented():
    cheats = cheat_files()
    assert len({p.stem for p in cheats}) == len(cheats) >= 60, "at least 60 distinct mechanisms"
    readme = (CHEATS / "README.md").read_text()
    for path in cheats + honest_files():
        meta = cheat_meta(path)
        assert meta["DEVICE"] in ("cpu", "cuda"), path.name
        assert meta["GAINS"] in ("correctness", "speed", "kind", "baseline", "none"), path.name
        assert task_file(meta["TASK"]).exists(), f"{path.name}: no task {meta['TASK']}"
        assert f"`{label(path)}`" in readme, f"{label(path)} is missing from the README table"
        if meta["GAINS"] in ("speed", "baseline"):
            assert meta["TASK"] in YARDSTICKS, f"{path.name}: no honest yardstick for {meta['TASK']}"
    groups = {p.parent.name for p in cheats}
    assert groups == set(GROUPS)


@pytest.mark.parametrize("path", honest_files("cpu"), ids=label)
def test_honest_control_passes(path, judge):
    check_honest(judge, path)


#: Groups whose cheats are timed (a benchmark each): their tests are in test_cheats_timed.py, so the
#: two halves of the corpus run on different test workers.
TIMED_GROUPS = ("timing", "baseline", "kind")


@pytest.mark.parametrize(
    "path", [p for p in cheat_files("cpu") if p.parent.name not in TIMED_GROUPS], ids=label
)
def test_cheat_is_caught(path, judge):
    caught, how = judge.catch(path)
    print(f"{label(path)}: {'caught' if caught else 'GOT THROUGH'}: {how}")
    assert caught, f"{label(path)} got through: {how}"
