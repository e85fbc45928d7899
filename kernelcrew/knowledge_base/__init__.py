"""The knowledge base: verified wins per GPU architecture, curated seeds, retrieval for every job.

Modules: ``db`` (Base, engines, sessions, migrations), ``models`` (tables, visibility),
``signature`` (pattern signatures), ``store`` (add / dedupe / export / import), ``retrieval``
(tiers and BM25), ``bm25``, ``seeds`` (curated advice per architecture), ``handle`` (the
:class:`KnowledgeBase` the crew and the CLI hold), ``cli`` (``kernelcrew kb``). Nothing here
imports the agents, the API or the workers: they import this.
"""

from kernelcrew.knowledge_base.handle import KnowledgeBase, local_owner
from kernelcrew.knowledge_base.models import Reader
from kernelcrew.knowledge_base.retrieval import hit_line, hits_for_task, order_configs, preferred_strategies
from kernelcrew.knowledge_base.schemas import WinIn
from kernelcrew.knowledge_base.signature import from_analysis, signature
from kernelcrew.knowledge_base.store import ImportRefused, WinRefused, add_win

__all__ = [
    "ImportRefused",
    "KnowledgeBase",
    "Reader",
    "WinIn",
    "WinRefused",
    "add_win",
    "from_analysis",
    "hit_line",
    "hits_for_task",
    "local_owner",
    "order_configs",
    "preferred_strategies",
    "signature",
]
