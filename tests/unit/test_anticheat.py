"""Static rules, state snapshots, op traces and the pass rule, one behaviour at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kernelcrew.tools.anticheat import classify_kind, record_ops, snapshot_state, state_changes, static_check
from kernelcrew.tools.correctness import compare_output, op_class, tolerance_for

HONEST = textwrap.dedent(
    """
    import math
    import os
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import triton
    import triton.language as tl
    from torch.utils.cpp_extension import load_inline

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    class ModelNew(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.linear = nn.Linear(dim, dim)
            self.scale = 1.0 / math.sqrt(dim)

        def forward(self, x):
            w = getattr(self.linear, "weight")
            y = F.linear(x, w) * self.scale
            out = torch.empty_like(y)
            grid = lambda META: (triton.cdiv(y.numel(), META["BLOCK"]),)
            add_kernel[grid](y, y, out, y.numel(), BLOCK=1024)
            torch.cuda.synchronize() if x.is_cuda else None
            return out
    """
)


def rules(source: str) -> set[str]:
    return {f.rule for f in static_check(textwrap.dedent(source))}


def test_honest_candidate_breaks_no_rule():
    assert static_check(HONEST) == []


@pytest.mark.parametrize(
    ("source", "rule"),
    [
        ("import gc", "import"),
        ("import inspect", "import"),
        ("import ctypes", "import"),
        ("import subprocess", "import"),
        ("from threading import Thread", "import"),
        ("import importlib", "import"),
        ("from . import task", "import"),
        ("import sys\nsys.modules['x']", "introspection"),
        ("import sys\nsys._getframe(1)", "introspection"),
        ("import sys\nsys.exit(0)", "module-attr"),
        ("import os\nos.system('ls')", "module-attr"),
        ("import os as o\no.kill(1, 9)", "module-attr"),
        ("from os import fork", "module-attr"),
        ("x = (1).__class__.__subclasses__()", "dunder"),
        ("def f(e):\n    return e.__traceback__.tb_frame.f_back.f_locals", "dunder"),
        ("getattr(object, name)", "dynamic-attr"),
        ("getattr(object, '__dict__')", "dynamic-attr"),
        ("import torch\nsetattr(torch.cuda, 'synchronize', None)", "monkeypatch"),
        ("import torch\ntorch.cuda.synchronize = lambda: None", "monkeypatch"),
        ("import torch\ntorch.backends.cuda.matmul.allow_tf32 = True", "monkeypatch"),
        ("import torch.nn.functional as F\nF.softmax = None", "monkeypatch"),
        ("import torch\ns = torch.cuda.Stream()", "stream"),
        ("from torch.cuda import Stream", "stream"),
        ("import torch\nwith torch.cuda.stream(None):\n    pass", "stream"),
        ("exec('1')", "name"),
        ("eval('1')", "name"),
        ("__import__('time')", "name"),
        ("open('/etc/passwd')", "name"),
        ("y = Model()", "name"),
        ("y = get_inputs()", "name"),
        ("globals()['x'] = 1", "name"),
    ],
)
def test_cheat_construct_is_flagged(source, rule):
    assert rule in rules(source), static_check(textwrap.dedent(source))


def test_findings_carry_lines():
    findings = static_check("import torch\n\n\nimport gc\n")
    assert findings[0].line == 4


def test_a_candidates_own_definitions_are_not_banned_names():
    assert rules("def compile(x):\n    return x\ny = compile(1)\n") == set()


def test_state_snapshot_sees_flag_and_function_changes():
    before = snapshot_state()
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert any("float32_matmul_precision" in c for c in state_changes(before, snapshot_state()))
    finally:
        torch.set_float32_matmul_precision(old)
    original = torch.cuda.synchronize
    try:
        torch.cuda.synchronize = lambda *a, **k: None
        assert "torch.cuda.synchronize was replaced" in state_changes(before, snapshot_state())
    finally:
        torch.cuda.synchronize = original
    assert state_changes(before, snapshot_state()) == []


DYNAMO_IMPORT = """
import functools, sys, torch
from kernelcrew.tools.anticheat import snapshot_state, state_changes
assert "torch._dynamo" not in sys.modules
before = snapshot_state()
import torch._dynamo  # wraps torch.manual_seed in torch._disable_dynamo, in place
assert state_changes(before, snapshot_state()) == [], state_changes(before, snapshot_state())
wrapped = torch.manual_seed
torch.manual_seed = functools.wraps(wrapped.__wrapped__)(lambda *a, **k: None)
own = state_changes(before, snapshot_state())
torch.manual_seed = torch._disable_dynamo(lambda *a, **k: None)
other = state_changes(before, snapshot_state())
torch.manual_seed = wrapped
print(own, other)
assert own == other == ["torch.manual_seed was replaced"]
"""


def test_importing_dynamo_late_is_no_state_change_but_a_wrapper_of_ones_own_is():
    """A candidate may import ``torch._dynamo`` lazily (``torch.compile``, fx tracing at run time): its
    import wraps ``torch.manual_seed`` in ``torch._disable_dynamo``, which calls the same function.
    Any other replacement, a look-alike wrapper included, is still a change."""
    res = subprocess.run([sys.executable, "-c", DYNAMO_IMPORT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_op_trace_and_kind():
    x = torch.randn(4, 8)
    _, ref_ops = record_ops(torch.softmax, x, -1)
    _, lib_ops = record_ops(lambda t: torch.softmax(t * 1.0, -1), x)
    kind, evidence = classify_kind(lib_ops, ref_ops, {"triton": False}, launches=0)
    assert kind == "library" and "_softmax" in evidence["ops_shared_with_reference"]
    _, alloc_ops = record_ops(lambda t: torch.empty_like(t), x)
    assert classify_kind(alloc_ops, ref_ops, {"triton": True}, launches=1)[0] == "kernel"
    assert classify_kind(alloc_ops, ref_ops, {"triton": True}, launches=0)[0] == "library"
    assert classify_kind(alloc_ops, ref_ops, {"compiler": True}, launches=3)[0] == "compiler"


def test_op_class():
    assert op_class({"addmm": 1, "relu": 1}) == "matmul"
    assert op_class({"_softmax": 1}) == "pointwise"


def _golden(shape=(64, 64), seed=0):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return g, g.float()


def test_pass_rule_accepts_fp32_rounding():
    g, n = _golden()
    assert compare_output(n.clone(), g, n, tolerance_for("float32", "pointwise", "strict"))["ok"]


def test_pass_rule_rejects_zeros_and_small_systematic_error():
    g, n = _golden()
    tol = tolerance_for("float32", "pointwise", "strict")
    assert compare_output(torch.zeros_like(n), g, n, tol)["stage"] == "correctness"
    # A 1e-3 relative error everywhere (TF32-like) fails strict and passes relaxed.
    off = (g * (1 + 1e-3)).float()
    assert not compare_output(off, g, n, tol)["ok"]
    assert compare_output(off, g, n, tolerance_for("float32", "pointwise", "relaxed"))["ok"]


def test_pass_rule_l2_catches_many_small_errors_within_elementwise_limits():
    g, n = _golden((256, 256))
    tol = tolerance_for("float32", "pointwise", "strict")
    bumped = (g + 0.9 * (tol.atol_rms * float(g.pow(2).mean().sqrt()) + tol.rtol * g.abs())).float()
    res = compare_output(bumped, g, n, tol)
    assert not res["ok"] and "relative L2" in res["message"]


def test_pass_rule_nan_dtype_shape_and_exact_ints():
    g, n = _golden()
    tol = tolerance_for("float32", "pointwise", "strict")
    bad = n.clone()
    bad[3, 5] = float("nan")
    res = compare_output(bad, g, n, tol)
    assert res["stage"] == "nan" and res["first_bad_index"] == [3, 5]
    assert compare_output(n.double(), g, n, tol)["stage"] == "dtype"
    assert compare_output(n[:, :-1], g, n, tol)["stage"] == "shape"
    ints = torch.arange(10)
    assert compare_output(ints, ints.clone(), ints, tolerance_for("int64", "pointwise", "strict"))["ok"]
    off = ints.clone()
    off[7] += 1
    assert compare_output(off, ints, ints, tolerance_for("int64", "pointwise", "strict"))[
        "first_bad_index"
    ] == [7]


def test_nan_where_the_reference_has_nan_passes():
    g, n = _golden()
    g[0, 0] = float("nan")
    n[0, 0] = float("nan")
    assert compare_output(n.clone(), g, n, tolerance_for("float32", "pointwise", "strict"))["ok"]


def test_thresholds_follow_dtype_and_op_class():
    assert tolerance_for("float16", "matmul", "strict").rtol == 1e-2
    assert tolerance_for("float16", "pointwise", "strict").rtol == 2e-3
    assert tolerance_for("bfloat16", "matmul", "strict").l2_floor == 1e-2
    assert tolerance_for("bool", "pointwise", "strict").exact


def test_thread_check_counts_only_threads_running_candidate_code():
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    stop = threading.Event()
    before = snapshot_state((__file__,))
    # A library's worker thread (its code lives in concurrent/futures) is not the candidate's.
    pool = ThreadPoolExecutor(max_workers=1)
    pool.submit(queue.Queue().put, 1).result()
    assert state_changes(before, snapshot_state((__file__,))) == []
    # With no candidate (the baseline's timing of eager and torch.compile), no thread is one's own.
    assert snapshot_state()["threads"] == 0
    # A thread running a function defined in the candidate's file is.
    mine = threading.Thread(target=lambda: stop.wait(5))
    mine.start()
    try:
        changes = state_changes(before, snapshot_state((__file__,)))
        assert any("threads started by the candidate" in c for c in changes)
    finally:
        stop.set()
        mine.join()
        pool.shutdown()


def test_sliced_judgement_matches_whole_tensor_arithmetic(monkeypatch):
    """The streaming judge (slices of JUDGE_CHUNK elements) reports what the same rule computed on
    whole tensors reports: metrics, count beyond tolerance and the first bad index, also when the
    first bad element lies in a later slice."""
    from kernelcrew.tools import correctness

    monkeypatch.setattr(correctness, "JUDGE_CHUNK", 97)
    g, n = _golden((40, 33), seed=3)
    tol = tolerance_for("float32", "pointwise", "strict")
    cand = n.clone()
    cand[25, 4] += 1.0
    cand[31, 30] -= 2.0
    res = compare_output(cand, g, n, tol)

    rms = float(g.pow(2).mean().sqrt())
    err = (cand.double() - g).abs()
    beyond = err > tol.atol_rms * rms + tol.rtol * g.abs()
    assert not res["ok"] and res["stage"] == "correctness"
    assert res["first_bad_index"] == [25, 4]
    assert res["message"].startswith(f"{int(beyond.sum())} of {g.numel()} elements outside")
    assert res["max_abs_error"] == pytest.approx(float(err.max()))
    assert res["rel_l2"] == pytest.approx(float((cand.double() - g).norm() / g.norm()))
    assert res["pytorch_rel_l2"] == pytest.approx(float((n.double() - g).norm() / g.norm()))
    assert res["max_rel_error"] == pytest.approx(float((err / g.abs().clamp_min(rms)).max()))


def test_a_nan_in_a_later_slice_still_reaches_the_non_finite_rule(monkeypatch):
    from kernelcrew.tools import correctness

    monkeypatch.setattr(correctness, "JUDGE_CHUNK", 64)
    g, n = _golden((30, 30), seed=4)
    bad = n.clone()
    bad[29, 1] = float("inf")
    res = compare_output(bad, g, n, tolerance_for("float32", "pointwise", "strict"))
    assert res["stage"] == "nan" and res["first_bad_index"] == [29, 1]
