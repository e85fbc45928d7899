"""The search engine: an archive of verified candidates, their fitness, which parent and operator
the next step uses, and when a run stops. Pure logic: nothing here runs a kernel.

* **Archive**: every verified candidate with its evidence (kind, time, speedup over eager and its
  95% interval, fraction of speed of light), the candidate it came from (``parent``) and the
  operator that made it. Stored in the crew's state as a list of dicts, so it is checkpointed
  with the run.
* **Fitness** is the judge's verdict: on a GPU, the lower bound of the speedup's 95% interval when
  the speedup is significant (a candidate that is not has none); on a CPU, interpreter timings
  never drive a decision, so only the kind ranks (own kernel first), as decide keeps the best.
* **Niches** (strategy family x kind) keep the search diverse: a row-reduction kernel and a
  torch.compile candidate are not rivals for the same slot.
* **Selection**: a seeded coin (``options.seed`` and the step number, so a run and its resume make
  the same choices) decides between *exploit* (vary the fittest) and *explore* (a strategy family
  never tried, else the best of the least-tried niche other than the fittest's), ``EXPLORE_RATE``
  of the time.
* **Operators** are data: ``new_strategy`` (the next untried menu entry of a family not tried
  yet, else the menu's next entry), ``tune`` (the untried tuning configuration nearest the
  parent's, by log-distance of the parameters), ``recombine`` (two verified anchored-fusion
  candidates' per-part parameters crossed: see :data:`RECOMBINABLE`), ``llm_edit`` (the LLM planner
  and coder starting from the selected parent's source) and ``fallback`` (the compiler's
  candidate decide verifies when the baseline measured it faster).
* **Termination** (:func:`stop_reason`): the iteration or time budget, the best at
  ``SOL_TARGET`` of speed of light, ``patience`` steps without a gain beyond noise (on a GPU), and
  (in the planner) nothing left to try.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

KIND_RANK = {"kernel": 0, "hybrid": 1, "library": 2, "compiler": 3}
"""Which kind of candidate a CPU run prefers (lower first): timings cannot say, ownership can."""

EXPLORE_RATE = 0.25
"""The share of steps that explore instead of exploiting the fittest. Most steps refine what works
(tuning usually moves a kernel's time by tens of percent); one in four keeps other families alive
so that a run does not spend its whole budget on configurations of its first win."""

SOL_TARGET = 0.9
"""A GPU run stops once its best runs at this fraction of the task's speed-of-light floor: the floor
is a lower bound no kernel reaches, so the gain left is under 1/0.9 - 1 = 11%, about the spread of
a step's timing plus what another configuration usually finds."""

OPERATORS = ("new_strategy", "tune", "recombine", "llm_edit", "fallback")

RECOMBINABLE: dict[str, tuple[str, ...]] = {"anchored_fusion": ("pointwise", "rows")}
"""Strategies whose parameters are independent parts, one per generator (the pointwise kernels'
block sizes, the row kernels' tiles): any part of one verified configuration with any other part
of another is a valid configuration, so two winners can be crossed. A child is judged like any
other candidate; the crossing only proposes it. Parameters are per generator, not per region, so
the parts crossed are the generators' (all regions of a generator share one configuration)."""


class MenuStep(Protocol):
    """What the engine reads of a planned step: its strategy and parameters."""

    strategy: str
    params: dict[str, Any]


StepKey = Callable[[str, dict[str, Any]], str]
"""How the planner names a tried step (``planner.step_key``)."""


def family(strategy: str) -> str:
    """A strategy's family: its name, or ``custom`` for every step an LLM named itself."""
    return strategy.split(":", 1)[0]


@dataclass
class Entry:
    """One verified candidate in the archive, with its evidence and lineage."""

    id: str
    step: int
    strategy: str
    params: dict[str, Any] = field(default_factory=dict)
    kind: str | None = None
    source_kind: str = "kernel"
    time_ms: float | None = None
    speedup_eager: float | None = None
    speedup_eager_ci: list[float | None] | None = None
    significant: bool = False
    sol_fraction: float | None = None
    parent: str | None = None
    operator: str = "new_strategy"
    source: str = ""
    """The candidate's source, so that a later step can branch from it (never in the report)."""

    @classmethod
    def from_candidate(cls, cand: Any, step: int, parent: str | None, operator: str) -> Entry:
        """The archive entry of a verified candidate (:class:`kernelcrew.agents.state.Candidate`)."""
        return cls(
            id=cand.id,
            step=step,
            strategy=cand.strategy,
            params=dict(cand.params),
            kind=cand.kind,
            source_kind=cand.source_kind,
            time_ms=cand.time_ms,
            speedup_eager=cand.speedup_eager,
            speedup_eager_ci=list(cand.speedup_eager_ci) if cand.speedup_eager_ci else None,
            significant=bool(cand.significant),
            sol_fraction=cand.sol_fraction,
            parent=parent,
            operator=operator,
            source=cand.source,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Entry:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_dict(self, source: bool = True) -> dict[str, Any]:
        """A JSON-safe dict (the state's form); ``source=False`` for the report."""
        out = asdict(self)
        if not source:
            out.pop("source")
        return out

    def niche(self) -> tuple[str, str]:
        return family(self.strategy), self.kind or "unknown"


def fitness(entry: Entry, device: str) -> float | None:
    """The judge's verdict as a number, higher better; None when the judge found no gain (GPU)."""
    if device == "cpu":
        return -float(KIND_RANK.get(entry.kind or "", len(KIND_RANK)))
    ci = entry.speedup_eager_ci or []
    if not entry.significant or not ci or ci[0] is None:
        return None
    return float(ci[0])


class Archive:
    """The verified candidates of a run, in the order they were verified."""

    def __init__(self, entries: list[Entry], device: str) -> None:
        self.entries = list(entries)
        self.device = device

    @classmethod
    def from_dicts(cls, records: list[dict[str, Any]], device: str) -> Archive:
        return cls([Entry.from_dict(r) for r in records], device)

    def to_dicts(self, source: bool = True) -> list[dict[str, Any]]:
        return [e.to_dict(source) for e in self.entries]

    def get(self, entry_id: str | None) -> Entry | None:
        return next((e for e in self.entries if e.id == entry_id), None)

    def rank(self, entry: Entry) -> tuple[int, float, int]:
        """Sort key, higher better: fit before unfit, then fitness (the median speedup among the
        unfit), then the earlier candidate (as decide keeps the first of equals)."""
        fit = fitness(entry, self.device)
        if fit is not None:
            return 1, fit, -entry.step
        return 0, entry.speedup_eager or 0.0, -entry.step

    def fittest(self, among: list[Entry] | None = None) -> Entry | None:
        pool = self.entries if among is None else among
        return max(pool, key=self.rank, default=None)

    def niches(self) -> dict[tuple[str, str], list[Entry]]:
        out: dict[tuple[str, str], list[Entry]] = {}
        for entry in self.entries:
            out.setdefault(entry.niche(), []).append(entry)
        return out

    def lineage(self, entry_id: str | None) -> list[Entry]:
        """The chain of ancestors of ``entry_id``, the root first (empty when it is not here)."""
        chain: list[Entry] = []
        seen: set[str] = set()
        entry = self.get(entry_id)
        while entry is not None and entry.id not in seen:
            chain.append(entry)
            seen.add(entry.id)
            entry = self.get(entry.parent)
        return chain[::-1]


@dataclass(frozen=True)
class Proposal:
    """The engine's choice for the next step: ``index`` into the menu it was given, or ``params``
    of a step that is not on it (a recombination), the operator and the parent it varies."""

    operator: str
    strategy: str
    params: dict[str, Any]
    parent: str | None
    why: str
    index: int | None = None


def coin(seed: int, step: int) -> random.Random:
    """The random source of one step: the same run seed and step make the same choices, however
    the run was interrupted and resumed."""
    return random.Random(f"kernelcrew-search:{seed}:{step}")


def explores(seed: int, step: int, rate: float = EXPLORE_RATE) -> bool:
    return coin(seed, step).random() < rate


def _flat(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """How far two configurations are: per parameter, |log2| of the ratio of two positive numbers
    (a block of 2048 is as near 1024 as 4096), 1 for any other difference or a missing one."""
    fa, fb = _flat(a), _flat(b)
    total = 0.0
    for key in fa.keys() | fb.keys():
        x, y = fa.get(key), fb.get(key)
        if x == y:
            continue
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (x, y))
        total += abs(math.log2(x / y)) if numeric else 1.0  # type: ignore[operator]
    return total


def neighbours(parent: Entry, menu: list[MenuStep]) -> list[int]:
    """Menu indices of the parent's strategy, the configuration nearest the parent's first."""
    same = [i for i, s in enumerate(menu) if s.strategy == parent.strategy]
    return sorted(same, key=lambda i: (distance(menu[i].params, parent.params), i))


def crossings(
    archive: Archive, parent: Entry, tried: set[str], key: StepKey
) -> list[tuple[dict[str, Any], Entry]]:
    """Children of ``parent`` crossed with the fittest other verified candidate of its strategy
    whose every part differs (a crossing of parents that share a part gives a parent back):
    one child per part taken from the other, those already tried left out. ``key`` names a step
    as the planner remembers it (``step_key``)."""
    parts = RECOMBINABLE.get(parent.strategy)
    if not parts:
        return []
    others = [
        e
        for e in archive.entries
        if e.strategy == parent.strategy
        and e.id != parent.id
        and all(e.params.get(p) != parent.params.get(p) for p in parts)
    ]
    other = archive.fittest(others)
    if other is None:
        return []
    children = []
    for part in parts:
        child = {**parent.params, part: other.params.get(part)}
        if key(parent.strategy, child) not in tried and child != other.params:
            children.append((child, other))
    return children


def propose(
    archive: Archive,
    menu: list[MenuStep],
    *,
    seed: int,
    step: int,
    attempted: set[str],
    tried: set[str],
    key: StepKey,
    recombinable: set[str] | None = None,
    prefer_new: bool = False,
    explore_rate: float = EXPLORE_RATE,
) -> Proposal | None:
    """The next playbook step: which menu entry (or recombined configuration), by which operator,
    from which parent.

    ``menu`` holds the steps allowed now (untried, allowed by the user, inside the budget) in the
    playbook's order; ``attempted`` the strategies any step tried; ``tried`` the tried steps' keys
    (``key(strategy, params)``); ``recombinable`` the strategies the user still allows (a
    crossing is not on the menu); ``prefer_new``: a strategy not tried yet comes before any
    variation (the best clearly loses to torch.compile). Before anything verified, and with
    ``prefer_new``, the menu's order holds: the first step is always the menu's first.
    """
    if not menu:
        return None
    fittest = archive.fittest()
    untried = [i for i, s in enumerate(menu) if s.strategy not in attempted]
    if fittest is None or (prefer_new and untried):
        return menu_step(menu, untried[0] if prefer_new and untried else 0, archive, attempted)
    if explores(seed, step, explore_rate):
        chosen = _explore(archive, menu, fittest, untried)
        if chosen is not None:
            return chosen
    children = crossings(archive, fittest, tried, key) if fittest.strategy in (recombinable or set()) else []
    if children:
        params, other = children[0]
        return Proposal(
            "recombine",
            fittest.strategy,
            params,
            fittest.id,
            f"exploit: {fittest.id}'s parameters crossed with {other.id}'s, part by part",
        )
    near = neighbours(fittest, menu)
    if near:
        return _tune(menu, near[0], fittest, "exploit")
    if untried:
        return menu_step(menu, untried[0], archive, attempted)
    return menu_step(menu, 0, archive, attempted)


def _explore(archive: Archive, menu: list[MenuStep], fittest: Entry, untried: list[int]) -> Proposal | None:
    """A family never tried (the menu's first), else the best of the least-tried niche that is not
    the fittest's, tuned; None when neither has a step left."""
    if untried:
        i = untried[0]
        return Proposal(
            "new_strategy",
            menu[i].strategy,
            dict(menu[i].params),
            None,
            f"explore: {menu[i].strategy} was not tried yet",
            i,
        )

    def order(item: tuple[tuple[str, str], list[Entry]]) -> tuple[int, int, float]:
        best = archive.rank(archive.fittest(item[1]))  # type: ignore[arg-type]
        return len(item[1]), -best[0], -best[1]

    niches = sorted(archive.niches().items(), key=order)  # stable: first verified first among equals
    for niche, members in niches:
        if niche == fittest.niche():
            continue
        parent = archive.fittest(members)
        assert parent is not None
        near = neighbours(parent, menu)
        if near:
            return _tune(menu, near[0], parent, f"explore ({niche[0]} x {niche[1]}, {len(members)} tried)")
    return None


def _tune(menu: list[MenuStep], i: int, parent: Entry, mode: str) -> Proposal:
    return Proposal(
        "tune",
        menu[i].strategy,
        dict(menu[i].params),
        parent.id,
        f"{mode}: the configuration nearest {parent.id}'s",
        i,
    )


def menu_step(menu: list[MenuStep], i: int, archive: Archive, attempted: set[str]) -> Proposal:
    """The menu's entry ``i``: a new strategy, or another configuration of one tried before (its
    fittest verified candidate the parent, when it has one)."""
    s = menu[i]
    if s.strategy not in attempted:
        return Proposal("new_strategy", s.strategy, dict(s.params), None, "the menu's next strategy", i)
    parent = archive.fittest([e for e in archive.entries if e.strategy == s.strategy])
    return Proposal(
        "tune" if parent else "new_strategy",
        s.strategy,
        dict(s.params),
        parent.id if parent else None,
        "the menu's next configuration",
        i,
    )


def select_parent(
    archive: Archive, *, seed: int, step: int, explore_rate: float = EXPLORE_RATE
) -> Entry | None:
    """The parent an LLM edit starts from: the fittest, or (exploring) the best of the least-tried
    niche other than the fittest's; None before anything verified."""
    fittest = archive.fittest()
    if fittest is None or not explores(seed, step, explore_rate):
        return fittest
    others = [(len(m), niche, m) for niche, m in archive.niches().items() if niche != fittest.niche()]
    if not others:
        return fittest
    fewest = min(n for n, _, _ in others)
    return archive.fittest([e for n, _, m in others if n == fewest for e in m])


def stop_reason(
    *,
    device: str,
    steps: int,
    max_iters: int,
    elapsed_s: float,
    time_budget_s: float,
    since_gain: int,
    patience: int,
    best_sol_fraction: float | None,
    has_best: bool,
) -> str:
    """Why the run stops after this step ("" to go on): the iteration budget, the time budget, the
    best at ``SOL_TARGET`` of speed of light (GPU), or ``patience`` steps without a gain (GPU: CPU
    timings never drive a decision). The planner adds the last rule: nothing left to try."""
    if steps >= max_iters:
        return f"iteration budget reached ({max_iters})"
    if elapsed_s >= time_budget_s:
        return f"time budget reached ({time_budget_s:g} s)"
    if device != "cpu" and best_sol_fraction is not None and best_sol_fraction >= SOL_TARGET:
        return f"the best runs at {best_sol_fraction:.0%} of speed of light (target {SOL_TARGET:.0%})"
    if since_gain >= patience and device != "cpu" and has_best:
        return f"{since_gain} steps without a gain beyond noise"
    return ""


def summary(archive: Archive, iterations: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's account of the search: archive size, and per operator the steps that used it
    and how many of them verified."""
    operators: dict[str, dict[str, int]] = {}
    for record in iterations:
        op = record.get("operator")
        if not op:
            continue
        counts = operators.setdefault(op, {"steps": 0, "verified": 0})
        counts["steps"] += 1
        counts["verified"] += record.get("verdict") == "pass"
    return {
        "archive_size": len(archive.entries),
        "niches": sorted(f"{f} x {k}" for f, k in archive.niches()),
        "operators": operators,
        "explore_rate": EXPLORE_RATE,
        "sol_target": SOL_TARGET,
    }


def lineage(archive: Archive, best_id: str | None) -> list[dict[str, Any]]:
    """The answer's ancestors, the root first: step, id, strategy, params, operator, speedup."""
    return [
        {
            "step": e.step,
            "id": e.id,
            "strategy": e.strategy,
            "params": e.params,
            "operator": e.operator,
            "parent": e.parent,
            "speedup_eager": e.speedup_eager,
            "kind": e.kind,
        }
        for e in archive.lineage(best_id)
    ]
