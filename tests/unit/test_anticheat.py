"""Static rules, state snapshots, op traces and the pass rule, one behaviour at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernelcrew.tools.anticheat import (
    output_problems,
    record_ops,
    snapshot_state,
    state_changes,
    static_check,
)
from kernelcrew.tools.correctness import compare_output, op_class, tolerance_for
from tests.conftest import FIXTURES

ROOT = Path(__file__).resolve().parents[2]

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
        ("from torch import nn\nwalk = nn.Module().modules", "introspection"),  # a read, not the call
        ("import sys\nsys.modules(1)", "introspection"),
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


#: Ways around the static rules (module reach, hidden code, subclasses, hooks, state), each refused.
ESCAPES = [
    ("import torch\ntorch.sys.modules['torch']", "module-attr"),
    ("import torch\ntorch.os.system('id')", "module-attr"),
    ("import torch\nf = torch.inspect.currentframe()", "module-reach"),
    ("import torch\ntorch.serialization.pickle.loads(b'')", "module-reach"),
    ("import numpy as np\nnp.ctypeslib.as_array(0)", "module-reach"),
    ("import numpy as np\nnp.testing.assert_equal(1, 1)", "module-reach"),
    ("import torch\ntorch._C._set_grad_enabled(False)", "private"),
    ("import torch\ntorch.utils.cpp_extension.subprocess.run(['id'])", "module-reach"),
    ("import os\nos.path.os.system('id')", "module-attr"),
    ("import warnings\nwarnings.showwarning = print", "module-attr"),
    ("import warnings\nwith warnings.catch_warnings(record=True) as w:\n    pass", "module-attr"),
    ("import torch\nimport importlib\nimportlib.import_module('os')", "import"),
    ("import builtins\nbuiltins.exec('1')", "import"),
    ("from torch import os as o\no.system('id')", "module-attr"),
    ("from torch.nn.modules import module", "import"),
    ("import torch.multiprocessing", "import"),
    ("import torch\nt = torch\nt.os.system('id')", "module-attr"),
    ("import torch\ndef f(m):\n    return m.os\nf(torch)", "module-value"),
    ("import torch\nmods = [torch]\nmods[0].os.system('id')", "module-value"),
    ("import torch, functools\nfunctools.reduce(getattr, ['sys', 'modules'], torch)", "dynamic-attr"),
    ("import torch, operator\noperator.attrgetter('sys.modules')(torch)", "dynamic-attr"),
    ("import torch, operator\noperator.methodcaller('__subclasses__')(object)", "dynamic-attr"),
    ("import torch\ng = getattr\ng(torch, 'os')", "dynamic-attr"),
    ("import torch\ngetattr(torch, 'o' + 's')", "dynamic-attr"),
    ("import torch\ngetattr(torch, 'os').system('id')", "module-attr"),
    ("x = vars()", "name"),
    ("x = locals()['__builtins__']", "name"),
    ("import torch\nx = type(torch.zeros(1)).__mro__", "dunder"),
    ("x = __builtins__['eval']", "name"),
    ("import torch\nx = torch.nn.Module.__init__.__globals__['sys']", "dunder"),
    ("x = '{0.__init__.__globals__}'.format(object)", "dunder"),
    ("fmt = '{0.forward}'\nx = fmt.format(object)", "dynamic-attr"),
    ("import torch\nclass Fake(torch.Tensor):\n    pass", "tensor-subclass"),
    ("import torch.nn as nn\nclass P(nn.Parameter):\n    pass", "tensor-subclass"),
    ("from torch import Tensor as T\nclass Fake(T):\n    pass", "tensor-subclass"),
    ("import torch\nclass A(torch.Tensor):\n    pass\nclass B(A):\n    pass", "tensor-subclass"),
    (
        "class X:\n    @classmethod\n    def __torch_function__(cls, func, types, args=(), kwargs=None):\n        return 0",
        "dunder-def",
    ),
    (
        "class X:\n    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):\n        return 0",
        "dunder-def",
    ),
    ("class X:\n    __torch_function__ = classmethod(lambda *a: 0)", "dunder"),
    ("import torch\ny = torch.zeros(1).as_subclass(object)", "tensor-subclass"),
    ("import torch\nT = type('T', (torch.Tensor,), {})", "dynamic-class"),
    ("import torch\nMeta = type(torch.Tensor)\nT = Meta('T', (torch.Tensor,), {})", "class-value"),
    ("import torch\nx = torch.zeros(1)\nx.__class__ = object", "dunder"),
    ("import torch\nx = dict(__torch_function__=print)", "dunder"),
    ("import torch\nk = '__torch_' + 'function__'\nx = {'__torch_function__': print}", "dunder"),
    ("import torch\nTT = torch.Tensor\nTT.add = print", "class-value"),
    # only torch.nn layers pass as factories, and only as a default or a keyword argument
    ("import torch\ndef f(t=torch.Tensor):\n    t.add = print", "class-value"),
    ("import torch\ndef f(**kw):\n    pass\nf(t=torch.Tensor)", "class-value"),
    ("from torch import nn\nG = nn.GELU\nG.forward = print", "class-value"),
    ("from torch import nn\ndef f(c):\n    pass\nf(nn.GELU)", "class-value"),
    ("import torch\nx = torch.zeros(1)\ntype(x).add = print", "monkeypatch"),
    ("import torch\nx = torch.zeros(1)\nsetattr(type(x), 'add', print)", "monkeypatch"),
    ("import abc\nclass M(abc.ABCMeta):\n    pass", "module-attr"),
    ("class M(type):\n    pass", "metaclass"),
    ("import torch\nclass X(torch.nn.Module, metaclass=type):\n    pass", "metaclass"),
    ("class X:\n    def __init_subclass__(cls):\n        pass", "dunder-def"),
    ("import pickle\npickle.loads(b'')", "import"),
    ("import marshal", "import"),
    ("import codecs", "import"),
    ("import base64\nexec(base64.b64decode(b''))", "import"),
    ("import zlib", "import"),
    ("import torch\ntorch.load('x.pt')", "hidden-code"),
    ("import numpy as np\nnp.load('x.npy', allow_pickle=True)", "hidden-code"),
    ("from torch import load\nload('x.pt')", "hidden-code"),
    ("x = eval('1')", "name"),
    ("c = compile('1', 'f', 'eval')", "name"),
    ("s = b'eJwDAAAAAAE='.decode('base64')", "codec"),
    ("s = 'cevag(1)'.encode('rot13')", "codec"),
    ("class K:\n    def eval(self):\n        return 1\nexec('import os')", "name"),
    ("exec('import os')\ndef exec(x):\n    return x", "name"),
    ("def compile(x):\n    return x\ndel compile\ncompile('1', 'f', 'exec')", "name"),
    ("import torch\ntorch.fx.Graph().call_method('system', ())", "dynamic-attr"),
    ("import triton\ntriton.compile('kernel.ttir')", "hidden-code"),
    ("import torch\ntorch.jit.CompilationUnit('def f(x): return x')", "module-reach"),
    ("import ctypes", "import"),
    ("import mmap", "import"),
    ("import signal\nsignal.signal(2, print)", "import"),
    ("import atexit\natexit.register(print)", "import"),
    ("import sys\nsys.settrace(print)", "module-attr"),
    ("import sys\nsys.setprofile(print)", "module-attr"),
    ("import threading\nthreading.settrace(print)", "import"),
    ("import weakref\nweakref.finalize(object(), print)", "import"),
    ("import torch\ntorch.signal", "module-reach"),
    ("import torch\ntorch.cuda.cudart()", "native"),
    ("import numpy as np\nnp.fromfile('/etc/passwd')", "file"),
    ("import torch\ntorch.zeros(1).numpy().tofile('/tmp/x')", "file"),
    ("class X:\n    def __del__(self):\n        pass", "dunder-def"),
    ("def __getattr__(name):\n    return name", "dunder-def"),
    ("import torch\ntorch.nn.modules.module.register_module_forward_hook(print)", "module-reach"),
    ("import torch\nx = torch.zeros(1)\nx.set_(torch.ones(1))", "storage"),
    ("import torch\ntorch.Stream()", "stream"),
    ("import torch\ntorch.backends.cuda.enable_flash_sdp(False)", "module-reach"),
    ("import torch\ntorch.autograd.set_detect_anomaly(True)", "module-attr"),
    ("import torch\ntorch = None", "shadowing"),
    ("import torch\nimport os as torch", "shadowing"),
    ("import torch\ndef f(torch):\n    return torch.os", "shadowing"),
    ("def f():\n    return torch.os.system('id')\nimport torch", "module-attr"),
    ("import sys\nsys.exit(0)", "module-attr"),
    ("import torch\nprint(type(torch.zeros(1))('x'))", "class-value"),
    # a setting switched inside the forward and restored before it returns: no snapshot sees it
    (
        "import torch\ndef forward(x, w):\n    torch.set_float32_matmul_precision('high')\n"
        "    y = x @ w\n    torch.set_float32_matmul_precision('highest')\n    return y",
        "state",
    ),
    ("import torch\nsetp = torch.set_float32_matmul_precision\nsetp('medium')", "state"),
    ("import torch\ntorch.use_deterministic_algorithms(False)", "state"),
    ("import torch\ntorch.set_default_dtype(torch.float16)", "state"),
]


@pytest.mark.parametrize(("source", "rule"), ESCAPES, ids=[f"{i}-{r}" for i, (_, r) in enumerate(ESCAPES)])
def test_escape_is_refused(source, rule):
    assert rule in rules(source), static_check(source)


def test_there_are_at_least_thirty_distinct_escapes():
    assert len({s for s, _ in ESCAPES}) >= 30


HONEST_SNIPPETS = [
    "import torch\nF = torch.nn.functional\ny = F.relu(torch.ones(2))",
    "from torch import nn\nclass M(nn.Module):\n    pass",
    "import torch\ndef f(x):\n    return isinstance(x, (torch.Tensor, list)) or type(x) is torch.Tensor",
    "import torch\ndef f(x: torch.Tensor) -> torch.Tensor:\n    return x",
    "import os\nos.environ['TORCH_CUDA_ARCH_LIST'] = '9.0'\np = os.path.join('a', 'b')",
    "import numpy as np\na = np.zeros(3) + np.random.rand(3)\nb = np.linalg.norm(a)",
    "import triton.language as tl\nd = getattr(tl, 'float32')",
    "import triton.language as tl\nf = tl.extra.cuda.libdevice.tanh",
    "from torch.utils.cpp_extension import load_inline\next = load_inline('x', cpp_sources='', functions=['f'])",
    "import torch\nclass F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        return x",
    "import torch\ntry:\n    pass\nexcept torch.cuda.OutOfMemoryError:\n    pass",
    "msg = '{} of {}'.format(1, 2).encode('utf-8').decode()",
    "import math, functools, itertools, operator\nx = functools.reduce(operator.mul, itertools.repeat(math.pi, 2))",
    "import torch\ng = torch.cuda.CUDAGraph() if torch.cuda.is_available() else None",
    "import dataclasses\n@dataclasses.dataclass\nclass C:\n    x: int = 1",
    "if __name__ == '__main__':\n    pass",
    "import torch\nx = torch.ops.aten.add(torch.ones(1), 1)",
    # a weight-init loop over nn.Module.modules() (a reference that does this was refused a copy)
    "from torch import nn\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        for m in self.modules():\n            pass",
    # layer classes handed over as factories, as timm-style models do (two KernelBench Swin models)
    "from torch import nn\nclass Mlp(nn.Module):\n    def __init__(self, act_layer=nn.GELU, *, norm=nn.LayerNorm):\n"
    "        super().__init__()\n        self.act = act_layer()",
    "from torch import nn\ndef block(**kw):\n    return kw\nb = block(norm_layer=nn.LayerNorm)",
]


@pytest.mark.parametrize("source", HONEST_SNIPPETS)
def test_honest_snippet_breaks_no_rule(source):
    assert static_check(source) == []


HONEST_FILES = sorted(
    [p for p in (FIXTURES / "candidates").glob("*.py") if "EXPECT: static" not in p.read_text()]
    + [p for p in (ROOT / "examples").glob("*.py") if "ModelNew" in p.read_text()]
)


@pytest.mark.parametrize("path", HONEST_FILES, ids=[p.name for p in HONEST_FILES])
def test_candidates_the_static_rules_must_let_through(path):
    """Every fixture whose expected stage is not ``static`` (honest ones, and cheats that the dynamic
    checks catch) and every example candidate pass the static rules."""
    assert static_check(path.read_text(), str(path)) == []


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


def _changes_while(change, undo, files=()):
    """The state changes that ``change()`` leaves, reported before ``undo()`` restores the process."""
    before = snapshot_state(files)
    change()
    try:
        return state_changes(before, snapshot_state(files))
    finally:
        undo()


def _tracer(*args):
    return None


def test_snapshot_sees_trace_and_profile_hooks():
    import threading

    assert any(
        "sys.gettrace" in c for c in _changes_while(lambda: sys.settrace(_tracer), lambda: sys.settrace(None))
    )
    assert any(
        "sys.getprofile" in c
        for c in _changes_while(lambda: sys.setprofile(_tracer), lambda: sys.setprofile(None))
    )
    assert any(
        "threading.gettrace" in c
        for c in _changes_while(lambda: threading.settrace(_tracer), lambda: threading.settrace(None))
    )


def test_snapshot_sees_signal_handlers():
    import signal

    old = signal.getsignal(signal.SIGUSR1)
    changes = _changes_while(
        lambda: signal.signal(signal.SIGUSR1, _tracer), lambda: signal.signal(signal.SIGUSR1, old)
    )
    assert changes == ["signal handlers changed for SIGUSR1"]


def test_snapshot_sees_atexit_handlers_of_the_candidate_only(tmp_path):
    import atexit

    path = str(tmp_path / "candidate.py")
    code = compile("import atexit\natexit.register(handler)\n", path, "exec")
    registered = []

    def register_from_candidate():
        def handler():
            return None

        registered.append(handler)
        exec(code, {"handler": handler})

    changes = _changes_while(register_from_candidate, lambda: atexit.unregister(registered[0]), files=(path,))
    assert changes == ["the candidate registered 1 atexit handler(s) (not allowed)"]
    # A library's (or this file's) handler is not the candidate's.
    assert (
        _changes_while(lambda: atexit.register(_tracer), lambda: atexit.unregister(_tracer), files=(path,))
        == []
    )


def test_snapshot_sees_replaced_sys_modules_entries():
    import types

    original = sys.modules["torch.nn.functional"]

    def replace():
        sys.modules["torch.nn.functional"] = types.ModuleType("torch.nn.functional")

    def restore():
        sys.modules["torch.nn.functional"] = original

    assert "sys.modules['torch.nn.functional'] was replaced" in _changes_while(replace, restore)


def test_snapshot_sees_patched_tensor_and_module_methods():
    call_impl, relu = torch.nn.Module._call_impl, torch.relu

    def patch_tensor():
        torch.Tensor.add = lambda *a, **k: None

    def patch_module():
        torch.nn.Module._call_impl = lambda *a, **k: None

    def patch_torch():
        torch.relu = lambda *a, **k: None

    assert "torch.Tensor.add was added" in _changes_while(patch_tensor, lambda: delattr(torch.Tensor, "add"))
    assert "torch.nn.Module._call_impl was replaced" in _changes_while(
        patch_module, lambda: setattr(torch.nn.Module, "_call_impl", call_impl)
    )
    assert "torch.relu was replaced" in _changes_while(patch_torch, lambda: setattr(torch, "relu", relu))


def test_snapshot_sees_global_module_hooks_and_left_modes():
    from torch.nn.modules.module import register_module_forward_hook
    from torch.overrides import TorchFunctionMode

    handles = []
    changes = _changes_while(
        lambda: handles.append(register_module_forward_hook(lambda *a: None)), lambda: handles[0].remove()
    )
    assert any("_global_forward_hooks" in c for c in changes), changes

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    mode = PassThrough()
    changes = _changes_while(mode.__enter__, lambda: mode.__exit__(None, None, None))
    assert any("torch_function_modes" in c for c in changes), changes


def test_snapshot_sees_backend_flags_threads_and_dtype():
    cuda = torch.backends.cuda
    flash, bench, threads = cuda.flash_sdp_enabled(), torch.backends.cudnn.benchmark, torch.get_num_threads()
    cases = [
        (
            "cuda.flash_sdp_enabled",
            lambda: cuda.enable_flash_sdp(not flash),
            lambda: cuda.enable_flash_sdp(flash),
        ),
        (
            "cudnn.benchmark",
            lambda: setattr(torch.backends.cudnn, "benchmark", not bench),
            lambda: setattr(torch.backends.cudnn, "benchmark", bench),
        ),
        (
            "default_dtype",
            lambda: torch.set_default_dtype(torch.float64),
            lambda: torch.set_default_dtype(torch.float32),
        ),
        ("num_threads", lambda: torch.set_num_threads(threads + 1), lambda: torch.set_num_threads(threads)),
    ]
    for key, change, undo in cases:
        assert any(c.startswith(key) for c in _changes_while(change, undo)), key


def test_snapshot_is_cheap(capsys):
    import time

    snapshot_state(("candidate.py",))  # installs the atexit recorder once
    reps = 200
    start = time.perf_counter()
    for _ in range(reps):
        before = snapshot_state(("candidate.py",))
    taken = time.perf_counter()
    for _ in range(reps):
        assert state_changes(before, before) == []
    compared = time.perf_counter()
    snapshot_ms = (taken - start) / reps * 1e3
    compare_ms = (compared - taken) / reps * 1e3
    with capsys.disabled():
        print(f"\nsnapshot_state: {snapshot_ms:.3f} ms, state_changes: {compare_ms:.3f} ms per call")
    assert snapshot_ms < 5.0  # about 0.25 ms unloaded; the bound leaves room for a busy machine


LIBRARY_PATCHES = """
import torch
from kernelcrew.tools.anticheat import snapshot_state, state_changes
before = snapshot_state(("candidate.py",))
import triton, triton.language
from torch._dynamo.mutation_guard import install_generation_tagging_init
install_generation_tagging_init()  # what torch.compile does to nn.Module.__init__ on first use
assert torch.nn.Module.__init__ is not before["ns:torch.nn.Module"]["__init__"]
assert state_changes(before, snapshot_state(("candidate.py",))) == []
own = torch.nn.Module.__init__
torch.nn.Module.__init__ = lambda self, *a, **k: own(self, *a, **k)
print(state_changes(before, snapshot_state(("candidate.py",))))
assert state_changes(before, snapshot_state(("candidate.py",))) == ["torch.nn.Module.__init__ was replaced"]
"""


def test_library_patches_from_importing_triton_and_compiling_are_no_state_change():
    res = subprocess.run([sys.executable, "-c", LIBRARY_PATCHES], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_plain_outputs_have_no_problems():
    x = torch.randn(3)
    out = [x, (x, 1.0, 2, True, None), {"a": x, 0: [x]}, torch.max(torch.randn(2, 3), 1)]
    assert output_problems(out) == []


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda x: x.as_subclass(_Sub), "_Sub, not a plain torch.Tensor"),
        (lambda x: torch.nn.Parameter(x), "torch.nn.Parameter"),
        (lambda x: [x, (x.to("meta"),)], "output[1][0] is on device 'meta'"),
        (lambda x: x.to_sparse(), "layout torch.sparse_coo"),
        (lambda x: torch._to_functional_tensor(x), "wrapper tensor"),
        (lambda x: {"a": x.numpy()}, "output['a'] is a numpy.ndarray"),
        (lambda x: [1.0, "text"], "output[1] is a builtins.str"),
        (lambda x: {1.5: x}, "key of type float"),
    ],
)
def test_output_that_is_not_plain_data_is_reported(make, problem):
    problems = output_problems(make(torch.randn(3)))
    assert any(problem in p for p in problems), problems


def test_output_with_shadowed_methods_or_an_overridden_tensor_type_is_reported():
    x = torch.randn(2)
    x.cpu = lambda: torch.zeros(2)
    assert any("shadow tensor methods: cpu" in p for p in output_problems(x))
    original = torch.Tensor.__dict__["__torch_function__"]
    try:
        torch.Tensor.__torch_function__ = classmethod(lambda cls, func, types, args=(), kwargs=None: None)
        assert any("__torch_function__ is overridden" in p for p in output_problems(torch.randn(2)))
    finally:
        torch.Tensor.__torch_function__ = original
    assert output_problems(torch.randn(2)) == []


def test_fake_tensors_and_cycles_are_reported():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2)
    assert any("FakeTensor" in p for p in output_problems(fake))
    loop: list = []
    loop.append(loop)
    assert any("contains itself" in p for p in output_problems(loop))


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


def test_op_trace():
    x = torch.randn(4, 8)
    _, ref_ops = record_ops(torch.softmax, x, -1)
    assert "_softmax" in ref_ops


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


def test_elements_off_by_no_more_than_pytorchs_largest_error_pass_and_beyond_it_fail():
    """Mostly exact zeros (a tiny RMS, so a tiny atol) and a few near-zero tail values: a candidate
    whose errors there stay within PyTorch's own largest error on the output passes; one element
    off by more than PyTorch ever is fails, however few."""
    g = torch.zeros(4096, dtype=torch.float64)
    g[:64] = torch.linspace(-1e-3, -1e-6, 64, dtype=torch.float64)
    n = g.float()
    n[7] += 3e-7  # PyTorch's own worst rounding in the tail
    tol = tolerance_for("float32", "pointwise", "strict")
    cand = g.float()
    cand[20] += 2e-7  # differently rounded, no worse than PyTorch's worst
    res = compare_output(cand, g, n, tol)
    assert res["ok"] and res["within_pytorch_max_error"] == 1, res
    cand[30] += 1e-6  # beyond anything PyTorch does on this output
    res = compare_output(cand, g, n, tol)
    assert not res["ok"] and res["stage"] == "correctness", res
    assert "above PyTorch's own largest error" in res["message"]
