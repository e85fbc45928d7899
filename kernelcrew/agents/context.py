"""What every node of a run can reach besides the state: executor, model, usage meter, events.

The context is rebuilt by whoever runs the graph (CLI, orchestrator) and never checkpointed: it
holds connections and callbacks, the state holds the facts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kernelcrew.records import ExecutorRequest
from kernelcrew.tools.executor import Executor

R = TypeVar("R", bound=ExecutorRequest)


@dataclass
class CrewContext:
    """Injected into every node as ``runtime.context``."""

    executor: Executor
    chat: Any | None = None
    """A ``ChatModel`` (kernelcrew.agents.llm), or None for the offline playbook."""
    meter: Any | None = None
    """The run's ``UsageMeter`` (tokens and cost per agent)."""
    out_dir: Path | None = None
    run_id: str = ""
    on_event: Callable[[dict[str, Any]], None] | None = None
    analyze: Callable[..., Any] | None = None
    """Sandboxed FX analysis of the task (the playbook's); injectable for tests."""
    kb: Any | None = None
    """The knowledge base (a ``kernelcrew.knowledge_base.KnowledgeBase``), or None: no hits, no records."""
    samples: int = 1
    """Candidates the coder's model writes per step (``KERNELCREW_LLM_SAMPLES``)."""
    max_tokens: int = 8192
    """Output token budget of the coder's replies (``KERNELCREW_LLM_MAX_TOKENS``)."""

    def emit(self, kind: str, **data: Any) -> None:
        """Tell the user (progress view, SSE stream) what just happened."""
        event = {"kind": kind, "time": time.time(), **data}
        if self.on_event is not None:
            self.on_event(event)

    def request(self, kind: type[R], state: Any, **extra: Any) -> R:
        """A ``kind`` request with the fields every executor request carries from the run's state."""
        opts = state.options
        return kind(
            task_source=state.task_source,
            task_path=state.task_path,
            device=opts.device,
            precision=opts.precision,
            seed=opts.seed,
            **extra,
        )
