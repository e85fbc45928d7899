"""A candidate's kind (own kernel, hybrid, compiler or library) from a profile of where its time goes.

Who wrote a kernel decides nothing by itself; what counts is the share of the time each owner's
kernels take over the profiled calls:

* :func:`own_names` reads a candidate's source (nothing is executed) for the kernels it defines:
  ``@triton.jit`` / ``@triton.autotune`` / ``@triton.heuristics`` functions and CUDA ``__global__``
  functions in its string constants (what ``load_inline`` and friends compile), and whether it
  calls ``torch.compile``.
* :func:`classify` turns profile rows (kernel name, time, count) into a kind: ``kernel`` when the
  candidate's own kernels take at least half of the time, ``hybrid`` when they take a real share
  (10 %) but less, else ``compiler`` or ``library``, whichever took more.
* :func:`profile_kind` profiles calls of a candidate. On a GPU the rows are the device kernels
  torch.profiler saw (CUDA activities). On a CPU, where Triton runs in its interpreter and no device
  kernels exist, the rows are host wall time: inside Triton launches, inside aten ops outside
  launches, inside ``torch.compile`` regions, and the rest of the call (Python, NumPy).

A name alone can be forged (a dead ``__global__`` string named like a cuBLAS kernel), so a kernel
is the candidate's own only when its name is one the candidate defines and it was not launched from
inside an aten op, is not in a library namespace (``at::``, ``cutlass::``...) and is not named like
a vendor library kernel (:data:`LIBRARY_KERNEL`). Every doubt falls to ``library``.
"""

from __future__ import annotations

import ast
import contextlib
import re
import time
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

from kernelcrew.task import parse_python
from kernelcrew.tools.build import import_aliases

#: The kinds, from most to least the candidate's own work.
KINDS = ("kernel", "hybrid", "compiler", "library")
#: Own kernels' share of the time from which a candidate is a ``kernel``.
KERNEL_SHARE = 0.5
#: Own kernels' share of the time from which a candidate is at least ``hybrid``.
HYBRID_SHARE = 0.1

#: Triton kernels Inductor generates: ``triton_`` + the first three letters of the kernel's
#: category (``poi``ntwise, ``red``uction, ``per``sistent reduction, ``tem``plate, ``for``each,
#: ``spl``it scan, ``unk``nown) + ``_``.
INDUCTOR_KERNEL = re.compile(r"^triton_[a-z]{3}_")
#: Names of vendor library kernels (cuBLAS/cuBLASLt, CUTLASS, cuDNN, cuFFT, NCCL, FlashAttention)
#: and copies: never the candidate's own, whatever its source declares.
LIBRARY_KERNEL = re.compile(
    r"^(?:(?:sm\d+|ampere|volta|turing|hopper|maxwell|pascal|blackwell)_|nvjet_|cutlass|cublas|cudnn|"
    r"cask_|xmma|gemv|gemmk|gemmSN|splitKreduce|implicit_convolve|regular_fft|vector_fft|fft_|nccl|"
    r"flash_fwd|flash_bwd|Memcpy|Memset)"
)
#: C++ namespaces whose kernels belong to a library, whatever the unqualified name.
LIBRARY_NAMESPACES = frozenset(
    {
        "at",
        "aten",
        "c10",
        "caffe2",
        "torch",
        "cutlass",
        "cute",
        "cub",
        "thrust",
        "cublas",
        "cublasLt",
        "cudnn",
        "nccl",
        "flash",
        "pytorch_flash",
    }
)
#: Device-time entries of the profiler itself, not of the candidate.
PROFILER_OVERHEAD = frozenset({"Activity Buffer Request"})
#: Host annotations that ``torch.compile`` puts around compiled code.
COMPILED_REGION = ("Torch-Compiled Region", "## Call CompiledFxGraph")

#: The profiler annotation around each profiled call, and the prefix of each timed Triton launch.
CALL_MARK = "kernelcrew::call"
LAUNCH_MARK = "kernelcrew::launch::"

_TOP_KERNELS = 10
_MAX_NAME = 200


# ----------------------------------------------------------------------------------------------
# What the candidate defines
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnNames:
    """The kernels a candidate's source defines, and whether it calls ``torch.compile``."""

    triton: frozenset[str] = field(default_factory=frozenset)
    """Names of its ``@triton.jit`` (or autotune/heuristics-wrapped) functions."""
    cuda: frozenset[str] = field(default_factory=frozenset)
    """Names of the CUDA ``__global__`` functions in its string constants."""
    compiler: bool = False
    """It calls ``torch.compile`` (or reaches ``torch._dynamo`` / ``torch._inductor``)."""

    @property
    def names(self) -> frozenset[str]:
        return self.triton | self.cuda

    def to_dict(self) -> dict[str, Any]:
        return {"triton": sorted(self.triton), "cuda": sorted(self.cuda), "compiler": self.compiler}


_TRITON_WRAPPERS = frozenset({"jit", "autotune", "heuristics"})
_GLOBAL = re.compile(r"__global__\b")
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\([^)]*\)")
_GLOBAL_NAME = re.compile(r"^[^(;{}]*?([A-Za-z_]\w*)\s*\(")


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` of a Name/Attribute chain, its root resolved through the imports."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _is_triton_wrapper(node: ast.AST, aliases: dict[str, str]) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    name = _dotted(target, aliases)
    return bool(name) and name.startswith("triton.") and name.rsplit(".", 1)[-1] in _TRITON_WRAPPERS


def _is_compiler(name: str) -> bool:
    return name == "torch.compile" or name.startswith(("torch._dynamo", "torch._inductor"))


def cuda_global_names(code: str) -> set[str]:
    """Names of the ``__global__`` functions declared in CUDA C++ ``code``."""
    names = set()
    for match in _GLOBAL.finditer(code):
        rest = _LAUNCH_BOUNDS.sub(" ", code[match.end() : match.end() + 500])
        found = _GLOBAL_NAME.match(rest)
        if found and found.group(1) not in {"void", "__launch_bounds__"}:
            names.add(found.group(1))
    return names


def own_names(source: str) -> OwnNames:
    """The kernel names a candidate source defines (read, never run); nothing for a file that does
    not parse.

    Every string constant is read for ``__global__`` declarations, whichever builder compiles it
    (``load_inline``, ``cpp_extension.load`` sources kept inline, CuPy): a declaration that is never
    built only names a kernel that never runs, which counts for nothing.
    """
    try:
        tree = parse_python(source)
    except (SyntaxError, ValueError):
        return OwnNames()
    aliases = import_aliases(tree)
    triton: set[str] = set()
    cuda: set[str] = set()
    compiler = any(_is_compiler(path) for path in aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if any(_is_triton_wrapper(d, aliases) for d in node.decorator_list):
                triton.add(node.name)
        elif isinstance(node, ast.Call):
            if _is_triton_wrapper(node.func, aliases):  # triton.jit(fn), triton.jit(**options)(fn)
                triton.update(a.id for a in node.args[:1] if isinstance(a, ast.Name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "__global__" in node.value:
            cuda.update(cuda_global_names(node.value))
        if isinstance(node, ast.Attribute | ast.Name):
            name = _dotted(node, aliases)
            compiler = compiler or bool(name and _is_compiler(name))
    return OwnNames(triton=frozenset(triton), cuda=frozenset(cuda), compiler=compiler)


# ----------------------------------------------------------------------------------------------
# Whose kernel is it
# ----------------------------------------------------------------------------------------------


class KernelRow(NamedTuple):
    """One row of a profile: a kernel (or host region) name, its time and its count."""

    name: str
    time_us: float
    count: int
    origin: str = ""
    """How the profile saw it run: ``""`` (launched by the candidate: decided by its name),
    ``"aten"`` (launched from inside an aten op: a library), ``"compiled"`` (host time inside a
    ``torch.compile`` region) or ``"host"`` (host time outside kernels and ops: Python, NumPy)."""


def _strip_templates(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out)


def _demangled_path(name: str) -> list[str]:
    """``void ns::foo<128>(float*, int)`` -> ``["ns", "foo"]``."""
    text = name.replace("(anonymous namespace)", "anonymous_namespace")
    depth = 0
    for i, ch in enumerate(text):  # cut the parameter list: the first "(" outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif ch == "(" and not depth:
            text = text[:i]
            break
    text = _strip_templates(text).strip()
    text = text.split()[-1] if text else ""  # drop a return type ("void")
    return [p for p in text.split("::") if p]


def _mangled_path(name: str) -> list[str] | None:
    """``_ZN2ns3fooEPf`` -> ``["ns", "foo"]``; ``_Z3fooPf`` -> ``["foo"]``; None if not Itanium-mangled."""
    if not name.startswith("_Z"):
        return None
    pos, nested = 2, name.startswith("_ZN")
    pos += nested
    parts = []
    while pos < len(name) and name[pos].isdigit():
        end = pos
        while end < len(name) and name[end].isdigit():
            end += 1
        size = int(name[pos:end])
        parts.append(name[end : end + size])
        pos = end + size
        if not nested:
            break
    return parts or None


def kernel_path(name: str) -> list[str]:
    """A profiled kernel's qualified name as a list (namespaces, then its identifier)."""
    return _mangled_path(name.strip()) or _demangled_path(name.strip())


def owner(row: KernelRow, own: OwnNames) -> str:
    """``own``, ``compiler`` or ``library``: who a profiled kernel belongs to."""
    if row.origin == "compiled":
        return "compiler"
    if row.origin:  # "aten", "host" or anything unknown
        return "library"
    path = kernel_path(row.name)
    if not path or LIBRARY_KERNEL.match(row.name.strip()):
        return "library"
    ident = path[-1]
    if len(path) > 1 and path[0] in LIBRARY_NAMESPACES:
        return "library"
    inductor = bool(INDUCTOR_KERNEL.match(ident))
    if ident in own.names and not (inductor and own.compiler):
        return "own"
    if inductor:
        return "compiler"
    return "library"


def classify(
    events: Iterable[Sequence[Any]], own: OwnNames, *, calls: int | None = None, complete: bool = True
) -> tuple[str, dict[str, Any]]:
    """The kind of a profiled candidate, and the evidence that decided it.

    ``events`` are rows ``(name, time_us, count)`` or :class:`KernelRow`. ``calls`` is the number of
    calls profiled (evidence only); ``complete=False`` says the profile lost some of them, and then
    nothing the candidate ran can make it ``kernel`` or ``hybrid``.
    """
    rows = [KernelRow(*e) for e in events]
    by_owner: Counter[str] = Counter({"own": 0.0, "compiler": 0.0, "library": 0.0})
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for row in rows:
        if row.time_us <= 0:
            continue
        who = owner(row, own)
        by_owner[who] += row.time_us
        entry = per_kernel[(row.name, who)]
        entry[0] += row.time_us
        entry[1] += int(row.count)
    total = sum(by_owner.values())
    shares = {k: (v / total if total > 0 else 0.0) for k, v in by_owner.items()}
    if not complete or total <= 0:
        kind = "compiler" if by_owner["compiler"] > by_owner["library"] else "library"
    elif shares["own"] >= KERNEL_SHARE:
        kind = "kernel"
    elif shares["own"] >= HYBRID_SHARE:
        kind = "hybrid"
    elif own.compiler:  # it compiled itself: what ran is what the compiler emitted (C++ on a CPU)
        kind = "compiler"
    else:
        kind = "compiler" if by_owner["compiler"] > by_owner["library"] else "library"
    top = sorted(per_kernel.items(), key=lambda item: item[1][0], reverse=True)[:_TOP_KERNELS]
    evidence = {
        "shares": shares,
        "total_us": total,
        "top_kernels": [
            {
                "name": name[:_MAX_NAME],
                "owner": who,
                "time_us": t,
                "count": n,
                "share": t / total if total > 0 else 0.0,
            }
            for (name, who), (t, n) in top
        ],
        "calls_profiled": calls,
        "complete": complete,
        "own_names": own.to_dict(),
        "thresholds": {"kernel": KERNEL_SHARE, "hybrid": HYBRID_SHARE},
    }
    if total <= 0:
        evidence["note"] = "the profile saw no time in any kernel"
    elif not complete:
        evidence["note"] = "the profile lost some calls: the candidate cannot count as its own kernel"
    return kind, evidence


# ----------------------------------------------------------------------------------------------
# Profiling the calls
# ----------------------------------------------------------------------------------------------


def profile_kind(
    fn: Callable[[Any], Any],
    inputs_list: Sequence[Any],
    *,
    device: str,
    own: OwnNames,
    reps: int,
) -> tuple[str, dict[str, Any]]:
    """Run ``fn(inputs)`` ``reps`` times (cycling through ``inputs_list``) under torch.profiler and
    classify the candidate by where the time went.

    Call it on a warmed-up candidate (the timed calls): compilation and autotuning are not its
    subject. Every call runs under ``torch.no_grad()`` and is followed by a device-wide synchronize.
    """
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    if not inputs_list:
        raise ValueError("inputs_list is empty")
    on_gpu = str(device).startswith("cuda")
    rows, calls, extra = (_device_rows if on_gpu else _host_rows)(fn, inputs_list, device, reps)
    kind, evidence = classify(rows, own, calls=calls, complete=calls == reps)
    if not on_gpu and kind == "kernel":
        # The interpreter makes an own kernel's time on a CPU many times its device time, so a
        # matmul, convolution or attention beside it says more than its share: then it is hybrid.
        from kernelcrew.tools.correctness import MATMUL_OPS

        heavy = sorted({str(row[0]) for row in rows if str(row[0]).removeprefix("aten::") in MATMUL_OPS})
        if heavy:
            kind = "hybrid"
            evidence["note"] = (
                f"on a CPU, a library matmul or convolution beside own kernels is hybrid: {heavy[:5]}"
            )
    evidence.update(extra)
    evidence["calls_requested"] = reps
    evidence["clock"] = (
        "device kernels (torch.profiler, CUDA activities)"
        if on_gpu
        else "host wall time (Triton interpreter launches, aten ops, the rest of the call)"
    )
    return kind, evidence


def _calls(fn: Callable[[Any], Any], inputs_list: Sequence[Any], reps: int, sync: Callable[[], None]) -> int:
    """Run the calls, each inside :data:`CALL_MARK`; the elements of their outputs, all calls."""
    import torch
    from torch.profiler import record_function
    from torch.utils._pytree import tree_leaves

    elements = 0
    with torch.no_grad():
        for i in range(reps):
            with record_function(CALL_MARK):
                out = fn(inputs_list[i % len(inputs_list)])
                sync()
            with contextlib.suppress(Exception):
                elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    return elements


def _device_rows(
    fn: Callable[[Any], Any], inputs_list: Sequence[Any], device: str, reps: int
) -> tuple[list[KernelRow], int, dict[str, Any]]:
    """Device kernels of the calls; those launched from inside an aten op get origin ``aten``."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        torch.cuda.synchronize(device)

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _calls(fn, inputs_list, reps, sync)
    events = prof.events()
    device_time: Counter[str] = Counter()
    device_count: Counter[str] = Counter()
    aten_time: Counter[str] = Counter()
    aten_count: Counter[str] = Counter()
    calls = 0
    for evt in events:
        if evt.device_type == DeviceType.CPU:
            if evt.name == CALL_MARK:
                calls += 1
            elif evt.name.startswith("aten::"):
                for k in evt.kernels:
                    aten_time[k.name] += float(k.duration)
                    aten_count[k.name] += 1
        elif not _annotation(evt):
            device_time[evt.name] += float(evt.time_range.elapsed_us())
            device_count[evt.name] += 1
    rows = []
    for name, total in device_time.items():
        in_aten = min(aten_time[name], total)
        n_aten = min(aten_count[name], device_count[name])
        if in_aten > 0 or n_aten:
            rows.append(KernelRow(name, in_aten, n_aten, "aten"))
        if total - in_aten > 0:
            rows.append(KernelRow(name, total - in_aten, device_count[name] - n_aten))
    return rows, calls, {}


def _annotation(evt: Any) -> bool:
    """A device-side entry that is no kernel: the timeline of a host annotation (ours, Inductor's)
    or the profiler's own bookkeeping."""
    return (
        bool(getattr(evt, "is_user_annotation", False))
        or evt.name in PROFILER_OVERHEAD
        or (evt.name == CALL_MARK or evt.name.startswith((LAUNCH_MARK, *COMPILED_REGION)))
    )


class _LaunchTimer:
    """Wraps Triton's launch entry points (``JITFunction.run``, the interpreter's
    ``InterpretedFunction.run``) so that each outermost launch runs inside a profiler annotation
    named after its kernel; :meth:`installed` puts the originals back, even on error."""

    def __init__(self) -> None:
        self.depth = 0
        self.launches: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        #: Elements each kernel stored (masked-off lanes not counted), interpreter only.
        self.stored: Counter[str] = Counter()
        self.interpreted: set[str] = set()
        self.current = ""

    def _classes(self) -> list[type]:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return []
        classes: list[type] = [JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:
            return classes
        return [*classes, InterpretedFunction]

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        from torch.profiler import record_function

        timer = self

        def run(fn_self: Any, *args: Any, **kwargs: Any) -> Any:
            if timer.depth or kwargs.get("warmup"):
                return original(fn_self, *args, **kwargs)
            name = getattr(fn_self, "__name__", None) or getattr(
                getattr(fn_self, "fn", None), "__name__", "?"
            )
            timer.depth += 1
            timer.current = name
            start = time.perf_counter()
            try:
                with record_function(LAUNCH_MARK + name):
                    return original(fn_self, *args, **kwargs)
            finally:
                timer.seconds[name] += time.perf_counter() - start
                timer.launches[name] += 1
                if type(fn_self).__name__ == "InterpretedFunction":
                    timer.interpreted.add(name)
                timer.depth -= 1

        return run

    @contextmanager
    def installed(self) -> Iterator[_LaunchTimer]:
        patches = [
            (cls, "run", cls.__dict__["run"], self._wrap(cls.__dict__["run"]))
            for cls in self._classes()
            if "run" in cls.__dict__
        ]
        patches += self._store_counters()
        try:
            for cls, attr, _original, replacement in patches:
                setattr(cls, attr, replacement)
            yield self
        finally:
            for cls, attr, original, _replacement in patches:
                setattr(cls, attr, original)

    def _store_counters(self) -> list[tuple[type, str, Callable[..., Any], Callable[..., Any]]]:
        """The interpreter's store entry points (class, name, original, replacement), each counting
        the elements it writes for the launch in progress (none where the interpreter is absent)."""
        try:
            from triton.runtime.interpreter import InterpreterBuilder
        except ImportError:
            return []
        timer = self
        counters = {  # entry point: the elements a call stores, from its arguments
            "create_store": lambda a: int(a[1].data.size),
            "create_masked_store": lambda a: int(a[2].data.sum()),  # the mask's true lanes
            "create_descriptor_store": lambda a: int(a[1].data.size),
        }
        patches = []
        for attr, count in counters.items():
            original = InterpreterBuilder.__dict__.get(attr)
            if original is None:
                continue

            def counted(builder: Any, *args: Any, _original=original, _count=count, **kwargs: Any) -> Any:
                if timer.depth:
                    with contextlib.suppress(Exception):
                        timer.stored[timer.current] += _count(args)
                return _original(builder, *args, **kwargs)

            patches.append((InterpreterBuilder, attr, original, counted))
        return patches


def _host_rows(
    fn: Callable[[Any], Any], inputs_list: Sequence[Any], device: str, reps: int
) -> tuple[list[KernelRow], int, dict[str, Any]]:
    """Host wall time of the calls, split by what ran: Triton launches, aten ops, compiled regions,
    the rest. Aten ops that compute inside a launch (a pre-run hook) are not the launch's time; ops
    that only move memory there are the interpreter's own copies and are."""
    from torch.profiler import ProfilerActivity, profile

    from kernelcrew.tools.anticheat import TRIVIAL_OPS

    overhead_us = interpreter_launch_overhead_us()
    timer = _LaunchTimer()
    with timer.installed(), profile(activities=[ProfilerActivity.CPU]) as prof:
        output_elements = _calls(fn, inputs_list, reps, lambda: None)
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start or e.name == CALL_MARK]
    call_events = [e for e in events if e.name == CALL_MARK]
    threads = {e.thread for e in call_events}
    events = [e for e in events if e.thread in threads]
    aten = sorted(
        (e for e in events if e.name.startswith("aten::")),
        key=lambda e: (e.time_range.start, -e.time_range.end),
    )
    top_aten, reach = [], float("-inf")
    for e in aten:  # outermost aten ops only: a nested op's time is its parent's
        if e.time_range.start >= reach:
            top_aten.append(e)
            reach = e.time_range.end
    launches = [e for e in events if e.name.startswith(LAUNCH_MARK)]
    launch_spans = [(e.time_range.start, e.time_range.end) for e in launches]

    def in_launch(e: Any) -> bool:
        return any(s <= e.time_range.start < t for s, t in launch_spans)

    def trivial(e: Any) -> bool:
        op = e.name.split("::", 1)[-1]
        return op in TRIVIAL_OPS or op.rstrip("_") in TRIVIAL_OPS

    # Layers, highest priority first: each instant of a call is painted by the first layer over it.
    layers: list[list[tuple[float, float, str]]] = [
        [_span(e, "aten", e.name) for e in top_aten if in_launch(e) and not trivial(e)],
        [_span(e, "", e.name[len(LAUNCH_MARK) :]) for e in launches],
        [_span(e, "aten", e.name) for e in top_aten if not in_launch(e)],
        [_span(e, "compiled", "torch.compile region") for e in events if e.name.startswith(COMPILED_REGION)],
        [_span(e, "host", "host (Python, NumPy, outside aten ops and launches)") for e in call_events],
    ]
    painted = _paint(layers)
    counts: Counter[str] = Counter()
    for layer in layers:
        for _s, _t, label in layer:
            counts[label] += 1
    for label in painted:  # the interpreter's cost of a launch is no kernel's work
        if label.startswith("\0"):
            name = label[1:]
            painted[label] = max(0.0, painted[label] - counts[label] * overhead_us)
            if name in timer.interpreted and output_elements:
                # The interpreter's time per operation hardly depends on the data: a kernel that
                # writes a few elements beside library ops doing the real work would read as most
                # of the call. Its time counts in proportion to what it wrote, up to the outputs.
                painted[label] *= min(1.0, timer.stored[name] / output_elements)
    rows = [
        KernelRow(label.split("\0", 1)[1], t, counts[label], label.split("\0", 1)[0])
        for label, t in painted.items()
    ]
    launched = {
        name: {"launches": n, "time_us": timer.seconds[name] * 1e6}
        for name, n in sorted(timer.launches.items())
    }
    extra = {
        "triton_launches": launched,
        "interpreter_launch_overhead_us": overhead_us,
        "interpreter_stored_elements": dict(sorted(timer.stored.items())),
        "output_elements": output_elements,
    }
    return rows, len(call_events), extra


def _probe_kernel(n):  # launched empty by interpreter_launch_overhead_us
    pass


def interpreter_launch_overhead_us(samples: int = 5) -> float:
    """The median wall time of launching an empty kernel in Triton's interpreter (its fixed cost
    per launch: patching ``triton.language``, setting up the grid), or 0 when launches are compiled
    or the probe cannot run."""
    import triton
    import triton.language as tl

    # triton.language in the probe's globals, as in any kernel's module, so that it is patched too
    body = types.FunctionType(_probe_kernel.__code__, {"tl": tl, "triton": triton})
    probe = triton.jit(body)
    if type(probe).__name__ != "InterpretedFunction":
        return 0.0
    times = []
    try:
        probe[(1,)](0)  # the first launch also rewrites the function: not part of the fixed cost
        for _ in range(samples):
            start = time.perf_counter()
            probe[(1,)](0)
            times.append((time.perf_counter() - start) * 1e6)
    except Exception:  # an interpreter that cannot run it: subtract nothing
        return 0.0
    return sorted(times)[len(times) // 2]


def _span(evt: Any, origin: str, name: str) -> tuple[float, float, str]:
    return (float(evt.time_range.start), float(evt.time_range.end), f"{origin}\0{name}")


def _paint(layers: list[list[tuple[float, float, str]]]) -> dict[str, float]:
    """Time per label, each instant given to the label of the highest-priority layer covering it."""
    edges = sorted({x for layer in layers for s, t, _ in layer for x in (s, t)})
    active: list[Counter[str]] = [Counter() for _ in layers]
    starts: dict[float, list[tuple[int, str]]] = defaultdict(list)
    ends: dict[float, list[tuple[int, str]]] = defaultdict(list)
    for level, layer in enumerate(layers):
        for s, t, label in layer:
            if t > s:
                starts[s].append((level, label))
                ends[t].append((level, label))
    out: Counter[str] = Counter()
    for left, right in pairwise(edges):
        for level, label in ends.get(left, ()):
            active[level][label] -= 1
        for level, label in starts.get(left, ()):
            active[level][label] += 1
        for counter in active:
            live = sorted(label for label, n in counter.items() if n > 0)
            if live:
                out[live[0]] += right - left
                break
    return dict(out)
