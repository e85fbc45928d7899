"""The adversarial corpus's timed half on the CPU: timing, baseline and kind cheats (the rules of
"caught" are test_cheats.py's)."""

from __future__ import annotations

import pytest

from tests.unit.test_cheats import TIMED_GROUPS, Judge, cheat_files, label


@pytest.fixture(scope="module")
def judge():
    made = Judge("cpu")
    yield made
    made.cleanup()


@pytest.mark.parametrize("path", [p for p in cheat_files("cpu") if p.parent.name in TIMED_GROUPS], ids=label)
def test_timed_cheat_is_caught(path, judge):
    caught, how = judge.catch(path)
    print(f"{label(path)}: {'caught' if caught else 'GOT THROUGH'}: {how}")
    assert caught, f"{label(path)} got through: {how}"
