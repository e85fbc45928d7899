"""Attention written out by hand, replaced by ``scaled_dot_product_attention`` (a ``library`` candidate).

Code written before SDPA existed, or copied from papers, spells attention as
``softmax(q @ k.transpose(-2, -1) * scale + bias) @ v``: it writes the whole score matrix to memory
and reads it back two or three times. PyTorch's fused attention (flash or memory-efficient, chosen
by PyTorch per device and dtype) never materializes it.

:func:`match` finds every such site in the traced graph of the task: ``matmul(softmax(X, dim=-1),
V)`` where ``X`` is the scores ``matmul(Q, K.transpose(-2, -1))``, optionally scaled by a constant
(``*`` or ``/``), then optionally given an additive bias (``+ bias``) or a boolean mask
(``.masked_fill(mask, -inf)``), each intermediate used only on that path. The candidate copies the
reference (renamed ``_Reference``, as the compiler strategy does), traces its forward with
``torch.fx`` on the first call for each input signature, replaces each site's nodes by one
``scaled_dot_product_attention`` node (``attn_mask`` = the bias, or the negated mask) and runs
the rewritten graph; everything around the sites runs as written. A forward that computes from its
inputs' shapes (a causal mask ``torch.ones(seq, seq).tril()``, a scale ``1 / math.sqrt(d)``) is
traced with fx's ``MetaTracer`` at each input signature's shapes instead, as the analysis did, and
the scale is read from that graph. Data-dependent control flow gets no candidate here.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any

from kernelcrew.agents.playbook.analysis import TaskAnalysis
from kernelcrew.agents.playbook.compiler import REFERENCE_NAME, checked_copy, reference_source
from kernelcrew.task import parse_python


@dataclass(frozen=True)
class AttentionPlan:
    """The attention sites: for each, the graph nodes to replace and what replaces them."""

    sites: tuple[dict[str, Any], ...]


class Unsupported(ValueError):
    pass


def _ref(value: Any) -> str | None:
    return value.get("ref") if isinstance(value, dict) else None


def _node(a: TaskAnalysis, name: str | None) -> dict[str, Any]:
    """The node called ``name``, or an empty record for a constant or a missing name."""
    try:
        return a.node(name) if name else {}
    except KeyError:
        return {}


def _arg(node: dict[str, Any], index: int, name: str) -> Any:
    args = node.get("args") or []
    return args[index] if len(args) > index else (node.get("kwargs") or {}).get(name)


def _site(a: TaskAnalysis, out: dict[str, Any]) -> dict[str, Any]:
    """The rewrite of the attention ending at ``out`` (``matmul(P, V)``); ``Unsupported`` if it is none."""
    probs = _node(a, _ref(_arg(out, 0, "input")))
    if probs.get("op") != "softmax":
        raise Unsupported(f"{out['name']}: not a softmax times a value matrix")
    rank = len(probs.get("shape") or [])
    if _arg(probs, 1, "dim") not in (-1, rank - 1) or rank < 3:
        raise Unsupported(f"{probs['name']}: softmax over another dim than the keys'")
    chain = [probs["name"]]
    x = _node(a, _ref(_arg(probs, 0, "input")))
    site: dict[str, Any] = {"out": out["name"], "v": _ref(_arg(out, 1, "other")), "bias": None, "mask": None}
    if x.get("op") == "add":
        left, right = (_ref(v) for v in x["args"][:2])
        scores_side = left if _node(a, left).get("op") in ("matmul", "mul", "div") else right
        site["bias"] = right if scores_side == left else left
        if not str(_node(a, site["bias"]).get("dtype") or "").startswith(("float", "bfloat")):
            raise Unsupported(f"{x['name']}: the scores get something else than a floating-point bias")
        chain.append(x["name"])
        x = _node(a, scores_side)
    elif x.get("op") == "masked_fill":
        value = _arg(x, 2, "value")
        if isinstance(value, dict) and "float" in value:  # how the analysis spells non-finite floats
            value = float(value["float"])
        if not (isinstance(value, float) and math.isinf(value) and value < 0):
            raise Unsupported(f"{x['name']}: masked_fill with {value!r}, not -inf")
        site["mask"] = _ref(_arg(x, 1, "mask"))
        if _node(a, site["mask"]).get("dtype") != "bool":
            raise Unsupported(f"{x['name']}: the mask is not a boolean tensor of the graph")
        chain.append(x["name"])
        x = _node(a, _ref(x["args"][0]))
    site["scale"], site["scale_node"] = 1.0, None
    if x.get("op") in ("mul", "div"):
        first, second = x["args"][:2]
        number = second if _ref(first) else first
        if not isinstance(number, int | float) or not (_ref(first) or _ref(second)):
            raise Unsupported(f"{x['name']}: the scores are scaled by a tensor, not a constant")
        if x["op"] == "div" and not _ref(first):
            raise Unsupported(f"{x['name']}: a constant divided by the scores is no scale")
        site["scale"] = float(number) if x["op"] == "mul" else 1.0 / float(number)
        site["scale_node"] = x["name"]  # re-read at run time: traced at shapes, it follows the head dim
        chain.append(x["name"])
        x = _node(a, _ref(first) or _ref(second))
    if x.get("op") != "matmul":
        raise Unsupported(f"{probs['name']}: its input is not q @ k^T")
    keys_t = _node(a, _ref(x["args"][1]))
    dims = sorted(d % rank for d in (keys_t.get("args") or [None, 0, 0])[1:3] if isinstance(d, int))
    if keys_t.get("op") != "transpose" or dims != [rank - 2, rank - 1]:
        raise Unsupported(f"{x['name']}: the keys are not transposed in their last two dims")
    chain += [x["name"], keys_t["name"]]
    site.update(q=_ref(x["args"][0]), k=_ref(keys_t["args"][0]))
    if not (site["q"] and site["k"] and site["v"]):
        raise Unsupported("q, k and v must all be tensors of the graph")
    for name in chain:  # every removed node feeds only the next one on the path
        if len(a.users(name)) != 1:
            raise Unsupported(f"{name} is used elsewhere too: the scores cannot be dropped")
    shapes = [_node(a, site[k]).get("shape") or [] for k in ("q", "k", "v")]
    if not all(shapes) or len({len(s) for s in shapes}) != 1 or shapes[0][-1] != shapes[1][-1]:
        raise Unsupported("q, k and v do not have the shapes of one attention")
    site["removed"] = chain
    return site


def match(analysis: TaskAnalysis) -> tuple[AttentionPlan | None, str]:
    """``(plan, why it applies)`` or ``(None, why not)``: the playbook's strategy protocol."""
    if not (analysis.traced or analysis.traced_at_shapes):
        return None, f"the module could not be traced with torch.fx: {analysis.trace_error}"
    sites, reasons = [], []
    for node in analysis.call_nodes():
        if node.get("op") != "matmul":
            continue
        try:
            sites.append(_site(analysis, node))
        except Unsupported as exc:
            reasons.append(str(exc))
        except (LookupError, TypeError, ValueError) as exc:  # a graph of another shape than expected
            reasons.append(f"{node['name']}: not an attention ({type(exc).__name__}: {exc})")
    if not sites:
        return None, "no softmax(q @ k^T ...) @ v in the forward" + (f" ({reasons[-1]})" if reasons else "")
    masks = ", ".join(
        "an additive bias" if s["bias"] else "a boolean mask" if s["mask"] else "no mask" for s in sites
    )
    return AttentionPlan(tuple(sites)), (
        f"the forward spells out {len(sites)} attention(s) ({masks}): scaled_dot_product_attention "
        "computes each without writing the score matrix to memory"
    )


def tuning_space(plan: AttentionPlan, arch: str) -> list[dict[str, Any]]:
    """PyTorch picks the fused kernel per device and dtype: nothing to tune by hand."""
    del plan, arch
    return [{}]


def generate(task_source: str, analysis: TaskAnalysis, plan: AttentionPlan, params: dict[str, Any]) -> str:
    """The candidate: the reference's own graph with each attention site replaced by SDPA."""
    if params:
        raise ValueError(f"the attention rewrite takes no parameters, got {sorted(params)}")
    reference = reference_source(task_source)
    signature, names = _forward_signature(task_source)
    sites = repr([dict(site) for site in plan.sites])
    tracer = "trace_at_shapes(self, list(args))" if analysis.traced_at_shapes else "_trace(self)"
    source = TEMPLATE.format(
        reference=reference,
        name=REFERENCE_NAME,
        sites=sites,
        signature=signature,
        call=", ".join(names),
        tracer=tracer,
        arg_names=names,
    )
    return checked_copy(source)


def _forward_signature(task_source: str) -> tuple[str, list[str]]:
    """The reference forward's parameters (as written, defaults included) and their names after
    ``self``: the candidate's forward must have them so that tracing it names the nodes as the
    analysis did."""
    tree = parse_python(task_source)
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    forward = next(n for n in model.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    params = forward.args
    if params.vararg or params.kwarg or params.kwonlyargs or params.posonlyargs:
        raise ValueError("the forward takes *args, **kwargs or keyword-only parameters")
    for arg in params.args:
        arg.annotation = None
    names = [arg.arg for arg in params.args[1:]]
    return ast.unparse(params), names


TEMPLATE = '''"""Attention rewrite (kernelcrew playbook): the task's graph with softmax(q @ k^T) @ v replaced by
torch.nn.functional.scaled_dot_product_attention (library). The reference is copied as {name};
ModelNew inherits its parameters and buffers and runs the rewritten graph of its forward.
"""

import torch
import torch.fx
import torch.nn.functional as F

{reference}


SITES = {sites}
ARG_NAMES = {arg_names!r}  # the forward's parameters after self


def _trace(module):
    return torch.fx.Tracer().trace(module)


def trace_at_shapes(module, args):
    """The forward traced on meta tensors of ``args``' shapes: sizes are constants, so a graph per
    input signature (the analysis traced the task this way too)."""
    from torch.fx.experimental.meta_tracer import MetaTracer

    names = ARG_NAMES[: len(args)]
    meta = {{n: a.to("meta") for n, a in zip(names, args) if torch.is_tensor(a)}}
    concrete = {{n: a for n, a in zip(names, args) if not torch.is_tensor(a)}}
    tracer = MetaTracer()
    tracer.proxy_buffer_attributes = True
    return tracer.trace(module, meta_args=meta, concrete_args=concrete or None)


def _scale(node):
    """The constant a scale node multiplies (or divides) the scores by, in this graph."""
    number = next((a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
    if number is None:
        raise RuntimeError(f"{{node.name}} does not scale by a constant in this graph")
    return float(number) if "mul" in str(node.target) else 1.0 / float(number)


def _rewrite(graph_module):
    """Replace each site's nodes by one scaled_dot_product_attention node."""
    graph = graph_module.graph
    nodes = {{node.name: node for node in graph.nodes}}
    for site in SITES:
        missing = [n for n in [site["out"], *site["removed"]] if n not in nodes]
        if missing:
            raise RuntimeError(f"the traced graph has no node(s) {{missing}}: the rewrite does not apply")
        out = nodes[site["out"]]
        scale = _scale(nodes[site["scale_node"]]) if site["scale_node"] else site["scale"]
        with graph.inserting_before(out):
            mask = None
            if site["bias"]:
                mask = nodes[site["bias"]]
            elif site["mask"]:
                mask = graph.call_function(torch.logical_not, (nodes[site["mask"]],))
            fused = graph.call_function(
                F.scaled_dot_product_attention,
                (nodes[site["q"]], nodes[site["k"]], nodes[site["v"]]),
                {{"attn_mask": mask, "scale": scale}},
            )
        out.replace_all_uses_with(fused)
        graph.erase_node(out)
        for name in site["removed"]:
            graph.erase_node(nodes[name])
    graph.lint()
    graph_module.recompile()
    return graph_module


class ModelNew({name}):
    """{name} whose forward runs its own graph with the attention sites fused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tracing = False
        self._graphs = {{}}

    def _graph(self, args):
        # The graph holds the submodules and parameters themselves, but a buffer that .to() replaced
        # would be stale in it: buffers are part of the key.
        key = tuple((tuple(a.shape), a.dtype, a.device) if torch.is_tensor(a) else repr(a) for a in args)
        key = (key, tuple(b.data_ptr() for b in self.buffers()))
        if key not in self._graphs:
            self._tracing = True
            try:
                graph = {tracer}
            finally:
                self._tracing = False
            self._graphs[key] = _rewrite(torch.fx.GraphModule(self, graph))
        return self._graphs[key]

    def forward({signature}):
        if self._tracing:
            return {name}.forward(self, {call})
        return self._graph(({call},))({call})
'''

__all__ = ["AttentionPlan", "generate", "match", "tuning_space"]
