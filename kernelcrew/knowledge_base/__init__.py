"""The knowledge base: verified wins per GPU architecture, curated seeds, retrieval for every job.

Modules: ``db`` (Base, engines, sessions, migrations), ``models`` (tables, visibility),
``patterns`` (pattern signatures), ``store`` (add / dedupe / export / import), ``retrieval``
(tiers and BM25), ``bm25``, ``seeds`` (curated advice per architecture), ``handle`` (the
:class:`KnowledgeBase` the crew and the CLI hold), ``cli`` (``kernelcrew kb``). Nothing here
imports the agents, the API or the workers: they import this.

The names below are imported on first use (SQLAlchemy is not loaded by ``kernelcrew --help``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KnowledgeBase": "handle",
    "local_owner": "handle",
    "Reader": "models",
    "hit_line": "retrieval",
    "hits_for_task": "retrieval",
    "order_configs": "retrieval",
    "preferred_strategies": "retrieval",
    "WinIn": "schemas",
    "from_analysis": "patterns",
    "signature": "patterns",
    "ImportRefused": "store",
    "WinRefused": "store",
    "add_win": "store",
}

if TYPE_CHECKING:
    from kernelcrew.knowledge_base.handle import KnowledgeBase, local_owner
    from kernelcrew.knowledge_base.models import Reader
    from kernelcrew.knowledge_base.patterns import from_analysis, signature
    from kernelcrew.knowledge_base.retrieval import (
        hit_line,
        hits_for_task,
        order_configs,
        preferred_strategies,
    )
    from kernelcrew.knowledge_base.schemas import WinIn
    from kernelcrew.knowledge_base.store import ImportRefused, WinRefused, add_win


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = [  # noqa: RUF022  (the order of _EXPORTS)
    "KnowledgeBase",
    "local_owner",
    "Reader",
    "hit_line",
    "hits_for_task",
    "order_configs",
    "preferred_strategies",
    "WinIn",
    "from_analysis",
    "signature",
    "ImportRefused",
    "WinRefused",
    "add_win",
]
