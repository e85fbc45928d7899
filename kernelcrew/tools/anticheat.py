"""Reward-hacking checks: static rules on a candidate's own source, global-state snapshots, op traces.

Four layers, each reported as structured findings:

* :func:`static_check` reads the candidate's syntax tree (its own source only, never the
  toolchains it calls). Every import and every attribute chain of an imported name is resolved
  against the installed modules and :data:`MODULE_ATTRS` (an allow-list: a chain that reaches any
  other module, ``torch.os`` or ``np.ctypeslib``, is refused); modules and library classes may not
  travel as values; string-named attribute access, dunder hooks, tensor subclasses, metaclasses,
  code hidden in codecs or format strings, file access, threads, streams and monkey-patching are refused.
* :func:`snapshot_state` / :func:`state_changes` capture precision, backend and thread settings,
  interpreter hooks (trace, profile, signals, atexit, imports), global module hooks and the
  identity of every Tensor, Module, torch and builtins attribute, before and after each call.
* :func:`output_problems` checks that a forward returned plain tensors and numbers, no subclass or wrapper.
* :class:`OpRecorder` traces the aten ops a call runs (the reference's op class for the pass rule);
  a candidate's ``kind`` comes from a profile of its calls (:mod:`kernelcrew.tools.kinds`).

Compiled CUDA/C++ code is opaque to the static layer; the dynamic layers still apply to it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import string
import sys
import threading
import time
import types
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kernelcrew.task import parse_python

#: Every module a candidate may reach, by import or through an attribute chain, and the attributes
#: it may use on it: ``None`` for every public attribute the installed module defines that is not
#: itself a module outside this table (the libraries kernels are written with), or the closed set
#: of names allowed (the standard library's helpers, whose namespaces hold ``sys``, ``os`` and
#: friends). A module reached any other way (``torch.os``, ``np.ctypeslib``, ``torch.sys``) is refused.
MODULE_ATTRS: dict[str, frozenset[str] | None] = {
    "__future__": None,
    "torch": None,
    "torch.nn": None,
    "torch.nn.functional": None,
    "torch.nn.init": None,
    "torch.cuda": None,
    "torch.linalg": None,
    "torch.fft": None,
    "torch.special": None,
    "torch.ops": None,
    "torch.utils": frozenset({"cpp_extension"}),
    "torch.utils.cpp_extension": None,
    "torch.autograd": frozenset({"Function"}),
    "torch.fx": None,
    "torch.fx.experimental": frozenset({"meta_tracer"}),
    "torch.fx.experimental.meta_tracer": None,
    "triton": None,
    "triton.language": None,
    "triton.language.math": None,
    "triton.language.extra": None,
    "triton.language.extra.cuda": None,
    "triton.language.extra.cuda.libdevice": None,
    "triton.language.extra.libdevice": None,
    "numpy": None,
    "numpy.random": None,
    "numpy.linalg": None,
    "numpy.fft": None,
    "math": None,
    "itertools": None,
    "operator": None,
    "numbers": None,
    "collections.abc": None,
    "einops": frozenset({"rearrange", "reduce", "repeat", "einsum", "pack", "unpack", "parse_shape"}),
    "functools": frozenset(
        {
            "partial",
            "reduce",
            "lru_cache",
            "cache",
            "cached_property",
            "wraps",
            "total_ordering",
            "cmp_to_key",
        }
    ),
    "collections": frozenset({"namedtuple", "OrderedDict", "defaultdict", "deque", "Counter", "abc"}),
    "typing": frozenset(
        {
            *("Any", "Optional", "Union", "List", "Tuple", "Dict", "Set", "Callable", "Sequence"),
            *("Iterable", "Iterator", "Mapping", "TYPE_CHECKING", "Literal", "cast", "Final", "ClassVar"),
            *("NamedTuple", "TypeVar", "Generic", "Type", "Protocol", "overload"),
        }
    ),
    "dataclasses": frozenset(
        {"dataclass", "field", "fields", "replace", "asdict", "astuple", "is_dataclass", "InitVar"}
    ),
    "enum": frozenset({"Enum", "IntEnum", "Flag", "IntFlag", "auto", "unique"}),
    "abc": frozenset({"ABC", "abstractmethod"}),
    "copy": frozenset({"copy", "deepcopy"}),
    "warnings": frozenset({"warn"}),
    "string": frozenset(
        {
            *("ascii_letters", "ascii_lowercase", "ascii_uppercase", "digits", "hexdigits"),
            *("octdigits", "punctuation", "printable", "whitespace"),
        }
    ),
    "os": frozenset({"environ", "path", "getenv", "cpu_count"}),
    "os.path": frozenset({"join", "basename", "dirname", "splitext", "exists", "isfile", "isdir", "abspath"}),
    "sys": frozenset({"version_info", "platform", "maxsize", "byteorder", "float_info"}),
}
MODULE_ATTRS["typing_extensions"] = MODULE_ATTRS["typing"]

#: Native GPU bindings: any of their submodules may be imported (their code is as opaque as a
#: ``load_inline`` extension, which the dynamic checks cover).
OPEN_PACKAGES = ("cuda", "cupy")

#: Top-level modules a candidate may import. Everything else is refused with this list in the message.
ALLOWED_IMPORTS = frozenset({name.split(".")[0] for name in MODULE_ATTRS} | set(OPEN_PACKAGES))

#: Private attributes of allowed modules that honest candidates use (the cuBLASLt epilogue).
ALLOWED_PRIVATE = frozenset({"torch._addmm_activation"})

#: Objects of allowed modules that are refused however they are reached: ``(rule, why)`` by dotted name.
DENIED_OBJECTS: dict[str, tuple[str, str]] = {
    "torch.load": ("hidden-code", "unpickling runs code hidden in the data"),
    "torch.save": ("file", "writes files"),
    "torch.from_file": ("file", "maps files into memory"),
    "torch.utils.cpp_extension.load": ("file", "builds sources read from files; use load_inline"),
    "numpy.load": ("hidden-code", "unpickling runs code hidden in the data"),
    **{
        f"numpy.{name}": ("file", "reads or writes files")
        for name in ("save", "savez", "savez_compressed", "savetxt", "loadtxt", "genfromtxt", "fromfile")
    },
    "numpy.memmap": ("file", "maps files into memory"),
    "numpy.fromregex": ("file", "reads files"),
    "triton.compile": ("hidden-code", "compiles kernels from IR text or files"),
    "torch.set_flush_denormal": ("state", "flushes denormals process-wide, with no way to read it back"),
    # Process-wide settings a candidate could switch inside its forward and restore before it
    # returns (the state snapshots around each call would see nothing): TF32 matmuls under the
    # strict policy, non-deterministic algorithms, another default dtype or device.
    **{
        f"torch.{name}": ("state", "changes a process-wide setting (precision, determinism or defaults)")
        for name in (
            "set_float32_matmul_precision",
            "use_deterministic_algorithms",
            "set_deterministic_debug_mode",
            "set_default_dtype",
            "set_default_tensor_type",
            "set_default_device",
            "set_num_threads",
            "set_num_interop_threads",
        )
    },
    "torch.cuda.cudart": ("native", "raw CUDA runtime calls"),
    **{
        name: ("stream", "extra CUDA streams are not allowed (work outside the timed stream)")
        for name in (
            "torch.Stream",
            "torch.cuda.Stream",
            "torch.cuda.ExternalStream",
            "torch.cuda.stream",
            "torch.cuda.set_stream",
            "torch.cuda.StreamContext",
        )
    },
    **{
        f"torch.nn.modules.module.register_module_{hook}": ("global-hook", "hooks every module's calls")
        for hook in (
            "forward_hook",
            "forward_pre_hook",
            "full_backward_hook",
            "full_backward_pre_hook",
            "backward_hook",
            "buffer_registration_hook",
            "module_registration_hook",
            "parameter_registration_hook",
        )
    },
}

BANNED_NAMES = {
    "__import__": "dynamic import",
    "exec": "exec of generated code",
    "eval": "eval of generated code",
    "compile": "compiling generated code",
    "open": "file access",
    "globals": "access to module globals",
    "locals": "access to frame locals",
    "vars": "access to object namespaces",
    "breakpoint": "debugger hook",
    "input": "reading standard input",
    "help": "interactive help",
    "exit": "exits the process",
    "quit": "exits the process",
    "__builtins__": "access to builtins",
    "delattr": "deleting attributes",
    "Model": "use of the reference Model",
    "get_inputs": "use of the task's input generator",
    "get_init_inputs": "use of the task's input generator",
    "get_test_inputs": "use of the task's verification inputs",
}

#: Builtins that read or write an attribute named by a string: only called directly, with a constant name.
ATTR_BUILTINS = frozenset({"getattr", "setattr", "hasattr", "delattr"})

#: Attributes that walk frames, tracebacks, code objects, class hierarchies or module tables.
BANNED_ATTRS = frozenset(
    {
        *("f_back", "f_locals", "f_globals", "f_builtins", "f_code", "f_lineno", "f_lasti", "f_trace"),
        *("gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await"),
        *("ag_frame", "ag_code", "ag_await", "tb_frame", "tb_next", "tb_lasti", "tb_lineno"),
        *("co_code", "co_consts", "co_names", "co_filename"),
        "_getframe",
        "modules",  # sys.modules, importlib and friends
        "mro",
    }
)
#: PyTorch's process-wide operator tables: registering or overriding an operator (``torch.library``,
#: a ``py_impl``, a dispatch or function mode, the raw ``torch._C`` bindings) changes what the eager
#: reference runs in the timing process, so a candidate could slow the baseline it is measured
#: against. Candidates call operators; they never redefine them.
DISPATCH_ATTRS = frozenset(
    {
        "library",
        "Library",
        "custom_op",
        "triton_op",
        "register_kernel",
        "register_fake",
        "register_autograd",
        "py_impl",
        "load_library",
        "_C",
        "overrides",
        "_python_dispatch",
        "TorchDispatchMode",
        "TorchFunctionMode",
    }
)
#: Methods that turn a tensor into an instance of another class (a subclass can lie to the judge).
SUBCLASS_ATTRS = frozenset({"as_subclass", "_make_subclass", "_make_wrapper_subclass"})
#: Methods that read or write an attribute, method, module or node named by a string.
DYNAMIC_ATTR_CALLS = frozenset(
    {"attrgetter", "methodcaller", "call_method", "get_attr", "call_module", "create_node", "create_proxy"}
)
#: Attributes that swap a tensor's memory, touch files or import modules by name, on any object.
SIDE_DOOR_ATTRS = {
    "set_": ("storage", "Tensor.set_ swaps a tensor's memory (the caller's inputs included)"),
    "tofile": ("file", "writes files"),
    "from_file": ("file", "maps files into memory"),
    "import_module": ("import", "imports a module by name"),
}
#: Text encodings ``str.encode``/``bytes.decode`` may name; the others (zlib, base64, rot13...) hide payloads.
TEXT_CODECS = frozenset({"utf-8", "utf8", "ascii", "latin-1", "latin1", "utf-16", "utf-32"})

ALLOWED_DUNDERS = frozenset({"__init__", "__name__", "__doc__", "__future__"})
#: Dunder names a candidate may read or bind as plain names (module metadata).
ALLOWED_DUNDER_NAMES = frozenset({"__name__", "__doc__", "__file__", "__debug__", "__all__", "__qualname__"})
#: Dunder methods a candidate may define; the others hook the interpreter or PyTorch (``__torch_function__``,
#: ``__torch_dispatch__``, ``__del__``, ``__getattr__``, ``__init_subclass__``, ``__reduce__``...).
ALLOWED_DUNDER_DEFS = frozenset(
    {"__init__", "__post_init__", "__repr__", "__str__", "__len__", "__iter__", "__getitem__", "__call__"}
    | {"__enter__", "__exit__"}
)
#: Dunder strings a candidate may write (``if __name__ == "__main__"``).
ALLOWED_DUNDER_STRINGS = ALLOWED_DUNDERS | {"__main__"}


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def module_allowed(name: str) -> bool:
    """Whether a candidate may reach the module ``name`` (import or attribute chain)."""
    return name in MODULE_ATTRS or name.split(".")[0] in OPEN_PACKAGES


_UNKNOWN = object()  # a value the static layer cannot know (an instance, a call's result, a lazy attribute)
_LIVE_LOCK = threading.RLock()
_LIVE_MODULES: dict[str, Any] = {}
_DENIED_BY_ID: dict[int, tuple[str, str, str]] = {}
_DENIED_DONE: set[str] = set()
_DENIED_KEEP: list[Any] = []  # keeps the denied objects alive, so their ids stay theirs


def _live_module(name: str) -> Any:
    """The installed module ``name`` (an allowed one: trusted library code), or None if it does not import."""
    with _LIVE_LOCK:
        if name not in _LIVE_MODULES:
            try:
                _LIVE_MODULES[name] = importlib.import_module(name)
            except Exception:  # not installed here: its attributes stay unknown
                _LIVE_MODULES[name] = None
        return _LIVE_MODULES[name]


def _denied(obj: Any) -> tuple[str, str, str] | None:
    """``(rule, dotted name, why)`` when ``obj`` is one of :data:`DENIED_OBJECTS` (looked up once its
    package is imported: an object of a package nobody imported cannot be in hand)."""
    with _LIVE_LOCK:
        for dotted, (rule, why) in DENIED_OBJECTS.items():
            if dotted in _DENIED_DONE or dotted.split(".")[0] not in sys.modules:
                continue
            _DENIED_DONE.add(dotted)
            module, _, attr = dotted.rpartition(".")
            try:
                target = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                continue
            _DENIED_KEEP.append(target)
            _DENIED_BY_ID[id(target)] = (rule, dotted, why)
        return _DENIED_BY_ID.get(id(obj))


def _is_submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _module_name(obj: Any) -> str | None:
    """The name under which :data:`MODULE_ATTRS` knows the module ``obj`` (``os.path`` for posixpath)."""
    import os

    if obj is os.path:
        return "os.path"
    name = getattr(obj, "__name__", None)
    return name if isinstance(name, str) else None


@dataclass
class _Ref:
    """What a name or attribute chain of the candidate refers to, as far as the static layer knows."""

    path: str
    obj: Any = _UNKNOWN
    module: str | None = None  # set when the value is a module


def _module_ref(name: str) -> _Ref:
    return _Ref(name, _live_module(name), module=name)


@dataclass
class Finding:
    """One static-check violation."""

    rule: str
    message: str
    line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_getattr(node: ast.AST) -> bool:
    """``getattr(x, "name")`` (or with a default): an attribute access written as a call."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) in (2, 3)
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def _is_link(parent: ast.AST | None, node: ast.AST) -> bool:
    """Whether ``parent`` reads an attribute of ``node`` (``node.x`` or ``getattr(node, "x")``)."""
    if isinstance(parent, ast.Attribute):
        return parent.value is node
    return _is_getattr(parent) and parent.args[0] is node  # type: ignore[union-attr]


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """``a.b.c`` (or ``getattr(a.b, "c")``) as (``a``'s node, ``["b", "c"]``)."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif _is_getattr(node):
            parts.append(node.args[1].value)  # type: ignore[attr-defined]
            node = node.args[0]  # type: ignore[attr-defined]
        else:
            return node, list(reversed(parts))


def _base(node: ast.AST) -> tuple[ast.AST, bool]:
    """The innermost expression under attributes, subscripts and calls, and whether a call was crossed."""
    crossed = False
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call | ast.Starred):
        if isinstance(node, ast.Call):
            crossed = True
            node = node.func
        else:
            node = node.value
    return node, crossed


class _StaticChecker(ast.NodeVisitor):
    def __init__(self, tree: ast.Module) -> None:
        self.findings: list[Finding] = []
        self.roots: dict[str, _Ref] = {}  # names bound to imported modules or objects
        self.root_bindings: dict[str, set[int]] = {}  # id() of the nodes allowed to bind each root
        self.parents: dict[ast.AST, ast.AST] = {}
        self.annotations: set[ast.AST] = set()
        self.own_defs: dict[str, int] = {}  # unconditional top-level def/class -> its line
        self.tensor_classes: set[str] = set()  # the candidate's own classes that subclass torch.Tensor
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            annotations: list[ast.AST | None] = []
            if isinstance(node, ast.arg):
                annotations.append(node.annotation)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                annotations.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                annotations.append(node.annotation)
            for ann in annotations:
                if ann is not None:
                    self.annotations.update(ast.walk(ann))
        for stmt in tree.body:
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                self.own_defs.setdefault(stmt.name, stmt.lineno)
        self._collect_roots(tree)

    def flag(self, rule: str, message: str, node: ast.AST) -> None:
        self.findings.append(Finding(rule, message, getattr(node, "lineno", None)))

    # --- what names refer to -------------------------------------------------------------------
    def _bind_root(self, name: str, ref: _Ref, node: ast.AST) -> None:
        old = self.roots.get(name)
        if old is not None and (old.path != ref.path):
            self.flag("shadowing", f"{name!r} is bound to both {old.path!r} and {ref.path!r}", node)
        self.roots.setdefault(name, ref)
        self.root_bindings.setdefault(name, set()).add(id(node))

    def _collect_roots(self, tree: ast.Module) -> None:
        """Every import, and every assignment of a module to a name, before any use is checked:
        a use above its import (a function body over a late import) is checked like any other."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "__future__" or not self._import_allowed(alias.name, node):
                        continue
                    if alias.asname:
                        self._bind_root(alias.asname, _module_ref(alias.name), node)
                    else:
                        top = alias.name.split(".")[0]
                        self._bind_root(top, _module_ref(top), node)
            elif isinstance(node, ast.ImportFrom):
                if node.level or node.module == "__future__" or not node.module:
                    continue
                if not self._import_allowed(node.module, node):
                    continue
                for alias in node.names:
                    if alias.name == "*":
                        self.flag("import", f"'from {node.module} import *' is not allowed", node)
                        continue
                    ref = self._resolve(_module_ref(node.module), [alias.name], node, use="import")
                    if ref is not None:
                        self._bind_root(alias.asname or alias.name, ref, node)
        # module aliases by assignment (``F = torch.nn.functional``), in source order
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute | ast.Name)
            ):
                ref = self._chain_ref(node.value, report=False)
                if ref is not None and ref.module is not None:
                    self._bind_root(node.targets[0].id, ref, node.targets[0])

    def _import_allowed(self, module: str, node: ast.AST) -> bool:
        if module_allowed(module):
            return True
        top = module.split(".")[0]
        if top == "torch" and DISPATCH_ATTRS & set(module.split(".")):
            self._flag_dispatch(module, node)
        allowed = ", ".join(sorted(ALLOWED_IMPORTS - {"__future__"}))
        if top in ALLOWED_IMPORTS:
            self.flag(
                "import",
                f"import of {module!r} is not allowed in a candidate (allowed modules: "
                f"{', '.join(sorted(m for m in MODULE_ATTRS if m.split('.')[0] == top))})",
                node,
            )
        else:
            self.flag(
                "import", f"import of {module!r} is not allowed in a candidate (allowed: {allowed})", node
            )
        return False

    def _resolve(self, ref: _Ref, parts: list[str], node: ast.AST, use: str = "attr") -> _Ref | None:
        """Follow ``parts`` from ``ref`` against the module table; flags and returns None at the first
        step that leaves it. An object's attributes are looked up statically (no code runs)."""
        for part in parts:
            path = f"{ref.path}.{part}"
            if ref.module is not None:
                sub = f"{ref.module}.{part}"
                allowed = MODULE_ATTRS.get(ref.module)
                if (
                    module_allowed(sub)
                    and (allowed is None or part in allowed)
                    and (_live_module(sub) is not None or ref.obj is None)
                ):
                    ref = _Ref(path, _live_module(sub), module=sub)
                    continue
                if allowed is not None and part not in allowed:
                    shown = f"from {ref.module} import {part}" if use == "import" else path
                    self.flag("module-attr", f"'{shown}' is not allowed in a candidate", node)
                    return None
                if part.startswith("_") and sub not in ALLOWED_PRIVATE and not _is_dunder(part):
                    self.flag("private", f"'{path}' is a private attribute of {ref.module}", node)
                    return None
                if ref.obj is None or ref.obj is _UNKNOWN or ref.module.split(".")[0] in OPEN_PACKAGES:
                    ref = _Ref(path)
                    continue
                if ref.module == "torch.ops":  # operator namespaces are created on lookup
                    ref = _Ref(path)
                    continue
                value = vars(ref.obj).get(part, _UNKNOWN)
                if value is _UNKNOWN:  # a lazy attribute (a submodule, say) or a missing one
                    if _is_submodule(sub):
                        self.flag(
                            "module-reach",
                            f"'{path}' is the module {sub!r}, which a candidate may not use",
                            node,
                        )
                        return None
                    ref = _Ref(path)
                    continue
            elif ref.obj is _UNKNOWN:
                return _Ref(f"{ref.path}.{'.'.join(parts[parts.index(part) :])}")
            else:
                if part.startswith("_") and not _is_dunder(part):
                    self.flag("private", f"'{path}' is a private attribute of a library object", node)
                    return None
                try:
                    value = inspect.getattr_static(ref.obj, part)
                except AttributeError:
                    return _Ref(path)
            if isinstance(value, types.ModuleType):
                name = _module_name(value)
                if name is None or not module_allowed(name):
                    self.flag(
                        "module-reach",
                        f"'{path}' reaches the module {name or value!r}, which a candidate may not use",
                        node,
                    )
                    return None
                ref = _Ref(path, value, module=name)
                continue
            denied = _denied(value)
            if denied is not None:
                rule, dotted, why = denied
                self.flag(rule, f"'{path}' ({dotted}) is not allowed: {why}", node)
                return None
            ref = _Ref(path, value)
        return ref

    def _chain_ref(self, node: ast.AST, report: bool = True) -> _Ref | None:
        """What an attribute chain rooted at an imported name refers to (None if not one, or refused)."""
        base, parts = _chain(node)
        if not isinstance(base, ast.Name) or base.id not in self.roots:
            return None
        if not parts:
            return self.roots[base.id]
        if not report:
            saved = self.findings
            self.findings = []
            try:
                return self._resolve(self.roots[base.id], parts, node)
            finally:
                self.findings = saved
        return self._resolve(self.roots[base.id], parts, node)

    # --- values that must not travel: modules, library classes ----------------------------------
    def _value_context(self, node: ast.AST) -> str:
        """How an expression is used: ``attr`` (base of an attribute), ``call``, ``type-check``
        (isinstance/issubclass, a comparison, an annotation, an except clause), ``base`` (of a class),
        ``alias`` (a module bound to a name), ``decorator``, or ``value`` (it travels)."""
        parent = self.parents.get(node)
        if _is_link(parent, node):
            return "attr"
        if node in self.annotations:
            return "type-check"
        if isinstance(parent, ast.Tuple) and isinstance(
            self.parents.get(parent), ast.Call | ast.ExceptHandler
        ):
            node, parent = parent, self.parents.get(parent)
        if isinstance(parent, ast.Call):
            if parent.func is node:
                return "call"
            func = parent.func
            if isinstance(func, ast.Name) and func.id in {"isinstance", "issubclass"} and node in parent.args:
                return "type-check"
            if isinstance(func, ast.Name) and func.id == "hasattr" and parent.args[:1] == [node]:
                return "attr"
        if isinstance(parent, ast.Compare | ast.ExceptHandler):
            return "type-check"
        if isinstance(parent, ast.ClassDef) and node in parent.bases:
            return "base"
        if isinstance(parent, ast.Subscript) and parent.value is node:
            return self._value_context(parent)
        if (
            isinstance(parent, ast.Assign)
            and len(parent.targets) == 1
            and isinstance(parent.targets[0], ast.Name)
            and id(parent.targets[0]) in self.root_bindings.get(parent.targets[0].id, set())
        ):
            return "alias"
        if (
            isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and node in parent.decorator_list
        ):
            return "decorator"
        return "value"

    def _check_value_use(self, node: ast.AST, ref: _Ref) -> None:
        context = self._value_context(node)
        if ref.module is not None and context not in {"attr", "alias"}:
            self.flag(
                "module-value",
                f"the module {ref.module!r} is used as a value ({ref.path!r}); only its attributes may be used",
                node,
            )
        elif isinstance(ref.obj, type) and context == "value" and not self._layer_factory(node, ref.obj):
            self.flag(
                "class-value",
                f"the library class {ref.path!r} is used as a value (only called, subclassed or type-checked)",
                node,
            )

    def _layer_factory(self, node: ast.AST, cls: type) -> bool:
        """A ``torch.nn`` layer class handed over as a factory, as real models do it: a parameter's
        default (``act_layer=nn.GELU``) or a keyword argument (``Block(norm_layer=nn.LayerNorm)``).
        The class only travels to code that calls it; patching it would still be caught at run time
        (the verifier's state check), and the reference runs in a process of its own."""
        import torch

        if not issubclass(cls, torch.nn.Module):
            return False
        parent = self.parents.get(node)
        if isinstance(parent, ast.keyword):
            return True
        return isinstance(parent, ast.arguments) and (
            node in parent.defaults or node in [d for d in parent.kw_defaults if d is not None]
        )

    # --- imports -------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self.flag("import", "relative imports are not allowed in a candidate", node)
        self.generic_visit(node)

    def _flag_dispatch(self, name: str, node: ast.AST) -> None:
        self.flag(
            "dispatch", f"{name!r} is not allowed: candidates may not register or override operators", node
        )

    # --- definitions -----------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._check_binding(node.name, node)
        for keyword in node.keywords:
            self.flag(
                "metaclass",
                f"class keyword {keyword.arg or '**'!r} runs a metaclass or __init_subclass__ hook",
                node,
            )
        for base in node.bases:
            inner = base.value if isinstance(base, ast.Subscript) else base
            if not isinstance(inner, ast.Name | ast.Attribute):
                self.flag("dynamic-class", "a class base must be a plain name, not a computed value", base)
                continue
            ref = self._chain_ref(inner, report=False)
            obj = ref.obj if ref is not None else None
            if isinstance(inner, ast.Name) and inner.id in self.tensor_classes:
                obj = None
                self.tensor_classes.add(node.name)
                self.flag(
                    "tensor-subclass", f"{node.name!r} subclasses the tensor subclass {inner.id!r}", node
                )
            if isinstance(inner, ast.Name) and inner.id == "type" and inner.id not in self.roots:
                self.flag("metaclass", f"{node.name!r} subclasses type (a metaclass)", node)
            if isinstance(obj, type):
                if _is_tensor_class(obj):
                    self.tensor_classes.add(node.name)
                    self.flag(
                        "tensor-subclass",
                        f"{node.name!r} subclasses {ref.path!r}: tensor subclasses can lie to the judge",
                        node,
                    )
                elif issubclass(obj, type):
                    self.flag("metaclass", f"{node.name!r} subclasses the metaclass {ref.path!r}", node)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if _is_dunder(node.name) and node.name not in ALLOWED_DUNDER_DEFS:
            self.flag(
                "dunder-def",
                f"defining {node.name!r} is not allowed: it hooks the interpreter or PyTorch",
                node,
            )
        if not isinstance(self.parents.get(node), ast.ClassDef):
            self._check_binding(node.name, node)
        self._check_arguments(node.args)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _check_arguments(self, args: ast.arguments) -> None:
        """A parameter name binds like an assignment: it may not shadow an import."""
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None:
                self._check_binding(arg.arg, arg)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._check_arguments(node.args)
        self.generic_visit(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self._check_binding(node.name, node)
        self.generic_visit(node)

    def _check_binding(self, name: str, node: ast.AST) -> None:
        """A name bound to an imported module or object may not be rebound: the rules would check
        its uses against the wrong thing."""
        if name in self.roots and id(node) not in self.root_bindings.get(name, set()):
            self.flag("shadowing", f"{name!r} names {self.roots[name].path!r} and may not be rebound", node)

    # --- names and attributes ----------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        name = node.id
        if isinstance(node.ctx, ast.Store | ast.Del):
            self._check_binding(name, node)
        reason = BANNED_NAMES.get(name)
        if reason and not self._own_definition_in_scope(node):
            self.flag("name", f"{name!r} is not allowed in a candidate ({reason})", node)
        elif _is_dunder(name) and name not in ALLOWED_DUNDER_NAMES:
            self.flag("dunder", f"the name {name!r} is not allowed in a candidate", node)
        if name in ATTR_BUILTINS and name not in self.roots and name not in self.own_defs:
            parent = self.parents.get(node)
            if not (isinstance(parent, ast.Call) and parent.func is node):
                self.flag("dynamic-attr", f"{name} may only be called directly, not passed around", node)
        if isinstance(node.ctx, ast.Load) and name in self.roots:
            self._check_value_use(node, self.roots[name])
        self.generic_visit(node)

    def _own_definition_in_scope(self, node: ast.Name) -> bool:
        """A candidate's own top-level def named like a banned builtin hides it from code after it;
        ``del`` (which would bring the builtin back) never counts."""
        line = self.own_defs.get(node.id)
        return line is not None and isinstance(node.ctx, ast.Load) and node.lineno > line

    def _module_walk(self, node: ast.Attribute) -> bool:
        """``x.modules()`` called at once with no arguments: ``nn.Module.modules()``, the submodules
        an init loop walks. ``sys.modules`` is a dict (calling it raises), so only the attribute
        read by itself, not this call, reaches a module table."""
        call = self.parents.get(node)
        return (
            node.attr == "modules"
            and isinstance(call, ast.Call)
            and call.func is node
            and not call.args
            and not call.keywords
        )

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if _is_dunder(attr) and (attr not in ALLOWED_DUNDERS or not isinstance(node.ctx, ast.Load)):
            self.flag("dunder", f"access to {attr!r} is not allowed in a candidate", node)
        elif attr in BANNED_ATTRS and not self._module_walk(node):
            self.flag("introspection", f"access to {attr!r} is not allowed (frames or module tables)", node)
        elif attr in DISPATCH_ATTRS:
            self._flag_dispatch(attr, node)
        elif attr in SUBCLASS_ATTRS:
            self.flag(
                "tensor-subclass", f"{attr!r} is not allowed: tensor subclasses can lie to the judge", node
            )
        elif attr in DYNAMIC_ATTR_CALLS:
            self.flag("dynamic-attr", f"{attr!r} reaches attributes or methods named by a string", node)
        elif attr in SIDE_DOOR_ATTRS:
            rule, why = SIDE_DOOR_ATTRS[attr]
            self.flag(rule, f"{attr!r} is not allowed: {why}", node)
        parent = self.parents.get(node)
        if not _is_link(parent, node):
            ref = self._chain_ref(node)
            if ref is not None and isinstance(node.ctx, ast.Load):
                self._check_value_use(node, ref)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if (
            isinstance(node.value, str)
            and _is_dunder(node.value)
            and node.value not in ALLOWED_DUNDER_STRINGS
        ):
            self.flag("dunder", f"the string {node.value!r} names a dunder attribute", node)

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg and _is_dunder(node.arg):
            self.flag("dunder", f"the keyword {node.arg!r} names a dunder attribute", node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ATTR_BUILTINS and func.id not in self.own_defs:
            self._check_attr_builtin(func.id, node)
        if isinstance(func, ast.Name) and func.id == "type" and "type" not in self.own_defs:
            if len(node.args) != 1 or node.keywords:
                self.flag("dynamic-class", "type() with three arguments builds a class at run time", node)
            elif self._value_context(node) in {"value", "call"}:
                self.flag(
                    "class-value", "type(x) may only be compared or type-checked, not kept or called", node
                )
        if isinstance(func, ast.Attribute) and func.attr in {"format", "format_map"}:
            self._check_format(func.value, node)
        if isinstance(func, ast.Attribute) and func.attr in {"encode", "decode"}:
            codec = (
                node.args[0]
                if node.args
                else next((k.value for k in node.keywords if k.arg == "encoding"), None)
            )
            if codec is not None and not (
                isinstance(codec, ast.Constant)
                and isinstance(codec.value, str)
                and codec.value.lower().replace("_", "-") in TEXT_CODECS
            ):
                self.flag(
                    "codec",
                    f".{func.attr}() with a codec other than a text encoding can hide a payload",
                    node,
                )
        self.generic_visit(node)

    def _check_attr_builtin(self, name: str, node: ast.Call) -> None:
        name_arg = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(name_arg, ast.Constant) and isinstance(name_arg.value, str)):
            self.flag("dynamic-attr", f"{name}() with a computed attribute name is not allowed", node)
            return
        attr = name_arg.value
        if (
            attr.startswith("__")
            or attr in BANNED_ATTRS | DISPATCH_ATTRS | SUBCLASS_ATTRS | DYNAMIC_ATTR_CALLS
            or attr in SIDE_DOOR_ATTRS
        ):
            self.flag("dynamic-attr", f"{name}(..., {attr!r}) is not allowed", node)
        target = node.args[0] if node.args else None
        if target is None:
            return
        if name == "getattr" and not _is_link(self.parents.get(node), node):
            ref = self._chain_ref(node)
            if ref is not None:
                self._check_value_use(node, ref)
        elif name == "hasattr":
            ref = (
                self._chain_ref(target, report=False)
                if isinstance(target, ast.Attribute | ast.Name)
                else None
            )
            if ref is not None:
                self._resolve(ref, [attr], node)
        base, crossed = _base(target)
        if name == "setattr" and (
            (isinstance(base, ast.Name) and base.id in self.roots) or (crossed and _is_type_call(target))
        ):
            self.flag("monkeypatch", "setattr on a library module, class or object is not allowed", node)

    def _check_format(self, receiver: ast.AST, node: ast.Call) -> None:
        """``str.format`` reads attributes and items named in the format string (``{0.__class__}``)."""
        if not (isinstance(receiver, ast.Constant) and isinstance(receiver.value, str)):
            self.flag("dynamic-attr", "format() of a string built at run time can read any attribute", node)
            return
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(receiver.value) if f]
        except ValueError:
            return
        if any("__" in f for f in fields):
            self.flag("dunder", "a format field reads a dunder attribute", node)

    # --- assignments: monkey-patching ------------------------------------------------------------
    def _check_target(self, target: ast.AST) -> None:
        if isinstance(target, ast.Tuple | ast.List | ast.Starred):
            for elt in target.elts if not isinstance(target, ast.Starred) else [target.value]:
                self._check_target(elt)
            return
        if isinstance(target, ast.Attribute | ast.Subscript):
            base, crossed = _base(target)
            if isinstance(base, ast.Name) and base.id in self.roots:
                ref = (
                    self._chain_ref(target.value, report=False) if isinstance(target, ast.Subscript) else None
                )
                if ref is not None and _is_environ(ref.obj):
                    return
                self.flag(
                    "monkeypatch", f"assignment to {ast.unparse(target)!r} changes global state", target
                )
            elif crossed and _is_type_call(target):
                self.flag("monkeypatch", f"assignment to {ast.unparse(target)!r} patches a class", target)
        if isinstance(target, ast.Name) and target.id == "__builtins__":
            self.flag("monkeypatch", "assignment to __builtins__", target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self._check_target(node.target)
        self.generic_visit(node)

    visit_AsyncFor = visit_For

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self._check_target(node.optional_vars)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._check_target(node.target)
        self.generic_visit(node)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.name:
            self._check_binding(node.name, node)
        self.generic_visit(node)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name:
            self._check_binding(node.name, node)
        self.generic_visit(node)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        if node.rest:
            self._check_binding(node.rest, node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._check_target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._check_target(target)
        self.generic_visit(node)


def _is_type_call(node: ast.AST) -> bool:
    """Whether ``type(...)`` occurs under an attribute/subscript target (``type(x).add = f``)."""
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "type"
        for n in ast.walk(node)
    )


def _is_environ(obj: Any) -> bool:
    import os

    return obj is os.environ


def _is_tensor_class(cls: type) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and issubclass(cls, torch.Tensor)


def static_check(source: str, path: str = "candidate.py") -> list[Finding]:
    """The static rules on a candidate's source; an empty list means none was broken."""
    try:
        tree = parse_python(source, filename=path)
    except SyntaxError as exc:
        return [Finding("syntax", f"syntax error: {exc.msg}", exc.lineno)]
    checker = _StaticChecker(tree)
    checker.visit(tree)
    seen: set[tuple[str, int | None, str]] = set()
    unique = []
    for f in checker.findings:
        key = (f.rule, f.line, f.message)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


# ----------------------------------------------------------------------------------------------
# Global state around every candidate call
# ----------------------------------------------------------------------------------------------


def _harness_functions() -> dict[str, Any]:
    import torch

    funcs: dict[str, Any] = {
        "time.perf_counter": time.perf_counter,
        "time.perf_counter_ns": time.perf_counter_ns,
        "time.monotonic": time.monotonic,
        "time.time": time.time,
        "torch.cuda.synchronize": torch.cuda.synchronize,
        "torch.cuda.Event": torch.cuda.Event,
        "torch.cuda.Event.record": torch.cuda.Event.record,
        "torch.cuda.Event.elapsed_time": torch.cuda.Event.elapsed_time,
        "torch.cuda.Event.synchronize": torch.cuda.Event.synchronize,
        "torch.cuda.current_stream": torch.cuda.current_stream,
        "torch.cuda.graph": torch.cuda.graph,
        "torch.cuda.CUDAGraph": torch.cuda.CUDAGraph,
        "torch.Tensor.clone": torch.Tensor.clone,
        "torch.Tensor.copy_": torch.Tensor.copy_,
        "torch.Tensor.cpu": torch.Tensor.cpu,
        "torch.Tensor.to": torch.Tensor.to,
        "torch.Tensor.detach": torch.Tensor.detach,
        "torch.Tensor.data_ptr": torch.Tensor.data_ptr,
        "torch.Tensor.__eq__": torch.Tensor.__eq__,
        "torch.equal": torch.equal,
        "torch.allclose": torch.allclose,
        "torch.isfinite": torch.isfinite,
        "torch.save": torch.save,
        "torch.load": torch.load,
        "torch.manual_seed": torch.manual_seed,
        "torch.randint": torch.randint,
        "os.urandom": os.urandom,
        "torch.nn.Module.__call__": torch.nn.Module.__call__,
        "torch.nn.Module._call_impl": torch.nn.Module._call_impl,
        "torch.nn.Module.load_state_dict": torch.nn.Module.load_state_dict,
        "torch.nn.Module.eval": torch.nn.Module.eval,
        "torch.nn.Module.train": torch.nn.Module.train,
        "torch.use_deterministic_algorithms": torch.use_deterministic_algorithms,
    }
    return funcs


def _thread_origin(thread: threading.Thread) -> str:
    """The file that defines what a Python thread runs (its target, or its overridden ``run``)."""
    target = getattr(thread, "_target", None)
    fn = target if target is not None else type(thread).run
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else "<native>"


#: Prefixes of the ``sys.modules`` entries that must keep their module object (a replaced entry
#: hands every later importer, the harness included, the candidate's look-alike).
WATCHED_MODULES = ("torch", "triton", "numpy", "kernelcrew", "time", "builtins", "sys", "os", "math")
#: Modules the compiler generates and registers (and replaces when it compiles again, as under
#: another grad mode): their entries are its own, not a candidate's patch.
GENERATED_MODULES = ("torch._inductor.runtime.compile_tasks.", "torch._inductor.codecache.")

#: ``(caller's file, callback's file)`` of every ``atexit.register`` call since the recorder went in.
_ATEXIT_RECORDS: list[tuple[str, str]] = []


def _code_file(fn: Any) -> str:
    """The file that defines a callable (through partials and bound methods), ``<native>`` for C code."""
    for _ in range(8):
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None)
        if inner is None:
            break
        fn = inner
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else "<native>"


def _install_atexit_recorder() -> None:
    """Route ``atexit.register`` through a recorder (once per process): CPython cannot list exit
    handlers, and libraries (Triton, Inductor) register their own, so each is told apart by who
    registered it and what it runs."""
    import atexit

    if getattr(atexit.register, "_kernelcrew_recorder", False):
        return
    original = atexit.register

    def register(func: Any, *args: Any, **kwargs: Any) -> Any:
        _ATEXIT_RECORDS.append((sys._getframe(1).f_code.co_filename, _code_file(func)))
        return original(func, *args, **kwargs)

    register._kernelcrew_recorder = True  # type: ignore[attr-defined]
    atexit.register = register


#: The classes among :func:`_namespaces` (an added attribute overrides an inherited one).
CLASS_NAMESPACES = frozenset(
    {"torch.Tensor", "torch._C.TensorBase", "torch.nn.Module", "torch.UntypedStorage"}
)


def _namespaces() -> dict[str, Any]:
    """Namespaces whose every entry is compared by identity: a replaced Tensor or Module method, torch
    function or builtin changes what the judge and the reference run; a replaced function of the
    modules the harness saves, sends and times with (serialization, pickle, files, clocks) changes
    what the judge is told."""
    import builtins
    import io
    import json
    import os
    import pickle
    import time

    import torch
    import torch.serialization

    return {
        "torch.Tensor": vars(torch.Tensor),
        "torch._C.TensorBase": vars(torch._C.TensorBase),
        "torch.nn.Module": vars(torch.nn.Module),
        "torch": vars(torch),
        "torch.nn.functional": vars(torch.nn.functional),
        "builtins": vars(builtins),
        "torch.serialization": vars(torch.serialization),
        "torch.UntypedStorage": vars(torch.UntypedStorage),
        "pickle": vars(pickle),
        "io": vars(io),
        "os": vars(os),
        "json": vars(json),
        "time": vars(time),
    }


def _global_hooks() -> dict[str, Any]:
    """``torch.nn.modules.module``'s global hook tables (``register_module_forward_hook`` and friends)."""
    from torch.nn.modules import module

    return {
        name: tuple(value.values()) if isinstance(value, dict) else value
        for name, value in vars(module).items()
        if name.startswith("_global_")
    }


def _torch_flags(torch: Any) -> dict[str, Any]:
    cuda = torch.backends.cuda
    flags: dict[str, Any] = {
        "cuda.matmul.allow_tf32": cuda.matmul.allow_tf32,
        "cuda.matmul.allow_fp16_reduced_precision_reduction": cuda.matmul.allow_fp16_reduced_precision_reduction,
        "cuda.matmul.allow_bf16_reduced_precision_reduction": cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cuda.flash_sdp_enabled": cuda.flash_sdp_enabled(),
        "cuda.mem_efficient_sdp_enabled": cuda.mem_efficient_sdp_enabled(),
        "cuda.math_sdp_enabled": cuda.math_sdp_enabled(),
        "cuda.cudnn_sdp_enabled": cuda.cudnn_sdp_enabled(),
        "cuda.preferred_linalg_library": str(cuda.preferred_linalg_library()),
        "cuda.preferred_blas_library": str(cuda.preferred_blas_library()),
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.enabled": torch.backends.cudnn.enabled,
        "mkldnn.enabled": torch.backends.mkldnn.enabled,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "default_dtype": str(torch.get_default_dtype()),
        "default_device": str(torch.get_default_device()),
        "grad_enabled": torch.is_grad_enabled(),
        "anomaly_enabled": torch.is_anomaly_enabled(),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "torch_function_modes": torch._C._len_torch_function_stack(),
        "torch_dispatch_modes": torch._C._len_torch_dispatch_stack(),
    }
    if hasattr(cuda, "allow_fp16_bf16_reduction_math_sdp"):
        flags["cuda.fp16_bf16_reduction_math_sdp"] = cuda.fp16_bf16_reduction_math_sdp_allowed()
    return flags


def _interpreter_hooks() -> dict[str, Any]:
    import gc
    import signal

    return {
        "sys.gettrace": sys.gettrace(),
        "sys.getprofile": sys.getprofile(),
        "threading.gettrace": threading.gettrace(),
        "threading.getprofile": threading.getprofile(),
        "sys.excepthook": sys.excepthook,
        "sys.unraisablehook": sys.unraisablehook,
        "threading.excepthook": threading.excepthook,
        "sys.meta_path": tuple(sys.meta_path),
        "sys.path_hooks": tuple(sys.path_hooks),
        "gc.callbacks": tuple(gc.callbacks),
        "signal handlers": {sig.name: signal.getsignal(sig) for sig in signal.Signals},
    }


def snapshot_state(candidate_files: tuple[str, ...] = ()) -> dict[str, Any]:
    """Flags, hooks and function identities that a candidate must not change.

    ``threads`` counts the live Python threads that run code from ``candidate_files`` (none when
    no file is given: the reference and the compiler alone are timed): libraries the candidate
    legitimately uses, Triton's compiler and Inductor among them, start worker threads of their own,
    sometimes late, even while eager and torch.compile alone are being timed. ``atexit handlers``
    counts the exit handlers registered from, or defined in, those files, for the same reason.
    """
    import torch

    _install_atexit_recorder()
    state: dict[str, Any] = _torch_flags(torch)
    state["threads"] = sum(1 for t in threading.enumerate() if _thread_origin(t) in candidate_files)
    state["atexit handlers"] = sum(
        1 for caller, callback in _ATEXIT_RECORDS if caller in candidate_files or callback in candidate_files
    )
    for name, value in _interpreter_hooks().items():
        state[f"hook:{name}"] = value
    for name, value in _global_hooks().items():
        state[f"hook:torch.nn.modules.module.{name}"] = value
    for name, namespace in _namespaces().items():
        state[f"ns:{name}"] = dict(namespace)
    state["ns:sys.modules"] = dict(sys.modules)
    state["id:sys.modules"] = sys.modules
    for name, fn in _harness_functions().items():
        state[f"id:{name}"] = fn  # compared by identity
    return state


def _dynamo_wrapper_of(new: Any, old: Any) -> bool:
    """Whether ``new`` is ``torch._disable_dynamo(old)``: importing ``torch._dynamo`` puts that wrapper on
    ``torch.manual_seed`` in place, and a candidate may import it late (``torch.compile``, fx tracing at
    run time). The wrapper calls the same function with Dynamo off; a look-alike of one's own is not it."""
    import torch

    disable = getattr(torch, "_disable_dynamo", None)
    return (
        disable is not None
        and getattr(new, "__wrapped__", None) is old
        and getattr(new, "__code__", None) is getattr(disable(_dynamo_probe), "__code__", False)
    )


def _dynamo_probe() -> None:
    """Only wrapped, to find the code object of ``torch._disable_dynamo``'s wrapper."""


#: The flag Dynamo sets on ``nn.Module`` once it has patched ``__init__``/``__setstate__``.
DYNAMO_MODULE_FLAG = "___needs_generation_tag_patch"


def _library_patch(namespace: str, key: str, new: Any, old: Any) -> bool:
    """Replacements PyTorch makes itself when a candidate legitimately imports Dynamo or compiles:
    ``torch._disable_dynamo`` wrappers, and Dynamo's tagging of ``nn.Module.__init__``/``__setstate__``
    (code that lives in ``torch/_dynamo``)."""
    if _dynamo_wrapper_of(new, old):
        return True
    if namespace == "torch.nn.Module" and key in {"__init__", "__setstate__"}:
        import torch

        dynamo_dir = str(Path(torch.__file__).parent / "_dynamo")
        return _code_file(new).startswith(dynamo_dir + "/")
    return False


def _namespace_changes(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    changes = []
    watched = name != "sys.modules"
    for key, value in old.items():
        if not watched and (key.split(".")[0] not in WATCHED_MODULES or key.startswith(GENERATED_MODULES)):
            continue
        current = new.get(key, _UNKNOWN)
        if current is value:
            continue
        shown = f"sys.modules[{key!r}]" if name == "sys.modules" else f"{name}.{key}"
        if current is _UNKNOWN:
            changes.append(f"{shown} was removed")
        elif not _library_patch(name, key, current, value):
            changes.append(f"{shown} was replaced")
    if name in CLASS_NAMESPACES:  # a new class attribute overrides what a base class defines
        changes.extend(
            f"{name}.{key} was added"
            for key in new
            if key not in old and not (name == "torch.nn.Module" and key == DYNAMO_MODULE_FLAG)
        )
    return changes


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Human-readable differences between two snapshots; empty when nothing changed."""
    changes = []
    for key, old in before.items():
        new = after.get(key)
        if key.startswith("id:"):
            if new is not old and not _dynamo_wrapper_of(new, old):
                changes.append(f"{key[3:]} was replaced")
        elif key.startswith("ns:"):
            changes.extend(_namespace_changes(key[3:], old, new or {}))
        elif key.startswith("hook:"):
            if key == "hook:signal handlers":
                changed = sorted(sig for sig in old if (new or {}).get(sig) != old[sig])
                if changed:
                    changes.append(f"signal handlers changed for {', '.join(changed)}")
            elif new != old:
                changes.append(f"{key[5:]} changed (a hook was installed or replaced)")
        elif new != old:
            if key == "threads":
                changes.append(f"threads started by the candidate went from {old} to {new} (not allowed)")
            elif key == "atexit handlers":
                changes.append(f"the candidate registered {new - old} atexit handler(s) (not allowed)")
            else:
                changes.append(f"{key} changed from {old!r} to {new!r}")
    return list(dict.fromkeys(changes))  # a function both watched by name and in a namespace: once


# ----------------------------------------------------------------------------------------------
# A forward's output
# ----------------------------------------------------------------------------------------------

#: Device types whose tensors hold real data the judge can read.
DATA_DEVICES = frozenset({"cpu", "cuda"})
#: Non-tensor leaves a forward may return (exact types: a subclass of ``float`` can lie too).
PLAIN_SCALARS = (int, float, bool, complex, type(None))
#: Dispatch keys of tensors that only wrap or describe data (functionalization, functorch, Python
#: subclasses, lazy, meta, sparse and nested layouts).
_WRAPPER_KEYS = ("Python", "Functionalize", "FuncTorch", "Batched", "Lazy", "Meta", "Sparse", "Nested")
MAX_OUTPUT_DEPTH = 16


def _tensor_problems(t: Any, where: str) -> list[str]:
    import torch

    cls = type(t)
    if cls is not torch.Tensor:
        kind = "a torch.nn.Parameter" if isinstance(t, torch.nn.Parameter) else f"a {cls.__qualname__}"
        return [f"{where} is {kind}, not a plain torch.Tensor (subclasses can change what the judge reads)"]
    problems = []
    overridden = [
        name
        for name, plain in (
            ("__torch_function__", _PLAIN_TORCH_FUNCTION),
            ("__torch_dispatch__", torch._C._disabled_torch_dispatch_impl),
        )
        if _raw_class_attr(torch.Tensor, name) is not plain
    ]
    if overridden:
        problems.append(f"{where}: torch.Tensor.{' and '.join(overridden)} is overridden")
    shadowed = sorted(k for k in getattr(t, "__dict__", {}) if hasattr(torch.Tensor, k))
    if shadowed:
        problems.append(f"{where} has instance attributes that shadow tensor methods: {', '.join(shadowed)}")
    if t.layout is not torch.strided:
        problems.append(f"{where} has layout {t.layout}, not torch.strided")
    if t.device.type not in DATA_DEVICES:
        problems.append(f"{where} is on device {t.device.type!r}, which holds no data the judge can read")
    keys = str(torch._C._dispatch_keys(t))
    wrappers = sorted({k for k in _WRAPPER_KEYS if k in keys})
    if wrappers or torch._is_functional_tensor(t) or torch._C._functorch.is_functorch_wrapped_tensor(t):
        problems.append(
            f"{where} is a wrapper tensor ({', '.join(wrappers) or 'functional'}), not plain data"
        )
    return problems


def _raw_class_attr(cls: type, name: str) -> Any:
    raw = inspect.getattr_static(cls, name, None)
    return getattr(raw, "__func__", raw)


def _plain_torch_function() -> Any:
    import torch

    return _raw_class_attr(torch.Tensor, "__torch_function__")


_PLAIN_TORCH_FUNCTION: Any = None


def output_problems(out: Any) -> list[str]:
    """What makes a forward's output other than plain data: every tensor (in nested lists, tuples
    and dicts) must be exactly ``torch.Tensor``, strided, on a data device, no wrapper, with its type's
    ``__torch_function__``/``__torch_dispatch__`` untouched; every other leaf a plain number or None.
    Empty when the output is plain. Call it in the candidate's process, on what ``forward`` returned."""
    global _PLAIN_TORCH_FUNCTION
    import torch

    if _PLAIN_TORCH_FUNCTION is None:
        _PLAIN_TORCH_FUNCTION = _plain_torch_function()
    problems: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(out, "output", 0)]
    while stack:
        obj, where, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            problems.extend(_tensor_problems(obj, where))
            continue
        cls = type(obj)
        if cls in PLAIN_SCALARS:
            continue
        if cls not in (list, tuple, dict) and not _is_return_type(cls):
            problems.append(f"{where} is a {cls.__module__}.{cls.__qualname__}, not a tensor, number or None")
            continue
        if id(obj) in seen or depth >= MAX_OUTPUT_DEPTH:
            problems.append(f"{where} nests too deep or contains itself")
            continue
        seen.add(id(obj))
        if cls is dict:
            for key, value in obj.items():
                if type(key) not in (str, int):
                    problems.append(f"{where} has a key of type {type(key).__qualname__} (str or int only)")
                stack.append((value, f"{where}[{key!r}]", depth + 1))
        else:
            stack.extend((value, f"{where}[{i}]", depth + 1) for i, value in enumerate(obj))
    return problems


def _is_return_type(cls: type) -> bool:
    """``torch.return_types`` named tuples (what ``torch.max(x, dim)`` returns)."""
    import torch

    return cls.__module__ == "torch.return_types" and getattr(torch.return_types, cls.__name__, None) is cls


# ----------------------------------------------------------------------------------------------
# Op traces and the candidate's kind
# ----------------------------------------------------------------------------------------------

#: aten ops that only allocate, reshape, move or fill memory: no compute of the module's function.
TRIVIAL_OPS = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "ones",
        "ones_like",
        "full",
        "full_like",
        "fill_",
        "zero_",
        "view",
        "_unsafe_view",
        "reshape",
        "as_strided",
        "t",
        "transpose",
        "permute",
        "expand",
        "contiguous",
        "clone",
        "copy_",
        "_to_copy",
        "to",
        "detach",
        "alias",
        "lift_fresh",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "split",
        "split_with_sizes",
        "chunk",
        "narrow",
        "unbind",
        "view_as",
        "resize_",
        "set_",
        "arange",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_contiguous",
        "dim",
        "size",
        "stride",
        "numel",
        "_local_scalar_dense",
        "item",
        "record_stream",
    }
)


def _op_name(func: Any) -> str:
    packet = getattr(func, "_overloadpacket", None)
    name = getattr(packet, "__name__", None) or str(func)
    return name.split(".")[-1]


def _make_recorder() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpRecorder(TorchDispatchMode):
        """Counts the aten ops run while it is active (candidate or reference forward)."""

        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[_op_name(func)] += 1
            return func(*args, **(kwargs or {}))

    return OpRecorder()


def record_ops(fn: Any, *args: Any) -> tuple[Any, dict[str, int]]:
    """Call ``fn(*args)`` under an aten op recorder; returns the result and the op counts."""
    recorder = _make_recorder()
    with recorder:
        out = fn(*args)
    return out, dict(recorder.ops)
