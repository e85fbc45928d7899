"""Reading the knowledge base: the records that matter for a task on a GPU, best first, with why.

:func:`hits_for_task` is what the crew calls. It ranks the records a reader may see in tiers:

1. ``exact_model``: verified wins on the same GPU model;
2. ``arch``: the same architecture (other models, and that architecture's seeds);
3. ``nearest_arch``: other architectures by distance of their compute capability
   (from ``sm_90``: ``sm_89``, then ``sm_80`` before ``sm_100`` at equal distance, the older one
   first since its code runs on the newer); seeds only from the nearest architecture that has
   seeds. The CPU is a class of its own: CPU records never answer a GPU task, nor the reverse.

Verified wins come before seeds (advice), each kind ranked by those tiers. Only records relevant
to the task enter: the same signature, or a pattern kind in common (a seed that applies to ``any``
is relevant to every kind, after the kind-specific ones); a record tagged ``regime:<r>`` (``launch``,
``<L2``, ``>=L2``) only when the task's shape class is in that regime. Within a tier, the same
signature comes first, then the BM25 similarity (:mod:`.bm25`) of the record's signature,
strategy, tags and description to the task's signature.

:func:`search` answers free text (``kernelcrew kb search``): BM25 over every visible record,
tiered by ``--gpu``/``--arch`` when given (``similarity`` otherwise). With an embedding model
configured (:mod:`.embeddings`), both blend BM25 with the model's cosine similarity.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from kernelcrew.knowledge_base.bm25 import BM25, tokenize
from kernelcrew.knowledge_base.embeddings import Embedder
from kernelcrew.knowledge_base.models import Reader, Win, visible_to
from kernelcrew.knowledge_base.patterns import TaskSignature, from_analysis, from_text

MAX_CANDIDATES = 5000
"""Most recent visible records ranked per query (BM25 runs in memory)."""
MATCHES = ("exact_model", "arch", "nearest_arch", "similarity")


def normalize_arch(arch: str) -> str:
    """``SM90a`` / ``sm_90`` / ``90`` -> ``sm_90``; ``cpu`` stays; anything else is a ValueError."""
    text = arch.strip().lower()
    if text == "cpu":
        return "cpu"
    found = re.fullmatch(r"(?:sm_?|compute_?)?(\d{2,3})[a-z]?", text)
    if not found:
        raise ValueError(f"unknown architecture {arch!r} (expected sm_XY such as sm_90, or cpu)")
    return f"sm_{found.group(1)}"


def arch_number(arch: str) -> int | None:
    """``sm_90`` -> 90; ``cpu`` -> None."""
    norm = normalize_arch(arch)
    return None if norm == "cpu" else int(norm[3:])


def arch_distance(a: str, b: str) -> int | None:
    """How far apart two architectures are (compute capability as a number); None across CPU/GPU."""
    na, nb = arch_number(a), arch_number(b)
    if na is None or nb is None:
        return 0 if na is None and nb is None else None
    return abs(na - nb)


def nearest_archs(arch: str, known: Iterable[str]) -> list[str]:
    """The architectures in ``known`` other than ``arch``, nearest first (older first at a tie)."""
    target = normalize_arch(arch)
    others = {normalize_arch(k) for k in known} - {target}
    ranked = [(arch_distance(target, k), arch_number(k) or 0, k) for k in others]
    return [k for d, _, k in sorted(r for r in ranked if r[0] is not None)]


def task_signature(task: Mapping[str, Any] | TaskSignature | str) -> TaskSignature:
    """The signature of an analysis record (``op_sequence``, ``inputs``...), a signature line, or itself."""
    if isinstance(task, TaskSignature):
        return task
    if isinstance(task, str):
        return from_text(task)
    if isinstance(task, Mapping):
        return from_analysis(task)
    raise TypeError(
        f"a task is an analysis dict, a signature string or a TaskSignature, not {type(task).__name__}"
    )


def _reader(owner: str | Reader, team: str | None) -> Reader:
    return owner if isinstance(owner, Reader) else Reader(owner, team)


def _text(row: Win) -> str:
    """What a record is ranked by: its signature, strategy, tags, pattern kinds and description."""
    return " ".join(
        [row.signature, row.strategy, " ".join(row.tags), " ".join(row.pattern_kinds), row.description]
    )


def _candidates(session: Session, reader: Reader, device: str | None) -> list[Win]:
    stmt = select(Win).options(defer(Win.candidate_source)).where(visible_to(reader))
    if device == "cpu":
        stmt = stmt.where(Win.arch == "cpu")
    elif device == "gpu":
        stmt = stmt.where(Win.arch != "cpu")
    return list(session.scalars(stmt.order_by(Win.created_at.desc()).limit(MAX_CANDIDATES)))


def _hit(row: Win, match: str, why: str, score: float, exact: bool) -> dict[str, Any]:
    return {
        "id": str(row.id),
        "source": row.source,
        "match": match,
        "why": why,
        "score": round(score, 4),
        "exact_signature": exact,
        "strategy": row.strategy,
        "params": dict(row.params),
        "tags": list(row.tags),
        "gpu_model": row.gpu_model,
        "arch": row.arch,
        "signature": row.signature,
        "pattern_kinds": list(row.pattern_kinds),
        "clock": row.clock,
        "speedup_eager": row.speedup_eager,
        "speedup_compile": row.speedup_compile,
        "sol_fraction": row.sol_fraction,
        "confirmations": row.confirmations,
        "description": row.description,
        "visibility": row.visibility,
    }


def _tier(
    row: Win, gpu_model: str | None, arch: str, seed_arch: str | None
) -> tuple[int, int, str, str] | None:
    """(tier, distance, match, why) of a record for a device, or None when it does not answer it."""
    if row.source == "seed":
        if row.arch != seed_arch:
            return None
        if row.arch == arch:
            return 1, 0, "arch", f"seed advice for {arch}"
        distance = arch_distance(arch, row.arch) or 0
        return 2, distance, "nearest_arch", f"seed advice for the nearest seeded architecture {row.arch}"
    if gpu_model and row.gpu_model == gpu_model:
        return 0, 0, "exact_model", f"verified on the same GPU model ({gpu_model})"
    if row.arch == arch:
        return 1, 0, "arch", f"verified on the same architecture {arch} ({row.gpu_model})"
    distance = arch_distance(arch, row.arch)
    if distance is None:
        return None
    return (
        2,
        distance,
        "nearest_arch",
        f"verified on {row.arch} ({row.gpu_model}), distance {distance} from {arch}",
    )


def _seed_arch(rows: Sequence[Win], arch: str) -> str | None:
    seeded = {r.arch for r in rows if r.source == "seed"}
    if arch in seeded:
        return arch
    nearest = nearest_archs(arch, seeded)
    return nearest[0] if nearest else None


_REGIME = re.compile(r"\((launch|<L2|>=L2)\)")


def _regime_ok(row: Win, sig: TaskSignature) -> bool:
    wanted = {tag.split(":", 1)[1] for tag in row.tags if tag.startswith("regime:")}
    if not wanted:
        return True
    found = _REGIME.search(sig.text)
    return found is not None and found.group(1) in wanted


def hits_for_task(
    session: Session,
    task: Mapping[str, Any] | TaskSignature | str,
    gpu_model: str | None,
    arch: str,
    owner: str | Reader,
    *,
    team: str | None = None,
    k: int = 5,
    embedder: Embedder | None = None,
) -> list[dict[str, Any]]:
    """The ``k`` records that matter most for ``task`` on (``gpu_model``, ``arch``), as ``owner`` sees them.

    ``task`` is the playbook's analysis dict, a signature line or a :class:`TaskSignature`. Each hit
    is a dict with the record's fields (no source code) plus ``match`` (exact_model, arch,
    nearest_arch), ``why`` (one sentence), ``score`` (BM25, or its blend with an ``embedder``'s
    cosine similarity: :mod:`.embeddings`) and ``exact_signature``.
    """
    reader = _reader(owner, team)
    sig = task_signature(task)
    arch = normalize_arch(arch)
    rows = _candidates(session, reader, "cpu" if arch == "cpu" else "gpu")
    if not rows or k <= 0:
        return []
    query = f"{sig.text} {sig.kind}"
    texts = [_text(r) for r in rows]
    bm25 = BM25([tokenize(t) for t in texts]).scores(tokenize(query))
    scores, label = _similarity(embedder, query, texts, bm25)
    seed_arch = _seed_arch(rows, arch)
    ranked = []
    for row, score in zip(rows, scores, strict=True):
        exact = bool(row.signature) and row.signature_key == sig.key
        kinds = set(row.pattern_kinds)
        if not (exact or sig.kind in kinds or "any" in kinds) or not _regime_ok(row, sig):
            continue
        tier = _tier(row, gpu_model, arch, seed_arch)
        if tier is None:
            continue
        level, distance, match, why = tier
        if row.clock == "cpu-wall":
            why += "; CPU wall-clock timing, not a GPU speedup"
        why += "; same signature" if exact else (f"; {label} {score:.2f}" if score > 0 else "")
        generic = sig.kind not in kinds  # an "any" record: after the ones for this kind
        older = arch_number(row.arch) or 0  # at equal distance, the older architecture first
        key = (
            row.source == "seed",
            level,
            distance,
            older,
            generic,
            not exact,
            -score,
            -(row.speedup_eager or 0.0),
        )
        ranked.append((key, _hit(row, match, why, score, exact)))
    ranked.sort(key=lambda item: item[0])
    return [hit for _, hit in ranked[:k]]


def search(
    session: Session,
    query: str,
    reader: Reader,
    *,
    arch: str | None = None,
    gpu_model: str | None = None,
    k: int = 10,
    embedder: Embedder | None = None,
) -> list[dict[str, Any]]:
    """Free-text search: BM25 (blended with an ``embedder``'s similarity when given) over what
    ``reader`` sees, tiered by GPU model / architecture when given."""
    target = normalize_arch(arch) if arch else None
    device = (
        None
        if target is None and gpu_model is None
        else ("cpu" if target == "cpu" or gpu_model == "cpu" else "gpu")
    )
    rows = _candidates(session, reader, device)
    if not rows:
        return []
    seed_arch = _seed_arch(rows, target) if target else None
    terms = tokenize(query)
    texts = [_text(r) for r in rows]
    scores, label = _similarity(embedder, query, texts, BM25([tokenize(t) for t in texts]).scores(terms))
    ranked = []
    for row, score in zip(rows, scores, strict=True):
        if terms and score <= 0:
            continue
        if target is None and gpu_model is None:
            tier: tuple[int, int, str, str] | None = (0, 0, "similarity", f"{label} {score:.2f}")
        elif target is None:
            tier = (
                (0, 0, "exact_model", f"on {gpu_model}")
                if row.gpu_model == gpu_model
                else (1, 0, "similarity", f"{label} {score:.2f} (other GPU model)")
            )
        else:
            tier = _tier(row, gpu_model, target, seed_arch)
            if tier is not None and score > 0:
                tier = (*tier[:3], f"{tier[3]}; {label} {score:.2f}")
        if tier is None:
            continue
        level, distance, match, why = tier
        ranked.append(((row.source == "seed", level, distance, -score), _hit(row, match, why, score, False)))
    ranked.sort(key=lambda item: item[0])
    return [hit for _, hit in ranked[:k]]


def _similarity(
    embedder: Embedder | None, query: str, texts: list[str], bm25: list[float]
) -> tuple[list[float], str]:
    """Each record's similarity to the query and how it is labelled in a hit's ``why``: BM25, or
    its blend with the embedder's (BM25 alone, saying why, when the model fails)."""
    if embedder is None:
        return bm25, "similarity"
    blended, error = embedder.blend(query, texts, bm25)
    if blended is None:
        return bm25, f"similarity (BM25 only: embeddings failed, {error[:120]})"
    return blended, f"similarity (BM25 + {embedder.model})"


def hit_line(hit: Mapping[str, Any]) -> str:
    """One line for a prompt or a terminal: what worked, where, how much, and why it matched."""
    params = json.dumps(hit.get("params") or {}, sort_keys=True)
    if hit["source"] == "seed":
        advice = hit["description"].split(". ")[0].rstrip(".")
        return f"[seed {hit['arch']}] {hit['strategy']} {params}: {advice}. ({hit['why']})"
    gain = f"{hit['speedup_eager']:.2f}x vs eager" if hit.get("speedup_eager") else "timed"
    if hit.get("speedup_compile"):
        gain += f", {hit['speedup_compile']:.2f}x vs torch.compile"
    if hit.get("clock") == "cpu-wall":
        gain += " (CPU wall clock)"
    conf = hit.get("confirmations", 1)
    return (
        f"[verified {hit['gpu_model']} {hit['arch']}] {hit['strategy']} {params}: {gain}, "
        f"{conf} confirmation{'s' if conf != 1 else ''}; pattern {hit['signature']} ({hit['why']})"
    )


def _pattern(signature: str) -> tuple[str, str]:
    """The ops and dtypes parts of a signature line (its shape class left out)."""
    parts = dict(p.strip().split("=", 1) for p in (signature or "").split("|") if "=" in p)
    return parts.get("ops", "?").strip(), parts.get("dtypes", "?").strip()


def preferred_strategies(hits: Iterable[Mapping[str, Any]], task: str | None = None) -> list[str]:
    """Strategies the knowledge base shows *won* (verified hits), best hit first, each once.

    With the task's signature line, only wins on the same pattern count: the same ops on the same
    dtypes, at any shape. Which strategy wins turns on both: TF32x3 beats cuBLAS on float32 layers
    and loses to it on float16 ones, and a float16 gated pair that the Triton matmul won says
    nothing of one float16 layer, where cuBLASLt wins (measured: see docs/benchmarks.md).
    """
    want = None if task is None else _pattern(task)
    return list(
        dict.fromkeys(
            h["strategy"]
            for h in hits
            if h.get("source") == "verified" and (want is None or _pattern(h.get("signature", "")) == want)
        )
    )


def order_configs(
    configs: Sequence[Mapping[str, Any]],
    hits: Iterable[Mapping[str, Any]],
    strategy: str,
    task: str | None = None,
) -> list[dict[str, Any]]:
    """A strategy's tuning configurations with the best known first.

    Parameters of verified wins for ``strategy`` on the task's own signature come first, in hit
    order; then the playbook's first configuration (its choice for the task's shape class); then
    the parameters of wins on other tasks (a win on 8192-column rows says little about 128256-column
    ones), of the same dtypes when the task's signature line is given (a float32 matmul's tile
    says nothing of a float16 one's). Wins are added when the space lacks them but names the same
    parameters with scalar values. Then the configurations that a seed recommends (each parameter
    within its list of values), then the rest, in their order.
    """
    dtypes = None if task is None else _pattern(task)[1]
    ordered = [dict(c) for c in configs]
    relevant = [h for h in hits if h.get("strategy") == strategy]
    keys = {frozenset(c) for c in ordered}
    same: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for hit in relevant:
        params = dict(hit.get("params") or {})
        scalar = all(isinstance(v, bool | int | float | str) for v in params.values())
        usable = hit.get("source") == "verified" and params and scalar and frozenset(params) in keys
        exact = bool(hit.get("exact_signature"))
        if not exact and dtypes is not None and _pattern(hit.get("signature", ""))[1] != dtypes:
            continue
        if usable and params not in same + other:
            (same if exact else other).append(params)
    known: list[dict[str, Any]] = []
    for config in [*same, *ordered[:1], *other]:
        if config not in known:
            known.append(config)
    ranges = [h["params"] for h in relevant if h.get("source") == "seed" and h.get("params")]

    def recommended(config: Mapping[str, Any]) -> bool:
        return any(
            all(
                config.get(name) in values
                for name, values in r.items()
                if isinstance(values, list) and name in config
            )
            and any(name in config for name in r)
            for r in ranges
        )

    rest = [c for c in ordered if c not in known]
    rest.sort(key=lambda c: 0 if recommended(c) else 1)  # stable: the playbook's order within each group
    return known + rest


__all__ = [
    "MATCHES",
    "arch_distance",
    "hit_line",
    "hits_for_task",
    "nearest_archs",
    "normalize_arch",
    "order_configs",
    "preferred_strategies",
    "search",
    "task_signature",
]
