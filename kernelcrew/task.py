"""Load and validate task files (KernelBench format) and candidate files (``ModelNew``).

A task is one Python file defining ``class Model(nn.Module)``, ``get_inputs()`` and
``get_init_inputs()``; optionally ``get_test_inputs()``, a list of extra input lists used only for
verification. A candidate defines ``class ModelNew(nn.Module)`` with the same constructor and
forward signature.

Two levels of checking:

* :func:`check_source` parses the file without running it (safe in any process): syntax errors
  with their line, missing definitions, wrong kinds of definition.
* :func:`load_task` / :func:`load_candidate` import the file and check what it built (callables,
  an ``nn.Module`` subclass, inputs that are tensors, plain values, or lists, tuples and dicts of
  them). Importing runs user code, so the verifier calls these inside the sandbox only (see
  :mod:`kernelcrew.tools.taskcheck`).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import sys
import threading
import traceback
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

MAX_SOURCE_BYTES = 1_000_000
TASK_REQUIRED = ("Model", "get_inputs", "get_init_inputs")


class TaskError(ValueError):
    """A task or candidate file that cannot be used; ``message`` says what and where."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        where = f"{path}:{line}: " if path and line else (f"{path}: " if path else "")
        super().__init__(f"{where}{message}")
        self.message = message
        self.path = path
        self.line = line


@dataclass
class Task:
    """A loaded task: the module plus the pieces the harness calls."""

    name: str
    source: str
    module: ModuleType
    model_cls: type
    get_inputs: Any
    get_init_inputs: Any
    get_test_inputs: Any | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return source_digest(self.source)


def source_digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def read_source(path: str | Path) -> str:
    """Read a task or candidate file as UTF-8 text, refusing what cannot be one."""
    p = Path(path)
    if not p.is_file():
        raise TaskError("file not found", path=str(path))
    data = p.read_bytes()
    if len(data) > MAX_SOURCE_BYTES:
        raise TaskError(f"file is {len(data)} bytes; the limit is {MAX_SOURCE_BYTES}", path=str(path))
    if b"\x00" in data:
        raise TaskError("binary file (NUL bytes): a task is a Python source file", path=str(path))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"not UTF-8 text (byte {exc.start})", path=str(path)) from exc


def _top_level_defs(tree: ast.Module) -> dict[str, ast.AST]:
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                defs[(alias.asname or alias.name).split(".")[0]] = node
    return defs


#: CPython 3.11 keeps ``ast.parse``'s recursion depth in state that threads share: two threads
#: parsing at once (the graph analysis beside the timing, two web requests) can fail with
#: "AST constructor recursion depth mismatch". Every parse in kernelcrew holds this lock. Reentrant:
#: a finalizer run by the garbage collector mid-parse may parse too.
_AST_LOCK = threading.RLock()


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, one thread at a time (see ``_AST_LOCK``)."""
    with _AST_LOCK:
        return ast.parse(source, filename=filename)


def parse(source: str, path: str = "<task>") -> ast.Module:
    if len(source.encode()) > MAX_SOURCE_BYTES:
        raise TaskError(f"source is larger than {MAX_SOURCE_BYTES} bytes", path=path)
    try:
        return parse_python(source, filename=path)
    except SyntaxError as exc:
        raise TaskError(f"syntax error: {exc.msg}", path=path, line=exc.lineno) from exc


def check_source(source: str, kind: str = "task", path: str = "<task>") -> list[str]:
    """Static checks of a task (``kind="task"``) or candidate (``kind="candidate"``) without running it.

    Returns notes (warnings); raises :class:`TaskError` for a file that cannot work.
    """
    tree = parse(source, path)
    defs = _top_level_defs(tree)
    notes: list[str] = []
    required = TASK_REQUIRED if kind == "task" else ("ModelNew",)
    missing = [name for name in required if name not in defs]
    if missing:
        raise TaskError(f"missing top-level definition(s): {', '.join(missing)}", path=path)
    cls_name = "Model" if kind == "task" else "ModelNew"
    if not isinstance(defs[cls_name], ast.ClassDef | ast.ImportFrom | ast.Import | ast.Assign):
        raise TaskError(
            f"{cls_name} must be a class", path=path, line=getattr(defs[cls_name], "lineno", None)
        )
    if kind == "task":
        for fn in ("get_inputs", "get_init_inputs", "get_test_inputs"):
            node = defs.get(fn)
            if isinstance(node, ast.ClassDef):
                raise TaskError(f"{fn} must be a function, found a class", path=path, line=node.lineno)
        if "get_test_inputs" not in defs:
            notes.append("no get_test_inputs(): other shapes are not tested")
    return notes


def import_source(source: str, name: str, path: str) -> ModuleType:
    """Import ``source`` as a fresh module named ``name``; import errors name the failing line."""
    module = ModuleType(name)
    module.__file__ = path
    spec = importlib.util.spec_from_loader(name, loader=None, origin=path)
    module.__spec__ = spec
    sys.modules[name] = module
    try:
        code = compile(source, path, "exec")
        exec(code, module.__dict__)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        raise TaskError(f"syntax error: {exc.msg}", path=path, line=exc.lineno) from exc
    except BaseException as exc:
        sys.modules.pop(name, None)
        line = _user_line(exc, path)
        raise TaskError(f"import failed: {type(exc).__name__}: {exc}", path=path, line=line) from exc
    return module


def _user_line(exc: BaseException, path: str) -> int | None:
    """The deepest traceback line that lies in the user's file."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == path:
            line = frame.lineno
    return line


def _check_callable(module: ModuleType, name: str, path: str) -> Any:
    obj = getattr(module, name, None)
    if obj is None:
        raise TaskError(f"missing {name}", path=path)
    if not callable(obj):
        raise TaskError(f"{name} is not callable (it is a {type(obj).__name__})", path=path)
    return obj


def load_task(source: str, path: str = "task.py", name: str | None = None) -> Task:
    """Import a task and check it; runs user code, so call it inside the sandbox."""
    import torch.nn as nn

    check_source(source, "task", path)
    mod_name = name or f"kc_task_{uuid.uuid4().hex[:8]}"
    module = import_source(source, mod_name, path)
    model_cls = getattr(module, "Model", None)
    if not (inspect.isclass(model_cls) and issubclass(model_cls, nn.Module)):
        raise TaskError("Model must be a subclass of torch.nn.Module", path=path)
    get_inputs = _check_callable(module, "get_inputs", path)
    get_init_inputs = _check_callable(module, "get_init_inputs", path)
    get_test_inputs = getattr(module, "get_test_inputs", None)
    if get_test_inputs is not None and not callable(get_test_inputs):
        raise TaskError("get_test_inputs is not callable", path=path)
    return Task(
        name=Path(path).stem,
        source=source,
        module=module,
        model_cls=model_cls,
        get_inputs=get_inputs,
        get_init_inputs=get_init_inputs,
        get_test_inputs=get_test_inputs,
    )


def load_candidate(source: str, path: str = "candidate.py", name: str | None = None) -> type:
    """Import a candidate and return its ``ModelNew`` class; runs user code (sandbox only)."""
    import torch.nn as nn

    check_source(source, "candidate", path)
    module = import_source(source, name or f"kc_candidate_{uuid.uuid4().hex[:8]}", path)
    cls = getattr(module, "ModelNew", None)
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        raise TaskError("ModelNew must be a subclass of torch.nn.Module", path=path)
    return cls


def call_inputs(fn: Any, what: str, path: str) -> list[Any]:
    """Call ``get_inputs``/``get_init_inputs`` and check it returned a list or tuple.

    The values of ``get_inputs`` (not of ``get_init_inputs``, which never leave the process that
    builds the model) must survive ``torch.save`` and a ``weights_only`` load: see
    :func:`check_input_values`.
    """
    try:
        value = fn()
    except Exception as exc:
        raise TaskError(
            f"{what}() raised {type(exc).__name__}: {exc}", path=path, line=_user_line(exc, path)
        ) from exc
    if not isinstance(value, list | tuple):
        raise TaskError(f"{what}() must return a list, got {type(value).__name__}", path=path)
    if what != "get_init_inputs":
        check_input_values(value, what, path)
    return list(value)


def check_input_values(inputs: list[Any] | tuple[Any, ...], what: str, path: str) -> None:
    """Refuse an input the harness cannot carry between processes, naming where it is.

    Inputs are tensors, numbers, strings, bytes, None, dtypes and devices, or lists, tuples and
    dicts (string or integer keys) of them, nested to any depth: what ``torch.load(...,
    weights_only=True)`` reads back. Anything else raises :class:`TaskError` with the value's
    index path, e.g. ``get_inputs()[0][1] is a slice``.
    """
    import torch

    leaves = (torch.Tensor, bool, int, float, complex, str, bytes, torch.dtype, torch.device)

    def visit(value: Any, where: str) -> None:
        if value is None or isinstance(value, leaves):
            return
        if type(value) in (list, tuple, torch.Size):
            for i, item in enumerate(value):
                visit(item, f"{where}[{i}]")
            return
        if type(value) in (dict, OrderedDict):
            for key, item in value.items():
                if not isinstance(key, str | int):
                    raise TaskError(
                        f"{where} has a key of type {type(key).__name__}; use str or int", path=path
                    )
                visit(item, f"{where}[{key!r}]")
            return
        raise TaskError(
            f"{where} is a {type(value).__name__}: inputs must be tensors, numbers, strings or None, "
            "or lists, tuples and dicts of them",
            path=path,
        )

    for i, value in enumerate(inputs):
        visit(value, f"{what}()[{i}]")


def test_input_sets(task: Task) -> list[list[Any]]:
    """The task's extra verification input sets (``get_test_inputs()``), checked."""
    if task.get_test_inputs is None:
        return []
    sets = call_inputs(task.get_test_inputs, "get_test_inputs", task.name)
    for i, s in enumerate(sets):
        if not isinstance(s, list | tuple):
            raise TaskError(
                f"get_test_inputs()[{i}] must be a list of inputs, got {type(s).__name__}", path=task.name
            )
    return [list(s) for s in sets]
