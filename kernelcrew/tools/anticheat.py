"""Reward-hacking checks: static rules on a candidate's own source, global-state snapshots, op traces.

Three layers, each reported as structured findings:

* :func:`static_check` reads the candidate's syntax tree (its own source only, never the
  toolchains it calls). Imports come from an allow-list; the escape hatches that let Python code
  reach the harness, the reference or the timer are refused: frames and ``gc``/``inspect``,
  ``sys.modules``, dunder attributes, dynamic ``getattr``/``setattr``/``__import__``/``exec``,
  file access, threads, subprocesses, extra CUDA streams, and assignments to attributes of
  imported modules (monkey-patching ``torch.cuda.synchronize``, ``time.perf_counter``...).
* :func:`snapshot_state` / :func:`state_changes` capture precision and determinism flags and the
  identity of every function the harness and timer rely on, before and after each candidate call.
* :class:`OpRecorder` traces the aten ops a call runs; :func:`classify_kind` turns the trace into
  the candidate's ``kind``: ``kernel`` (its own Triton/CUDA kernels do the work), ``library``
  (PyTorch ops do it, the very op it replaces included) or ``compiler`` (``torch.compile``).

Compiled CUDA/C++ code is opaque to the static layer; the dynamic layers still apply to it.
"""

from __future__ import annotations

import ast
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from kernelcrew.task import parse_python

#: Top-level modules a candidate may import. Everything else is refused with this list in the message.
ALLOWED_IMPORTS = frozenset(
    {
        "__future__",
        "torch",
        "triton",
        "math",
        "numpy",
        "typing",
        "typing_extensions",
        "functools",
        "itertools",
        "operator",
        "dataclasses",
        "collections",
        "enum",
        "abc",
        "numbers",
        "copy",
        "warnings",
        "string",
        "os",
        "sys",
        "einops",
        "cuda",
        "cupy",
    }
)

#: The only attributes of ``os`` and ``sys`` a candidate may touch.
ALLOWED_MODULE_ATTRS = {
    "os": frozenset({"environ", "path", "getenv", "cpu_count"}),
    "sys": frozenset({"version_info", "platform", "maxsize", "byteorder", "float_info"}),
}

#: torch attributes that create or switch CUDA streams (work outside the timed stream).
STREAM_ATTRS = frozenset({"Stream", "stream", "set_stream", "ExternalStream", "StreamContext"})

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
    "__builtins__": "access to builtins",
    "delattr": "deleting attributes",
    "Model": "use of the reference Model",
    "get_inputs": "use of the task's input generator",
    "get_init_inputs": "use of the task's input generator",
    "get_test_inputs": "use of the task's verification inputs",
}

#: Attributes that walk frames, tracebacks or object internals.
BANNED_ATTRS = frozenset(
    {
        "f_back",
        "f_locals",
        "f_globals",
        "f_builtins",
        "f_code",
        "gi_frame",
        "cr_frame",
        "ag_frame",
        "tb_frame",
        "tb_next",
        "_getframe",
        "modules",  # sys.modules, importlib and friends
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
ALLOWED_DUNDERS = frozenset({"__init__", "__name__", "__doc__", "__future__"})


@dataclass
class Finding:
    """One static-check violation."""

    rule: str
    message: str
    line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _StaticChecker(ast.NodeVisitor):
    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.module_aliases: dict[str, str] = {}  # local name -> top-level module
        self.defined: set[str] = set()

    def flag(self, rule: str, message: str, node: ast.AST) -> None:
        self.findings.append(Finding(rule, message, getattr(node, "lineno", None)))

    # --- imports -------------------------------------------------------------------------------
    def _check_module(self, module: str, node: ast.AST) -> str:
        top = module.split(".")[0]
        if top not in ALLOWED_IMPORTS:
            allowed = ", ".join(sorted(ALLOWED_IMPORTS - {"__future__"}))
            self.flag(
                "import", f"import of {module!r} is not allowed in a candidate (allowed: {allowed})", node
            )
        elif top == "torch" and DISPATCH_ATTRS & set(module.split(".")):
            self._flag_dispatch(module, node)
        return top

    def _flag_dispatch(self, name: str, node: ast.AST) -> None:
        self.flag(
            "dispatch", f"{name!r} is not allowed: candidates may not register or override operators", node
        )

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = self._check_module(alias.name, node)
            self.module_aliases[(alias.asname or alias.name).split(".")[0]] = (
                alias.name if alias.asname else top
            )
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self.flag("import", "relative imports are not allowed in a candidate", node)
            return
        module = node.module or ""
        top = self._check_module(module, node)
        for alias in node.names:
            if top in ALLOWED_MODULE_ATTRS and alias.name not in ALLOWED_MODULE_ATTRS[top]:
                self.flag("module-attr", f"'from {module} import {alias.name}' is not allowed", node)
            if alias.name == "*":
                self.flag("import", f"'from {module} import *' is not allowed", node)
            if module.startswith("torch.cuda") and alias.name in STREAM_ATTRS:
                self.flag(
                    "stream", "extra CUDA streams are not allowed (work outside the timed stream)", node
                )
            if top == "torch" and alias.name in DISPATCH_ATTRS:
                self._flag_dispatch(f"{module}.{alias.name}", node)
            self.module_aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
        self.generic_visit(node)

    # --- definitions -----------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.defined.add(node.name)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.defined.add(node.name)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    # --- names and attributes ----------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        reason = BANNED_NAMES.get(node.id)
        if reason and node.id not in self.defined:
            self.flag("name", f"{node.id!r} is not allowed in a candidate ({reason})", node)
        self.generic_visit(node)

    def _root(self, node: ast.AST) -> tuple[str | None, list[str]]:
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            return node.id, list(reversed(parts))
        return None, list(reversed(parts))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if attr.startswith("__") and attr.endswith("__") and attr not in ALLOWED_DUNDERS:
            self.flag("dunder", f"access to {attr!r} is not allowed in a candidate", node)
        elif attr in BANNED_ATTRS:
            self.flag("introspection", f"access to {attr!r} is not allowed (frames or module tables)", node)
        elif attr in DISPATCH_ATTRS:
            self._flag_dispatch(attr, node)
        root, parts = self._root(node)
        if root is not None and root in self.module_aliases and parts:
            module = self.module_aliases[root].split(".")[0]
            if module in ALLOWED_MODULE_ATTRS and parts[0] not in ALLOWED_MODULE_ATTRS[module]:
                self.flag("module-attr", f"'{root}.{parts[0]}' is not allowed in a candidate", node)
            full = [*self.module_aliases[root].split("."), *parts]
            if full[:2] == ["torch", "cuda"] and len(full) > 2 and full[2] in STREAM_ATTRS:
                self.flag(
                    "stream", "extra CUDA streams are not allowed (work outside the timed stream)", node
                )
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in {"getattr", "setattr", "hasattr"}:
            name_arg = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name_arg, ast.Constant) and isinstance(name_arg.value, str)):
                self.flag("dynamic-attr", f"{func.id}() with a computed attribute name is not allowed", node)
            elif name_arg.value.startswith("__") or name_arg.value in BANNED_ATTRS | DISPATCH_ATTRS:
                self.flag("dynamic-attr", f"{func.id}(..., {name_arg.value!r}) is not allowed", node)
            if func.id == "setattr" and node.args:
                root, _ = self._root(node.args[0])
                if root in self.module_aliases:
                    self.flag("monkeypatch", f"setattr on module {root!r} is not allowed", node)
        self.generic_visit(node)

    # --- assignments: monkey-patching ------------------------------------------------------------
    def _check_target(self, target: ast.AST) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for elt in target.elts:
                self._check_target(elt)
            return
        if isinstance(target, ast.Attribute):
            root, parts = self._root(target)
            if root in self.module_aliases:
                dotted = ".".join([self.module_aliases[root], *parts[:-1], parts[-1]]) if parts else root
                self.flag("monkeypatch", f"assignment to {dotted!r} changes global state", target)
        if isinstance(target, ast.Name) and target.id == "__builtins__":
            self.flag("monkeypatch", "assignment to __builtins__", target)

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


def static_check(source: str, path: str = "candidate.py") -> list[Finding]:
    """The static rules on a candidate's source; an empty list means none was broken."""
    try:
        tree = parse_python(source, filename=path)
    except SyntaxError as exc:
        return [Finding("syntax", f"syntax error: {exc.msg}", exc.lineno)]
    checker = _StaticChecker()
    # Definitions first, so a candidate's own helper named like a banned builtin is not flagged.
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            checker.defined.add(node.name)
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


def snapshot_state(candidate_files: tuple[str, ...] = ()) -> dict[str, Any]:
    """Flags and function identities that a candidate must not change.

    ``threads`` counts the live Python threads that run code from ``candidate_files`` (none when
    no file is given: the reference and the compiler alone are timed): libraries the candidate
    legitimately uses, Triton's compiler and Inductor among them, start worker threads of their own,
    sometimes late, even while eager and torch.compile alone are being timed.
    """
    import torch

    state: dict[str, Any] = {
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cuda.matmul.allow_fp16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda.matmul.allow_bf16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.enabled": torch.backends.cudnn.enabled,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "threads": sum(1 for t in threading.enumerate() if _thread_origin(t) in candidate_files),
    }
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


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Human-readable differences between two snapshots; empty when nothing changed."""
    changes = []
    for key, old in before.items():
        new = after.get(key)
        if key.startswith("id:"):
            if new is not old and not _dynamo_wrapper_of(new, old):
                changes.append(f"{key[3:]} was replaced")
        elif new != old:
            if key == "threads":
                changes.append(f"threads started by the candidate went from {old} to {new} (not allowed)")
            else:
                changes.append(f"{key} changed from {old!r} to {new!r}")
    return changes


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


def compute_ops(ops: dict[str, int]) -> set[str]:
    """The ops of a trace that compute something (allocation, views and copies left out).

    In-place variants count as their op (``relu_`` is ``relu``).
    """
    names = set()
    for name in ops:
        base = name[:-1] if name.endswith("_") and len(name) > 1 else name
        if name not in TRIVIAL_OPS and base not in TRIVIAL_OPS:
            names.add(base)
    return names


def classify_kind(
    candidate_ops: dict[str, int],
    reference_ops: dict[str, int],
    source_kind: dict[str, bool],
    launches: int,
) -> tuple[str, dict[str, Any]]:
    """``kernel``, ``library`` or ``compiler``, with the evidence that decided it.

    ``compiler`` when the candidate calls ``torch.compile``/dynamo; ``library`` when PyTorch ops do
    the work (any op the reference itself runs, or compute ops and no kernel of its own);
    ``kernel`` when its own Triton/CUDA kernels do the work and PyTorch ops at most move memory.
    """
    cand = compute_ops(candidate_ops)
    ref = compute_ops(reference_ops)
    shared = sorted(cand & ref)
    own_kernels = launches > 0 or source_kind.get("cuda", False) or source_kind.get("cpp", False)
    evidence = {
        "candidate_compute_ops": sorted(cand),
        "reference_compute_ops": sorted(ref),
        "ops_shared_with_reference": shared,
        "own_kernel_launches": launches,
        "source": source_kind,
    }
    if source_kind.get("compiler"):
        return "compiler", evidence
    if shared or not own_kernels:
        return "library", evidence
    return "kernel", evidence
