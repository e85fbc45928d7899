"""The ``kernelcrew`` command line."""

from __future__ import annotations

import contextlib
import json
import shlex
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kernelcrew.api.cli import serve, submit, token_app
from kernelcrew.knowledge_base.cli import Visibility as KbVisibility
from kernelcrew.knowledge_base.cli import app as kb_app
from kernelcrew.records import Baseline, BenchmarkRequest, BenchmarkResult, ProfileRequest, VerifyRequest
from kernelcrew.task import TaskError, read_source
from kernelcrew.worker.cli import orchestrator, worker

app = typer.Typer(
    help="kernelcrew: verified, faster GPU kernels for PyTorch modules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(kb_app, name="kb")
app.add_typer(token_app, name="token")
console = Console(stderr=True)


#: Commands that run task files or candidates (user code) on this machine.
RUNS_USER_CODE = frozenset({"verify", "optimize", "profile", "bench"})


@app.callback()
def _root(
    ctx: typer.Context,
    unsafe_no_sandbox: Annotated[
        bool,
        typer.Option(
            "--unsafe-no-sandbox",
            help="Run task files and candidates without isolation (no bubblewrap): only your own code.",
        ),
    ] = False,
) -> None:
    """kernelcrew: verified, faster GPU kernels for PyTorch modules."""
    if ctx.invoked_subcommand in RUNS_USER_CODE:
        require_sandbox(unsafe_no_sandbox)
        stop_on_sigterm()


def stop_on_sigterm() -> None:
    """A SIGTERM (``kill``, a job scheduler's stop) ends a command as Ctrl-C does: the run is
    checkpointed and its temporary files (a large task's golden is tens of GB) are removed, where
    Python's default would exit at once and leave them behind."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def require_sandbox(unsafe: bool) -> None:
    """Refuse to run user code unisolated unless asked to, loudly (exit code 2)."""
    import os

    from kernelcrew.config import get_settings
    from kernelcrew.tools import sandbox

    if unsafe:
        os.environ["KERNELCREW_SANDBOX"] = "unsafe-none"
        get_settings.cache_clear()
        console.print(
            "[bold white on red] WARNING [/] [bold red]--unsafe-no-sandbox: task files and candidates run "
            "WITHOUT isolation, with this user's access to its files, network, sockets and secrets. "
            "Run only code you wrote or have read.[/]"
        )
        return
    state = sandbox.readiness(get_settings())
    if not state["ready"]:
        console.print(
            f"[bold red]error:[/] {sandbox.SandboxUnavailable(state['reason'])}. kernelcrew refuses to "
            "run task files and candidates unisolated; pass --unsafe-no-sandbox before the command "
            "(kernelcrew --unsafe-no-sandbox verify ...) to run your own code anyway."
        )
        raise typer.Exit(2)


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(StrEnum):
    strict = "strict"
    relaxed = "relaxed"


def resolve_device(device: Device) -> str:
    """``auto`` is cuda when a GPU is visible, else cpu; asking for cuda without one is an error."""
    import torch

    if device == Device.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == Device.cuda and not torch.cuda.is_available():
        raise TaskError("--device cuda was asked for, but no CUDA GPU is visible here")
    return device.value


@app.command()
def verify(
    task: Annotated[
        Path, typer.Argument(help="Task file (KernelBench format: Model, get_inputs, get_init_inputs).")
    ],
    candidate: Annotated[Path, typer.Argument(help="Candidate file defining ModelNew.")],
    device: Annotated[Device, typer.Option(help="Where to run: cuda, cpu, or auto.")] = Device.auto,
    precision: Annotated[
        Precision, typer.Option(help="strict: fp32 stays fp32, TF32 off; relaxed: TF32 allowed.")
    ] = Precision.strict,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    seed: Annotated[int | None, typer.Option(help="Replay a run with its logged seed.")] = None,
    compile_modes: Annotated[
        str, typer.Option(help="torch.compile baselines: auto, none, or a comma list of modes.")
    ] = "auto",
    quick: Annotated[bool, typer.Option(help="Few timing repetitions (fast, noisy).")] = False,
    no_timing: Annotated[bool, typer.Option("--no-timing", help="Verify only; skip the timing.")] = False,
    memcheck: Annotated[bool, typer.Option(help="Also run compute-sanitizer memcheck (GPU).")] = False,
) -> None:
    """Verify a candidate against its task and time it. Exit code 0 pass, 1 fail, 2 bad input."""
    try:
        report = run_verify(
            task,
            candidate,
            device=device,
            precision=precision.value,
            seed=seed,
            compile_modes=compile_modes,
            quick=quick,
            timing=not no_timing,
            memcheck=memcheck,
        )
    except TaskError as exc:
        if as_json:
            print(json.dumps({"verdict": "error", "stage": "input", "message": str(exc)}))
        else:
            console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    raise typer.Exit(0 if report["verdict"] == "pass" else 1)


def run_verify(
    task: Path,
    candidate: Path,
    *,
    device: Device,
    precision: str,
    seed: int | None,
    compile_modes: str,
    quick: bool,
    timing: bool,
    memcheck: bool = False,
) -> dict[str, Any]:
    """The whole protocol and timing for one candidate, as the JSON report of ``verify --json``."""
    from kernelcrew.config import get_settings
    from kernelcrew.tools import hardware
    from kernelcrew.tools import timing as timing_mod
    from kernelcrew.tools.correctness import make_golden
    from kernelcrew.tools.correctness import verify as verify_candidate
    from kernelcrew.tools.harness import Laps

    task_source = read_source(task)
    candidate_source = read_source(candidate)
    dev = resolve_device(device)
    try:
        modes = timing_mod.parse_compile_modes(compile_modes, dev)
    except ValueError as exc:
        raise TaskError(str(exc)) from exc
    settings = get_settings().model_copy(
        update={"compute_sanitizer": memcheck or get_settings().compute_sanitizer}
    )
    lap = Laps()
    with contextlib.ExitStack() as stack:
        golden = stack.enter_context(
            make_golden(
                task_source,
                device=dev,
                precision=precision,
                seed=seed,
                task_path=str(task),
                settings=settings,
            )
        )
        timing_args: dict[str, Any] = {
            "compile_modes": modes,
            "quick": quick,
            "golden": golden,
            "task_path": str(task),
            "settings": settings,
        }
        candidates = {"candidate": (candidate_source, str(candidate))}
        lap("golden")
        # On a GPU the timing's processes load and build while the candidate is verified, unless the
        # inputs are so large that more processes holding them at once could run out of memory. On
        # the CPU they would only take cores from the verification.
        pending = None
        if timing and dev != "cpu" and golden.input_bytes <= timing_mod.OVERLAP_INPUT_BYTES:
            pending = stack.enter_context(timing_mod.start_benchmark(task_source, candidates, **timing_args))
        verdict = verify_candidate(
            task_source,
            candidate_source,
            candidate_path=str(candidate),
            task_path=str(task),
            golden=golden,
            settings=settings,
            profile_kind=not timing,  # the timing profiles the candidate it times
        )
        lap("verify")
        report: dict[str, Any] = verdict.model_dump(mode="json")
        report.update(baseline_ms=None, compile_ms=None, candidate_ms=None, speedup=None, timing=None)
        if verdict.passed and timing:
            if pending is not None:
                bench = pending.result()
            else:
                bench = timing_mod.benchmark(task_source, candidates, **timing_args)
            _merge_timing(report, bench)
            lap("timing")
    # this command's phases, then the verification's own (the candidate child's, the judging)
    report["phase_s"] = {**lap.seconds, **verdict.verify_phases()}
    info = hardware.detect(dev)
    report["gpu"] = info.to_dict() if info.device == "cuda" else None
    report["hardware"] = info.to_dict()
    report["versions"] = hardware.versions()
    cmd = [
        "kernelcrew",
        "verify",
        str(task),
        str(candidate),
        "--device",
        dev,
        "--precision",
        precision,
        "--seed",
        str(report["seed"]),
    ]
    report["reproduce"] = shlex.join(cmd)
    return report


@app.command()
def optimize(
    task: Annotated[
        Path | None, typer.Argument(help="Task file (KernelBench format); not needed with --resume.")
    ] = None,
    backend: Annotated[str, typer.Option(help="auto, playbook, openai, anthropic or replay.")] = "auto",
    model: Annotated[str, typer.Option(help="The LLM's model name (KERNELCREW_MODEL).")] = "",
    max_iters: Annotated[int, typer.Option(min=1, max=200, help="Plan-code-verify steps at most.")] = 6,
    time_budget: Annotated[float, typer.Option(min=1, help="Seconds for the whole run.")] = 900.0,
    patience: Annotated[
        int, typer.Option(min=1, help="Stop after this many steps without a gain beyond noise (GPU).")
    ] = 3,
    device: Annotated[Device, typer.Option(help="Where to run: cuda, cpu, or auto.")] = Device.auto,
    precision: Annotated[
        Precision, typer.Option(help="strict (fp32 stays fp32) or relaxed (TF32 allowed).")
    ] = Precision.strict,
    start: Annotated[
        Path | None, typer.Option(help="A ModelNew file to start from (verified first).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Where best.py and the reports go (default: the run's folder).")
    ] = None,
    chat: Annotated[bool, typer.Option(help="Type guidance for the crew between steps.")] = False,
    resume: Annotated[
        str | None, typer.Option(help="Continue the run with this id from its checkpoint.")
    ] = None,
    message: Annotated[
        list[str] | None, typer.Option(help="Guidance for a resumed run (repeatable).")
    ] = None,
    local_only: Annotated[
        bool, typer.Option(help="Never send the source to an external LLM provider.")
    ] = False,
    seed: Annotated[int | None, typer.Option(help="Replay a run's inputs with its logged seed.")] = None,
    compile_modes: Annotated[
        str, typer.Option(help="torch.compile baselines: auto, none, or a comma list.")
    ] = "auto",
    quick: Annotated[bool, typer.Option(help="Few timing repetitions (fast, noisy).")] = False,
    no_kb: Annotated[
        bool, typer.Option("--no-kb", help="Neither read nor write the knowledge base.")
    ] = False,
    record: Annotated[
        Path | None, typer.Option(help="Write a transcript of every LLM call to this folder.")
    ] = None,
    replay: Annotated[
        Path | None, typer.Option(help="Play the LLM calls a --record folder holds (the replay backend).")
    ] = None,
    parallel: Annotated[
        int,
        typer.Option(
            min=0,
            max=64,
            help="Steps evaluated side by side, one per GPU (0: every GPU visible; 1 on a CPU).",
        ),
    ] = 0,
) -> None:
    """Run the crew on a task and write best.py, report.md and report.json."""
    from kernelcrew.agents.llm import BACKENDS, LLMError
    from kernelcrew.agents.run import OptimizeRequest, run_optimize
    from kernelcrew.config import get_settings

    try:
        if backend not in ("auto", *BACKENDS):
            raise TaskError(f"unknown backend {backend!r}: choose auto or one of {', '.join(BACKENDS)}")
        request = OptimizeRequest(
            task=task,
            backend=backend,
            model=model,
            max_iters=max_iters,
            time_budget_s=time_budget,
            patience=patience,
            device=resolve_device(device) if resume is None or device != Device.auto else None,
            precision=precision.value,
            start=start,
            out=out,
            chat=chat,
            resume=resume,
            messages=list(message or []),
            local_only=local_only,
            seed=seed,
            compile_modes=compile_modes,
            quick=quick,
            use_kb=not no_kb,
            record=record,
            parallel=parallel,
        )
        settings = None
        if replay is not None:
            request.backend = "replay"
            settings = get_settings().model_copy(update={"replay_file": str(replay)})
        report = run_optimize(
            request, console=console, ask=_ask_guidance if chat else None, settings=settings
        )
    except (TaskError, LLMError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the run is checkpointed; continue it with --resume RUN_ID")
        raise typer.Exit(130) from None
    if report is None:
        raise typer.Exit(1)
    raise typer.Exit(0)


@app.command()
def profile(
    task: Annotated[Path, typer.Argument(help="Task file (KernelBench format).")],
    candidate: Annotated[
        Path | None, typer.Option(help="A ModelNew file to profile next to the reference.")
    ] = None,
    device: Annotated[Device, typer.Option(help="Where to run: cuda, cpu, or auto.")] = Device.auto,
    precision: Annotated[Precision, typer.Option(help="strict or relaxed.")] = Precision.strict,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ncu: Annotated[bool, typer.Option(help="Run Nsight Compute (GPU with ncu).")] = True,
    calibrate: Annotated[
        bool, typer.Option(help="Measure this GPU's bandwidth and matmul rates first (stored).")
    ] = False,
    gpu: Annotated[
        str, typer.Option(help="Compute the floor for this GPU model (e.g. h100-sxm) instead of this one.")
    ] = "",
    seed: Annotated[int | None, typer.Option(help="Inputs' seed.")] = None,
    compile_modes: Annotated[
        str, typer.Option(help="torch.compile baselines: auto, none, or a comma list.")
    ] = "auto",
    quick: Annotated[bool, typer.Option(help="Few timing repetitions (fast, noisy).")] = False,
) -> None:
    """Profile a task (and a candidate): hotspots, Nsight Compute, floor, speed of light, diagnosis."""
    try:
        report = run_profile(
            task,
            candidate,
            device=device,
            precision=precision.value,
            use_ncu=ncu,
            calibrate=calibrate,
            gpu=gpu,
            seed=seed,
            compile_modes=compile_modes,
            quick=quick,
        )
    except (TaskError, ValueError, RuntimeError) as exc:
        if as_json:
            print(json.dumps({"error": str(exc)}))
        else:
            console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_profile(report)
    raise typer.Exit(1 if report.get("candidate_verdict", {}).get("verdict") == "fail" else 0)


def run_profile(
    task: Path,
    candidate: Path | None,
    *,
    device: Device,
    precision: str,
    use_ncu: bool = True,
    calibrate: bool = False,
    gpu: str = "",
    seed: int | None = None,
    compile_modes: str = "auto",
    quick: bool = False,
) -> dict[str, Any]:
    """What ``kernelcrew profile`` prints: the same analysis the profiler agent gives the planner."""
    import secrets

    from kernelcrew.agents.diagnosis import assess
    from kernelcrew.tools import hardware, roofline
    from kernelcrew.tools.executor import LocalExecutor
    from kernelcrew.tools.timing import parse_compile_modes

    task_source = read_source(task)
    cand_source = read_source(candidate) if candidate else None
    dev = resolve_device(device)
    hw = hardware.detect(dev).to_dict()
    notes: list[str] = []
    target = roofline.peaks_for({"device": "cuda", "model": gpu}) if gpu else None
    if target is not None and target.basis == "unknown":
        raise TaskError(f"unknown GPU model {gpu!r} (known: {', '.join(roofline.DATASHEET)})")
    if calibrate:
        if dev != "cuda":
            raise TaskError("--calibrate measures a GPU; this run is on the CPU")
        roofline.calibrate(hw)
    executor = LocalExecutor()
    common: dict[str, Any] = {
        "task_source": task_source,
        "task_path": str(task),
        "device": dev,
        "precision": precision,
        "seed": secrets.randbits(31) if seed is None else seed,
    }
    report: dict[str, Any] = {
        "task": str(task),
        "device": dev,
        "hardware": hw,
        "versions": hardware.versions(),
    }
    try:
        ref = executor.profile(ProfileRequest(**common, ncu=use_ncu and dev == "cuda"))
        verdict = None
        if cand_source is not None:
            verdict = executor.verify(
                VerifyRequest(**common, candidate_source=cand_source, candidate_path=str(candidate))
            )
            report["candidate_verdict"] = verdict.model_dump(include={"verdict", "stage", "message", "kind"})
        passed = cand_source is not None and verdict is not None and verdict.passed
        bench = executor.benchmark(
            BenchmarkRequest(
                **common,
                candidates={"candidate": cand_source} if passed and cand_source is not None else {},
                compile_modes=parse_compile_modes(compile_modes, dev),
                quick=quick,
            )
        )
        cand = (
            executor.profile(
                ProfileRequest(
                    **common,
                    candidate_source=cand_source,
                    candidate_path=str(candidate),
                    ncu=use_ncu and dev == "cuda",
                )
            )
            if passed
            else None
        )
    finally:
        executor.close()
    timing = {
        "clock": bench.clock,
        "eager_ms": bench.median_ms("eager"),
        "compile_ms": bench.compile_medians(),
        "candidate_ms": bench.median_ms("candidate"),
    }
    peaks = roofline.Peaks(**ref.peaks)
    floor = ref.floor or {}
    if target is not None:
        peaks, floor = target, roofline.floor(ref.work or {}, target)
        notes.append(f"floor computed for {gpu} ({target.basis}), not for the device measured here")
    if dev == "cpu":
        notes.append("no GPU here: CPU profile (aten ops by self CPU time) and the analytic floor only")
    baseline = Baseline(
        hotspots=ref.hotspots,
        hotspot_clock=ref.clock,
        hotspot_total_us=ref.total_us,
        work=ref.work,
        peaks=ref.peaks,
        hardware=ref.hardware,
        floor=floor,
        ncu=ref.ncu or {},
        eager_ms=timing["eager_ms"],
        clock=timing["clock"],
    )
    if not (ref.ncu or {}).get("available") and dev == "cuda":
        notes.append(f"Nsight Compute: {(ref.ncu or {}).get('reason', 'not asked for')}")
    timed = dev == "cuda"
    floor_ms = floor.get("floor_ms") if timed else None  # CPU wall time is never set against a GPU floor
    report.update(
        peaks=peaks.to_dict(),
        work=ref.work,
        floor=floor,
        timing=timing,
        sol_fraction={
            **roofline.sol_fractions(floor_ms, timing["eager_ms"], timing["compile_ms"]),
            "candidate": roofline.sol_fraction(floor_ms, timing["candidate_ms"]),
        },
        hotspots=[h.model_dump(mode="json") for h in ref.hotspots],
        hotspot_clock=ref.clock,
        ncu={"reference": ref.ncu, "candidate": cand.ncu if cand else None},
        diagnosis={
            "reference": assess(baseline),
            "candidate": assess(baseline, cand.ncu or {}, timing["candidate_ms"], subject="candidate")
            if cand is not None
            else None,
        },
        notes=notes,
    )
    if not timed:
        report["timing_note"] = "CPU wall-clock timings: no fraction of speed of light is computed from them"
    return report


def _print_profile(report: dict[str, Any]) -> None:
    from kernelcrew.agents.diagnosis import render

    out = Console()
    hw = report["hardware"]
    out.print(f"[bold]{report['task']}[/] on {hw['name']} ({hw['arch']})")
    for note in report["notes"]:
        out.print(f"  [yellow]![/] {note}")
    work, floor, timing = report.get("work") or {}, report.get("floor") or {}, report["timing"]
    table = Table(show_header=False, box=None)
    table.add_row("compulsory bytes", f"{work.get('bytes', 0) / 1e6:.4g} MB")
    table.add_row("flops", f"{(work.get('matmul_flops', 0) + work.get('other_flops', 0)) / 1e9:.4g} GFLOP")
    table.add_row(
        "floor",
        _fmt_ms(floor.get("floor_ms")) + (f" ({floor.get('bound')}-bound)" if floor.get("bound") else ""),
    )
    table.add_row("eager", _fmt_ms(timing["eager_ms"]))
    for mode, ms in timing["compile_ms"].items():
        table.add_row(f"torch.compile ({mode})", _fmt_ms(ms))
    if timing["candidate_ms"] is not None:
        table.add_row("candidate", _fmt_ms(timing["candidate_ms"]))
    for key, value in report["sol_fraction"].items():
        if value is not None:
            table.add_row(f"speed of light: {key}", f"{value:.0%}")
    out.print(table)
    for hot in report["hotspots"][:5]:
        out.print(f"  {hot['share']:6.1%}  {hot['time_us']:10.1f} us  {hot['name'][:90]}")
    for diag in report["diagnosis"].values():
        if diag:
            out.print(render(diag))
    verdict = report.get("candidate_verdict")
    if verdict and verdict["verdict"] != "pass":
        out.print(f"[red]candidate failed verification[/] ({verdict['stage']}): {verdict['message']}")


@app.command()
def bench(
    suite_dir: Annotated[Path, typer.Argument(help="A folder of task files (KernelBench format).")],
    device: Annotated[Device, typer.Option(help="Where to run: cuda, cpu, or auto.")] = Device.auto,
    tasks: Annotated[str, typer.Option(help="Comma list of task names (default: all).")] = "",
    resume: Annotated[bool, typer.Option(help="Keep finished rows in OUT and run the rest.")] = False,
    out: Annotated[Path, typer.Option(help="Where suite.json, suite.md and the runs go.")] = Path(
        "bench-out"
    ),
    time_budget: Annotated[float, typer.Option(min=1, help="Seconds of crew time per task.")] = 90.0,
    max_iters: Annotated[int, typer.Option(min=1, max=200, help="Steps per task at most.")] = 6,
    max_wall: Annotated[
        float | None, typer.Option(help="Start no new task after this many seconds (shards).")
    ] = None,
    compile_modes: Annotated[
        str, typer.Option(help="torch.compile baselines: auto, none, or a list.")
    ] = "auto",
    quick: Annotated[bool, typer.Option(help="Few timing repetitions (fast, noisy).")] = False,
    parallel: Annotated[
        int, typer.Option(min=0, max=64, help="Steps side by side, one per GPU (0: every GPU visible).")
    ] = 0,
) -> None:
    """Run optimize on every task of a suite; a table (JSON + markdown) that resumes across shards."""
    from kernelcrew.benchmark import markdown, run_bench

    try:
        data = run_bench(
            suite_dir,
            out,
            device=resolve_device(device),
            names=[t for t in tasks.split(",") if t] or None,
            resume=resume,
            time_budget_s=time_budget,
            max_iters=max_iters,
            max_wall_s=max_wall,
            compile_modes=compile_modes,
            quick=quick,
            parallel=parallel,
            console=console,
        )
    except TaskError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    print(markdown(data))


def _ask_guidance(step: int) -> str:
    """Read one line of guidance from the terminal (empty: go on)."""
    return typer.prompt(f"guidance before step {step} (enter to go on)", default="", show_default=False)


def _merge_timing(report: dict[str, Any], bench: BenchmarkResult) -> None:
    """Fold the benchmark into the top-level fields and fail the verdict on a bad timed output."""
    report["timing"] = bench.model_dump(mode="json")
    report["baseline_ms"] = bench.median_ms("eager")
    compiled = bench.compile_medians()
    report["compile_ms"] = min(compiled.values()) if compiled else None
    report["compile_s"] = report["timing"].get("compile_s")
    report["candidate_ms"] = bench.median_ms("candidate")
    ratio = bench.ratios.get("candidate")
    if ratio:
        report["speedup"] = ratio.median
        report["speedup_ci"] = [ratio.ci_low, ratio.ci_high]
        report["speedup_significant"] = ratio.significant
    if compiled and report["candidate_ms"]:
        report["speedup_vs_compile"] = min(compiled.values()) / report["candidate_ms"]
    if bench.clock == "cpu-wall":
        report["flags"].append("CPU timings (wall clock): not GPU speedups")
    profiled = bench.kinds.get("candidate")
    if profiled:  # the kind of the calls that were timed, rather than of the verification calls
        report["kind"], report["kind_evidence"] = profiled["kind"], profiled["evidence"]
    failure = bench.failure
    if failure is not None:
        report["verdict"], report["stage"], report["message"] = "fail", failure.stage, failure.message
        report["failures"].append(failure.model_dump(mode="json"))
    report["checks"].append(
        {"name": "timed outputs", "passed": failure is None, "detail": bench.samples_checked or 0}
    )


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f} ms"


def _print_report(report: dict[str, Any]) -> None:
    out = Console()
    color = "green" if report["verdict"] == "pass" else "red"
    out.print(f"[bold {color}]{report['verdict'].upper()}[/] ({report['stage']}): {report['message']}")
    table = Table(show_header=False, box=None)
    table.add_row("device", f"{report['device']} ({report['hardware']['name']})")
    table.add_row("kind", str(report.get("kind")))
    table.add_row(
        "max rel error", f"{report['max_rel_error']:.3g}" if report.get("max_rel_error") is not None else "-"
    )
    table.add_row("eager", _fmt_ms(report["baseline_ms"]))
    table.add_row("torch.compile", _fmt_ms(report["compile_ms"]))
    table.add_row("candidate", _fmt_ms(report["candidate_ms"]))
    if report.get("speedup") is not None:
        lo, hi = report["speedup_ci"]
        table.add_row("speedup vs eager", f"{report['speedup']:.3f}x (95% CI {lo:.3f}-{hi:.3f})")
    if report.get("speedup_vs_compile") is not None:
        table.add_row("speedup vs compile", f"{report['speedup_vs_compile']:.3f}x")
    table.add_row("seed", str(report["seed"]))
    out.print(table)
    for flag in report["flags"]:
        out.print(f"  [yellow]![/] {flag}")
    for failure in report["failures"][:5]:
        out.print(f"  [red]x[/] [{failure['stage']}] {failure['message']}")
    out.print(f"reproduce: {report['reproduce']}")


@kb_app.command("import")
def kb_import(
    file: Annotated[Path, typer.Argument(help="A file written by `kernelcrew kb export`.")],
    visibility: Annotated[
        KbVisibility, typer.Option(help="Who sees the imported records: private (default), team, public.")
    ] = KbVisibility.private,
) -> None:
    """Import FILE as yours, in one transaction: every record or, on any problem, none.

    The file is data: fields, sizes and counts are checked, and every candidate source must parse
    and pass the verifier's static rules; nothing in it runs.
    """
    from kernelcrew.api.kb import source_problems
    from kernelcrew.knowledge_base.cli import err, fail, open_kb
    from kernelcrew.knowledge_base.schemas import MAX_FILE_BYTES
    from kernelcrew.knowledge_base.store import ImportRefused

    try:
        size = file.stat().st_size
        if size > MAX_FILE_BYTES:
            raise fail(f"{file} is {size} bytes; the limit is {MAX_FILE_BYTES}")
        raw = file.read_bytes()
    except OSError as exc:
        raise fail(f"cannot read {file}: {exc}") from exc
    kb = open_kb()
    try:
        counts = kb.import_file(raw, check_source=source_problems, visibility=visibility.value)
    except ImportRefused as exc:
        raise fail(f"{file}: {exc}; nothing was imported") from exc
    err.print(
        f"imported {counts['records']} record(s) from {file} as {kb.reader.owner} ({visibility.value}): "
        f"{counts['inserted']} new, {counts['improved']} improved, {counts['confirmed']} confirmed, "
        f"{counts['unchanged']} unchanged, {counts['skipped']} skipped (another owner's)"
    )


app.command()(worker)
app.command()(orchestrator)
app.command()(serve)
app.command()(submit)
