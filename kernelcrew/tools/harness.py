"""Code that runs inside sandbox children: golden outputs, candidate runs, shared model/input helpers.

Every function named ``*_child`` is a sandbox target (``sandbox.run("kernelcrew.tools.harness:NAME")``)
called as ``fn(payload, workdir)``. Files travel through ``workdir``: the golden child writes
``inputs.pt``, ``state_dict.pt``, ``golden.pt`` and ``native.pt``; the parent copies only
``inputs.pt`` and ``state_dict.pt`` into a candidate child's own directory, so candidate code never
sees the golden outputs; the candidate child writes its outputs to ``outputs.pt`` and the parent
judges them (:mod:`kernelcrew.tools.correctness`).
"""

from __future__ import annotations

import copy
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kernelcrew.task import Task, TaskError, call_inputs, load_task, test_input_sets
from kernelcrew.tools.sandbox import StageError

TEST_SEED_OFFSET = 1000
SIGN_SEED_OFFSET = 2000
#: Seed sets that get a signed variant: a kernel that assumes non-negative inputs fails on the first
#: one already, and each further variant of a memory-bound task is hundreds of megabytes to make,
#: store and run.
SIGNED_SETS = 2
#: Factors of the scaled variants, each applied to its own seed set (so their cost is bounded as the
#: signed variants' is). x100 puts unit-scale data where exp() overflows float32 (exp(88.7) is its
#: largest value): a softmax without max subtraction, a naive log(sum(exp)), tanh as a ratio of
#: exponentials all give Inf or NaN. x1e-3 puts it where an epsilon is no longer negligible and
#: squares underflow half precision: a norm that drops or misplaces its eps, or accumulates x*x in
#: fp16, misses the golden. A variant is kept only where the float64 reference stays finite and
#: PyTorch's own output passes the pass rule with room to spare (see VARIANT_TOLERANCE_USED).
SCALE_FACTORS = (100.0, 1e-3)
#: Bytes of input sets the golden child makes at most (the seed sets, then variants): every set is
#: kept with its golden for the whole verification, so a task whose inputs are gigabytes gets fewer
#: sets (never fewer than two seeds: the cache sequence needs them) and says so.
GOLDEN_INPUT_BYTES = 8 * 1024**3
#: Seed sets every task gets, whatever their size (the cache sequence needs two).
MIN_SEED_SETS = 2
#: The most of the pass rule's tolerance PyTorch's own output may use on a scaled variant, unless it
#: uses as much on the set it was scaled from (within a factor of 2: low-precision outputs spend a
#: good part of it on their final rounding). Beyond that the scale is ill-conditioned for the task
#: and would fail honest kernels that round differently.
VARIANT_TOLERANCE_USED = 0.25
INIT_SEED_OFFSET = 0
#: The timing process compares the global state with its start every this many calls (a snapshot
#: costs about a millisecond; the outputs are checked on every call).
STATE_CHECK_EVERY = 8
#: Calls the verify child profiles on a GPU to decide the candidate's kind (the timing process
#: profiles its own, on fresh data, and its kind is the one reported with a speedup).
KIND_CALLS_VERIFY = 5
#: The verify child keeps the outputs of its first calls (on different data) and checks at the end
#: that later calls left them alone: a candidate rotating through fewer output buffers than calls fails.
HELD_OUTPUTS = 6
#: Share of the GPU's free memory a verification child holds its input sets and held outputs in:
#: past it (a task whose input set is GBs) each set goes to the device only for its own call, and
#: outputs are held while they fit. Eight sets of 6.4 GB and the outputs held with them ran an H100
#: out of memory.
CHECK_MEMORY_SHARE = 0.4


class Laps:
    """Seconds per named phase: ``laps("name")`` ends a phase where the previous one ended (or where
    the clock started); a name used again adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._clock = time.monotonic()

    def __call__(self, name: str) -> float:
        now = time.monotonic()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._clock, 2)
        self._clock = now
        return self.seconds[name]


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def apply_precision(policy: str) -> None:
    """Fix the precision flags of the policy: ``strict`` keeps fp32 in fp32 (TF32 off everywhere)."""
    import torch

    if policy not in ("strict", "relaxed"):
        raise ValueError(f"unknown precision policy {policy!r} (strict or relaxed)")
    relaxed = policy == "relaxed"
    torch.backends.cuda.matmul.allow_tf32 = relaxed
    torch.backends.cudnn.allow_tf32 = relaxed
    torch.set_float32_matmul_precision("high" if relaxed else "highest")


@contextmanager
def poisoned_memory():
    """Fill every new tensor with NaN (integers with their max), so unwritten outputs show."""
    import torch

    prev = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = prev[2]


def map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor nested in its lists, tuples and dicts."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def iter_tensors(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every tensor nested in ``obj``'s lists, tuples and dicts with its index path, in a fixed order
    (sequences in order, dicts in insertion order)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            yield from iter_tensors(item, (*path, i))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from iter_tensors(item, (*path, key))


def path_label(path: tuple[Any, ...]) -> str:
    """An index path as it reads in messages: ``(1, 0, "w")`` is ``1[0]['w']``."""
    if not path:
        return "inputs"
    return str(path[0]) + "".join(f"[{key!r}]" for key in path[1:])


def to_device(obj: Any, device: str) -> Any:
    """``obj`` with every tensor on ``device``: a large host tensor goes to a GPU through the pinned
    staging buffer (:func:`device_copy`), a GPU tensor to the host through :func:`host_copy`."""

    def move(t: Any) -> Any:
        if t.requires_grad or t.device.type == str(device).split(":")[0]:
            return t.to(device)
        if t.device.type == "cuda" and device == "cpu":
            return host_copy(t)
        if t.device.type == "cpu" and str(device).startswith("cuda"):
            return device_copy(t, device)
        return t.to(device)

    return map_tensors(obj, move)


def to_float64(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.to(__import__("torch").float64) if t.is_floating_point() else t)


def clone_tensors(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().clone())


#: A tensor of more bytes than this crosses between the host and a GPU through a pinned staging
#: buffer of this size: a copy from or into pageable memory ran at about 1.4 GB/s on an H100 host,
#: a large task's inputs and outputs are GBs, and pinning each whole tensor cost as much as it saved
#: (and memory: the pinned allocator rounds up to powers of two and keeps what it freed).
STAGING_BYTES = 64 * 1024**2
_staging: list[Any] = []
_staging_lock = threading.Lock()


def _staged(source: Any, target: Any) -> bool:
    """Copy the flat bytes ``source`` into ``target`` (one on the host, one on a GPU) through the
    staging buffer; False where no pinned memory is to be had (nothing copied)."""
    import torch

    with _staging_lock:
        if not _staging:
            try:
                _staging.append(torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True))
            except RuntimeError:
                return False
        stage = _staging[0]
        size = source.numel()
        for start in range(0, size, STAGING_BYTES):
            n = min(STAGING_BYTES, size - start)
            stage[:n].copy_(source[start : start + n])  # each copy waits: the stage is reused next
            target[start : start + n].copy_(stage[:n])
    return True


def host_copy(t: Any) -> Any:
    """A detached CPU copy of ``t`` that never shares its memory."""
    import torch

    t = t.detach()
    if t.device.type != "cuda":
        return t.to("cpu").clone()
    if t.numel() * t.element_size() <= STAGING_BYTES:
        return t.to("cpu")
    out = torch.empty(t.shape, dtype=t.dtype)
    if not _staged(t.contiguous().reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)):
        return t.to("cpu")
    return out


def device_copy(t: Any, device: str) -> Any:
    """A copy of host tensor ``t`` on GPU ``device``. From pageable memory (an mmap'd inputs file)
    the driver copied a large task's GBs of inputs at a fraction of the bus's rate, in every child
    that loads them."""
    import torch

    if t.numel() * t.element_size() <= STAGING_BYTES or not t.is_contiguous():
        return t.to(device)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if not _staged(t.detach().reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)):
        return t.to(device)
    return out


def judging_device(tensor_lists: list[Any], device: str) -> str:
    """``device`` when it is a GPU with room for these tensors and the comparisons' temporaries
    (three times their size), else the CPU."""
    import torch

    if not device.startswith("cuda"):
        return "cpu"
    size = sum(input_bytes(x) for x in tensor_lists)
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return device if 3 * size < free else "cpu"


def save_tensors(obj: Any, path: Path) -> None:
    """``torch.save`` without the archive's CRC-32 checksums, which made writing about five times
    slower (a large task's golden is tens of GB). The files live only as long as one evaluation on
    this machine and are read back with ``mmap``, which never checks them anyway."""
    import torch

    try:
        from torch.utils.serialization import config
    except ImportError:  # an older torch: checksums it is
        torch.save(obj, path)
        return
    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save(obj, path)
    finally:
        config.save.compute_crc32 = before


def inputs_unchanged(snapshot: Any, inputs: Any) -> tuple[Any, ...] | None:
    """The index path of the first place where ``inputs`` differ from ``snapshot`` (a
    :func:`clone_tensors` copy taken before a call), or None when nothing changed.

    A tensor changed when its shape, dtype or bits differ; a list, tuple or dict changed when its
    type, length or keys differ (the path is then the container's); any other value when it no
    longer compares equal.
    """
    return _first_difference(snapshot, inputs, ())


def _first_difference(old: Any, new: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    import torch

    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        same = isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and _tensor_equal(old, new)
        return None if same else path
    if isinstance(old, list | tuple | dict) or isinstance(new, list | tuple | dict):
        if type(old) is not type(new) or len(old) != len(new):
            return path
        if isinstance(old, dict):
            if list(old) != list(new):
                return path
            pairs = [(k, old[k], new[k]) for k in old]
        else:
            pairs = [(i, a, b) for i, (a, b) in enumerate(zip(old, new, strict=True))]
        for key, a, b in pairs:
            found = _first_difference(a, b, (*path, key))
            if found is not None:
                return found
        return None
    try:
        return None if bool(old == new) or old is new else path
    except Exception:  # a value whose comparison does not give one bool
        return None if old is new else path


def _tensor_equal(a: Any, b: Any) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(((a == b) | both_nan).all())
    return bool(torch.equal(a, b))


def _bitwise_equal(a: Any, b: Any) -> bool:
    """Same structure, every tensor the same shape, dtype and values (NaN equal to NaN)."""
    return _first_difference(a, b, ()) is None


def flatten_outputs(out: Any) -> list[Any]:
    """A module's output as a flat list of tensors (tuples, lists and dicts flattened; scalars wrapped)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in flatten_outputs(o)]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in flatten_outputs(out[k])]
    if isinstance(out, bool | int | float):
        return [torch.tensor(out)]
    if out is None:
        return []
    raise TypeError(f"forward returned {type(out).__name__}; expected tensors")


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def describe_inputs(inputs: list[Any]) -> list[str]:
    """One line per input: ``(4, 8):float32`` for a tensor, nested as ``[...]``, ``(...)`` and
    ``{key: ...}`` for lists, tuples and dicts, the type's name for any other value."""
    return [_describe(x) for x in inputs]


def _describe(x: Any) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}"
    if isinstance(x, list):
        return "[" + ", ".join(_describe(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(_describe(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    return type(x).__name__


def zero_inputs(inputs: list[Any]) -> list[str]:
    """The paths (:func:`path_label`) of the non-empty all-zero tensors in ``inputs``."""
    return [path_label(p) for p, t in iter_tensors(inputs) if t.numel() > 0 and not bool(t.any())]


def build_reference(task: Task, seed: int, device: str = "cpu") -> tuple[Any, list[Any]]:
    """Construct the task's Model under ``seed`` (:func:`construct_on` ``device``), as every child
    does; returns it and its init args."""
    import torch

    torch.manual_seed(seed + INIT_SEED_OFFSET)
    init = call_inputs(task.get_init_inputs, "get_init_inputs", task.name)
    try:
        model = construct_on(device, lambda: task.model_cls(*init), seed + INIT_SEED_OFFSET)
    except Exception as exc:
        raise TaskError(
            f"Model(*get_init_inputs()) raised {type(exc).__name__}: {exc}", path=task.name
        ) from exc
    return model, init


def construct_on(device: str, build: Callable[[], Any], seed: int) -> Any:
    """``build()`` (a module's constructor) with ``device`` as the default device: a model of
    GB of weights drew them on the CPU for seconds in every child, where a GPU takes
    milliseconds. The weights differ from a CPU build's, but every child past the golden loads the
    golden's.

    The module is built again on the CPU, under ``seed`` again, when that raised (``__init__``
    needs CPU tensors) or when it holds a tensor outside its parameters and buffers: a user's
    ``Model(...).to(device)`` leaves such a tensor on the CPU, and a build on the device would hide
    what that does to its forward."""
    import torch

    if device != "cpu":
        try:
            with torch.device(device):
                model = build()
            if not stray_tensors(model):
                return model
        except Exception:  # the CPU build below raises the constructor's own error, if any
            pass
        model = None  # the device build goes before the CPU one is made
        torch.manual_seed(seed)
    return build()


def stray_tensors(model: Any) -> list[str]:
    """Attributes of ``model`` and its submodules (lists, tuples and dicts looked into) that hold
    a tensor which is neither a parameter nor a buffer (what ``.to()`` does not move)."""
    import torch

    found: list[str] = []
    if not isinstance(model, torch.nn.Module):
        return found
    moved = {id(t) for t in (*model.parameters(), *model.buffers())}  # an RNN's _flat_weights lists these
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            if any(id(t) not in moved for _, t in iter_tensors(value)):
                found.append(f"{prefix}.{name}" if prefix else name)
    return found


def randomize_constant_parameters(model: Any, seed: int) -> list[str]:
    """Move constant parameters (norm weights of 1, biases of 0, ...) and norm running stats away
    from their defaults, so a candidate that ignores them fails. Returns the names changed."""
    import torch
    from torch.nn.modules.batchnorm import _NormBase

    gen = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            if not bool((flat == flat[0]).all()):
                continue
            value = float(flat[0])
            if value == 0.0:
                new = 0.2 * torch.randn(p.shape, generator=gen)
            else:
                new = value * (0.5 + torch.rand(p.shape, generator=gen))
            p.copy_(new.to(device=p.device, dtype=p.dtype))
            changed.append(name)
        for mod_name, module in model.named_modules():
            if isinstance(module, _NormBase) and module.running_mean is not None:
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=gen))
                module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=gen))
                changed.append(f"{mod_name}.running_mean/var")
    return changed


def copy_into(dst: Any, src: Any) -> None:
    """Write the data of ``src``'s tensors into ``dst``'s tensors in place (same structure and shapes),
    so ``dst`` holds new data at its old addresses."""
    sources = dict(iter_tensors(src))
    for path, tensor in iter_tensors(dst):
        tensor.copy_(sources[path])


def shares_storage(out: Any, inputs: Any) -> bool:
    """Whether a tensor of ``out`` shares memory with a tensor nested anywhere in ``inputs``."""
    ptrs = {
        t.untyped_storage().data_ptr() for _, t in iter_tensors(inputs) if t.untyped_storage().nbytes() > 0
    }
    return any(
        t.untyped_storage().nbytes() > 0 and t.untyped_storage().data_ptr() in ptrs
        for _, t in iter_tensors(out)
    )


# ----------------------------------------------------------------------------------------------
# Golden child: inputs and reference outputs, before any candidate code exists in any process
# ----------------------------------------------------------------------------------------------


def _input_sets(task: Task, seed: int, n_seeds: int, device: str = "cpu") -> tuple[list[dict[str, Any]], str]:
    """The seed and test input sets (on the CPU), and a note when they could not be made on ``device``.

    Factory calls (``torch.randn``...) in ``get_inputs()`` run with ``device`` as the default
    device: a GPU draws a memory-bound task's hundreds of millions of random numbers in
    milliseconds where the CPU took seconds per set. A ``get_inputs()`` that needs CPU tensors
    (NumPy, ``.numpy()``) is run again on the CPU. Each set moves to the CPU as soon as it is made,
    so the GPU never holds more than one.
    """
    if device != "cpu":
        try:
            return _make_input_sets(task, seed, n_seeds, device), ""
        except Exception as exc:  # any failure: the CPU run below raises the task's own error
            note = f"inputs made on the CPU: with {device} as the default device, {type(exc).__name__}: {exc}"
            return _make_input_sets(task, seed, n_seeds, "cpu"), note
    return _make_input_sets(task, seed, n_seeds, "cpu"), ""


def _make_input_sets(task: Task, seed: int, n_seeds: int, device: str) -> list[dict[str, Any]]:
    import torch

    def made(fn: Any) -> list[Any]:
        with torch.device(device):
            return to_device(fn(), "cpu")

    sets = []
    for i in range(n_seeds):
        s = seed + 1 + i
        torch.manual_seed(s)
        inputs = made(lambda: call_inputs(task.get_inputs, "get_inputs", task.name))
        sets.append({"origin": "seed", "seed": s, "inputs": inputs})
        if i >= 1 and (i + 2) * input_bytes(inputs) > golden_input_budget():
            break  # the next set would pass the budget
    torch.manual_seed(seed + TEST_SEED_OFFSET)
    for j, inputs in enumerate(made(lambda: test_input_sets(task))):
        sets.append({"origin": "test", "seed": seed + TEST_SEED_OFFSET, "test_index": j, "inputs": inputs})
    return sets


def golden_input_budget() -> int:
    """:data:`GOLDEN_INPUT_BYTES`, or an eighth of the memory a child may use where that is less:
    the golden child also holds each set's float64 golden and native output, and its folder (where
    all of them are saved) is memory too."""
    from kernelcrew.tools.sandbox import machine_memory_limit

    return min(GOLDEN_INPUT_BYTES, machine_memory_limit() // 8)


def golden_kept_budget() -> int:
    """Bytes of input sets, float64 goldens and native outputs the golden child keeps at most: a
    sixth of the memory a child may use. It holds them in memory, then writes them to its folder
    (memory too), and needs room besides for the model and one set's outputs while it runs."""
    from kernelcrew.tools.sandbox import machine_memory_limit

    return machine_memory_limit() // 6


def input_bytes(inputs: Any) -> int:
    """Bytes of the tensors in an input set (nested lists, tuples and dicts included)."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(inputs))


def _signed_variant(inputs: list[Any], seed: int, device: str = "cpu") -> list[Any] | None:
    """Inputs with random signs on every non-negative floating tensor (nested ones too), or None if
    none is.

    The signs are drawn on ``device`` (a GPU draws a memory-bound task's hundreds of millions in
    milliseconds, where the CPU took seconds); the variant comes back on the CPU, like the inputs.
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    changed = False

    def flip(x: Any) -> Any:
        nonlocal changed
        if not (x.is_floating_point() and x.numel() > 1 and bool((x >= 0).all())):
            return x
        signs = torch.randint(0, 2, x.shape, generator=gen, device=device).to(x.dtype) * 2 - 1
        changed = True
        return (x.to(device) * signs).to(x.device)

    out = map_tensors(inputs, flip)
    return out if changed else None


def _scaled_variant(inputs: list[Any], factor: float, device: str = "cpu") -> list[Any] | None:
    """Inputs with every floating tensor of more than one element (nested ones too) multiplied by
    ``factor``, or None if there is none. Scalars stay: a 0-d tensor is more often a setting (a
    temperature, an epsilon) than data. Computed on ``device``, returned on the CPU."""
    changed = False

    def scale(x: Any) -> Any:
        nonlocal changed
        if not (x.is_floating_point() and x.numel() > 1):
            return x
        changed = True
        return (x.to(device) * factor).to(x.device)

    out = map_tensors(inputs, scale)
    return out if changed else None


def _run_golden(
    model64: Any,
    model_fp32: Any,
    inputs: list[Any],
    device: str,
    to_host: bool = True,
    native: list[Any] | None = None,
) -> tuple[list[Any], str]:
    """The reference's outputs in float64 (on the host, as :func:`stored_golden` keeps them against
    the ``native`` outputs, or where computed and unrounded when not ``to_host``) and how they were
    computed: in float32 under strict precision where an op has no float64 kernel, or where float64
    does not fit the device's memory (a 6.4 GB float32 input is 12.8 GB in float64, and the timing's
    reference process holds its sets besides); the verdict flags either."""
    import torch

    fallback = None
    with torch.no_grad():
        try:
            out = model64(*to_float64(to_device(inputs, device)))
            mode = "float64"
        except torch.OutOfMemoryError:
            fallback = "float32 (float64 did not fit the device's memory)"
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            if "Double" not in str(exc) and "double" not in str(exc) and "float64" not in str(exc):
                raise
            fallback = "float32 (an op has no float64 kernel)"
        if fallback is not None:  # out of the except block: its traceback held the float64 tensors
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            policy = "relaxed" if torch.backends.cuda.matmul.allow_tf32 else "strict"
            apply_precision("strict")  # the golden never uses TF32, whatever the job's policy
            try:
                out = model_fp32(*to_device(inputs, device))
            finally:
                apply_precision(policy)
            mode = fallback
    synchronize(device)
    outs = flatten_outputs(out)
    if not to_host:
        return outs, mode
    out = None  # the model's output structure: each float64 tensor goes once it is rounded
    outs = stored_golden(outs, native)
    return [host_copy(t) for t in outs], mode


def stored_golden(golden: list[Any], native: list[Any] | None) -> list[Any]:
    """Float64 golden outputs (the list, changed in place) as the golden keeps them: each rounded
    to float32 where the reference's own output (``native``) is float32 or narrower and rounding
    leaves every finite value finite, else as computed. Rounding moves a value by at most 2**-24
    of itself, under a thousandth of the strictest float tolerance (rtol 1e-4), and halves what a
    large task's golden copies to the host, writes and the judge reads (12.8 GB a set for a 6.4 GB
    float32 output). A golden beyond float32's range stays float64: the judge tells such elements
    apart."""
    import torch

    if native is None or len(native) != len(golden):
        return golden
    narrow = (torch.float32, torch.float16, torch.bfloat16)
    for i, n in enumerate(native):  # in place: each float64 output goes once its rounding replaces it
        if golden[i].dtype == torch.float64 and n.dtype in narrow:
            try:
                rounded = golden[i].to(torch.float32)
            except torch.OutOfMemoryError:  # no room for the rounded copy: kept as computed
                continue
            if int(torch.isinf(rounded).sum()) == int(torch.isinf(golden[i]).sum()):
                golden[i] = rounded
            del rounded
    return golden


def golden_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Make the input sets, run the reference in float64 (golden) and in its own dtype (native)."""
    import torch

    from kernelcrew.tools.anticheat import record_ops

    device, seed, policy = payload["device"], int(payload["seed"]), payload["precision"]
    apply_precision(policy)
    lap = Laps()
    try:
        task = load_task(payload["task_source"], path=payload["task_path"])
        model, _ = build_reference(task, seed, device)
        sets, inputs_note = _input_sets(task, seed, int(payload["n_seeds"]), device)
    except TaskError as exc:
        raise StageError("task", str(exc)) from exc
    lap("inputs")
    randomized = randomize_constant_parameters(model, seed + 7)
    model.eval()
    state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}

    native_model = model.to(device).eval()
    model64 = copy.deepcopy(native_model).to(torch.float64).eval()
    notes: list[str] = [inputs_note] if inputs_note else []
    seed_sets = [s for s in sets if s["origin"] == "seed"]
    if len(seed_sets) < int(payload["n_seeds"]):
        size = input_bytes(seed_sets[0]["inputs"]) / 1e9
        notes.append(
            f"{len(seed_sets)} seed input sets instead of {payload['n_seeds']}: each is {size:.1f} GB"
        )
    shapes = {tuple(describe_inputs(s["inputs"])) for s in sets if s["origin"] == "seed"}
    if len(shapes) != 1:
        notes.append("get_inputs() returned different shapes under different seeds")

    records, golden, native, input_lists = [], [], [], []
    reference_ops: dict[str, int] = {}
    golden_mode = "float64"

    def add(entry: dict[str, Any], inputs: list[Any]) -> str | None:
        """Run the reference on one input set and keep it; a variant (``of`` another set) that
        the reference cannot judge is dropped, and the reason returned."""
        nonlocal reference_ops, golden_mode
        try:
            with torch.no_grad():
                dev_inputs = to_device(inputs, device)
                if not reference_ops:
                    out, reference_ops = record_ops(native_model, *dev_inputs)
                else:
                    out = native_model(*dev_inputs)
                synchronize(device)
                alias = shares_storage(out, dev_inputs)
                nat = [host_copy(t) for t in flatten_outputs(out)]
            gold, mode = _run_golden(model64, native_model, inputs, device, native=nat)
        except Exception as exc:
            raise StageError(
                "task", f"the reference Model failed on input set {entry}: {type(exc).__name__}: {exc}"
            ) from exc
        if mode != "float64":
            golden_mode = mode
        if "of" in entry:
            reason = unusable(gold, nat, entry["of"], entry["origin"] == "scaled")
            if reason:
                return reason
        entry.update(
            index=len(records),
            shapes=describe_inputs(inputs),
            alias=alias,
            constant_output=all(g.numel() <= 1 or bool((g == g.reshape(-1)[0]).all()) for g in gold),
            zero_inputs=zero_inputs(inputs),
            bytes=input_bytes(inputs),
        )
        records.append(entry)
        golden.append(gold)
        native.append(nat)
        input_lists.append(map_tensors(inputs, lambda x: x.detach().to("cpu")))
        return None

    def used_by_pytorch(gold: list[Any], nat: list[Any]) -> float:
        """How much of the pass rule's tolerance PyTorch's own outputs use (above 1: they fail)."""
        from kernelcrew.tools.correctness import compare_output, op_class, tolerance_for

        worst = 0.0
        for g, n in zip(gold, nat, strict=True):
            tol = tolerance_for(str(n.dtype).replace("torch.", ""), op_class(reference_ops), policy)
            res = compare_output(n, g, n, tol, native_allowance=False)
            worst = max(worst, res.get("tolerance_used", 0.0) if res["ok"] else math.inf)
        return worst

    def unusable(gold: list[Any], nat: list[Any], of: int, judge_native: bool) -> str:
        def nonfinite(outs: list[Any]) -> int:
            return sum(int((~torch.isfinite(g)).sum()) for g in outs if g.is_floating_point())

        # Judged on the GPU where it has room: a large task's outputs took the CPU seconds a pass.
        where = judging_device([gold, nat, golden[of], native[of]], device)
        gold, nat = to_device(gold, where), to_device(nat, where)
        base_gold, base_nat = to_device(golden[of], where), to_device(native[of], where)
        if nonfinite(gold) > nonfinite(base_gold):
            return "the float64 reference is not finite there"
        if judge_native:
            worst = used_by_pytorch(gold, nat)
            base = used_by_pytorch(base_gold, base_nat)
            if worst > max(VARIANT_TOLERANCE_USED, 2 * base):
                used = "fails the pass rule" if math.isinf(worst) else f"uses {worst:.0%} of the tolerance"
                return (
                    f"PyTorch's own output {used} there ({base:.0%} on input set {of}): "
                    "too ill-conditioned to judge a candidate by"
                )
        return ""

    lap("model")
    kept_budget = golden_kept_budget()

    def room(inputs: list[Any]) -> bool:
        """Whether one more set fits: its inputs by :func:`golden_input_budget`, and its inputs,
        golden and native outputs (sized as the first set's) by :func:`golden_kept_budget`."""
        held = sum(input_bytes(x) for x in input_lists)
        if held + input_bytes(inputs) > golden_input_budget():
            return False
        outputs = input_bytes(golden) + input_bytes(native)
        per_set = input_bytes(golden[0]) + input_bytes(native[0]) if golden else 0
        return held + outputs + input_bytes(inputs) + per_set <= kept_budget

    dropped = 0
    for s in sets:
        inputs = s.pop("inputs")
        if len(records) >= MIN_SEED_SETS and not room(inputs):
            dropped += 1  # the outputs are what is large (a task that expands its inputs)
            continue
        add(dict(s), inputs)
    if dropped:
        per_set = (input_bytes(golden[0]) + input_bytes(native[0])) / 1e9
        notes.append(
            f"{dropped} of {len(sets)} input sets not judged: each set's golden and native outputs "
            f"are {per_set:.1f} GB, and what the golden keeps is bounded by "
            f"{kept_budget / 1e9:.0f} GB (memory)"
        )
    lap("reference")

    for rec in [r for r in records if r["origin"] == "seed"][:SIGNED_SETS]:
        if not room(input_lists[rec["index"]]):
            notes.append("signed variants not tested: the inputs are too large for more sets")
            break
        variant = _signed_variant(input_lists[rec["index"]], seed + SIGN_SEED_OFFSET + rec["index"], device)
        if variant is not None:
            add({"origin": "signed", "seed": rec["seed"], "of": rec["index"]}, variant)
    lap("signed")
    seed_records = [r for r in records if r["origin"] == "seed"]
    for k, factor in enumerate(SCALE_FACTORS):
        rec = seed_records[k % len(seed_records)]
        if not room(input_lists[rec["index"]]):
            notes.append("scaled variants not tested: the inputs are too large for more sets")
            break
        variant = _scaled_variant(input_lists[rec["index"]], factor, device)
        if variant is None:
            break  # no floating input: no factor applies
        reason = add({"origin": "scaled", "seed": rec["seed"], "of": rec["index"], "factor": factor}, variant)
        if reason:
            notes.append(f"scaled variant x{factor:g} of input set {rec['index']} not tested: {reason}")
    lap("scaled")

    first = native[0]
    result = {
        "sets": records,
        "reference_ops": reference_ops,
        "golden_mode": golden_mode,
        "randomized_parameters": randomized,
        "outputs": [{"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)} for t in first],
        "output_bytes": input_bytes(first),
        "device_memory": torch.cuda.get_device_properties(device).total_memory
        if device.startswith("cuda")
        else None,
        "notes": notes,
    }
    first = inputs = variant = None  # the last set's tensors, held by these names too
    out = workdir / "child"  # the only directory a child may write; the parent moves these out
    # The folder is memory too: each list is let go once it is written, so what is held at once
    # is the data plus its largest file, not the data twice.
    save_tensors(state, out / "state_dict.pt")
    for name, kept in (("inputs.pt", input_lists), ("golden.pt", golden), ("native.pt", native)):
        save_tensors(kept, out / name)
        kept.clear()
    lap("save")
    return {"phase_s": lap.seconds, **result}


# ----------------------------------------------------------------------------------------------
# Candidate child: build, load weights, run every check that needs the candidate's process
# ----------------------------------------------------------------------------------------------


def _stage_error_from(exc: BaseException, stage: str, where: str, source: str, path: str) -> StageError:
    from kernelcrew.tools.build import describe_exception

    build_error = describe_exception(exc, path, source)
    if build_error is not None:
        return build_error
    line = None
    import traceback as tb

    for frame in tb.extract_tb(exc.__traceback__):
        if frame.filename == path:
            line = frame.lineno
    message = f"{type(exc).__name__}: {exc}"[:2000]
    return StageError(stage, f"{where}: {message}", line=line, error_type=type(exc).__name__)


def load_candidate_model(
    task: Task, source: str, path: str, seed: int, state: dict[str, Any], device: str
) -> tuple[Any, Any, dict[str, Any]]:
    """Build ``ModelNew`` and give it the reference's weights; returns (model, reference or None, build)."""
    import torch

    from kernelcrew.tools.anticheat import snapshot_state, state_changes
    from kernelcrew.tools.build import BuildError, instrument_builds, load_candidate_module

    before = snapshot_state((path,))
    try:
        cls, report = load_candidate_module(source, path)
    except BuildError:
        raise
    except TaskError as exc:
        raise StageError("build", str(exc), line=exc.line) from exc
    changes = state_changes(before, snapshot_state((path,)))
    if changes:
        raise StageError("state", "importing the candidate changed global state: " + "; ".join(changes))

    torch.manual_seed(seed + INIT_SEED_OFFSET)
    init = call_inputs(task.get_init_inputs, "get_init_inputs", task.name)
    # The calls' own snapshots are taken after this: a change made while ModelNew is built and
    # given its weights would be the state every call starts from, seen by none of them.
    before = snapshot_state((path,))
    try:
        with instrument_builds(source, report, path):  # extensions built in __init__ are recorded too
            model = construct_on(device, lambda: cls(*init), seed + INIT_SEED_OFFSET)
    except BaseException as exc:
        raise _stage_error_from(exc, "init", "ModelNew(*get_init_inputs()) raised", source, path) from exc

    reference = None
    if callable(getattr(model, "load_reference", None)):
        reference, _ = build_reference(task, seed, device)
        reference.load_state_dict(state)
        try:
            model.load_reference(reference)
        except BaseException as exc:
            raise _stage_error_from(exc, "weights", "ModelNew.load_reference raised", source, path) from exc
        if _holds_reference(model, reference):
            raise StageError(
                "static", "ModelNew keeps a reference to the reference Model after load_reference"
            )
    else:
        try:
            result = model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise StageError(
                "weights",
                "the reference's weights do not load into ModelNew by state dict "
                f"({str(exc).splitlines()[0]} ...); keep the same parameter names and shapes, "
                "or define ModelNew.load_reference(model)",
                detail=str(exc)[:2000],
            ) from exc
        del result
    changes = state_changes(before, snapshot_state((path,)))
    if changes:
        raise StageError(
            "state", "building ModelNew or loading its weights changed global state: " + "; ".join(changes)
        )
    model = model.to(device).eval()
    return model, reference, report.to_dict()


def _holds_reference(model: Any, reference: Any) -> bool:
    import torch

    targets = {id(m) for m in reference.modules()}
    seen: set[int] = set()
    stack: list[Any] = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if id(obj) in targets:
            return True
        if isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, torch.nn.Module):
            stack.extend(obj.__dict__.values())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set):
            stack.extend(obj)
    return False


def candidate_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Build the candidate and run it on every input set, plus the repeat and caching sequences."""
    import torch

    from kernelcrew.tools import kinds
    from kernelcrew.tools.anticheat import output_problems, snapshot_state, state_changes

    device, seed, policy = payload["device"], int(payload["seed"]), payload["precision"]
    source, path = payload["candidate_source"], payload["candidate_path"]
    apply_precision(policy)
    task = load_task(payload["task_source"], path=payload["task_path"])
    state = torch.load(workdir / "state_dict.pt", weights_only=True, mmap=True)
    input_lists = torch.load(workdir / "inputs.pt", weights_only=True, mmap=True)
    sets = payload["sets"]
    lap = Laps()

    model, _reference, build = load_candidate_model(task, source, path, seed, state, device)
    lap("build")
    checks: list[dict[str, Any]] = [{"name": "build", "passed": True, "detail": build}]
    outputs: dict[str, list[Any]] = {}

    def call(inputs: list[Any], label: str, mode: Any = None) -> Any:
        before = snapshot_state((path,))
        snapshot = clone_tensors(inputs)
        try:
            with mode() if mode is not None else torch.no_grad():
                out = model(*inputs)
            synchronize(device)
        except BaseException as exc:
            raise _stage_error_from(exc, "runtime", f"forward on {label} raised", source, path) from exc
        changes = state_changes(before, snapshot_state((path,)))
        if changes:
            raise StageError(
                "state", f"calling the candidate on {label} changed global state: " + "; ".join(changes)
            )
        changed = inputs_unchanged(snapshot, inputs)
        if changed is not None:
            raise StageError(
                "inputs_mutated", f"the candidate modified input {path_label(changed)} in place on {label}"
            )
        if shares_storage(out, inputs) and not payload["reference_aliases"]:
            raise StageError("aliasing", f"an output of the candidate aliases an input on {label}")
        problems = output_problems(out)
        if problems:
            raise StageError("output_type", f"the candidate's output on {label}: " + "; ".join(problems[:3]))
        return out

    handed_out: list[tuple[str, list[Any], list[Any], list[Any]]] = []  # must survive later calls
    notes: list[str] = []
    picks: dict[str, list[Any]] = {}
    room = _check_memory(device)
    resident = room is None or sum(input_bytes(s) for s in input_lists) <= room
    held_bytes = 0

    # The parent's choice (correctness.sampled_sets): a large task's later seed sets, sampled.
    sampled = {int(k): int(v) for k, v in (payload.get("sampled_sets") or {}).items()}

    def keep(key: str, out: Any, hold: bool = False) -> None:
        nonlocal held_bytes
        tensors = flatten_outputs(out)
        if key.startswith("set:") and int(key[4:]) not in sampled:
            outputs[key], picks[key] = [host_copy(t) for t in tensors], [None] * len(tensors)
        elif key.startswith("set:"):
            outputs[key], picks[key] = sample_outputs(tensors, sampled[int(key[4:])])
        else:
            outputs[key], picks[key] = sample_outputs(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors)
        if hold and (room is None or held_bytes + size <= room):
            held_bytes += size
            handed_out.append((key, tensors, outputs[key], picks[key]))

    pinned: dict[int, list[Any]] = {}

    def on_device(index: int, pin: bool = False) -> list[Any]:
        """Input set ``index`` on the device: kept there for good when all sets fit (or ``pin``),
        otherwise moved for this call only."""
        if index in pinned:
            return pinned[index]
        inputs = to_device(input_lists[index], device)
        if resident or pin:
            pinned[index] = inputs
        return inputs

    with poisoned_memory():
        first_set = sets[0]["index"]
        for i, rec in enumerate(sets):
            label = f"input set {rec['index']} ({rec['origin']})"
            out = call(on_device(rec["index"], pin=i == 0), label)
            keep(f"set:{rec['index']}", out, hold=i < HELD_OUTPUTS)
            del out
        checks.append({"name": "all input sets", "passed": True, "detail": f"{len(sets)} sets ran"})
        if not resident:
            notes.append("input sets moved to the device one call at a time (they do not fit at once)")
        lap("input_sets")

        # The same inputs twice: same output, and the first output must survive the second call.
        first = call(on_device(first_set), "input set 0 (repeat 1)")
        first_copy = clone_tensors(flatten_outputs(first))
        second = call(on_device(first_set), "input set 0 (repeat 2)")
        keep("repeat:0", second)
        declared = bool(getattr(type(model), "NONDETERMINISTIC", False))
        held = all(_bitwise_equal(a, b) for a, b in zip(first_copy, flatten_outputs(first), strict=True))
        if not held:
            raise StageError(
                "cache", "the first call's output changed during the second call (a reused output buffer)"
            )
        same = all(_bitwise_equal(a, b) for a, b in zip(first_copy, flatten_outputs(second), strict=True))
        if not same and not declared:
            raise StageError(
                "determinism",
                "two calls on the same inputs gave different outputs; declare NONDETERMINISTIC = True on "
                "ModelNew if a reduction order varies, and it is then checked within tolerance",
            )
        checks.append(
            {
                "name": "repeat",
                "passed": True,
                "detail": "bitwise equal" if same else "declared nondeterministic",
            }
        )
        del first, first_copy, second

        # A user's call may run with autograd on or in inference mode: the same answer there. A
        # candidate that cannot run so (torch.compile refuses an in-place update its backward
        # would need, where eager runs the forward) is noted, not failed: the task is a forward.
        # Left out when the parent says so (kernelcrew's own torch.compile of the reference).
        modes = (("grad", torch.enable_grad), ("inference", torch.inference_mode))
        for mode_name, mode in modes if payload.get("mode_checks", True) else ():
            try:
                out = call(clone_tensors(on_device(first_set)), f"input set 0 with {mode_name} mode", mode)
            except StageError as exc:
                if exc.stage not in ("runtime", "build"):
                    raise
                notes.append(f"does not run in {mode_name} mode: {exc.message[:200]}")
                continue
            keep(f"{mode_name}:{first_set}", out)
            del out

        # Caching by address or call count: A, B, A's data at a new address, B's data at A's address.
        seeds = [r["index"] for r in sets if r["origin"] == "seed"]
        a, b = seeds[0], seeds[1] if len(seeds) > 1 else None
        if b is not None and describe_inputs(input_lists[a]) == describe_inputs(input_lists[b]):
            at_a, at_b = on_device(a, pin=True), on_device(b, pin=True)
            keep(f"seq:A:{a}", call(at_a, "cache sequence A"), hold=True)
            keep(f"seq:B:{b}", call(at_b, "cache sequence B"), hold=True)
            keep(
                f"seq:A_new_address:{a}",
                call(clone_tensors(at_a), "cache sequence A at a new address"),
                hold=True,
            )
            copy_into(at_a, at_b)
            keep(f"seq:B_at_A_address:{b}", call(at_a, "cache sequence B's data at A's address"))
            checks.append(
                {
                    "name": "cache sequence",
                    "passed": None,
                    "detail": "A, B, A at new address, B at A's address",
                }
            )

        # Every output handed out must stay as it was: a candidate that writes each call into
        # one (or a few) buffers of its own overwrites what an earlier caller still holds.
        for key, live, copies, picked in handed_out:
            now = [
                t.detach() if p is None else t.detach().reshape(-1)[p["positions"].to(t.device)]
                for t, p in zip(live, picked, strict=True)
            ]
            if not all(_bitwise_equal(t.to("cpu"), c) for t, c in zip(now, copies, strict=True)):
                raise StageError(
                    "cache",
                    f"the output of an earlier call ({key.rsplit(':', 1)[0]}) changed during later calls: "
                    "an output buffer reused across calls",
                )

    lap("checks")
    # Whose kernels did the work: a profile of calls on the seed sets, outside the poisoned memory.
    kind, kind_evidence = None, {"note": "decided by the timing that follows"}
    if payload.get("profile_kind", True):
        profiled = [on_device(r["index"]) for r in sets if r["origin"] == "seed"] or [on_device(first_set)]
        reps = KIND_CALLS_VERIFY if device.startswith("cuda") else 1
        kind, kind_evidence = kinds.profile_kind(
            lambda inputs: model(*inputs), profiled, device=device, own=kinds.own_names(source), reps=reps
        )
        lap("kind")
    save_tensors(outputs, workdir / "child" / "outputs.pt")
    save_tensors(picks, workdir / "child" / "picks.pt")
    lap("save")
    return {
        "phase_s": lap.seconds,
        "checks": checks,
        "build": build,
        "kind": kind,
        "kind_evidence": kind_evidence,
        "notes": notes,
        "nondeterministic": declared,
    }


def _check_memory(device: str) -> int | None:
    """Bytes of GPU memory a verification child holds input sets and outputs in
    (:data:`CHECK_MEMORY_SHARE` of what is free); None off a GPU, where nothing is copied."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(CHECK_MEMORY_SHARE * free)


def sample_outputs(tensors: list[Any], count: int | None = None) -> tuple[list[Any], list[Any]]:
    """What is kept of a re-check call's outputs (or a sampled input set's, ``count`` elements
    each: ``correctness.sampled_sets``): a tensor of at most ``count`` (``RECHECK_ELEMENTS``)
    elements in full, a larger one at that many positions drawn from ``os.urandom`` after the call
    returned (the state checks make sure the candidate has not replaced it), with the positions and
    the shape. A re-check catches a replayed, cached or mode-dependent answer: wrong nearly
    everywhere, so a random sample finds it as surely as the whole output, and a large task's
    re-checks no longer cost GBs of copies, files and judging each."""
    import torch

    from kernelcrew.tools.correctness import RECHECK_ELEMENTS

    count = RECHECK_ELEMENTS if count is None else count
    kept, picks = [], []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel() <= count:
            kept.append(host_copy(t))
            picks.append(None)
            continue
        generator = torch.Generator(device=flat.device).manual_seed(int.from_bytes(os.urandom(8)) >> 2)
        positions = torch.randint(0, flat.numel(), (count,), generator=generator, device=flat.device)
        kept.append(flat[positions].to("cpu"))
        picks.append({"positions": positions.to("cpu"), "shape": list(t.shape)})
    return kept, picks


def memcheck_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run the candidate once on the smallest input set (under compute-sanitizer, by the parent)."""
    import torch

    device, seed = payload["device"], int(payload["seed"])
    apply_precision(payload["precision"])
    task = load_task(payload["task_source"], path=payload["task_path"])
    state = torch.load(workdir / "state_dict.pt", weights_only=True, mmap=True)
    input_lists = torch.load(workdir / "inputs.pt", weights_only=True, mmap=True)
    sizes = [sum(t.numel() for _, t in iter_tensors(s)) for s in input_lists]
    index = sizes.index(min(sizes))
    model, _ref, _build = load_candidate_model(
        task, payload["candidate_source"], payload["candidate_path"], seed, state, device
    )
    with torch.no_grad():
        model(*to_device(input_lists[index], device))
    synchronize(device)
    return {"set": index}


# ----------------------------------------------------------------------------------------------
# Benchmark servers: the reference and the candidates in separate processes, timed in lockstep
# ----------------------------------------------------------------------------------------------


def make_input_sets(task: Task, seed: int, count: int) -> list[list[Any]]:
    """``count`` input sets from ``get_inputs()`` under seeds derived from ``seed`` (for timing only)."""
    import torch

    sets = []
    for i in range(count):
        torch.manual_seed(seed + 1 + i)
        sets.append(call_inputs(task.get_inputs, "get_inputs", task.name))
    return sets


#: Inputs above this size are not made a second time to compile ahead: the golden child holds
#: the same task's inputs (and their float64 copies) on the device at the same time.
WARMUP_INPUT_BYTES = 1024**3


def compile_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Compile the reference in each of ``compile_modes`` into the reference's build cache, on the
    first seed set's shapes, while the golden child works: the benchmark's reference process then
    loads the build instead of compiling it (the compile's CPU work overlaps the golden's)."""
    import torch

    from kernelcrew.tools import timing

    device, seed = payload["device"], int(payload["seed"])
    apply_precision(payload["precision"])
    task = load_task(payload["task_source"], path=payload["task_path"])
    reference, _ = build_reference(task, seed, device)
    reference = reference.to(device).eval()
    inputs = _input_sets(task, seed, 1, device)[0][0]["inputs"]  # the golden's first seed set
    size = input_bytes(inputs)
    if size > WARMUP_INPUT_BYTES:
        return {"compile_s": {}, "skipped": f"inputs of {size / 1e9:.1f} GB"}
    dev = timing._resolve_device(device)
    compile_s = {}
    with timing._on_device(dev):
        inputs = to_device(inputs, device)
        with torch.no_grad():
            reference(*inputs)
        for mode in payload["compile_modes"]:
            compile_s[mode] = round(timing.compile_baseline(reference, mode, inputs)[1], 3)
    forget_tuning(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    return {"compile_s": compile_s}


def forget_tuning(inductor_cache: Path) -> int:
    """Remove Inductor's autotuning choices (``*.best_config``) from a build, keeping its kernels.

    They were timed while the golden child shared the device: the timing run's reference tunes
    again on a quiet device (every configuration is built already, so that is only timing), and
    the compile baseline is never one tuned under load. Returns how many were removed."""
    removed = 0
    for path in inductor_cache.rglob("*.best_config"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _timing_inputs(task: Task, payload: dict[str, Any], workdir: Path) -> tuple[list[Any], dict[str, Any]]:
    """The input sets and weights both benchmark servers time with: the golden's shared files, or
    the same ones made again from the seed (randomized constant parameters included)."""
    import torch

    seed = int(payload["seed"])
    if (workdir / "inputs.pt").exists():
        input_lists = torch.load(workdir / "inputs.pt", weights_only=True, mmap=True)
        input_lists = [input_lists[i] for i in payload.get("set_indices", range(len(input_lists)))]
        state = torch.load(workdir / "state_dict.pt", weights_only=True, mmap=True)
        return input_lists, state
    reference, _ = build_reference(task, seed)
    randomize_constant_parameters(reference, seed + 7)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    return make_input_sets(task, seed, int(payload.get("n_sets", 3))), state


def _timing_config(payload: dict[str, Any]) -> Any:
    from kernelcrew.tools import timing

    config = timing.TimingConfig.quick() if payload.get("quick") else timing.TimingConfig()
    if payload.get("max_time_s"):
        config.max_time_s = float(payload["max_time_s"])
    return config


def reference_server(payload: dict[str, Any], workdir: Path, channel: Any) -> dict[str, Any]:
    """The reference's side of a benchmark: eager and ``torch.compile`` timed on request, then the
    golden of every judged timed call and the hotspot profile. No candidate code ever runs in this
    process, so no candidate can slow the baseline down or see what is judged."""
    from kernelcrew.tools import hardware, timing
    from kernelcrew.tools.anticheat import record_ops

    device, seed, policy = payload["device"], int(payload["seed"]), payload["precision"]
    apply_precision(policy)
    task = load_task(payload["task_source"], path=payload["task_path"])
    input_lists, state = _timing_inputs(task, payload, workdir)
    reference, _ = build_reference(task, seed, device)
    reference.load_state_dict(state)
    reference = reference.to(device).eval()
    dev = timing._resolve_device(device)
    with timing._on_device(dev):
        dev_sets = [to_device(s, device) for s in input_lists]
        out, reference_ops = record_ops(reference, *dev_sets[0])
        output_bytes = sum(t.numel() * t.element_size() for t in flatten_outputs(out))
        del out
        callables: dict[str, Any] = {"eager": lambda inputs: reference(*inputs)}
        compile_s: dict[str, float] = {}
        compile_errors: dict[str, str] = {}
        for mode in payload.get("compile_modes", []):
            try:
                fn, seconds = timing.compile_baseline(reference, mode, dev_sets[0])
            except Exception as exc:  # a compiler failure is reported, the other baselines still run
                compile_errors[mode] = f"{type(exc).__name__}: {exc}"[:500]
                continue
            callables[f"compile:{mode}"] = fn
            compile_s[mode] = round(seconds, 3)
        lane = timing.Lane(callables, dev_sets, dev, _timing_config(payload), fresh=True)
        while (message := channel.receive()) is not None:
            op = message["op"]
            if op == "ready":
                reply = {
                    **lane.info(),
                    "compile_s": compile_s,
                    "compile_errors": compile_errors,
                    "reference_ops": reference_ops,
                    "output_bytes": output_bytes,
                    "hardware": hardware.detect(device).to_dict(),
                    "versions": hardware.versions(),
                }
            elif op == "golden":
                _judged_goldens(reference, dev_sets, message["samples"], device, workdir / "child")
                reply = {}
            elif op == "profile":
                reply = profile_reference(reference, dev_sets[0], device, policy)
            else:
                reply = lane.handle(message)
            channel.reply(reply)
    return {}


def _judged_goldens(
    model: Any, dev_sets: list[Any], samples: dict[str, list[Any]], device: str, out_dir: Path
) -> None:
    """The float64 golden and the native output of each judged call ``{key: [name, set, seed,
    pick]}`` (the same fresh data the candidate got, the same elements picked), saved to
    ``judged.pt`` for the parent."""
    import torch

    from kernelcrew.tools import timing

    model64 = copy.deepcopy(model).to(torch.float64).eval()
    judged: dict[str, dict[str, Any]] = {}
    for key, (_name, set_index, seed, pick) in samples.items():
        inputs = dev_sets[set_index] if seed is None else timing.fresh_inputs(dev_sets[set_index], seed)
        with torch.no_grad():
            native = timing.pick_elements(flatten_outputs(model(*inputs)), pick)
        golden, mode = _run_golden(model64, model, inputs, device, to_host=False)
        judged[key] = {"golden": timing.pick_elements(golden, pick), "native": native, "mode": mode}
        del golden
    save_tensors(judged, out_dir / "judged.pt")


def fresh_sets_that_fit(inputs: Any, wanted: int, device: str) -> int:
    """How many fresh copies of ``inputs`` to hold at once on ``device``: ``wanted``, or on a GPU as
    many as half its free memory holds, one at least. The kind's profile cycles through them; ten
    copies of an attention task's 6 GB inputs ran an H100 out of memory."""
    if not device.startswith("cuda"):
        return wanted
    import torch

    size = input_bytes(inputs)
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return max(1, min(wanted, int(free // 2 // max(size, 1))))


def candidate_server(payload: dict[str, Any], workdir: Path, channel: Any) -> dict[str, Any]:
    """The candidates' side of a benchmark: each candidate timed on request with fresh data; the
    outputs the parent chose to judge (told only after each rep) are written to ``samples.pt``;
    each candidate's kind from a profile of calls on fresh data (:mod:`kernelcrew.tools.kinds`).
    Global state and every output are checked after every call."""

    from kernelcrew.tools import kinds, timing
    from kernelcrew.tools.anticheat import output_problems, snapshot_state, state_changes

    device, seed, policy = payload["device"], int(payload["seed"]), payload["precision"]
    apply_precision(policy)
    task = load_task(payload["task_source"], path=payload["task_path"])
    input_lists, state = _timing_inputs(task, payload, workdir)
    dev = timing._resolve_device(device)
    builds: dict[str, Any] = {}
    callables: dict[str, Any] = {}
    for name, cand in payload["candidates"].items():
        model, _ref, build = load_candidate_model(task, cand["source"], cand["path"], seed, state, device)
        builds[name] = build
        callables[name] = lambda inputs, m=model: m(*inputs)
    candidate_files = tuple(c["path"] for c in payload["candidates"].values())
    own = {name: kinds.own_names(cand["source"]) for name, cand in payload["candidates"].items()}

    with timing._on_device(dev):
        dev_sets = [to_device(s, device) for s in input_lists]
        baseline_state = snapshot_state(candidate_files)  # as the timer runs every call: grad off

        calls = [0]

        def check_call(name: str, out: Any) -> None:
            calls[0] += 1
            if calls[0] % STATE_CHECK_EVERY == 1:  # a change that persists is seen within a few reps
                changes = state_changes(baseline_state, snapshot_state(candidate_files))
                if changes:
                    raise StageError("state", f"timing {name} changed global state: " + "; ".join(changes))
            problems = output_problems(out)
            if problems:
                raise StageError("timed_output", f"{name}: " + "; ".join(problems[:3]))

        lane = timing.Lane(
            callables, dev_sets, dev, _timing_config(payload), fresh=True, check_call=check_call
        )
        while (message := channel.receive()) is not None:
            if message["op"] == "ready":
                reply = {**lane.info(), "builds": builds}
            elif message["op"] == "kinds":
                seeds = message["seeds"]
                fresh = [
                    timing.fresh_inputs(dev_sets[i % len(dev_sets)], seed)
                    for i, seed in enumerate(seeds[: fresh_sets_that_fit(dev_sets[0], len(seeds), device)])
                ]
                reply = {}
                for name, fn in callables.items():
                    kind, evidence = kinds.profile_kind(
                        fn, fresh, device=device, own=own[name], reps=len(seeds)
                    )
                    reply[name] = {"kind": kind, "evidence": evidence}
            else:
                reply = lane.handle(message)
            channel.reply(reply)
        changes = state_changes(baseline_state, snapshot_state(candidate_files))
        if changes:
            raise StageError("state", "timing changed global state: " + "; ".join(changes))
        save_tensors(lane.kept, workdir / "child" / "samples.pt")
    return {"builds": builds}


# ----------------------------------------------------------------------------------------------
# Profile child: the reference's kernels ranked by time (Amdahl's view of a multi-op module)
# ----------------------------------------------------------------------------------------------


def _profiled_model(payload: dict[str, Any], workdir: Path) -> tuple[Any, list[Any]]:
    """The reference (or ``payload["candidate_source"]``'s ModelNew) with the shared weights, on the
    payload's device and precision, and the first shared input set."""
    import torch

    device, seed = payload["device"], int(payload["seed"])
    apply_precision(payload["precision"])
    task = load_task(payload["task_source"], path=payload["task_path"])
    state = torch.load(workdir / "state_dict.pt", weights_only=True, mmap=True)
    inputs = to_device(torch.load(workdir / "inputs.pt", weights_only=True, mmap=True)[0], device)
    if payload.get("candidate_source"):
        model, _ref, _build = load_candidate_model(
            task, payload["candidate_source"], payload["candidate_path"], seed, state, device
        )
        return model, inputs
    model, _ = build_reference(task, seed, device)
    model.load_state_dict(state)
    return model.to(device).eval(), inputs


def profile_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """:func:`profile_reference` of the reference with the shared weights and first input set."""
    model, inputs = _profiled_model(payload, workdir)
    return profile_reference(model, inputs, payload["device"], payload["precision"])


def profile_reference(model: Any, inputs: list[Any], device: str, precision: str) -> dict[str, Any]:
    """Run ``model`` a few times under torch.profiler and rank what it spends its time on.

    On a GPU the ranking is by device kernels (self device time); on a CPU by aten ops (self CPU
    time), and it says so. ``share`` is each entry's fraction of the total: the most a kernel
    replacing that entry alone can save. ``work`` is what the floor is computed from.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    work = measure_work(model, inputs, precision)
    on_gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch.no_grad():
        for _ in range(3):  # warm-up: cuBLAS handles, autotuning
            model(*inputs)
        synchronize(device)
        reps = 5
        with profile(activities=activities) as prof:
            for _ in range(reps):
                model(*inputs)
            synchronize(device)
    rows = rank_hotspots(prof.key_averages(), on_gpu, reps)
    whole = sum(r["time_us"] for r in rows) or 1.0
    return {
        "device": device,
        "clock": "cuda kernels (self device time)" if on_gpu else "cpu aten ops (self CPU time)",
        "total_us": whole,
        "hotspots": rows[:15],
        "work": work,
    }


#: Device-time entries of the profiler itself, not of the module: CUPTI reports the time it spends
#: handing out activity buffers as if it were a kernel.
PROFILER_OVERHEAD = frozenset({"Activity Buffer Request"})


def rank_hotspots(events: Any, on_gpu: bool, reps: int) -> list[dict[str, Any]]:
    """The module's kernels (GPU) or aten ops (CPU) by time per call, each with its share."""
    rows = []
    for evt in events:
        if on_gpu:
            total = float(
                getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0)
            )
            if total <= 0 or evt.key.startswith("aten::") or evt.key in PROFILER_OVERHEAD:
                continue
        else:
            total = float(evt.self_cpu_time_total)
            if total <= 0 or not evt.key.startswith("aten::"):
                continue
        rows.append({"name": evt.key, "calls": int(evt.count) // reps, "time_us": total / reps})
    rows.sort(key=lambda r: r["time_us"], reverse=True)
    whole = sum(r["time_us"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["time_us"] / whole
    return rows


_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_convolution", "linear")
_NO_COMPUTE_OPS = (
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "permute",
    "transpose",
    "t",
    "clone",
    "contiguous",
    "copy_",
    "detach",
    "alias",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "empty",
    "empty_like",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "_to_copy",
    "lift_fresh",
    "split",
    "split_with_sizes",
    "cat",
    "stack",
    "index_select",
    "gather",
    "unbind",
    "narrow",
)


def measure_work(model: Any, inputs: list[Any], precision: str) -> dict[str, Any]:
    """What one forward must do at the least: the bytes it must move and the flops it must run.

    ``bytes``: every input, parameter, buffer and output once (intermediates are assumed to stay on
    chip: the floor of a perfectly fused kernel). ``matmul_flops``: torch's own flop counter (matmul,
    convolution, attention). ``other_flops``: one flop per output element of every other op that
    computes (a lower bound; data movement ops count nothing). ``matmul_dtype``: the dtype the
    matmuls run in, with the precision policy, which picks the compute peak (``fp32`` SIMT under
    ``strict``, ``tf32`` under ``relaxed``, ``fp16``, ``bf16``, ``fp8``).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    def nbytes(obj: Any) -> int:
        return sum(t.numel() * t.element_size() for t in flatten_outputs(obj) if isinstance(t, torch.Tensor))

    tensors_in = [x for x in inputs if isinstance(x, torch.Tensor)]
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    dtypes: dict[str, int] = {}
    other = [0]

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__.rstrip("_") if hasattr(func, "overloadpacket") else str(func)
            if name in _MATMUL_OPS or "scaled_dot_product" in name:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    key = str(first.dtype).replace("torch.", "")
                    dtypes[key] = dtypes.get(key, 0) + 1
            elif name not in _NO_COMPUTE_OPS:
                other[0] += sum(t.numel() for t in flatten_outputs(out) if isinstance(t, torch.Tensor))
            return out

    with torch.no_grad():
        counter = FlopCounterMode(display=False)
        with counter:
            out = model(*inputs)
        with _Ops():
            model(*inputs)
    matmul_dtype = max(dtypes, key=lambda k: dtypes[k]) if dtypes else None
    peak_class = None
    if matmul_dtype is not None:
        peak_class = {
            "float32": "tf32" if precision == "relaxed" else "fp32",
            "float16": "fp16",
            "bfloat16": "bf16",
            "float8_e4m3fn": "fp8",
            "float8_e5m2": "fp8",
            "float64": "fp64",
        }.get(matmul_dtype, "fp32")
    return {
        "bytes": sum(t.numel() * t.element_size() for t in tensors_in) + state_bytes + nbytes(out),
        "input_bytes": sum(t.numel() * t.element_size() for t in tensors_in),
        "state_bytes": state_bytes,
        "output_bytes": nbytes(out),
        "matmul_flops": int(counter.get_total_flops()),
        "other_flops": int(other[0]),
        "matmul_dtype": matmul_dtype,
        "compute_class": peak_class,
    }


def ncu_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run the reference (or the candidate) under Nsight Compute (the parent wraps this child in ncu).

    Warm-up calls run outside any range, so JIT compilation, autotuning and cuBLAS set-up are never
    profiled; then ``calls`` forwards run inside the NVTX range that ncu filters on.
    """
    import torch

    from kernelcrew.tools.ncu import NVTX_RANGE

    device = payload["device"]
    model, inputs = _profiled_model(payload, workdir)
    calls = max(int(payload.get("calls", 1)), 1)
    with torch.no_grad():
        for _ in range(3):
            model(*inputs)
        synchronize(device)
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        for _ in range(calls):
            model(*inputs)
        synchronize(device)
        torch.cuda.nvtx.range_pop()
    return {"calls": calls}
