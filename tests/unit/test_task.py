"""Task files: clear errors naming what is missing or wrong, and where."""

from __future__ import annotations

import gc
import re
import threading
from pathlib import Path

import pytest

import kernelcrew
from kernelcrew.task import (
    TaskError,
    call_inputs,
    check_source,
    load_candidate,
    load_task,
    parse,
    read_source,
)
from kernelcrew.task import test_input_sets as extra_input_sets
from kernelcrew.tools.anticheat import static_check
from tests.conftest import FIXTURES

BAD = sorted((FIXTURES / "tasks" / "bad").glob("*.py"))


def _load_fully(path):
    task = load_task(path.read_text(), path=str(path))
    call_inputs(task.get_inputs, "get_inputs", str(path))
    return task


@pytest.mark.parametrize("path", BAD, ids=[p.name for p in BAD])
def test_bad_task_gives_the_expected_error(path):
    expected = re.search(r"^EXPECT: (.+?)(?: \(line (\d+)\))?\"*$", path.read_text(), re.M)
    with pytest.raises(TaskError) as info:
        _load_fully(path)
    message = str(info.value)
    assert str(path) in message
    assert expected.group(1) in message, (expected.group(1), message)
    if expected.group(2):
        assert f":{expected.group(2)}:" in message


def test_import_error_names_the_line():
    path = FIXTURES / "tasks" / "bad" / "import_error.py"
    with pytest.raises(TaskError) as info:
        load_task(path.read_text(), path=str(path))
    assert info.value.line == 5
    assert "ModuleNotFoundError" in info.value.message


def test_good_tasks_load_with_their_test_inputs():
    for path in (FIXTURES / "tasks").glob("*.py"):
        task = load_task(path.read_text(), path=str(path))
        assert task.model_cls.__name__ == "Model"
        assert isinstance(call_inputs(task.get_inputs, "get_inputs", task.name), list)


def test_check_source_notes_missing_test_inputs():
    notes = check_source((FIXTURES / "tasks" / "relu.py").read_text(), "task")
    assert any("get_test_inputs" in n for n in notes)


def test_candidate_without_modelnew():
    with pytest.raises(TaskError, match=r"missing top-level definition.*ModelNew"):
        load_candidate("import torch\nclass Model(torch.nn.Module):\n    pass\n")


def test_candidate_modelnew_not_a_module():
    with pytest.raises(TaskError, match=r"ModelNew must be a subclass of torch\.nn\.Module"):
        load_candidate("class ModelNew:\n    pass\n")


def test_read_source_refuses_binary_huge_and_missing(tmp_path):
    binary = tmp_path / "b.py"
    binary.write_bytes(b"\x00\x01\x02")
    with pytest.raises(TaskError, match="binary"):
        read_source(binary)
    latin = tmp_path / "l.py"
    latin.write_bytes("x = 'caf\xe9'".encode("latin-1"))
    with pytest.raises(TaskError, match="not UTF-8"):
        read_source(latin)
    huge = tmp_path / "h.py"
    huge.write_text("#" * 2_000_000)
    with pytest.raises(TaskError, match="limit"):
        read_source(huge)
    with pytest.raises(TaskError, match="not found"):
        read_source(tmp_path / "missing.py")


def _parse_in_threads(parse) -> list[str]:
    """``parse`` on a sizable source from threads at different stack depths, with the garbage
    collector running finalizers mid-parse: the conditions under which CPython 3.11's shared
    AST recursion counter goes wrong. Returns the errors seen."""
    source = "\n".join(
        f"def f{i}(x):\n    return [[(x + {i}) * 2 for _ in range(3)] for _ in range(2)]" for i in range(300)
    )
    errors: list[str] = []

    class Finalized:
        def __del__(self) -> None:
            sum(range(10))

    def at_depth(n: int) -> None:
        if n:
            return at_depth(n - 1)
        for _ in range(20):
            cycle = [Finalized()]
            cycle.append(cycle)
            try:
                parse(source)
            except SystemError as exc:
                errors.append(str(exc))
                return

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        threads = [threading.Thread(target=at_depth, args=(d,)) for d in (5, 60, 120)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*thresholds)
    return errors


def test_parses_from_several_threads_at_once_do_not_fail():
    """The crew analyses a task in a thread while the main thread checks sources; the web server
    parses in its worker threads. Every kernelcrew parse goes through one lock."""
    assert _parse_in_threads(lambda s: parse(s, "t.py")) == []
    assert _parse_in_threads(static_check) == []


def test_no_parse_in_the_package_bypasses_the_lock():
    package = Path(kernelcrew.__file__).parent
    raw = [
        f"{p.relative_to(package)}:{n}"
        for p in package.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "ast.parse(" in line and not (p.name == "task.py" and "return ast.parse(" in line)
    ]
    assert raw == []


NESTED_TASK = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, xs, opts):
        return xs[0] * opts["scale"] + xs[1][0]

def get_inputs():
    return [[torch.randn(2, 3), (torch.randn(2, 3), 1)], {"scale": torch.tensor(2.0), "name": None}]

def get_init_inputs():
    return []

def get_test_inputs():
    return [[[torch.randn(1, 4), (torch.randn(1, 4), 1)], {"scale": 1.5, "mode": "x"}]]
"""


def test_nested_inputs_of_tensors_numbers_and_strings_are_accepted():
    task = load_task(NESTED_TASK, path="nested.py")
    inputs = call_inputs(task.get_inputs, "get_inputs", task.name)
    assert isinstance(inputs[0][1], tuple) and inputs[1]["name"] is None
    assert extra_input_sets(task)[0][1] == {"scale": 1.5, "mode": "x"}


def test_a_test_input_that_cannot_be_saved_is_named_by_its_path():
    source = NESTED_TASK.replace('"mode": "x"', '"mode": object()')
    task = load_task(source, path="nested.py")
    with pytest.raises(TaskError, match=r"get_test_inputs\(\)\[0\]\[1\]\['mode'\] is a object"):
        extra_input_sets(task)


def test_init_inputs_may_be_anything():
    assert call_inputs(lambda: [object(), slice(1)], "get_init_inputs", "t.py")[1] == slice(1)
