"""The own convolution kernel (implicit GEMM in TF32x3) against torch's convolutions, on the CPU
(Triton's interpreter): every spelling of a convolution module it replaces."""

from __future__ import annotations

import pytest
import torch.nn as nn

from kernelcrew.agents.playbook import conv
from kernelcrew.agents.playbook.analysis import TaskAnalysis
from tests.conftest import interpreted_json

CASES = {
    "conv2d": (nn.Conv2d(3, 16, 3), (2, 3, 9, 11)),
    "conv2d-stride-pad-dilation": (
        nn.Conv2d(5, 20, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(2, 1)),
        (2, 5, 12, 9),
    ),
    "conv2d-groups-no-bias": (nn.Conv2d(6, 32, 3, padding=1, groups=2, bias=False), (1, 6, 7, 7)),
    "conv2d-reflect": (nn.Conv2d(3, 16, 3, padding=2, padding_mode="reflect"), (2, 3, 8, 8)),
    "conv2d-same": (nn.Conv2d(3, 16, 4, padding="same", dilation=2), (2, 3, 10, 9)),
    "conv2d-unbatched": (nn.Conv2d(3, 16, 3), (3, 6, 6)),
    "conv1d-circular": (nn.Conv1d(4, 16, 5, stride=2, padding=2, padding_mode="circular"), (3, 4, 17)),
    "conv3d": (nn.Conv3d(2, 16, (2, 3, 3), stride=(1, 2, 2), padding=(1, 0, 1)), (2, 2, 5, 7, 6)),
    "conv2d-1x1": (nn.Conv2d(24, 16, 1), (2, 24, 5, 5)),
    # stride-1 transposed convolutions: as the forward convolution they equal
    "transposed2d": (nn.ConvTranspose2d(3, 16, 3), (2, 3, 6, 7)),
    "transposed2d-groups-pad-dilation-output-padding": (
        nn.ConvTranspose2d(4, 6, (3, 2), padding=(1, 0), dilation=(2, 3), output_padding=(1, 2), groups=2),
        (2, 4, 5, 6),
    ),
    "transposed1d-crop": (nn.ConvTranspose1d(5, 16, 3, padding=3, bias=False), (2, 5, 12)),
    "transposed3d-unbatched": (nn.ConvTranspose3d(2, 16, (2, 3, 1)), (2, 3, 4, 5)),
    # stride 2: the library's call, through the same host function
    "transposed2d-stride-library": (nn.ConvTranspose2d(3, 16, 3, stride=2, output_padding=1), (2, 3, 5, 5)),
}


#: Runs in a fresh interpreter: the Triton interpreter patches ``triton.language`` of the kernel's
#: module, and another test of the same process may have imported Triton anew.
CHECK = """
import json, sys
import torch
import torch.nn as nn
from tests.unit.test_conv import CASES
from kernelcrew.agents.playbook import conv

path = sys.argv[1]
with open(path, "w") as f:
    f.write("import torch\\nimport triton\\nimport triton.language as tl\\nimport torch.nn.functional as F\\n")
    f.write(conv.SOURCE)
sys.path.insert(0, str(__import__("pathlib").Path(path).parent))
import own_conv

params = conv.tuning_space("cpu")[0]
out = {}
for name, (module, shape) in CASES.items():
    torch.manual_seed(0)
    x = torch.randn(shape)
    with torch.no_grad():
        got = own_conv.conv_tf32x3(x, module.weight, module.bias, own_conv.conv_spec(module), params)
        want = module.double()(x.double()).float()
    same = got.shape == want.shape and got.dtype == torch.float32
    out[name] = float((got - want).abs().max() / want.abs().max()) if same else None
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    """Each case's worst error of the kernel (interpreted) against torch in float64, relative to
    the output's largest magnitude; None for a wrong shape or dtype."""
    source = tmp_path_factory.mktemp("conv") / "own_conv.py"
    return interpreted_json(["-c", CHECK, str(source)], timeout=600)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_matches_torch(errors, name):
    assert errors[name] is not None, "wrong output shape or dtype"
    assert errors[name] < 1e-5


def _node(module_type: str, groups: int, out: list[int], dtype: str = "float32") -> dict:
    return {
        "name": "c",
        "kind": "call_module",
        "target": "c",
        "module_type": f"torch.nn.modules.conv.{module_type}",
        "kwargs": {"groups": groups},
        "shape": out,
        "dtype": dtype,
    }


def _weights(*shape: int) -> TaskAnalysis:
    return TaskAnalysis({"state_dict": [{"name": "c.weight", "shape": list(shape), "dtype": "float32"}]})


def test_what_the_kernel_replaces():
    """The rules follow where the kernel beat cuDNN's float32 convolution (conv.py's docstring)."""
    big = [128, 128, 126, 126]
    assert conv.eligible(_weights(128, 64, 3, 3), _node("Conv2d", 1, big))[0]
    assert conv.eligible(_weights(2048, 512, 1, 1), _node("Conv2d", 1, [10, 2048, 7, 7]))[0]
    assert conv.eligible(_weights(128, 32, 3, 3), _node("Conv2d", 2, big))[0]  # 32 in, 64 out per group
    assert conv.eligible(_weights(128, 64, 3), _node("Conv1d", 1, [64, 128, 1000]))[0]
    assert conv.eligible(_weights(128, 64, 3), _node("Conv1d", 1, [128, 8192]))[0]  # unbatched
    assert conv.eligible(_weights(32, 16, 3, 3), _node("Conv2d", 1, [2, 32, 7, 7]))[0]  # tiny: any tiles
    few = conv.eligible(_weights(64, 8, 3, 3), _node("Conv2d", 1, big))  # KernelBench l2_73's: 0.57x
    assert not few[0] and "8 input" in few[1]
    depthwise = conv.eligible(_weights(128, 1, 3, 3), _node("Conv2d", 128, big))
    assert not depthwise[0] and "depthwise" in depthwise[1]
    small = conv.eligible(_weights(256, 256, 3, 3), _node("Conv2d", 1, [10, 256, 14, 14]))  # 0.5-0.8x
    assert not small[0] and "32 output tiles" in small[1]
    transposed = {**_node("ConvTranspose2d", 1, big), "args": [{"ref": "x"}]}
    assert conv.eligible(_weights(64, 128, 3, 3), {**transposed, "kwargs": {"groups": 1, "stride": [1, 1]}})[
        0
    ]
    strided = conv.eligible(
        _weights(64, 128, 3, 3), {**transposed, "kwargs": {"groups": 1, "stride": [2, 2]}}
    )
    assert not strided[0] and "stride [2, 2]" in strided[1]
    few_out = {**transposed, "kwargs": {"groups": 2, "stride": [1, 1]}}
    assert not conv.eligible(_weights(64, 8, 3, 3), few_out)[0]  # (in, out per group, ...): 8 out per group
    assert not conv.eligible(_weights(128, 64, 3, 3), _node("Conv2d", 1, big, "float16"))[0]
    with pytest.raises(ValueError, match="power of two"):
        conv.check_params({"BLOCK_M": 48})
