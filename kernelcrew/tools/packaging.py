"""``best.py`` for a user's ``torch.compile``: the verified kernels behind one ``torch.library.custom_op``.

A candidate's Triton kernels run eagerly; traced by a user's ``torch.compile(fullgraph=True)`` they
would break the graph (Dynamo does not trace a host function that launches a kernel on its own
terms). :func:`package` appends a block to a verified candidate that registers its ``ModelNew``
forward as one custom op (``kernelcrew_<digest>::forward``): eager calls still run the forward
directly; under compilation the module becomes one opaque node whose output shape comes from a fake
implementation (the same forward with every kernel launch skipped, on fake tensors).

Candidates may not touch ``torch.library`` (a registration changes what the eager reference runs
in the timing process), so the block is not part of what is verified. :func:`unpack` takes it off
again and refuses a block that is not exactly the one :func:`package` writes for the rest of the
file: ``kernelcrew verify best.py`` verifies the kernels, and nothing can hide in the block.
Only candidates whose kernels are Triton kernels at module level are packaged (:func:`packable`).
"""

from __future__ import annotations

import ast
import hashlib
import re

from kernelcrew.task import MAX_SOURCE_BYTES, TaskError, parse_python

MARKER = "# --- kernelcrew: torch.compile packaging (generated; `kernelcrew verify` checks it) ---"

_BLOCK = '''

{marker}
import threading as _kc_threading
import weakref as _kc_weakref

import torch.func as _kc_func

_KC_OP = "kernelcrew_{digest}::forward"
_KC_LAUNCHED = {launched!r}  # the kernels this file launches with kernel[grid](...)
_kc_modules = {{}}  # id -> weak reference to a ModelNew, for the op to find its module
_kc_local = _kc_threading.local()  # shapes_only: launches are skipped (this thread, fake tensors)
_kc_eager_init = ModelNew.__init__
_kc_eager_forward = ModelNew.forward


class _KcLaunch:
    """A launched kernel: itself, except while this thread only computes shapes."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        if getattr(_kc_local, "shapes_only", False):
            return lambda *args, **kwargs: None
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


for _kc_name in _KC_LAUNCHED:
    globals()[_kc_name] = _KcLaunch(globals()[_kc_name])


def _kc_shapes(module, state, inputs):
    """The forward on fake tensors (``state`` in place of the module's parameters and buffers),
    launching nothing: the output's shape, dtype and device."""
    params = [n for n, _ in module.named_parameters()]
    names = params + [n for n, _ in module.named_buffers()]
    state = [  # parameters stay parameters (a forward may read them with get_parameter)
        t if i >= len(params) or isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
        for i, t in enumerate(state)
    ]
    _kc_local.shapes_only = True
    try:
        return _kc_func.functional_call(module, dict(zip(names, state)), tuple(inputs))
    finally:
        _kc_local.shapes_only = False


@torch.library.custom_op(_KC_OP, mutates_args=())
def _kc_forward_op(key: int, state: list[torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    # the module's own parameters are ``state``: passed so that the graph depends on them
    return _kc_eager_forward(_kc_modules[key](), *inputs)


@_kc_forward_op.register_fake
def _kc_forward_fake(key, state, inputs):
    return _kc_shapes(_kc_modules[key](), state, inputs)


def _kc_init(self, *args, **kwargs):
    _kc_eager_init(self, *args, **kwargs)
    # here, not in forward (Dynamo would trace it); the entry goes with the module
    key = id(self)
    _kc_modules[key] = _kc_weakref.ref(self, lambda _, key=key: _kc_modules.pop(key, None))


def _kc_forward(self, *inputs):
    if getattr(_kc_local, "shapes_only", False) or not torch.compiler.is_compiling():
        return _kc_eager_forward(self, *inputs)
    if not all(isinstance(t, torch.Tensor) for t in inputs) or id(self) not in _kc_modules:
        return _kc_eager_forward(self, *inputs)  # traced as it is (a copy made without __init__, say)
    state = [t for _, t in self.named_parameters()] + [t for _, t in self.named_buffers()]
    return _kc_forward_op(id(self), state, list(inputs))


ModelNew.__init__ = _kc_init
ModelNew.forward = _kc_forward
'''


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def launched_kernels(source: str) -> tuple[str, ...]:
    """Module-level Triton kernels that ``source`` launches (``name[grid](...)``), in order."""
    tree = parse_python(source)
    kernels = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and any(ast.unparse(d).split("(")[0] in ("triton.jit", "triton.autotune") for d in n.decorator_list)
    }
    launched = [
        n.func.value.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Subscript)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id in kernels
    ]
    return tuple(dict.fromkeys(launched))


def block(source: str) -> str:
    """The packaging block :func:`package` appends to ``source``."""
    return _BLOCK.format(marker=MARKER, digest=_digest(source), launched=launched_kernels(source))


def packable(source: str) -> tuple[bool, str]:
    """Whether ``source`` can be packaged, and why not: a ``ModelNew`` class whose work is done by
    Triton kernels defined in the file (``@triton.jit``/``@triton.autotune``)."""
    tree = parse_python(source)
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    if "ModelNew" not in classes:
        return False, "no ModelNew class at the top level"
    if MARKER in source:
        return False, "already packaged"
    if not launched_kernels(source):
        return (
            False,
            "it launches no Triton kernel of its own (library or compiler candidates need no packaging)",
        )
    return True, ""


def custom_op_name(packaged: str) -> str | None:
    """The custom op a packaged ``best.py`` registers (None when it is not packaged)."""
    found = re.search(r'^_KC_OP = "([^"]+)"$', packaged, re.MULTILINE)
    return found.group(1) if found and MARKER in packaged else None


def package(source: str) -> str:
    """``source`` with its forward registered as a custom op for ``torch.compile`` (see the module)."""
    ok, why = packable(source)
    if not ok:
        raise ValueError(f"cannot package this candidate: {why}")
    base = source.rstrip("\n") + "\n"
    return base + block(base)


def unpack(source: str, path: str = "candidate.py") -> tuple[str, bool]:
    """``(candidate, was_packaged)``: ``source`` without the block :func:`package` appended.

    Raises :class:`TaskError` when the block is there but is not exactly what kernelcrew writes for
    the rest of the file (edited, or appended to another file), so it cannot carry unverified code.
    """
    if MARKER not in source or len(source.encode()) > MAX_SOURCE_BYTES:
        return source, False  # nothing to take off, or a file the source checks refuse anyway
    at = source.find("\n\n\n" + MARKER)
    base = source[: at + 1] if at >= 0 else ""
    try:
        expected = base + block(base) if at >= 0 else None
    except SyntaxError as exc:
        raise TaskError(f"syntax error: {exc.msg}", path=path, line=exc.lineno) from exc
    if source.rstrip("\n") + "\n" != expected:
        raise TaskError(
            "the torch.compile packaging block differs from the one kernelcrew writes for this file "
            "(edited, or copied from another best.py): remove it to verify the kernels",
            path=path,
        )
    return base, True


__all__ = ["MARKER", "block", "custom_op_name", "launched_kernels", "packable", "package", "unpack"]
