"""CUDA graph strategy: the task's own forward captured once per input signature and replayed.

A module whose GPU sits idle between small kernels (recurrent layers stepping through a sequence,
mobile CNNs, small transformers) spends its time on the host launching kernels, not on the device
running them. Replaying a captured CUDA graph launches the whole forward at once. The candidate
runs exactly the reference's kernels (kind ``library``: cuDNN, cuBLAS and ATen's own), in the same
order and precision.

The generated ``ModelNew(_Reference)`` (the task's ``Model`` copied as in
:mod:`kernelcrew.agents.playbook.compiler`) keeps one graph per input signature: the shapes,
strides, dtypes and devices of the tensor arguments, the other arguments' values, the training
flag and whether autograd is on. On a new signature it runs the forward twice to warm it up, the
second time with CUDA's synchronization debug mode raising (a forward that waits on the GPU, such
as ``.item()``, cannot be captured, and is not tried), puts back the buffers and the random
generators' states the warm-ups changed (batch-norm statistics, the draws of a ``torch.randn`` in
the forward), and captures it. A call copies its tensors into the
graph's static inputs, replays the graph and returns copies of the static outputs (a later replay
overwrites them). It runs the plain forward instead, for good, for a signature whose capture
failed (a host synchronization, data-dependent shapes), and always for CPU tensors, arguments it
cannot key, keyword arguments, autograd, or more than eight signatures. Parameters and buffers are
checked by address on every call: one moved or re-allocated (``.to()``, ``.data =``) captures
again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.compiler import REFERENCE_NAME, checked_copy, reference_source

#: Signatures one candidate captures at most; beyond them it runs the plain forward.
MAX_GRAPHS = 8


@dataclass(frozen=True)
class GraphPlan:
    """The CUDA graph candidate has nothing to choose: the plan only records that it applies."""

    traced_ops: int


def match(analysis: TaskAnalysis) -> tuple[GraphPlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    if analysis.task_source:
        try:
            generate_graphed(analysis.task_source)
        except ValueError as exc:
            return None, str(exc)
    ops = len(analysis.op_sequence)
    return GraphPlan(ops), (
        "any module: the reference's own kernels replayed as one CUDA graph per input signature, "
        "so the host launches a forward at once instead of kernel by kernel (on a GPU; a capture "
        "that fails runs the plain forward)"
    )


def generate(task_source: str, analysis: TaskAnalysis, plan: GraphPlan, params: dict[str, Any]) -> str:
    """The playbook's strategy protocol: the graphed candidate."""
    del analysis, plan
    if params:
        raise ValueError(f"CUDA graph candidates take no parameters, got {sorted(params)}")
    return generate_graphed(task_source)


def tuning_space(plan: GraphPlan, arch: str) -> list[dict[str, Any]]:
    """Nothing to tune: a graph replays what the reference launches."""
    del plan, arch
    return [{}]


def generate_graphed(task_source: str) -> str:
    """A candidate that replays the task's own forward as CUDA graphs (see the module docstring).

    Raises ``ValueError`` for a task without ``Model`` or a copied reference that breaks the
    candidate rules.
    """
    try:
        reference = reference_source(task_source)
    except SyntaxError as exc:
        raise ValueError(f"the task does not parse: {exc.msg} (line {exc.lineno})") from exc
    source = f'''"""CUDA graph candidate (kernelcrew playbook): the task's Model replayed as CUDA graphs.

One graph per input signature, captured on the first call with it; the reference is copied as
{REFERENCE_NAME} and ModelNew inherits its parameters and buffers, so the state dict is the
reference's. Any call the graphs cannot serve runs the plain forward.
"""

{reference}


_SCALARS = (bool, int, float, str)


class _Graphed:
    """One captured forward: its graph, static inputs and outputs, and the state it was captured on."""

    def __init__(self, graph, inputs, outputs, state):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.state = state
        self.addresses = [t.data_ptr() for t in state]

    def current(self):
        return all(t.data_ptr() == a for t, a in zip(self.state, self.addresses))

    def __call__(self, args):
        for static, arg in zip(self.inputs, args):
            if static is not None:
                static.copy_(arg)
        self.graph.replay()
        return _clone(self.outputs)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {{k: _clone(v) for k, v in value.items()}}
    return value


class ModelNew({REFERENCE_NAME}):
    """{REFERENCE_NAME} with its forward replayed as one CUDA graph per input signature."""

    _reference_forward = {REFERENCE_NAME}.forward
    _max_graphs = {MAX_GRAPHS}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._graphs = {{}}

    def _signature(self, args):
        key = [self.training, torch.is_grad_enabled()]
        if not any(isinstance(arg, torch.Tensor) for arg in args):
            return None
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if not arg.is_cuda or arg.requires_grad:
                    return None
                key.append((tuple(arg.shape), arg.stride(), arg.dtype, arg.device))
            elif arg is None or isinstance(arg, _SCALARS):
                key.append((isinstance(arg, bool), isinstance(arg, float), arg))
            else:
                return None
        return tuple(key)

    def _capture(self, args):
        state = [*self.parameters(), *self.buffers()]
        if any(t.requires_grad for t in state) and torch.is_grad_enabled():
            return None
        inputs = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
        call_args = [s if s is not None else a for s, a in zip(inputs, args)]
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        saved = [t.clone() for t in self.buffers()]
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device))

        def restore():
            for t, s in zip(self.buffers(), saved):
                t.copy_(s)
            torch.set_rng_state(rng[0])
            torch.cuda.set_rng_state(rng[1], device)

        sync_mode = torch.cuda.get_sync_debug_mode()
        try:
            self._reference_forward(*call_args)  # lazy initialization, workspaces
            torch.cuda.set_sync_debug_mode("error")  # a forward that waits on the GPU cannot be captured
            try:
                self._reference_forward(*call_args)
            finally:
                torch.cuda.set_sync_debug_mode(sync_mode)
            restore()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self._reference_forward(*call_args)
        except RuntimeError:
            restore()
            return None
        return _Graphed(graph, inputs, outputs, state)

    def forward(self, *args, **kwargs):
        key = None if kwargs else self._signature(args)
        if key is None:
            return self._reference_forward(*args, **kwargs)
        graphed = self._graphs.get(key)
        if graphed is False:
            return self._reference_forward(*args)
        if graphed is None or not graphed.current():
            if graphed is None and len(self._graphs) >= self._max_graphs:
                return self._reference_forward(*args)
            graphed = self._capture(args)
            self._graphs[key] = graphed or False
            if not graphed:
                return self._reference_forward(*args)
        return graphed(args)
'''
    return checked_copy(source)


__all__ = ["MAX_GRAPHS", "GraphPlan", "generate", "generate_graphed", "match", "tuning_space"]
