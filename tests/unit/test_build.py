"""Tests of kernelcrew.tools.build: caches, static detection, compiler output, instrumented builds."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from kernelcrew.task import TaskError
from kernelcrew.tools import build
from kernelcrew.tools.build import (
    BuildError,
    Diagnostic,
    build_env,
    cache_dirs,
    describe_exception,
    detect_source_kind,
    load_candidate_module,
    parse_compiler_output,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "build"
# A stand-in for <torch/extension.h> (pybind11 only) so that a test build takes seconds, not a minute.
FAKE_TORCH_INCLUDE = str(FIXTURES / "fake_torch_include")
PATH = "candidate.py"  # deliberately not a file on disk: build.py registers the source in linecache


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def line_of(source: str, text: str) -> int:
    """1-based line of the only line of ``source`` containing ``text``."""
    hits = [n for n, line in enumerate(source.splitlines(), 1) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


# ----------------------------------------------------------------------------------------------
# parse_compiler_output
# ----------------------------------------------------------------------------------------------


def test_parse_gcc_output():
    diags = parse_compiler_output(fixture("gcc_output.txt"))
    assert [d.severity for d in diags] == ["error", "warning"]  # deduplicated, errors first
    err = diags[0]
    assert err.file.endswith("/bad_ext_5d41402abc4b2a76/main.cpp")
    assert (err.line, err.column) == (5, 5)
    assert err.text == "expected \u2018,\u2019 or \u2018;\u2019 before \u2018return\u2019"  # gcc quotes
    assert err.source_line == "return x + undefined_var;"
    assert err.origin == "cpp_sources" and err.generated == "main.cpp:5"
    assert "cpp_sources" in err.message and "1 #include line" in err.message
    assert diags[1].line == 6 and "[-Wreturn-type]" in diags[1].text


def test_parse_clang_output():
    diags = parse_compiler_output(fixture("clang_output.txt"))
    assert [(d.line, d.column, d.severity) for d in diags] == [(7, 17, "error"), (3, 10, "error")]
    assert diags[0].text == "expected ';' after return statement"
    assert diags[0].source_line == "return x * 2"
    assert diags[1].text == "'missing_header.h' file not found"  # fatal error -> error
    assert diags[1].source_line == '#include "missing_header.h"'


def test_parse_nvcc_output():
    diags = parse_compiler_output(fixture("nvcc_output.txt"))
    assert [(d.line, d.severity) for d in diags] == [(9, "error"), (8, "warning")]
    err, warn = diags
    assert err.file.endswith("/cuda.cu")
    assert err.text == 'identifier "idx" is undefined'
    assert err.source_line == "if (idx < n) out[idx] = a[idx] + b[idx];"
    assert err.origin == "cuda_sources" and "3 #include lines" in err.message
    assert warn.text == 'variable "unused" was declared but never referenced'
    assert warn.source_line == "int unused = 0;"


def test_parse_ptxas_output():
    diags = parse_compiler_output(fixture("ptxas_output.txt"))
    assert [d.severity for d in diags] == ["error", "error"]  # "ptxas info" is not a diagnostic
    assert diags[0].origin == "ptxas" and "too much shared data" in diags[0].message
    assert diags[1].message == "Ptx assembly aborted due to errors"
    diags = parse_compiler_output(fixture("triton_ptxas_error.txt"))
    assert (diags[0].file, diags[0].line) == ("/tmp/tmpk3x9_1qe.ptx", 52)
    assert "requires .target sm_80" in diags[0].message


def test_parse_linker_output():
    diags = parse_compiler_output(fixture("linker_output.txt"))
    assert [d.message for d in diags] == [
        "ld: cannot find -lmissinglib: No such file or directory",
        "collect2: ld returned 1 exit status",
    ]
    assert diags[0].origin == "linker"


def test_parse_ignores_ninja_noise():
    text = "[1/2] c++ -c main.cpp -o main.o\nFAILED: main.o\nninja: build stopped: subcommand failed.\n"
    assert parse_compiler_output(text) == []


# ----------------------------------------------------------------------------------------------
# Static detection and caches
# ----------------------------------------------------------------------------------------------

TRITON_SRC = "import triton\nimport triton.language as tl\n\n@triton.jit\ndef k(x):\n    pass\n"
CUDA_SRC = (
    "from torch.utils.cpp_extension import load_inline\n"
    "ext = load_inline('e', cpp_sources='int f();', cuda_sources=CUDA, functions=['f'])\n"
)
CPP_SRC = (
    "import torch.utils.cpp_extension as cx\n"
    "ext = cx.load_inline(name='e', cpp_sources='int f() { return 1; }', functions=['f'])\n"
)
LOAD_CU_SRC = (
    "from torch.utils import cpp_extension\next = cpp_extension.load('e', sources=['k.cu', 'b.cpp'])\n"
)
COMPILE_SRC = "import torch\n\n@torch.compile\ndef f(x):\n    return x\n"
DYNAMO_SRC = "import torch._dynamo\ntorch._dynamo.config.cache_size_limit = 8\n"
PLAIN_SRC = "import torch\nstate = torch.load('weights.pt')\n"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (TRITON_SRC, {"triton": True, "cuda": False, "cpp": False, "compiler": False}),
        (CUDA_SRC, {"triton": False, "cuda": True, "cpp": True, "compiler": False}),
        (CPP_SRC, {"triton": False, "cuda": False, "cpp": True, "compiler": False}),
        (LOAD_CU_SRC, {"triton": False, "cuda": True, "cpp": True, "compiler": False}),
        (COMPILE_SRC, {"triton": False, "cuda": False, "cpp": False, "compiler": True}),
        (DYNAMO_SRC, {"triton": False, "cuda": False, "cpp": False, "compiler": True}),
        (PLAIN_SRC, {"triton": False, "cuda": False, "cpp": False, "compiler": False}),
    ],
)
def test_detect_source_kind(source, expected):
    assert detect_source_kind(source) == expected


def test_detect_source_kind_does_not_need_valid_python():
    kind = detect_source_kind("import triton\n@triton.jit\ndef k(:\n")
    assert kind["triton"] and not kind["cuda"]


def test_cache_dirs_per_source(tmp_path):
    a = cache_dirs("source a", tmp_path)
    again = cache_dirs("source a", tmp_path)
    b = cache_dirs("source b", tmp_path)
    assert a == again and a["root"] != b["root"]
    assert a["root"].parent == tmp_path and len(a["root"].name) == 16
    assert all(p.is_dir() for p in a.values())
    assert a["triton"] == a["root"] / "triton" and a["torch_extensions"] == a["root"] / "torch_extensions"
    env = build_env("source a", tmp_path)
    assert env["TRITON_CACHE_DIR"] == str(a["triton"])
    assert env["TORCH_EXTENSIONS_DIR"] == str(a["torch_extensions"])


def test_a_compiler_candidate_starts_from_the_references_build_and_nothing_else_does(tmp_path):
    """The reference's caches are apart from every candidate's; a candidate that calls torch.compile
    gets a copy of the reference's sealed build as its own (once: what it has stays), a Triton
    candidate gets nothing, and where children write in place (no sealed builds) the reference's
    files are copied into a candidate's empty folders."""
    from kernelcrew.tools.build import reference_build_env, reference_cache_dirs, seed_from_reference
    from kernelcrew.tools.sandbox import code_digest

    task = "import torch\nclass Model(torch.nn.Module):\n    pass\n"
    compiled = "import torch\nclass ModelNew(torch.nn.Module):\n    f = torch.compile(lambda x: x)\n"
    triton = "import triton\nclass ModelNew:\n    pass\n"
    ref = reference_cache_dirs(task, tmp_path)
    assert ref["root"] not in {cache_dirs(s, tmp_path)["root"] for s in (task, compiled, triton)}
    assert reference_build_env(task, tmp_path)["TORCHINDUCTOR_CACHE_DIR"] == str(ref["inductor"])

    (ref["root"] / "sealed-abc" / "inductor").mkdir(parents=True)
    (ref["root"] / "sealed-abc" / "inductor" / "graph.py").write_text("compiled by the reference")
    scope = code_digest({"task_source": task, "candidate_source": compiled})
    assert seed_from_reference(task, compiled, tmp_path)
    own = cache_dirs(compiled, tmp_path)["root"] / f"sealed-{scope}"
    assert (own / "inductor" / "graph.py").read_text() == "compiled by the reference"
    (own / "inductor" / "graph.py").write_text("the candidate's own")
    assert not seed_from_reference(task, compiled, tmp_path)  # a sealed build of its own stays
    assert (own / "inductor" / "graph.py").read_text() == "the candidate's own"
    assert not seed_from_reference(task, triton, tmp_path)
    assert not any(cache_dirs(triton, tmp_path)["root"].glob("sealed-*"))

    in_place = tmp_path / "in-place"
    ref = reference_cache_dirs(task, in_place)
    (ref["triton"] / "kernel.bin").write_text("ptx")
    assert seed_from_reference(task, compiled, in_place)
    assert (cache_dirs(compiled, in_place)["triton"] / "kernel.bin").read_text() == "ptx"
    assert not seed_from_reference(task, compiled, in_place)  # not into folders that have files


def test_cache_dirs_default_root_from_settings(monkeypatch):
    import shutil
    import tempfile

    from kernelcrew.config import get_settings

    base = Path(tempfile.mkdtemp(prefix="kc-cache-test-", dir="/tmp"))
    base.chmod(0o755)
    monkeypatch.setenv("KERNELCREW_CACHE_DIR", str(base / "cache"))
    get_settings.cache_clear()
    try:
        dirs = cache_dirs("x")
    finally:
        get_settings.cache_clear()
        shutil.rmtree(base, ignore_errors=True)
    assert dirs["root"].parent == base / "cache" / "build"


def test_cache_root_private_to_root_falls_back_to_a_reachable_one(tmp_path, monkeypatch):
    """As root, a cache the sandbox user cannot traverse to would break every build in the child."""
    import os
    import tempfile

    from kernelcrew.config import get_settings

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("KERNELCREW_CACHE_DIR", str(private / "cache"))
    get_settings.cache_clear()
    try:
        dirs = cache_dirs("x")
    finally:
        get_settings.cache_clear()
    if os.geteuid() == 0:
        assert dirs["root"].parent == Path(tempfile.gettempdir()) / "kernelcrew-build-cache"
    else:
        assert dirs["root"].parent == private / "cache" / "build"


# ----------------------------------------------------------------------------------------------
# C++ extensions (CPU only, real builds)
# ----------------------------------------------------------------------------------------------

CPP_CANDIDATE = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP_SOURCE = """
int add_ints(int a, int b) {
    int total = a + b;
    return total;
}
"""

ext = load_inline(
    name="add_ints_ext",
    cpp_sources=CPP_SOURCE,
    functions=["add_ints"],
    extra_include_paths=[INCLUDE],
    with_pytorch_error_handling=False,
)


class ModelNew(nn.Module):
    def forward(self, x):
        return x + ext.add_ints(1, 2)
'''


def cpp_candidate(body: str = CPP_CANDIDATE, **replace: str) -> str:
    for old, new in replace.items():
        body = body.replace(old, new)
    return body.replace("INCLUDE", repr(FAKE_TORCH_INCLUDE))


def test_cpp_extension_builds_then_comes_from_cache(tmp_path):
    from torch.utils import cpp_extension

    original = cpp_extension.load_inline
    source = cpp_candidate()
    cls, first = load_candidate_module(source, PATH, root=tmp_path)
    assert cpp_extension.load_inline is original  # restored
    assert torch.equal(cls()(torch.zeros(2)), torch.full((2,), 3.0))
    (ext,) = first.extensions
    digest = build.source_hash(source)
    assert ext["name"] == f"add_ints_ext_{digest}" and ext["requested_name"] == "add_ints_ext"
    assert ext["ok"] and not ext["cached"] and ext["line"] == line_of(source, "ext = load_inline(")
    assert Path(ext["build_directory"]) == tmp_path / digest / "torch_extensions" / ext["name"]
    assert first.kind == {"triton": False, "cuda": False, "cpp": True, "compiler": False}
    assert first.cache_dir == str(tmp_path / digest)
    json.dumps(first.to_dict())

    _, second = load_candidate_module(source, PATH, root=tmp_path)
    (again,) = second.extensions
    assert again["cached"] and again["library_existed"]
    assert again["seconds"] < ext["seconds"] and second.seconds < first.seconds


BAD_CPP = CPP_CANDIDATE.replace("int total = a + b;", "int total = a + b")


def test_cpp_syntax_error_is_a_build_error_on_the_candidate_line(tmp_path):
    source = cpp_candidate(BAD_CPP)
    with pytest.raises(BuildError) as info:
        load_candidate_module(source, PATH, root=tmp_path)
    err = info.value
    assert err.stage == "build" and err.tool == "cpp_extension"
    head = err.diagnostics[0]
    assert head.severity == "error" and head.file == PATH
    # gcc reports main.cpp:5:5 ("return" after the missing ';'): main.cpp is load_inline's #include,
    # then CPP_SOURCE (a blank first line, the signature, the bad line, the return).
    assert head.generated == "main.cpp:5" and head.column == 5
    assert head.line == line_of(source, "    return total;")
    assert head.source_line == "return total;"
    assert "expected" in head.text and "cpp_sources line 4" in head.message
    assert err.message.startswith("C++ extension 'add_ints_ext' failed to build: ")  # hash suffix dropped
    assert f"{PATH}:{head.line}" in err.message and "\n" not in err.message
    assert "FAILED: main.o" in err.log_tail
    assert json.loads(json.dumps(err.to_dict()))["diagnostics"][0]["line"] == head.line
    assert err.details["diagnostics"][0]["line"] == head.line  # what the sandbox records


def test_cpp_error_in_generated_bindings_points_at_the_load_inline_call(tmp_path):
    source = cpp_candidate(**{'functions=["add_ints"]': 'functions=["add_ints", "missing_fn"]'})
    with pytest.raises(BuildError) as info:
        load_candidate_module(source, PATH, root=tmp_path)
    head = info.value.diagnostics[0]
    assert "missing_fn" in head.text and head.origin == "bindings"
    assert (head.file, head.line) == (PATH, line_of(source, "ext = load_inline("))


def test_describe_extension_failure_without_instrumentation():
    """A raw torch failure (no record of the build) still maps when the code line is unique."""
    source = cpp_candidate(BAD_CPP).replace("return total;", "return x + undefined_var;")
    cause = subprocess.CalledProcessError(1, ["ninja", "-v"], output=b"...")
    try:
        try:
            raise cause
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                "Error building extension 'bad_ext_5d41402abc4b2a76': " + fixture("gcc_output.txt")
            ) from exc
    except RuntimeError as exc:
        err = describe_exception(exc, PATH, source)
    assert isinstance(err, BuildError)
    head = err.diagnostics[0]
    assert (head.file, head.line) == (PATH, line_of(source, "return x + undefined_var;"))
    assert err.diagnostics[1].file.endswith("main.cpp")  # "}" is not unique: left as printed


def test_describe_called_process_error_of_a_compiler():
    exc = subprocess.CalledProcessError(2, ["nvcc", "-c", "k.cu"], output=fixture("nvcc_output.txt").encode())
    err = describe_exception(exc, PATH, "x = 1\n")
    assert isinstance(err, BuildError)
    assert err.diagnostics[0].text == 'identifier "idx" is undefined'
    assert describe_exception(subprocess.CalledProcessError(1, ["ls"]), PATH, "x = 1\n") is None


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------

TRITON_CANDIDATE = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale(x):
    return x * undefined_factor


@triton.jit
def double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, scale(x), mask=mask)


@triton.jit
def arange_kernel(x_ptr):
    offs = tl.arange(0, 10)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def assert_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK % 32 == 0, "BLOCK must be a multiple of 32")
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK)))


class ModelNew(nn.Module):
    def __init__(self, which="double"):
        super().__init__()
        self.which = which

    def forward(self, x):
        y = torch.empty_like(x)
        if self.which == "double":
            double_kernel[(1,)](x, y, x.numel(), BLOCK=16)
        elif self.which == "arange":
            arange_kernel[(1,)](x)
        elif self.which == "assert":
            assert_kernel[(1,)](x, BLOCK=16)
        else:
            raise RuntimeError("plain runtime failure")
        return y
"""


def run_candidate(which: str, tmp_path: Path) -> BaseException:
    cls, report = load_candidate_module(TRITON_CANDIDATE, PATH, root=tmp_path)
    assert report.kind["triton"] and report.extensions == []
    with pytest.raises(Exception) as info:
        cls(which)(torch.zeros(16))
    return info.value


def test_triton_interpreter_undefined_name_points_into_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    err = describe_exception(run_candidate("double", tmp_path), PATH, TRITON_CANDIDATE)
    assert isinstance(err, BuildError) and err.tool == "triton_interpreter"
    head = err.diagnostics[0]
    assert (head.file, head.line) == (PATH, line_of(TRITON_CANDIDATE, "return x * undefined_factor"))
    assert "undefined_factor" in head.message and "@triton.jit scale" in head.message
    assert head.source_line == "return x * undefined_factor"


def test_triton_interpreter_arange_not_power_of_two(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    err = describe_exception(run_candidate("arange", tmp_path), PATH, TRITON_CANDIDATE)
    assert isinstance(err, BuildError)
    head = err.diagnostics[0]
    assert (head.file, head.line) == (PATH, line_of(TRITON_CANDIDATE, "offs = tl.arange(0, 10)"))
    assert "power of 2" in head.message


def test_triton_interpreter_static_assert(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    err = describe_exception(run_candidate("assert", tmp_path), PATH, TRITON_CANDIDATE)
    head = err.diagnostics[0]
    assert (head.file, head.line) == (PATH, line_of(TRITON_CANDIDATE, "tl.static_assert(BLOCK % 32 == 0"))
    assert "BLOCK must be a multiple of 32" in head.message


def test_runtime_failure_is_not_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert describe_exception(run_candidate("plain", tmp_path), PATH, TRITON_CANDIDATE) is None


def compile_for_gpu(fn, signature: dict[str, str], constexprs: dict[str, int]) -> BaseException:
    """Run Triton's front end (AST -> TTIR, no GPU needed) for an sm_80 target; return what it raised."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        triton_source = ASTSource(fn, signature, constexprs)
    except TypeError as exc:  # another Triton version's ASTSource signature
        pytest.skip(f"ASTSource API differs: {exc}")
    with pytest.raises(Exception) as info:
        __import__("triton").compile(triton_source, target=GPUTarget("cuda", 80, 32))
    return info.value


def test_triton_compilation_error_maps_to_candidate_lines(tmp_path, monkeypatch):
    """A real CompilationError (compiled, not interpreted) from the kernel's front end."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cls, _ = load_candidate_module(TRITON_CANDIDATE, PATH, root=tmp_path)  # needs linecache for @jit
    module = __import__(cls.__module__)
    exc = compile_for_gpu(
        module.double_kernel,
        {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 16},
    )
    assert type(exc).__name__ == "CompilationError"
    err = describe_exception(exc, PATH, TRITON_CANDIDATE)
    assert isinstance(err, BuildError) and err.tool == "triton"
    inner, call = err.diagnostics[:2]
    assert (inner.file, inner.line) == (PATH, line_of(TRITON_CANDIDATE, "return x * undefined_factor"))
    assert inner.column == len("    return x * ") + 1
    assert inner.text == "NameError: undefined_factor is not defined"
    assert "@triton.jit scale" in inner.message
    assert (call.line, call.text) == (
        line_of(TRITON_CANDIDATE, "tl.store(y_ptr + offs, scale(x), mask=mask)"),
        "in the call to @triton.jit scale",
    )
    assert err.message.startswith(f"Triton compilation failed: {PATH}:{inner.line}:")

    exc = compile_for_gpu(module.arange_kernel, {"x_ptr": "*fp32"}, {})
    head = describe_exception(exc, PATH, TRITON_CANDIDATE).diagnostics[0]
    assert head.line == line_of(TRITON_CANDIDATE, "offs = tl.arange(0, 10)")
    assert head.text == "arange's range must be a power of 2"


def test_triton_ptxas_error_is_a_build_error():
    from triton.runtime.errors import PTXASError

    message = fixture("triton_ptxas_error.txt").split("PTXAS error: ", 1)[1]
    err = describe_exception(PTXASError(message), PATH, "x = 1\n")
    assert isinstance(err, BuildError) and err.tool == "triton"
    assert "requires .target sm_80" in err.message


# ----------------------------------------------------------------------------------------------
# Import failures stay TaskErrors
# ----------------------------------------------------------------------------------------------


def test_import_error_is_a_task_error(tmp_path):
    source = "import torch.nn as nn\n\nx = 1 / 0\n\n\nclass ModelNew(nn.Module):\n    pass\n"
    with pytest.raises(TaskError) as info:
        load_candidate_module(source, PATH, root=tmp_path)
    assert not isinstance(info.value, BuildError)
    assert info.value.line == 3 and "ZeroDivisionError" in info.value.message
    assert describe_exception(info.value, PATH, source) is None


def test_diagnostic_str_and_dict():
    d = Diagnostic("candidate.py", 3, 7, "error", "boom", "x = y")
    assert str(d) == "candidate.py:3:7: error: boom"
    assert d.to_dict()["source_line"] == "x = y"


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("KERNELCREW_SLOW_TESTS"), reason="set KERNELCREW_SLOW_TESTS=1 (a minute)"
)
def test_cpp_error_with_the_real_torch_header(tmp_path):
    """The same mapping with the real <torch/extension.h> and torch types (about a minute to compile)."""
    source = cpp_candidate(BAD_CPP, **{"extra_include_paths=[INCLUDE],": "", "int ": "int64_t "}).replace(
        "with_pytorch_error_handling=False,", ""
    )
    with pytest.raises(BuildError) as info:
        load_candidate_module(source, PATH, root=tmp_path)
    head = info.value.diagnostics[0]
    assert (head.file, head.line) == (PATH, line_of(source, "    return total;"))


def test_a_torch_compile_back_end_failure_says_what_failed():
    """torch.compile's BackendCompilerFailed starts with ``backend='inductor' raised:`` and names
    the error on the next line: a ShuffleNet block's compiler candidate failed on an H100 with a
    message that stopped at "raised:"."""

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no lowering for aten.channel_shuffle")

    try:
        torch.compile(lambda x: x * 2 + 1, backend=failing_backend)(torch.ones(3))
    except Exception as exc:  # whatever torch.compile raises is what is described
        err = describe_exception(exc, PATH, "x = 1\n")
    else:
        pytest.fail("the back end's failure was not raised")
    assert err is not None and err.tool == "torch_compile"
    assert str(err).startswith("torch.compile failed: backend=")
    assert "RuntimeError: no lowering for aten.channel_shuffle" in str(err)
