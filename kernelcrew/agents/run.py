"""Drive one optimization run: build its context, start or resume its graph, show its progress.

Used by ``kernelcrew optimize``; runs live in ``<data_dir>/runs/<run id>/`` and their checkpoints
in ``<data_dir>/checkpoints.sqlite`` (thread id = run id), so an interrupted run resumes where it
stopped and a finished one continues with a message and a new budget (it re-enters at ``plan``).
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.graph import compile_graph, sqlite_checkpointer
from kernelcrew.agents.state import CrewState, Options
from kernelcrew.config import Settings, get_settings
from kernelcrew.records import Report
from kernelcrew.task import TaskError, check_source, read_source
from kernelcrew.tools.packaging import unpack


@dataclass
class OptimizeRequest:
    """What ``kernelcrew optimize`` was asked (``device=None`` on resume: keep the run's)."""

    task: Path | None = None
    backend: str = "auto"
    model: str = ""
    max_iters: int = 6
    time_budget_s: float = 900.0
    patience: int = 3
    device: str | None = "cpu"
    precision: str = "strict"
    start: Path | None = None
    out: Path | None = None
    chat: bool = False
    resume: str | None = None
    messages: list[str] = field(default_factory=list)
    local_only: bool = False
    seed: int | None = None
    compile_modes: str = "auto"
    quick: bool = False
    use_kb: bool = True
    """Read the knowledge base's hits and record the run's win (``--no-kb``: neither)."""
    record: Path | None = None
    """Write a transcript of every LLM call to this folder (``--record``; replayed by ``--replay``)."""
    parallel: int = 0
    """Steps evaluated side by side per round: 0 for one per GPU this machine shows (one on a CPU);
    with an injected executor (the service's workers), 0 means one."""


def round_size(executor: Any, device: str, requested: int) -> int:
    """Steps a round evaluates side by side: ``requested`` (0: as many as the executor can run
    at once), never more than that, since the budget counts a round's steps as concurrent."""
    if requested == 1:
        return 1
    capacity = getattr(executor, "capacity", None)
    most = capacity(device) if capacity is not None else None
    wanted = requested or most or 1
    return max(1, min(wanted, most) if most else wanted)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def resolve_chat(backend: str, model: str, local_only: bool, settings: Settings) -> tuple[Any, str, str]:
    """(chat model or None, backend name, note). ``local_only`` keeps sources off external providers."""
    from kernelcrew.agents.llm import resolve_chat_model

    chat = resolve_chat_model(settings, backend=None if backend == "auto" else backend, model=model or None)
    if chat is None:
        return None, "playbook", ""
    name = chat.provider
    if local_only and not _is_local(getattr(chat, "base_url", "")):  # where this provider sends
        return (
            None,
            "playbook",
            f"--local-only: the {name} provider is external; the offline playbook plans instead",
        )
    return chat, name, ""


def _is_local(base_url: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(base_url).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def run_optimize(
    req: OptimizeRequest,
    *,
    console: Console | None = None,
    ask: Callable[[int], str | list[str]] | None = None,
    settings: Settings | None = None,
    executor: Any = None,
    chat: Any = None,
    kb: Any = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    thread_id: str | None = None,
    checkpointer: Any = None,
) -> Report | None:
    """Start or continue a run and return its report (``None`` if it ended without one).

    ``executor``, ``chat`` and ``kb`` are injectable (tests, the service); by default a
    LocalExecutor, the provider the settings name and the configured knowledge base (none when
    ``req.use_kb`` is false). The service passes ``on_event`` (every event, besides the console),
    ``thread_id`` (the job id: started when new, continued when it has a checkpoint) and its own
    ``checkpointer``.
    """
    from kernelcrew.agents.llm import UsageMeter
    from kernelcrew.agents.playbook import analyze
    from kernelcrew.tools.executor import LocalExecutor, slots_for

    s = settings or get_settings()
    out = console or Console(stderr=True)
    run_id = req.resume or thread_id or new_run_id()
    run_dir = s.data_dir / "runs" / run_id
    graph = compile_graph(
        checkpointer or sqlite_checkpointer(s.data_dir / "checkpoints.sqlite"),
        pause_before_plan=ask is not None,
    )
    config = {"configurable": {"thread_id": run_id}, "recursion_limit": 500}
    snapshot = graph.get_state(config)

    if req.resume and not snapshot.values:
        raise TaskError(f"no run with id {req.resume!r} in {s.data_dir / 'checkpoints.sqlite'}")
    if chat is None:
        chat, backend, note = resolve_chat(req.backend, req.model, req.local_only, s)
    else:
        backend, note = getattr(chat, "provider", "injected"), ""
    if note:
        out.print(f"[yellow]{note}[/]")
    record_dir = req.record or (Path(s.llm_record_dir) if s.llm_record_dir else None)
    if chat is not None and record_dir is not None:
        from kernelcrew.agents.llm import RecordingChat

        chat = RecordingChat(chat, record_dir)
    meter = UsageMeter.from_dict(snapshot.values.get("usage") or {}) if snapshot.values else UsageMeter()
    if kb is None and req.use_kb:
        kb = open_kb(s)
    device = snapshot.values["options"].device if snapshot.values else req.device or "cpu"
    if executor is None:
        executor = LocalExecutor(s, slots=slots_for(device, req.parallel or None))
    parallel = round_size(executor, device, req.parallel)
    ctx = CrewContext(
        executor=executor,
        chat=chat,
        meter=meter,
        out_dir=req.out or run_dir,
        run_id=run_id,
        on_event=_fanout(_printer(out), on_event),
        analyze=lambda source, path, seed: analyze(source, path, seed=seed, settings=s),
        kb=kb if req.use_kb else None,
        samples=s.llm_samples,
        max_tokens=s.llm_max_tokens,
    )

    try:
        if not snapshot.values:
            state = _new_state(req, backend, s)
            state.options.parallel = parallel
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "task.py").write_text(state.task_source)
            out.print(f"run [bold]{run_id}[/] on {state.options.device} with the {backend} backend")
            graph.invoke(state, config, context=ctx)
        else:
            values = snapshot.values
            if snapshot.next:
                out.print(f"resuming run [bold]{run_id}[/] at {', '.join(snapshot.next)}")
                resumed: dict[str, Any] = {
                    "llm_failure": "",  # a new process tries the provider again
                    "options": replace(values["options"], parallel=parallel),  # this process's GPUs
                }
                if req.messages:
                    resumed["user_messages"] = [*values["user_messages"], *req.messages]
                graph.update_state(config, resumed)
                graph.invoke(None, config, context=ctx)
            else:
                opts: Options = values["options"]
                extra = req.max_iters if req.max_iters else 3
                # the time spent so far stays spent; the continuation gets the request's time budget
                spent = _spent_s(values)
                new_opts = replace(
                    opts,
                    max_iters=values["steps_used"] + extra,
                    time_budget_s=spent + req.time_budget_s,
                    parallel=parallel,
                )
                out.print(
                    f"continuing finished run [bold]{run_id}[/] for {extra} more steps "
                    f"and {req.time_budget_s:g} s"
                )
                graph.update_state(
                    config,
                    {
                        "user_messages": [*values["user_messages"], *req.messages],
                        "options": new_opts,
                        "stop_reason": "",
                        "llm_failure": "",
                        "status": "running",
                        "started_at": time.time() - spent,
                    },
                    as_node="decide",
                )
                graph.invoke(None, config, context=ctx)
        while ask is not None and graph.get_state(config).next:
            _chat_turn(graph, config, ctx, ask)
    finally:
        ctx.executor.close()
    final = graph.get_state(config).values
    report = final.get("report") or None
    if isinstance(report, dict):  # a checkpoint written before the report was a record
        report = Report.model_validate(report)
    if report is not None:
        where = ctx.out_dir
        out.print(f"[bold]{report.status}[/]: {report.stop_reason}. Report: {where}/report.md")
    return report


def report_so_far(
    thread_id: str, checkpointer: Any, out_dir: Path, stop_reason: str
) -> tuple[Report, str | None] | None:
    """The report of a run stopped between steps (its job was cancelled) and its ``best.py``: the best
    verified candidate of the last checkpoint, timed as its step timed it (no final timing), so a
    cancel keeps what the run verified. None when the run has no baseline yet.
    """
    from kernelcrew.agents.report import build_report, deliverable, write_report
    from kernelcrew.records import FinalTiming

    config = {"configurable": {"thread_id": thread_id}}
    values = compile_graph(checkpointer).get_state(config).values
    if not values or values.get("baseline") is None:
        return None
    state = CrewState(**{**values, "stop_reason": stop_reason})
    best, final = state.best, None
    if best is not None:
        ci = best.speedup_eager_ci or [None, None]
        final = FinalTiming(
            clock=state.baseline.clock,
            eager_ms=state.baseline.eager_ms,
            compile_ms=state.baseline.compile_ms,
            best_ms=best.time_ms,
            speedup_eager=best.speedup_eager,
            speedup_eager_ci=list(ci),
            significant=best.significant,
        )
    ctx = CrewContext(executor=None, chat=None, meter=None, out_dir=out_dir, run_id=thread_id)
    report = build_report(state, final, ctx)
    best_py = None
    if best is not None and report.best is not None:
        best_py, report.best.packaging = deliverable(best.source, best.source_kind)
    write_report(out_dir, report, best_py)
    return report, best_py


def _spent_s(values: dict[str, Any]) -> float:
    """Seconds a finished run has used: its report's total (final timing included) when it has one."""
    report = values.get("report")
    if isinstance(report, dict):
        report = Report.model_validate(report)
    return report.elapsed_s if report is not None else values.get("elapsed_s", 0.0)


def open_kb(settings: Settings) -> Any:
    """The configured knowledge base for this user; a clear TaskError when it cannot be opened."""
    from kernelcrew.knowledge_base import KnowledgeBase
    from kernelcrew.knowledge_base.db import DatabaseError

    try:
        return KnowledgeBase.open(settings)
    except DatabaseError as exc:
        raise TaskError(
            f"the knowledge base cannot be opened ({exc}); run with --no-kb to go without it"
        ) from exc


def _chat_turn(
    graph: Any, config: dict[str, Any], ctx: CrewContext, ask: Callable[[int], str | list[str]]
) -> None:
    """Ask for the messages posted since the last step (one, or a list kept one per message) and
    run the next step with them."""
    values = graph.get_state(config).values
    answer = ask(values["steps_used"] + 1)
    messages = [m.strip() for m in ([answer] if isinstance(answer, str) else answer) if m.strip()]
    if messages:
        graph.update_state(config, {"user_messages": [*values["user_messages"], *messages]})
    graph.invoke(None, config, context=ctx)


def _parse_modes(spec: str, device: str) -> tuple[list[str], list[str]]:
    """``(modes the baseline always times, modes it times when the budget affords them)``: with
    ``auto`` only the first mode is required, the others wait on the budget; named modes are all
    required."""
    from kernelcrew.tools.timing import parse_compile_modes

    try:
        modes = parse_compile_modes(spec, device)
    except ValueError as exc:
        raise TaskError(str(exc)) from exc
    return (modes[:1], modes[1:]) if spec == "auto" else (modes, [])


def _new_state(req: OptimizeRequest, backend: str, s: Settings) -> CrewState:
    if req.task is None:
        raise TaskError("a task file is needed (or --resume RUN_ID)")
    source = read_source(req.task)
    check_source(source, "task", str(req.task))
    start_source = None
    if req.start is not None:
        # a best.py of an earlier run starts as the kernels it verified, without its packaging
        start_source, _ = unpack(read_source(req.start), str(req.start))
        check_source(start_source, "candidate", str(req.start))
    device = req.device or "cpu"
    modes, optional_modes = _parse_modes(req.compile_modes, device)
    opts = Options(
        device=device,
        precision=req.precision,
        backend=backend,
        model=req.model,
        max_iters=req.max_iters,
        time_budget_s=req.time_budget_s,
        patience=req.patience,
        seed=secrets.randbits(31) if req.seed is None else req.seed,
        compile_modes=modes,
        optional_compile_modes=optional_modes,
        quick=req.quick,
    )
    return CrewState(
        task_source=source,
        task_path=str(req.task),
        options=opts,
        start_source=start_source,
        user_messages=list(req.messages),
        started_at=time.time(),
    )


def _fanout(*callbacks: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    def emit(event: dict[str, Any]) -> None:
        for callback in callbacks:
            if callback is not None:
                callback(event)

    return emit


def _printer(console: Console) -> Callable[[dict[str, Any]], None]:
    """The progress view: one line per event."""

    def show(event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "baseline":
            comp = ", ".join(f"{k} {v:.4g} ms" for k, v in (event.get("compile_ms") or {}).items()) or "-"
            console.print(
                f"baseline: eager {event['eager_ms']:.4g} ms; torch.compile {comp} ({event['clock']})"
            )
            for what, why in (event.get("skipped") or {}).items():
                console.print(f"  [dim]{what}: {why}[/]")
        elif kind == "plan":
            console.print(
                f"plan: [cyan]{event['strategy']}[/] {event.get('params') or ''} ({event['source']})"
            )
        elif kind == "verify":
            color = "green" if event["verdict"] == "pass" else "red"
            console.print(
                f"verify {event['candidate']}: [{color}]{event['verdict']}[/] ({event['stage']}) {event['message'][:160]}"
            )
        elif kind == "timing" and event.get("verdict") == "fail":
            console.print(f"timing {event['candidate']}: [red]fail[/] {event.get('message', '')[:200]}")
        elif kind == "timing" and event.get("time_ms") is not None:
            console.print(
                f"timing {event['candidate']}: {event['time_ms']:.4g} ms, {event['speedup_eager']:.3g}x over eager"
                + (" (significant)" if event.get("significant") else "")
                + (" [CPU]" if event.get("clock") == "cpu-wall" else "")
            )
        elif kind == "decide":
            console.print(
                f"step {event['step']}: {event['verdict']}"
                + (" [bold green]new best[/]" if event["new_best"] else "")
            )
        elif kind == "reply":
            console.print(f"[magenta]crew:[/] {event['message']}")
        elif kind == "kb":
            console.print(f"knowledge base: {len(event['hits'])} hit(s) for this task")
            for hit in event["hits"][:3]:
                console.print(f"  [dim]{hit['line'][:160]}[/]")
        elif kind == "kb_record":
            console.print(f"knowledge base: win {event['action']} ({event['id']})")
        elif kind == "answer":
            console.print(f"answer: [bold]{event['answer']}[/]: {event['why']}")
        elif kind in ("error", "invalid_plan"):
            console.print(f"[yellow]{kind}:[/] {event.get('message')}")
        elif kind == "node":
            console.print(f"{event['node']}: {event['message']}")
        elif kind == "round":
            console.print(f"round: {event['steps']} steps side by side ({', '.join(event['strategies'])})")

    return show
