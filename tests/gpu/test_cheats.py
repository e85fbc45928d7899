"""The adversarial corpus on the GPU: every cheat (the CPU ones too, run on cuda) is caught, and every
honest control passes with the right kind. The rules of "caught" are tests/unit/test_cheats.py's."""

from __future__ import annotations

import pytest

from tests.unit.test_cheats import Judge, cheat_files, check_honest, honest_files, label

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_judge():
    made = Judge("cuda")
    yield made
    made.cleanup()


@pytest.mark.parametrize("path", honest_files(), ids=label)
def test_honest_control_passes_on_cuda(path, cuda_judge):
    check_honest(cuda_judge, path)


@pytest.mark.parametrize("path", cheat_files(), ids=label)
def test_cheat_is_caught_on_cuda(path, cuda_judge):
    caught, how = cuda_judge.catch(path)
    print(f"{label(path)} on cuda: {'caught' if caught else 'GOT THROUGH'}: {how}")
    assert caught, f"{label(path)} got through on cuda: {how}"
