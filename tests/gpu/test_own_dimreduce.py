"""``dim_reduction``'s own kernels on the GPU: reductions over a dim that is not the last (sums,
means, extremes and their indices, in float32 and half precision) judged by ``kernelcrew verify``
as a user runs it. The CPU tests run the same kernels in Triton's interpreter."""

from __future__ import annotations

import pytest

from kernelcrew.agents.playbook import dimreduce
from tests.conftest import local_analysis
from tests.gpu.conftest import kernelcrew_json
from tests.unit.test_dimreduce import task

pytestmark = pytest.mark.gpu

TASKS = {
    # KernelBench level 1's task 47 (a sum over the middle dim, keepdim) at a smaller shape
    "sum-middle": task("torch.sum(x, dim=self.dim, keepdim=True)", "torch.randn(16, 256, 256)"),
    "mean-outer": task("torch.mean(x, dim=0)", "torch.randn(512, 4096)"),
    "argmax-middle": task("torch.argmax(x, dim=self.dim)", "torch.randn(64, 1024, 96)"),
    "argmin-inner-1": task("torch.argmin(x, dim=self.dim)", "torch.randn(128, 4096, 1)"),
    "max-pair-half": task("torch.max(x, dim=1)", "torch.randn(32, 333, 100).half()"),
    "prod-bfloat16": task("torch.prod(x, dim=1)", "(1 + 0.01 * torch.randn(8, 64, 513)).bfloat16()"),
}


#: Tasks whose every tuning configuration is verified (the others: the first, the one a run tries).
EVERY_CONFIG = ("argmax-middle",)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_own_dim_reductions_verify_on_the_gpu(tmp_path, name):
    source = TASKS[name]
    analysis = local_analysis(source)
    plan, reason = dimreduce.match(analysis)
    assert plan is not None, reason
    configs = dimreduce.tuning_space(plan, "sm_90")
    for params in configs if name in EVERY_CONFIG else configs[:1]:
        (tmp_path / "task.py").write_text(source)
        (tmp_path / "candidate.py").write_text(dimreduce.generate(source, analysis, plan, params))
        report = kernelcrew_json(
            "verify", str(tmp_path / "task.py"), str(tmp_path / "candidate.py"),
            "--device", "cuda", "--compile-modes", "none", "--quick",
        )  # fmt: skip
        assert report["verdict"] == "pass", (params, report.get("message"))
        assert report["kind"] == "kernel", report
