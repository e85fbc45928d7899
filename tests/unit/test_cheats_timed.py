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


#: Cheats that lie to the harness from inside its own process (a rewritten results file). The static
#: rules refuse them; the dynamic checks must catch them without those rules. (A patched clock is
#: caught without them only beyond what the parent's clock can see: ``untrusted_clocks``.)
WITHOUT_STATIC_RULES = ("files/rewrite_result_files",)


@pytest.mark.parametrize("name", WITHOUT_STATIC_RULES)
def test_in_process_lies_are_caught_with_the_static_rules_off(name, judge, monkeypatch):
    from kernelcrew.tools import correctness
    from tests.unit.test_cheats import CHEATS

    monkeypatch.setattr(correctness, "static_check", lambda source, path="candidate.py": [])
    caught, how = judge.catch(CHEATS / f"{name}.py")
    assert caught, f"{name} got through with the static rules off: {how}"
    assert "static" not in how.split(":")[0], how


def test_a_clock_the_parent_contradicts_is_not_trusted():
    from kernelcrew.tools.timing import untrusted_clocks

    seen = {
        "eager": [1.30, 1.32, 1.31, 1.29],
        "honest": [0.80, 0.82, 0.81, 0.79],
        "liar": [5.3, 5.2, 5.4, 5.3],
    }
    clock = {"eager": [1.0, 1.0, 1.0, 1.0], "honest": [0.5, 0.5, 0.5, 0.5], "liar": [0.1, 0.1, 0.1, 0.1]}
    lies = untrusted_clocks(seen, clock, trusted=["eager"])
    assert set(lies) == {"liar"} and "not trusted" in lies["liar"]
    assert untrusted_clocks(seen, clock, trusted=[]) == {}, "nothing trusted: nothing to compare with"
