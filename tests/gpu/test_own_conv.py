"""The own kernels of ``anchored_fusion`` on the GPU: float32 convolutions (the TF32x3 implicit GEMM,
stride-1 transposed ones among them; depthwise ones by the direct kernel) and linear layers (GEMM
heads) judged by ``kernelcrew verify`` at strict float32 tolerances, on the tensor cores this time
(the CPU tests run them in Triton's interpreter, in NumPy's float32)."""

from __future__ import annotations

import pytest

from kernelcrew.agents.playbook import anchored, generate, tuning_space
from tests.conftest import local_analysis
from tests.gpu.conftest import kernelcrew_json
from tests.unit.test_anchored import task

pytestmark = pytest.mark.gpu


def _task(init: str, forward: str, inputs: str) -> str:
    return task(init, forward, inputs, "[]")


TASKS = {
    # a compute-bound 3x3 convolution, bias and ReLU after it (KernelBench level 2's pattern)
    "conv2d_relu": _task(
        "self.conv = nn.Conv2d(64, 128, 3, padding=1)",
        "return torch.relu(self.conv(x)) * 0.5",
        "torch.randn(8, 64, 64, 64)",
    ),
    # 3-D, grouped, strided, no bias, then an instance norm
    "conv3d_groups_norm": _task(
        "self.conv = nn.Conv3d(32, 64, 3, stride=(1, 2, 2), groups=2, bias=False)\n"
        "self.norm = nn.InstanceNorm3d(64)",
        "return self.norm(self.conv(x))",
        "torch.randn(4, 32, 10, 34, 34)",
    ),
    # a stride-1 transposed convolution (the forward convolution it equals), dilated and padded
    "conv_transpose2d": _task(
        "self.conv = nn.ConvTranspose2d(64, 64, 3, padding=1, dilation=2)",
        "return self.conv(x)",
        "torch.randn(8, 64, 64, 64)",
    ),
    # a depthwise convolution (the own direct kernel), KernelBench level 1's asymmetric kernel
    "depthwise": _task(
        "self.conv = nn.Conv2d(32, 32, (3, 1), groups=32, bias=False)",
        "return self.conv(x)",
        "torch.randn(16, 32, 256, 256)",
    ),
    # a linear layer with K = 4096 (the GEMM head) and a softmax after it
    "linear_softmax": _task(
        "self.fc = nn.Linear(4096, 2048)",
        "return torch.softmax(self.fc(x) * 0.1, dim=-1)",
        "torch.randn(512, 4096)",
    ),
}


#: Known defect: under ``--quick`` the timing's clock check distrusts the direct kernel's candidate
#: on this shape (its requests take about 1.3 ms longer than its 0.2 ms per call and the
#: reference's overhead explain, on an H100 and an H200 alike), so the verdict is a fail. The
#: full verification of KernelBench's depthwise task (bench/results/kernelbench_h100.json) passes.
CLOCK_CHECK_DISTRUSTS = {"depthwise"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason="the clock check distrusts it (see above)"))
        if n in CLOCK_CHECK_DISTRUSTS
        else n
        for n in sorted(TASKS)
    ],
)
def test_own_tf32x3_kernels_verify_on_the_gpu(tmp_path, name):
    source = TASKS[name]
    analysis = local_analysis(source)
    plan, reason = anchored.match(analysis)
    assert plan is not None, reason
    assert plan.convs or plan.directs or any(r.generator == "matmul" for r in plan.regions), reason
    params = tuning_space("anchored_fusion", analysis, "sm_90")[0]
    (tmp_path / "task.py").write_text(source)
    (tmp_path / "candidate.py").write_text(generate("anchored_fusion", source, analysis, params))
    report = kernelcrew_json(
        "verify", str(tmp_path / "task.py"), str(tmp_path / "candidate.py"),
        "--device", "cuda", "--compile-modes", "none", "--quick",
    )  # fmt: skip
    assert report["verdict"] == "pass", report.get("message")
    assert report["kind"] == "kernel", report
