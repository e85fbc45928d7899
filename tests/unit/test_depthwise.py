"""The own direct convolution (depthwise and few channels per group) against torch's convolutions, on
the CPU (Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch.nn as nn

from kernelcrew.agents.playbook import depthwise
from tests.conftest import interpreted_json
from tests.unit.test_conv import _node, _weights

#: Small shapes (the interpreter is slow): a few hundred output positions each.
CASES = {
    "depthwise-3x1-no-bias": (nn.Conv2d(4, 4, (3, 1), groups=4, bias=False), (2, 4, 9, 7)),
    "depthwise-stride-pad-dilation-bias": (
        nn.Conv2d(3, 3, 3, stride=2, padding=1, dilation=2, groups=3),
        (2, 3, 11, 10),
    ),
    "depthwise-multiplier-2": (nn.Conv2d(3, 6, 3, groups=3), (1, 3, 8, 9)),
    "depthwise1d-reflect": (nn.Conv1d(4, 4, 5, padding=2, padding_mode="reflect", groups=4), (2, 4, 19)),
    "depthwise3d": (
        nn.Conv3d(2, 2, (2, 3, 3), stride=(1, 2, 1), padding=(1, 1, 0), groups=2),
        (1, 2, 4, 7, 6),
    ),
    "depthwise-same": (nn.Conv2d(3, 3, (4, 3), padding="same", dilation=(1, 2), groups=3), (1, 3, 7, 8)),
    "depthwise-unbatched": (nn.Conv2d(3, 3, 3, padding=1, groups=3), (3, 6, 5)),
    "grouped-2-in-3-out": (nn.Conv2d(4, 6, (2, 3), padding=(0, 1), groups=2), (2, 4, 6, 7)),
}


#: Runs in a fresh interpreter: TRITON_INTERPRET must be set before Triton is imported, and the
#: interpreter patches ``triton.language`` of the kernel's module.
CHECK = """
import json, sys
import torch
import torch.nn as nn
from tests.unit.test_depthwise import CASES
from kernelcrew.agents.playbook import conv, depthwise

path = sys.argv[1]
with open(path, "w") as f:
    f.write("import torch\\nimport triton\\nimport triton.language as tl\\nimport torch.nn.functional as F\\n")
    f.write(conv.SOURCE)  # conv_geometry
    f.write(depthwise.SOURCE)
sys.path.insert(0, str(__import__("pathlib").Path(path).parent))
import own_depthwise

params = depthwise.tuning_space("cpu")[0]
out = {}


def check(name, module, x, calls_kernel):
    launches = []
    kernel = own_depthwise.conv_direct_kernel
    own_depthwise.conv_direct_kernel = type("Spy", (), {
        "__getitem__": lambda self, grid: (launches.append(grid), kernel[grid])[1]
    })()
    try:
        with torch.no_grad():
            got = own_depthwise.conv_direct(x, module.weight, module.bias, own_depthwise.conv_spec(module), params)
            want = module(x)
    finally:
        own_depthwise.conv_direct_kernel = kernel
    try:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        error = None
    except AssertionError as e:
        error = str(e)
    out[name] = {"error": error, "as_expected": bool(launches) == calls_kernel}


for name, (module, shape) in CASES.items():
    torch.manual_seed(0)
    module.reset_parameters()
    check(name, module, torch.randn(shape), True)

torch.manual_seed(0)
check("transposed", nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=4),
      torch.randn(1, 4, 5, 6), False)
check("float64", nn.Conv2d(3, 3, 3, groups=3, padding_mode="circular", padding=1).double(),
      torch.randn(1, 3, 6, 5, dtype=torch.float64), False)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each case's mismatch against torch (None if close) and whether the kernel ran as expected."""
    source = tmp_path_factory.mktemp("depthwise") / "own_depthwise.py"
    return interpreted_json(["-c", CHECK, str(source)], timeout=300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_matches_torch(results, name):
    assert results[name]["error"] is None, results[name]["error"]
    assert results[name]["as_expected"], "the kernel did not run"


@pytest.mark.parametrize("name", ["transposed", "float64"])
def test_the_library_serves_the_rest(results, name):
    assert results[name]["error"] is None, results[name]["error"]
    assert results[name]["as_expected"], "the kernel ran where the library should have"


def test_what_the_kernel_replaces():
    task83 = depthwise.eligible(_weights(8, 1, 3, 1), _node("Conv2d", 8, [64, 8, 510, 512]))
    assert task83 == (True, "1 input and 1 output channel(s) per group: a memory-bound direct convolution")
    assert depthwise.eligible(_weights(16, 1, 3), _node("Conv1d", 8, [4, 16, 100]))[0]  # multiplier 2
    assert depthwise.eligible(_weights(12, 4, 3, 3, 3), _node("Conv3d", 3, [2, 12, 8, 8, 8]))[0]
    wide = depthwise.eligible(_weights(32, 16, 3, 3), _node("Conv2d", 1, [2, 32, 30, 30]))
    assert not wide[0] and "16 input and 32 output channel(s) per group: more than 4" in wide[1]
    assert not depthwise.eligible(_weights(10, 1, 3, 3), _node("Conv2d", 2, [2, 10, 30, 30]))[0]  # 5 out
    half = depthwise.eligible(_weights(8, 1, 3, 3), _node("Conv2d", 8, [2, 8, 30, 30], "float16"))
    assert not half[0] and "not float32" in half[1]
    transposed = depthwise.eligible(_weights(8, 1, 3, 3), _node("ConvTranspose2d", 8, [2, 8, 30, 30]))
    assert not transposed[0] and "not a call" in transposed[1]


def test_tuning_space_and_params():
    assert depthwise.tuning_space("sm_90")[0] == {"BLOCK": 1024, "num_warps": 4}
    assert depthwise.tuning_space("cpu") == [{"BLOCK": 64, "num_warps": 4}]
    for arch in ("sm_90", "sm_80", "cpu", "sm_100"):
        for config in depthwise.tuning_space(arch):
            assert depthwise.check_params(config) == config
    assert depthwise.check_params({"BLOCK": 256}) == {"BLOCK": 256, "num_warps": 4}
    with pytest.raises(ValueError, match="BLOCK"):
        depthwise.check_params({"BLOCK": 1000})
    with pytest.raises(ValueError, match="num_warps"):
        depthwise.check_params({"num_warps": 3})
    with pytest.raises(ValueError, match="BLOCK_M"):
        depthwise.check_params({"BLOCK_M": 64})
