"""Build candidates (C++/CUDA extensions, Triton kernels) with per-source caches, and explain build failures.

Runs inside the sandboxed child. A candidate builds in one of three ways:

* ``torch.utils.cpp_extension.load_inline`` / ``load`` at import or construction (C++ and CUDA);
* ``@triton.jit`` kernels, compiled lazily at their first launch (or interpreted under
  ``TRITON_INTERPRET=1``, where misuse of ``tl.*`` raises ordinary Python exceptions);
* ``torch.compile`` (Inductor, which generates Triton).

:func:`cache_dirs` / :func:`build_env` give every candidate source its own cache folders (the
parent passes :func:`build_env` into the sandbox environment). :func:`load_candidate_module`
imports a candidate while recording each extension it builds (time, served from the cache or not)
and suffixing extension names with the source's content hash, so two sources never share a build.
:func:`describe_exception` turns a failure raised while importing or first running the candidate
into a :class:`BuildError` whose :class:`Diagnostic` s point at the candidate's own lines (the
compiler's lines in load_inline's generated ``main.cpp`` / ``cuda.cu`` are mapped back into the
string literals of the candidate file when they can be found there), or returns ``None`` for an
error that is not a build error.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import linecache
import os
import re
import shutil
import subprocess
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kernelcrew.config import get_settings
from kernelcrew.task import TaskError, load_candidate, parse_python, source_digest
from kernelcrew.tools.pycache import reachable_by_others
from kernelcrew.tools.sandbox import StageError, code_digest

#: Hex characters of sha256(source) naming a candidate's cache folder and suffixing extension names.
HASH_CHARS = 16
#: An extension build faster than this was served from the cache (a real compile takes seconds).
CACHED_BUILD_S = 1.0
LOG_TAIL_CHARS = 6000

#: Files load_inline writes into the build directory, and the argument each one holds.
GENERATED_FILES = {"main.cpp": "cpp_sources", "cuda.cu": "cuda_sources", "sycl.sycl": "sycl_sources"}
#: Lines load_inline puts before the user's sources unless ``no_implicit_headers=True``.
IMPLICIT_HEADERS = {
    "main.cpp": ["#include <torch/extension.h>"],
    "cuda.cu": ["#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>"],
    "sycl.sycl": ["#include <torch/types.h>", "#include <sycl/sycl.hpp>"],
}
#: Programs whose failure (subprocess.CalledProcessError) is a build failure.
COMPILER_PROGRAMS = {"ninja", "nvcc", "gcc", "g++", "c++", "cc", "clang", "clang++", "ptxas", "hipcc", "ld"}


def source_hash(source: str) -> str:
    """The content hash naming a candidate's caches: the first 16 hex characters of sha256(source)."""
    return source_digest(source)[:HASH_CHARS]


def default_cache_root() -> Path:
    """``<cache_dir>/build``, or a folder under the system temp dir when run as root and the sandbox
    user could not reach the configured one (a cache under ``/root`` is private to root)."""
    base = get_settings().cache_dir / "build"
    if os.geteuid() == 0 and not reachable_by_others(base):
        base = Path(tempfile.gettempdir()) / "kernelcrew-build-cache"
        base.mkdir(mode=0o711, exist_ok=True)
    return base


def cache_dirs(source: str, root: Path | None = None) -> dict[str, Path]:
    """The candidate's cache folders (created): ``root`` (default :func:`default_cache_root`) / hash / ...

    Keys: ``root`` (this source's folder), ``triton``, ``torch_extensions`` and ``inductor``.
    """
    base = Path(root) if root is not None else default_cache_root()
    top = base / source_hash(source)
    dirs = {
        "root": top,
        "triton": top / "triton",
        "torch_extensions": top / "torch_extensions",
        "inductor": top / "inductor",
    }
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    return dirs


def build_env(source: str, root: Path | None = None) -> dict[str, str]:
    """Environment variables that point a child's Triton, C++-extension and Inductor caches at this source's."""
    dirs = cache_dirs(source, root)
    return {
        "TRITON_CACHE_DIR": str(dirs["triton"]),
        "TORCH_EXTENSIONS_DIR": str(dirs["torch_extensions"]),
        "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor"]),
    }


#: Prefixed to a task's source to name its reference's build caches (apart from any candidate's).
REFERENCE_CACHE_KEY = "# kernelcrew: the reference's build caches\n"


def reference_cache_dirs(task_source: str, root: Path | None = None) -> dict[str, Path]:
    """The build caches of a task's reference process (:func:`cache_dirs` of the task under its own
    key): its ``torch.compile`` baselines compile once per task, and later processes timing the same
    task (the final timing, another run) start from what the first one built. Only reference
    processes write there; candidates never get it as a writable cache."""
    return cache_dirs(REFERENCE_CACHE_KEY + task_source, root)


def reference_build_env(task_source: str, root: Path | None = None) -> dict[str, str]:
    """:func:`build_env` for a task's reference process (:func:`reference_cache_dirs`)."""
    return build_env(REFERENCE_CACHE_KEY + task_source, root)


def seed_from_reference(task_source: str, candidate_source: str, root: Path | None = None) -> bool:
    """Give a ``torch.compile`` candidate's first evaluation the reference's compiled artifacts.

    A candidate that compiles the reference (the compiler strategy, or an LLM's ``torch.compile``)
    builds the same Inductor graphs and Triton kernels the baseline already built: starting from a
    copy of the reference's caches its compile is a cache hit (seconds) instead of a cold compile.
    The copy goes where the sandbox looks for this candidate's sealed caches (its own folder only;
    the reference's stays as it was), and only while the candidate has none of its own. Returns
    whether it seeded anything.
    """
    if not detect_source_kind(candidate_source)["compiler"]:
        return False
    reference = reference_cache_dirs(task_source, root)["root"]
    target = cache_dirs(candidate_source, root)["root"]
    scope = code_digest({"task_source": task_source, "candidate_source": candidate_source})
    sealed = sorted(reference.glob("sealed-*"), key=lambda p: p.stat().st_mtime)
    if sealed:  # isolated children: the reference's sealed build becomes the candidate's
        if (target / f"sealed-{scope}").exists():
            return False
        staging = target / f".staging-{uuid.uuid4().hex[:12]}"
        try:
            shutil.copytree(sealed[-1], staging, symlinks=True)
            os.rename(staging, target / f"sealed-{scope}")
            return True
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            return False
    # children that write their caches in place: the reference's files, where the candidate has none
    seeded = False
    for sub in ("inductor", "triton"):
        src, dest = reference / sub, target / sub
        if src.is_dir() and any(src.iterdir()) and not any(dest.iterdir()):
            shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
            seeded = True
    return seeded


# ----------------------------------------------------------------------------------------------
# Static detection
# ----------------------------------------------------------------------------------------------

_CPP_EXTENSION = "torch.utils.cpp_extension"
_CUDA_FILE = re.compile(r"\.(cu|cuh)$")
_CPP_FILE = re.compile(r"\.(cpp|cc|cxx|c|h|hpp)$")


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it stands for (``tl`` -> ``triton.language``, ``load_inline`` -> its full name)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _resolve(name: str, aliases: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    full = aliases.get(head, head)
    return f"{full}.{rest}" if rest else full


def _string_values(node: ast.AST) -> list[str] | None:
    """The strings of a literal string / list / tuple, or None when it is not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.List | ast.Tuple):
        values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return values if len(values) == len(node.elts) else None
    return None


def detect_source_kind(source: str) -> dict[str, bool]:
    """What a candidate builds, found statically (nothing is executed).

    ``triton``: imports Triton or uses ``@triton.jit``; ``cuda``: builds CUDA code (``load_inline``
    with ``cuda_sources``, ``load`` of ``.cu`` files, ``with_cuda=True``, or ``__global__`` code next
    to a C++-extension build); ``cpp``: compiles a C++ translation unit (every ``load_inline`` does,
    CUDA ones included, for their bindings); ``compiler``: uses ``torch.compile`` / ``torch._dynamo`` /
    ``torch._inductor``.
    """
    kind = {"triton": False, "cuda": False, "cpp": False, "compiler": False}
    try:
        tree = parse_python(source)
    except SyntaxError:
        return _detect_by_text(source)
    aliases = import_aliases(tree)
    imported = set(aliases.values())
    if any(m == "triton" or m.startswith("triton.") for m in imported):
        kind["triton"] = True
    if any(m.startswith(("torch._dynamo", "torch._inductor")) or m == "torch.compile" for m in imported):
        kind["compiler"] = True
    builds_extension = False
    for node in ast.walk(tree):
        name = _dotted(node) if isinstance(node, ast.Attribute | ast.Name) else None
        if name:
            full = _resolve(name, aliases)
            if full.startswith("triton.") or full == "triton":
                kind["triton"] = True
            if full == "torch.compile" or full.startswith(("torch._dynamo", "torch._inductor")):
                kind["compiler"] = True
        if not isinstance(node, ast.Call):
            continue
        func = _dotted(node.func)
        if func is None:
            continue
        full = _resolve(func, aliases)
        last = full.rsplit(".", 1)[-1]
        inline = last == "load_inline"
        load = full == f"{_CPP_EXTENSION}.load" or (last == "load" and "cpp_extension" in full)
        if not (inline or load):
            continue
        builds_extension = True
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        with_cuda = kw.get("with_cuda")
        if isinstance(with_cuda, ast.Constant) and with_cuda.value is True:
            kind["cuda"] = True
        if inline:
            kind["cpp"] = True
            cuda = kw.get("cuda_sources", node.args[2] if len(node.args) > 2 else None)
            if cuda is not None and not (isinstance(cuda, ast.Constant) and not cuda.value):
                kind["cuda"] = True
        else:
            sources = kw.get("sources", node.args[1] if len(node.args) > 1 else None)
            files = _string_values(sources) if sources is not None else None
            if files is None:
                kind["cpp"] = True  # built from names we cannot see statically
            else:
                kind["cuda"] = kind["cuda"] or any(_CUDA_FILE.search(f) for f in files)
                kind["cpp"] = kind["cpp"] or any(_CPP_FILE.search(f) for f in files)
    if builds_extension and not kind["cuda"]:
        kind["cuda"] = any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and "__global__" in n.value
            for n in ast.walk(tree)
        )
    return kind


def _detect_by_text(source: str) -> dict[str, bool]:
    """Fallback for a file that does not parse: plain text search."""
    inline = "load_inline" in source or "cpp_extension" in source
    return {
        "triton": bool(re.search(r"^\s*(import|from)\s+triton\b|@triton\.jit", source, re.MULTILINE)),
        "cuda": inline and bool(re.search(r"cuda_sources|__global__|\.cu\b", source)),
        "cpp": inline,
        "compiler": bool(re.search(r"torch\.compile|torch\._dynamo|torch\._inductor", source)),
    }


# ----------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------


@dataclass
class Diagnostic:
    """One compiler (or Triton) message, pointing at the candidate file when it could be mapped there.

    ``message`` is the tool's text plus, for load_inline's generated files, where the line comes from;
    ``text`` is the tool's text alone. ``generated`` is ``"main.cpp:12"`` for a line of load_inline's
    generated file; ``origin`` says what the file holds (``cpp_sources``, ``cuda_sources``,
    ``bindings``, ``triton``, ``ptxas``, ``linker``, or empty for a file as printed).
    """

    file: str | None
    line: int | None
    column: int | None
    severity: str
    message: str
    source_line: str | None = None
    origin: str = ""
    generated: str | None = None
    text: str = ""

    def location(self) -> str:
        parts = [p for p in (self.file, self.line, self.column) if p is not None]
        return ":".join(str(p) for p in parts)

    def __str__(self) -> str:
        where = self.location()
        return f"{where}: {self.severity}: {self.message}" if where else f"{self.severity}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BuildError(StageError):
    """A candidate that does not build: ``message`` is one readable line (the first error).

    A :class:`~kernelcrew.tools.sandbox.StageError` with ``stage="build"``, so the sandbox records
    ``diagnostics``, ``log_tail`` and ``tool`` as its details.
    """

    def __init__(
        self,
        message: str,
        diagnostics: list[Diagnostic] | None = None,
        log_tail: str = "",
        *,
        tool: str = "",
        path: str | None = None,
    ) -> None:
        self.diagnostics = list(diagnostics or [])
        self.log_tail = log_tail
        self.tool = tool
        self.path = path
        super().__init__(
            "build",
            message,
            tool=tool,
            diagnostics=[d.to_dict() for d in self.diagnostics],
            log_tail=log_tail,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "message": self.message,
            "tool": self.tool,
            "path": self.path,
            "diagnostics": [d.to_dict() for d in self.diagnostics],
            "log_tail": self.log_tail,
        }


_SEVERITY = {
    "error": "error",
    "fatal error": "error",
    "catastrophic error": "error",
    "fatal": "error",
    "warning": "warning",
}
# gcc / clang: path/main.cpp:12:5: error: expected ';' ...
_GCC = re.compile(
    r"^(?P<file>[^\s:(][^:\n]*?):(?P<line>\d+):(?:(?P<col>\d+):)?\s*"
    r"(?P<sev>fatal error|error|warning)\s*:\s*(?P<msg>.*)$"
)
# nvcc (EDG front end): path/cuda.cu(12): error: identifier "x" is undefined; warning #177-D: ...
_NVCC = re.compile(
    r"^(?P<file>[^\s(][^(\n]*?)\((?P<line>\d+)\)\s*:\s*"
    r"(?P<sev>catastrophic error|fatal error|error|warning)(?:\s*#[\w-]+)?\s*:\s*(?P<msg>.*)$"
)
# ptxas error   : Entry function ...; ptxas /tmp/x.ptx, line 42; error   : ...
_PTXAS = re.compile(
    r"^ptxas\s*(?:(?P<file>[^,\n]+?),\s*line\s+(?P<line>\d+);\s*)?(?P<sev>fatal|error|warning)\s*:\s*(?P<msg>.*)$"
)
# nvcc fatal   : ..., c++: error: ..., collect2: error: ld returned 1 exit status, nvlink error   : ...
_TOOL = re.compile(
    r"^(?P<tool>nvcc|nvlink|cicc|fatbinary|cc1plus|c\+\+|g\+\+|gcc|cc|clang\+\+|clang|collect2)(?:\.exe)?\s*:?\s*"
    r"(?P<sev>fatal error|fatal|error|warning)\s*:\s*(?P<msg>.*)$"
)
# /usr/bin/ld: main.o: undefined reference ...; main.cpp:(.text+0x1c): undefined reference to `f'
_LD = re.compile(r"^(?:\S*/)?ld(?:\.\w+)?:\s*(?P<msg>.*)$")
_LD_REF = re.compile(r"^(?P<file>[^\s:]+):\(\.[\w.$]+\+0x[0-9a-fA-F]+\):\s*(?P<msg>.*)$")
_LD_ERRORS = ("undefined reference", "multiple definition", "cannot find", "error")
_GCC_SOURCE = re.compile(r"^\s*(?P<line>\d+)\s*\|\s?(?P<code>.*)$")
_CARET = re.compile(r"^[\s~]*\^[\s~^]*$")


def _source_line_after(lines: list[str], i: int, line_no: int | None) -> str | None:
    """The code line a compiler prints under a diagnostic (gcc's ``  12 | code``, nvcc/clang's code + caret)."""
    if i + 1 >= len(lines):
        return None
    m = _GCC_SOURCE.match(lines[i + 1])
    if m and line_no is not None and int(m.group("line")) == line_no:
        return m.group("code").strip()
    if i + 2 < len(lines) and _CARET.match(lines[i + 2]) and not _match_diagnostic(lines[i + 1]):
        return lines[i + 1].strip() or None
    return None


def _match_diagnostic(line: str) -> tuple[str | None, int | None, int | None, str, str, str] | None:
    """(file, line, column, severity, message, origin) of one output line, or None."""
    if line.startswith(("FAILED:", "ninja:", "[")):
        return None
    m = _NVCC.match(line)
    if m:
        return m["file"], int(m["line"]), None, _SEVERITY[m["sev"]], m["msg"].strip(), ""
    m = _GCC.match(line)
    if m:
        col = int(m["col"]) if m["col"] else None
        return m["file"], int(m["line"]), col, _SEVERITY[m["sev"]], m["msg"].strip(), ""
    m = _PTXAS.match(line)
    if m:
        line_no = int(m["line"]) if m["line"] else None
        return m["file"], line_no, None, _SEVERITY[m["sev"]], m["msg"].strip(), "ptxas"
    m = _TOOL.match(line)
    if m:
        return None, None, None, _SEVERITY[m["sev"]], f"{m['tool']}: {m['msg'].strip()}", ""
    m = _LD_REF.match(line)
    if m and "undefined reference" in m["msg"]:
        return m["file"], None, None, "error", m["msg"].strip(), "linker"
    m = _LD.match(line)
    if m and any(word in m["msg"] for word in _LD_ERRORS):
        return None, None, None, "error", f"ld: {m['msg'].strip()}", "linker"
    return None


def _generated_note(label: str, file_name: str, line: int | None, prepended: int | None) -> str:
    where = (
        f"line {line} of load_inline's generated {file_name}"
        if line
        else f"load_inline's generated {file_name}"
    )
    if prepended is None:
        return f"in {label}: {where}"
    if prepended == 0:
        return f"in {label}: {where}, which starts with {label}"
    s = "" if prepended == 1 else "s"
    return f"in {label}: {where}, which adds {prepended} #include line{s} before {label}"


def parse_compiler_output(text: str) -> list[Diagnostic]:
    """Diagnostics in nvcc, gcc/clang, ptxas and linker output: deduplicated, errors first.

    Ninja's progress, command and ``FAILED:`` lines are ignored. A diagnostic in load_inline's
    generated ``main.cpp`` / ``cuda.cu`` says so in its message (``origin`` is ``cpp_sources`` /
    ``cuda_sources``); its line numbers are the generated file's, which by default begins with
    load_inline's own ``#include`` lines (1 in ``main.cpp``, 3 in ``cuda.cu``).
    """
    lines = text.splitlines()
    found: list[Diagnostic] = []
    seen: set[tuple[Any, ...]] = set()
    for i, raw in enumerate(lines):
        match = _match_diagnostic(raw.rstrip())
        if match is None:
            continue
        file, line_no, col, severity, msg, origin = match
        if file is not None:
            file = file.strip()
        key = (file, line_no, col, severity, msg)
        if key in seen:
            continue
        seen.add(key)
        diag = Diagnostic(
            file=file,
            line=line_no,
            column=col,
            severity=severity,
            message=msg,
            source_line=_source_line_after(lines, i, line_no),
            origin=origin,
            text=msg,
        )
        base = os.path.basename(file) if file else ""
        if base in GENERATED_FILES:
            label = GENERATED_FILES[base]
            diag.origin = label
            diag.generated = f"{base}:{line_no}" if line_no else base
            diag.message = f"{msg} ({_generated_note(label, base, line_no, len(IMPLICIT_HEADERS[base]))})"
        found.append(diag)
    order = {"error": 0, "warning": 1}
    return sorted(found, key=lambda d: (order.get(d.severity, 2), d.file is None and d.line is None))


# ----------------------------------------------------------------------------------------------
# Mapping load_inline's generated files back to the candidate
# ----------------------------------------------------------------------------------------------


@dataclass
class _GeneratedSource:
    """How load_inline assembled one generated file: implicit lines, the user's parts, then bindings."""

    label: str
    file_name: str
    prepended: list[str]
    parts: list[str]
    call_line: int | None = None

    def locate(self, line: int) -> tuple[str, int | None, int]:
        """(``"prepended"`` | ``"part"`` | ``"bindings"``, part index, 1-based line within it)."""
        start = 1
        for text in self.prepended:
            end = start + text.count("\n")
            if line <= end:
                return "prepended", None, line - start + 1
            start = end + 1
        for index, text in enumerate(self.parts):
            end = start + text.count("\n")
            if line <= end:
                return "part", index, line - start + 1
            start = end + 1
        return "bindings", None, line - start + 1


#: Generated files of the extensions built in this process, by real path.
_GENERATED: dict[str, _GeneratedSource] = {}


class _SourceIndex:
    """The candidate's lines and string literals, for finding where a C++ part or a kernel lives."""

    def __init__(self, source: str) -> None:
        self.lines = source.splitlines()
        try:
            self.tree: ast.Module | None = parse_python(source)
        except SyntaxError:
            self.tree = None
        self.literals: list[ast.Constant] = []
        if self.tree is not None:
            in_fstring = {
                id(v) for n in ast.walk(self.tree) if isinstance(n, ast.JoinedStr) for v in ast.walk(n)
            }
            self.literals = [
                n
                for n in ast.walk(self.tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in in_fstring
            ]

    def text(self, line: int) -> str:
        return self.lines[line - 1] if 1 <= line <= len(self.lines) else ""

    def unique_line(self, want: str, lo: int = 1, hi: int | None = None) -> int | None:
        want = want.strip()
        if len(want) < 3:
            return None
        hi = hi or len(self.lines)
        hits = [n for n in range(lo, hi + 1) if self.text(n).strip() == want]
        return hits[0] if len(hits) == 1 else None

    def part_line(self, part: str, k: int) -> int | None:
        """The candidate line holding line ``k`` of the string ``part`` (a load_inline source)."""
        part_lines = part.split("\n")
        want = part_lines[k - 1].strip() if 1 <= k <= len(part_lines) else ""
        for node in self.literals:
            if node.value != part:
                continue
            end = node.end_lineno or node.lineno
            guess = node.lineno + k - 1
            if node.lineno <= guess <= end and (not want or want in self.text(guess)):
                return guess
            hit = self.unique_line(want, node.lineno, end)
            if hit is not None:
                return hit
        return self.unique_line(want) if want else None

    def literal_line(self, want: str) -> int | None:
        """The one line inside a multi-line string literal whose text is ``want``."""
        hits: set[int] = set()
        want = want.strip()
        if len(want) < 3:
            return None
        for node in self.literals:
            end = node.end_lineno or node.lineno
            for n in range(node.lineno, end + 1):
                line = self.text(n).strip()
                if line == want or (n in (node.lineno, end) and want in line):
                    hits.add(n)
        return hits.pop() if len(hits) == 1 else None


def _generated_text(path: str | None, line: int | None) -> str | None:
    if not path or not line:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, text in enumerate(fh, 1):
                if n == line:
                    return text.rstrip("\n")
    except OSError:
        return None
    return None


def _map_generated(diags: list[Diagnostic], source: str, path: str) -> list[Diagnostic]:
    """Point diagnostics in load_inline's generated files at the candidate's lines where possible."""
    index: _SourceIndex | None = None
    out: list[Diagnostic] = []
    for diag in diags:
        base = os.path.basename(diag.file) if diag.file else ""
        if base not in GENERATED_FILES or diag.line is None:
            out.append(diag)
            continue
        index = index or _SourceIndex(source)
        label = GENERATED_FILES[base]
        gen = _GENERATED.get(os.path.realpath(diag.file or ""))
        generated_at = f"generated {base}:{diag.line}"
        mapped: int | None = None
        origin = label
        if gen is not None:
            where, part, k = gen.locate(diag.line)
            if where == "part" and part is not None:
                mapped = index.part_line(gen.parts[part], k)
                name = f"{label}[{part}]" if len(gen.parts) > 1 else label
                note = f"in {name} line {k}; {generated_at}"
            elif where == "bindings":
                mapped, origin = gen.call_line, "bindings"
                note = f"in the pybind11 bindings load_inline generates for functions=...; {generated_at}"
            else:
                note = f"in the #include lines load_inline adds; {generated_at}"
        else:
            text = diag.source_line or _generated_text(diag.file, diag.line)
            mapped = index.literal_line(text) if text else None
            note = f"in {label}; {generated_at}"
        if mapped is None:
            out.append(diag)
            continue
        out.append(
            replace(
                diag,
                file=path,
                line=mapped,
                message=f"{diag.text} ({note})",
                source_line=index.text(mapped).strip() or diag.source_line,
                origin=origin,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------
# Instrumented import
# ----------------------------------------------------------------------------------------------


@dataclass
class BuildReport:
    """What importing a candidate built: ``seconds`` of the import, one dict per extension build."""

    seconds: float = 0.0
    extensions: list[dict[str, Any]] = field(default_factory=list)
    kind: dict[str, bool] = field(default_factory=dict)
    cache_dir: str = ""
    torch_extensions_dir: str = ""

    @property
    def build_seconds(self) -> float:
        return sum(float(e.get("seconds", 0.0)) for e in self.extensions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _caller_line(path: str) -> int | None:
    """The line of the innermost frame on the stack that runs the candidate file."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_filename == path:
                return frame.f_lineno
            frame = frame.f_back
        return None
    finally:
        del frame


def _library_state(build_dir: Path, name: str) -> dict[str, int]:
    from torch.utils import cpp_extension

    ext = getattr(cpp_extension, "LIB_EXT", ".so")
    state: dict[str, int] = {}
    if build_dir.is_dir():
        for lib in build_dir.glob(f"{name}*{ext}"):
            with contextlib.suppress(OSError):
                state[lib.name] = lib.stat().st_mtime_ns
    return state


class _BuildRecorder:
    """Wraps ``load_inline`` / ``load``: hash-suffixed names, a build folder per source, timings."""

    def __init__(self, source: str, path: str, report: BuildReport, ext_root: Path) -> None:
        self.hash = source_hash(source)
        self.path = path
        self.report = report
        self.ext_root = ext_root

    def wrap(self, original: Callable[..., Any], function: str) -> Callable[..., Any]:
        original = getattr(original, "__kernelcrew_wrapped__", original)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # torch reports the misuse itself
            return self._build(original, function, bound)

        wrapper.__kernelcrew_wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _build(self, original: Callable[..., Any], function: str, bound: inspect.BoundArguments) -> Any:
        arguments = bound.arguments
        requested = str(arguments["name"])
        name = requested if requested.endswith(f"_{self.hash}") else f"{requested}_{self.hash}"
        arguments["name"] = name
        if not arguments.get("build_directory"):
            build_dir = self.ext_root / name
            build_dir.mkdir(parents=True, exist_ok=True)
            arguments["build_directory"] = str(build_dir)
        build_dir = Path(arguments["build_directory"])
        cuda_sources = arguments.get("cuda_sources")
        record: dict[str, Any] = {
            "name": name,
            "requested_name": requested,
            "function": function,
            "build_directory": str(build_dir),
            "cuda": bool(cuda_sources) or bool(arguments.get("with_cuda")),
            "line": _caller_line(self.path),
        }
        if function == "load_inline":
            self._register(arguments, build_dir, record["line"])
        else:
            files = arguments.get("sources")
            files = [files] if isinstance(files, str) else list(files or [])
            record["cuda"] = record["cuda"] or any(_CUDA_FILE.search(str(f)) for f in files)
        before = _library_state(build_dir, name)
        start = time.perf_counter()
        try:
            result = original(*bound.args, **bound.kwargs)
        except BaseException as exc:
            record.update(ok=False, cached=False, seconds=round(time.perf_counter() - start, 3))
            record["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            self.report.extensions.append(record)
            raise
        seconds = time.perf_counter() - start
        after = _library_state(build_dir, name)
        unchanged = bool(before) and before == after
        record.update(
            ok=True,
            seconds=round(seconds, 3),
            cached=unchanged or seconds < CACHED_BUILD_S,
            library_existed=bool(before),
        )
        self.report.extensions.append(record)
        return result

    def _register(self, arguments: dict[str, Any], build_dir: Path, call_line: int | None) -> None:
        implicit = not arguments.get("no_implicit_headers", False)
        for file_name, key in (("main.cpp", "cpp_sources"), ("cuda.cu", "cuda_sources")):
            value = arguments.get(key)
            parts = [value] if isinstance(value, str) else [str(p) for p in (value or [])]
            if not parts and file_name != "main.cpp":
                continue
            _GENERATED[os.path.realpath(build_dir / file_name)] = _GeneratedSource(
                label=key,
                file_name=file_name,
                prepended=list(IMPLICIT_HEADERS[file_name]) if implicit else [],
                parts=parts,
                call_line=call_line,
            )


def _extensions_root(source: str, root: Path | None) -> tuple[Path, Path]:
    """(this source's cache folder, where its C++ extensions build)."""
    env_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None and env_dir:
        return Path(env_dir).parent, Path(env_dir)
    dirs = cache_dirs(source, root)
    return dirs["root"], dirs["torch_extensions"]


@contextlib.contextmanager
def instrument_builds(
    source: str, report: BuildReport, path: str = "candidate.py", root: Path | None = None
) -> Iterator[BuildReport]:
    """Record (into ``report``) every ``load_inline`` / ``load`` call made inside the block.

    Use it around the candidate's construction and first forward too: extensions built there are
    then recorded and hash-suffixed like those built at import. The originals are restored on exit;
    a wrapper the candidate kept a reference to keeps recording into ``report``.
    """
    from torch.utils import cpp_extension

    cache_root, ext_root = _extensions_root(source, root)
    report.cache_dir = report.cache_dir or str(cache_root)
    report.torch_extensions_dir = report.torch_extensions_dir or str(ext_root)
    recorder = _BuildRecorder(source, path, report, ext_root)
    saved = {name: getattr(cpp_extension, name) for name in ("load_inline", "load")}
    for name, fn in saved.items():
        setattr(cpp_extension, name, recorder.wrap(fn, name))
    try:
        yield report
    finally:
        for name, fn in saved.items():
            setattr(cpp_extension, name, fn)


def register_source(source: str, path: str) -> None:
    """Make ``path`` readable through linecache, which ``@triton.jit`` (via inspect) and tracebacks use.

    Without this, a compiled (not interpreted) ``@triton.jit`` kernel in a candidate imported from a
    string fails at import with "@jit functions should be defined in a Python file".
    """
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)


def load_candidate_module(
    source: str, path: str = "candidate.py", *, root: Path | None = None
) -> tuple[type, BuildReport]:
    """Import a candidate (sandbox only): its ``ModelNew`` class and what building it took.

    Raises :class:`BuildError` when an extension fails to build at import, and
    :class:`~kernelcrew.task.TaskError` for every other problem (syntax, a missing ``ModelNew``, an
    exception at import), with the line. ``root`` overrides the cache root (default: the child's
    ``TORCH_EXTENSIONS_DIR``, else ``<cache_dir>/build``).
    """
    report = BuildReport(kind=detect_source_kind(source))
    register_source(source, path)
    start = time.perf_counter()
    try:
        with instrument_builds(source, report, path, root):
            cls = load_candidate(source, path)
    except TaskError as exc:
        build = describe_exception(exc, path, source)
        if build is not None:
            raise build from exc
        raise
    finally:
        report.seconds = round(time.perf_counter() - start, 3)
    return cls, report


# ----------------------------------------------------------------------------------------------
# Exceptions -> BuildError
# ----------------------------------------------------------------------------------------------


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first."""
    out: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        out.append(current)
        seen.add(id(current))
        if current.__cause__ is not None:
            current = current.__cause__
        elif not current.__suppress_context__:
            current = current.__context__
        else:
            current = None
    return out


def _class_names(exc: BaseException, package: str) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__ if c.__module__.startswith(package)}


def _frames(exc: BaseException) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(exc.__traceback__))


def _in_file(frame: traceback.FrameSummary, fragment: str) -> bool:
    return fragment in frame.filename.replace("\\", "/")


def _user_frame(chain: list[BaseException], path: str) -> traceback.FrameSummary | None:
    """The deepest frame in ``path``, looking from the innermost exception outwards."""
    for exc in reversed(chain):
        frames = [f for f in _frames(exc) if f.filename == path]
        if frames:
            return frames[-1]
    return None


def _frame_diagnostic(
    frame: traceback.FrameSummary, path: str, message: str, *, origin: str = "", text: str | None = None
) -> Diagnostic:
    """An error pointing at a line of the candidate where a traceback passed (a call or a launch)."""
    return Diagnostic(
        file=path,
        line=frame.lineno,
        column=None,
        severity="error",
        message=message,
        source_line=(frame.line or "").strip() or None,
        origin=origin,
        text=message if text is None else text,
    )


def _first_line(text: str, limit: int = 300) -> str:
    """The first non-blank line; when it only introduces the error (torch.compile's
    ``backend='inductor' raised:``), with the line that names it."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:
        head = f"{head} {lines[1]}"
    return head[:limit]


def _headline(diags: list[Diagnostic]) -> Diagnostic | None:
    return next((d for d in diags if d.severity == "error"), diags[0] if diags else None)


def describe_exception(exc: BaseException, path: str, source: str) -> BuildError | None:
    """The :class:`BuildError` an exception raised while importing or first running a candidate means.

    Handles C++/CUDA extension builds (``torch.utils.cpp_extension``: "Error building extension",
    the compiler's output, ``subprocess.CalledProcessError`` of a compiler), Triton compilation
    (``CompilationError`` and subclasses, mapped to the candidate's lines; ptxas failures; out of
    resources), Triton's interpreter (``TRITON_INTERPRET=1``: the deepest frame in ``path``) and
    ``torch.compile`` backend failures. Returns ``None`` for anything else (a plain runtime error).
    """
    chain = _chain(exc)
    for item in chain:
        if isinstance(item, BuildError):
            return item
    for describe in (_describe_triton_compilation, _describe_triton_interpreter, _describe_cpp_extension):
        found = describe(chain, path, source)
        if found is not None:
            return found
    return _describe_other_compilers(chain, path, source)


# -- C++ / CUDA extensions ----------------------------------------------------------------------

_EXTENSION_PREFIX = re.compile(r"Error building extension '(?P<name>[^']+)'(?::\s*)?")


def _process_output(item: BaseException) -> str:
    parts = []
    for attr in ("output", "stderr"):
        value = getattr(item, attr, None)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if value:
            parts.append(str(value))
    return "\n".join(parts)


def _describe_cpp_extension(chain: list[BaseException], path: str, source: str) -> BuildError | None:
    output = ""
    extension = None
    from_torch = False
    for item in chain:
        text = str(item)
        m = _EXTENSION_PREFIX.search(text)
        if m:
            extension = m["name"]
            output = text[m.end() :]
            from_torch = True
            break
        if isinstance(item, subprocess.CalledProcessError):
            cmd = item.cmd if isinstance(item.cmd, list | tuple) else str(item.cmd).split()
            program = os.path.basename(str(cmd[0])) if cmd else ""
            text = _process_output(item)
            if program in COMPILER_PROGRAMS or parse_compiler_output(text):
                output = text or str(item)
                from_torch = True
                break
        if any(_in_file(f, "torch/utils/cpp_extension.py") for f in _frames(item)):
            output = text
            from_torch = True
    if not from_torch:
        return None
    diags = _map_generated(parse_compiler_output(output), source, path)
    if extension:
        extension = re.sub(rf"_[0-9a-f]{{{HASH_CHARS}}}$", "", extension)  # the suffix build.py adds
    what = f"C++ extension '{extension}'" if extension else "C++/CUDA extension"
    head = _headline(diags)
    if head is not None:
        message = f"{what} failed to build: {head}"
    else:
        hint = next(
            (
                line.strip()
                for line in output.splitlines()
                if re.search(r"error|not found|no such", line, re.I)
            ),
            _first_line(output) or _first_line(str(chain[-1])),
        )
        message = f"{what} failed to build: {hint[:300]}"
        user = _user_frame(chain, path)
        if user is not None:
            diags.append(_frame_diagnostic(user, path, hint[:300]))
    return BuildError(message, diags, output[-LOG_TAIL_CHARS:], tool="cpp_extension", path=path)


# -- Triton -------------------------------------------------------------------------------------

_REPR_ERROR = re.compile(r"^(?P<type>\w+(?:Error|Exception|Failure))\((?P<q>['\"])(?P<msg>.*)(?P=q)\)$", re.S)
_AT_LOCATION = re.compile(r"^at (?P<line>\d+):(?P<col>\d+):", re.M)


def _clean_error_text(text: str) -> str:
    """``NameError('x is not defined')`` -> ``NameError: x is not defined``."""
    text = text.strip()
    m = _REPR_ERROR.match(text)
    return f"{m['type']}: {m['msg']}" if m else text


def _jit_functions(tree: ast.Module | None, name: str) -> list[ast.FunctionDef]:
    if tree is None:
        return []
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]

    def jitted(fn: ast.FunctionDef) -> bool:
        for dec in fn.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            dotted = _dotted(target) or ""
            if dotted.rsplit(".", 1)[-1] in ("jit", "autotune", "heuristics"):
                return True
        return False

    return sorted(defs, key=lambda fn: not jitted(fn))


def _kernel_location(
    src: str | None, line: int | None, col: int | None, index: _SourceIndex
) -> tuple[int | None, int | None, str | None]:
    """Candidate (line, 1-based column) of ``line``/``col`` in a kernel's ``src``, and the kernel's name."""
    if not src or line is None:
        return None, None, None
    src_lines = src.split("\n")
    m = re.search(r"^\s*def\s+(\w+)", src, re.M)
    name = m.group(1) if m else None
    if name is None:
        return None, None, None
    first = next((s.strip() for s in src_lines if s.strip()), "")
    want = src_lines[line - 1].strip() if 1 <= line <= len(src_lines) else ""
    for fn in _jit_functions(index.tree, name):
        # Triton >= 3.x keeps the source from ``def``; older versions kept the decorators.
        for start in [fn.lineno, *(d.lineno for d in fn.decorator_list)]:
            if index.text(start).strip() != first:
                continue
            mapped = start + line - 1
            if want and index.text(mapped).strip() != want:
                continue
            text = index.text(start)
            indent = len(text) - len(text.lstrip())
            return mapped, (indent + col + 1) if col is not None else None, name
    return None, None, name


def _describe_triton_compilation(chain: list[BaseException], path: str, source: str) -> BuildError | None:
    errors = [e for e in chain if "CompilationError" in _class_names(e, "triton")]
    if not errors:
        return None
    index = _SourceIndex(source)
    diags: list[Diagnostic] = []
    inner_name: str | None = None
    for err in reversed(errors):  # innermost (the real error) first, then its call sites
        node = getattr(err, "node", None)
        line = getattr(node, "lineno", None)
        col = getattr(node, "col_offset", None)
        if line is None:
            m = _AT_LOCATION.search(str(err))
            line, col = (int(m["line"]), int(m["col"])) if m else (None, None)
        src = getattr(err, "src", None)
        mapped, column, name = _kernel_location(src if isinstance(src, str) else None, line, col, index)
        text = getattr(err, "error_message", None)
        if text is None and inner_name is not None:
            text = f"in the call to @triton.jit {inner_name}"
        elif text is None:
            cause = next(
                (c for c in _chain(err)[1:] if "CompilationError" not in _class_names(c, "triton")), None
            )
            text = f"{type(cause).__name__}: {cause}" if cause is not None else "compilation failed"
        text = _clean_error_text(str(text))
        kernel = f"@triton.jit {name}" if name else "a @triton.jit function"
        if mapped is not None:
            diags.append(
                Diagnostic(
                    file=path,
                    line=mapped,
                    column=column,
                    severity="error",
                    message=f"{text} (in {kernel})",
                    source_line=index.text(mapped).strip(),
                    origin="triton",
                    text=text,
                )
            )
        else:
            src_lines = src.split("\n") if isinstance(src, str) else []
            code = src_lines[line - 1].strip() if line and 1 <= line <= len(src_lines) else None
            diags.append(
                Diagnostic(
                    file=None,
                    line=None,
                    column=None,
                    severity="error",
                    message=f"{text} (line {line} of {kernel}, not found in {path})" if line else text,
                    source_line=code,
                    origin="triton",
                    text=text,
                )
            )
        inner_name = name or inner_name
    launch = _user_frame(chain, path)
    if launch is not None and not any(d.file == path for d in diags):
        diags.append(_frame_diagnostic(launch, path, "kernel launched here", origin="triton"))
    head = diags[0]
    return BuildError(
        f"Triton compilation failed: {head}",
        diags,
        str(errors[0])[-LOG_TAIL_CHARS:],
        tool="triton",
        path=path,
    )


_DEVICE_ASSERT_FRAMES = {"create_assert", "create_assume", "device_assert"}


def _describe_triton_interpreter(chain: list[BaseException], path: str, source: str) -> BuildError | None:
    if not any(_in_file(f, "triton/runtime/interpreter.py") for e in chain for f in _frames(e)):
        return None
    inner = chain[-1]
    inner_frames = _frames(inner)
    if isinstance(inner, AssertionError) and inner_frames and inner_frames[-1].name in _DEVICE_ASSERT_FRAMES:
        return None  # tl.device_assert failing is a runtime result, not a build error
    text = f"{type(inner).__name__}: {inner}".strip()
    frame = _user_frame(chain, path)
    index = _SourceIndex(source)
    diags: list[Diagnostic] = []
    if frame is not None:
        jit = bool(_jit_functions(index.tree, frame.name)) and frame.name != "<module>"
        where = f"@triton.jit {frame.name}" if jit else frame.name
        col = getattr(frame, "colno", None)
        diags.append(
            Diagnostic(
                file=path,
                line=frame.lineno,
                column=col + 1 if isinstance(col, int) else None,
                severity="error",
                message=f"{text} (in {where}, Triton interpreter)",
                source_line=(frame.line or index.text(frame.lineno or 0)).strip() or None,
                origin="triton",
                text=text,
            )
        )
    else:
        diags.append(
            Diagnostic(None, None, None, "error", f"{text} (Triton interpreter)", origin="triton", text=text)
        )
    log = "".join(traceback.format_exception(inner))[-LOG_TAIL_CHARS:]
    return BuildError(f"Triton kernel failed: {diags[0]}", diags, log, tool="triton_interpreter", path=path)


def _describe_other_compilers(chain: list[BaseException], path: str, source: str) -> BuildError | None:
    """Triton back-end failures (ptxas, out of resources, MLIR passes) and torch.compile back ends."""
    tool = None
    culprit: BaseException | None = None
    for item in chain:
        names = _class_names(item, "triton")
        frames = _frames(item)
        deepest = frames[-1] if frames else None
        in_compiler = deepest is not None and (
            _in_file(deepest, "triton/compiler/")
            or (_in_file(deepest, "triton/backends/") and deepest.filename.endswith("compiler.py"))
        )
        if names & {"OutOfResources", "PTXASError"} or in_compiler:
            tool, culprit = "triton", item
            break
        if _class_names(item, "torch._dynamo") & {"BackendCompilerFailed"} or _class_names(
            item, "torch._inductor"
        ) & {"InductorError"}:
            tool, culprit = "torch_compile", item
            break
    if culprit is None or tool is None:
        return None
    text = str(culprit)
    diags = parse_compiler_output(text)
    headline = _first_line(text) or type(culprit).__name__
    launch = _user_frame(chain, path)
    if launch is not None:
        diags.append(
            _frame_diagnostic(
                launch, path, f"{type(culprit).__name__}: {headline}", origin=tool, text=headline
            )
        )
    head = _headline(diags)
    label = "Triton compilation failed" if tool == "triton" else "torch.compile failed"
    message = f"{label}: {head}" if head is not None and head.origin != tool else f"{label}: {headline}"
    return BuildError(message, diags, text[-LOG_TAIL_CHARS:], tool=tool, path=path)
