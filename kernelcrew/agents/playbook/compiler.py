"""torch.compile strategy: the task's own module compiled by Inductor, as a candidate labelled ``compiler``.

:func:`generate_compiled` copies the task's ``Model`` class (renamed ``_Reference``, every use of
the name included) with the module-level imports, constants, functions and classes it needs, but
never ``get_inputs``/``get_init_inputs``/``get_test_inputs``, and subclasses it:
``ModelNew(_Reference)`` keeps the reference's state dict names by inheritance and runs
``torch.compile(_Reference.forward bound to self, mode=..., dynamic=False)``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.task import parse_python
from kernelcrew.tools.anticheat import static_check

MODES = ("default", "max-autotune-no-cudagraphs")
REFERENCE_NAME = "_Reference"
#: Task definitions a candidate must never contain (the verifier's input generators).
EXCLUDED = frozenset({"get_inputs", "get_init_inputs", "get_test_inputs"})


@dataclass(frozen=True)
class CompilePlan:
    """Which ``torch.compile`` mode the candidate uses."""

    mode: str


def match(analysis: TaskAnalysis, mode: str = "default") -> tuple[CompilePlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    if mode not in MODES:
        return None, f"unknown torch.compile mode {mode!r} (one of {', '.join(MODES)})"
    if analysis.task_source:
        try:
            generate_compiled(analysis.task_source, mode)
        except ValueError as exc:
            return None, str(exc)
    graph = f"{len(analysis.op_sequence)} traced op(s)" if analysis.traced else "an untraceable forward"
    return CompilePlan(mode), (
        f"any module ({graph}): Inductor fuses and tunes the reference as written "
        f"(mode={mode!r}, dynamic=False)"
    )


def generate(task_source: str, analysis: TaskAnalysis, plan: CompilePlan, params: dict[str, Any]) -> str:
    """The playbook's strategy protocol: the compiled candidate for ``plan``."""
    del analysis
    if params:
        raise ValueError(f"torch.compile candidates take no parameters, got {sorted(params)}")
    return generate_compiled(task_source, plan.mode)


def tuning_space(plan: CompilePlan, arch: str) -> list[dict[str, Any]]:
    """Nothing to tune by hand: Inductor's mode is the strategy itself."""
    del plan, arch
    return [{}]


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id == self.old:
            node.id = self.new
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        if node.name == self.old:
            node.name = self.new
        self.generic_visit(node)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        if node.name == self.old:
            node.name = self.new
        self.generic_visit(node)
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:  # string annotations: "Model"
        if node.value == self.old:
            node.value = self.new
        return node


def _defined_names(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {stmt.name}
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    names = set()
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)
    return names


def _used_names(stmt: ast.stmt) -> set[str]:
    return {node.id for node in ast.walk(stmt) if isinstance(node, ast.Name)}


def reference_source(task_source: str, new_name: str = REFERENCE_NAME) -> str:
    """The task's ``Model`` renamed ``new_name``, with the module-level code it needs, in file order."""
    tree = parse_python(task_source)
    body = tree.body
    defines: dict[str, list[int]] = {}
    for i, stmt in enumerate(body):
        for name in _defined_names(stmt):
            defines.setdefault(name, []).append(i)
    model = [i for i, s in enumerate(body) if isinstance(s, ast.ClassDef) and s.name == "Model"]
    if not model:
        raise ValueError("the task defines no class Model")
    keep: set[int] = set()
    stack = [model[-1]]
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        for name in _used_names(body[i]):
            if name in EXCLUDED:
                raise ValueError(f"Model uses {name}(), which a candidate may not contain")
            stack.extend(defines.get(name, []))
    future = [s for s in body if isinstance(s, ast.ImportFrom) and s.module == "__future__"]
    kept = [s for i, s in enumerate(body) if i in keep and s not in future]
    if not any("torch" in _defined_names(s) for s in kept):
        kept.insert(0, ast.Import(names=[ast.alias(name="torch")]))
    renamer = _Rename("Model", new_name)
    chunks: list[str] = []
    previous_import = False
    for stmt in [*future, *kept]:
        stmt = renamer.visit(stmt)
        ast.fix_missing_locations(stmt)
        is_import = isinstance(stmt, ast.Import | ast.ImportFrom)
        if chunks:
            chunks.append("\n" if is_import and previous_import else "\n\n\n")
        chunks.append(ast.unparse(stmt))
        previous_import = is_import
    return "".join(chunks)


def generate_compiled(task_source: str, mode: str = "default") -> str:
    """A candidate that runs the task's own forward through ``torch.compile(mode=mode, dynamic=False)``.

    Raises ``ValueError`` for an unknown mode, a task without ``Model``, or a copied reference that
    breaks the candidate rules (a disallowed import, dunder access...).
    """
    if mode not in MODES:
        raise ValueError(f"unknown torch.compile mode {mode!r} (one of {', '.join(MODES)})")
    try:
        reference = reference_source(task_source)
    except SyntaxError as exc:
        raise ValueError(f"the task does not parse: {exc.msg} (line {exc.lineno})") from exc
    source = f'''"""torch.compile candidate (kernelcrew playbook): the task's Model compiled by Inductor.

mode={mode!r}, dynamic=False. The reference is copied as {REFERENCE_NAME}; ModelNew inherits its
parameters and buffers, so the state dict is the reference's.
"""

{reference}


class ModelNew({REFERENCE_NAME}):
    """{REFERENCE_NAME} with its forward compiled once per input shape."""

    _reference_forward = {REFERENCE_NAME}.forward

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._compiled = torch.compile(self._reference_forward, mode={mode!r}, dynamic=False)

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)
'''
    return checked_copy(source)


def checked_copy(source: str) -> str:
    """``source``, a candidate that embeds a copy of the task's reference, once it passes the
    verifier's static rules; ``ValueError`` naming the first rule the copied code breaks."""
    findings = static_check(source)
    if findings:
        first = findings[0]
        raise ValueError(f"the copied reference breaks a candidate rule: {first.message} (line {first.line})")
    return source


__all__ = [
    "MODES",
    "CompilePlan",
    "checked_copy",
    "generate",
    "generate_compiled",
    "match",
    "reference_source",
    "tuning_space",
]
