"""Task files: clear errors naming what is missing or wrong, and where."""

from __future__ import annotations

import re

import pytest

from kernelcrew.task import TaskError, call_inputs, check_source, load_candidate, load_task, read_source
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
