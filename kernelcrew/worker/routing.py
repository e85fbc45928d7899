"""Queue routing: which queue a request goes to, given the GPU it asks for and the workers online.

Queues are named by GPU model (``gpu.h100-sxm``), then by architecture (``gpu.sm_90``), and ``cpu``
for machines without a GPU. Every GPU worker serves its model's and its architecture's queue, so a
request for a model goes to that model's queue when a worker serves it, else to its architecture's
queue (another model of the same architecture: same kernels, different timings), else it fails
with a clear error naming what is online. Nothing waits in a queue that no worker serves.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import NoReturn

from kernelcrew.tools.hardware import CPU_QUEUE, GPU_QUEUE_PREFIX, GpuRequest, arch_of_model
from kernelcrew.worker.errors import NoWorkerOnline
from kernelcrew.worker.inventory import WorkerInfo

_ARCH = re.compile(r"sm_\d+[a-z]?")


def model_queue(model: str) -> str:
    return f"{GPU_QUEUE_PREFIX}{model}"


def arch_queue(arch: str) -> str:
    return f"{GPU_QUEUE_PREFIX}{arch}"


def served_queues(workers: Iterable[WorkerInfo]) -> Counter[str]:
    """How many workers online serve each queue."""
    counts: Counter[str] = Counter()
    for worker in workers:
        counts.update(set(worker.queues))
    return counts


def pick_queue(workers: Iterable[WorkerInfo], gpu: str | None = None, *, device: str = "cuda") -> str:
    """The queue for a request on ``device`` (``cuda`` or ``cpu``) asking for ``gpu``.

    * ``device="cpu"`` (or ``gpu="cpu"``): the ``cpu`` queue;
    * a model: its queue if a worker serves it, else its architecture's queue;
    * an architecture: its queue;
    * no preference: the model queue with the most workers online (ties by name).

    Raises :class:`NoWorkerOnline` when no worker online serves a suitable queue, and
    ``ValueError`` for a contradictory request (a GPU model for a CPU run).
    """
    online = list(workers)
    served = served_queues(online)
    want = GpuRequest.parse(gpu)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"unknown device {device!r}: expected 'cuda' or 'cpu'")
    if want.kind == "cpu" and device == "cuda":
        raise ValueError("gpu='cpu' was asked for a request whose device is cuda")
    if device == "cpu":
        if want.kind in ("model", "arch"):
            raise ValueError(f"the request runs on the CPU but asks for GPU {want}")
        if served[CPU_QUEUE]:
            return CPU_QUEUE
        _raise("the CPU", [CPU_QUEUE], served)

    if want.kind == "model":
        assert want.value is not None
        tried = [model_queue(want.value)]
        if served[tried[0]]:
            return tried[0]
        arch = arch_of_model(want.value) or _arch_seen(online, want.value)
        if arch:
            tried.append(arch_queue(arch))
            if served[tried[1]]:
                return tried[1]
        _raise(f"GPU model {want.value}", tried, served, known_arch=arch is not None)
    if want.kind == "arch":
        assert want.value is not None
        queue = arch_queue(want.value)
        if served[queue]:
            return queue
        _raise(f"architecture {want.value}", [queue], served)

    models = {
        model_queue(w.model): served[model_queue(w.model)]
        for w in online
        if w.device == "cuda" and served[model_queue(w.model)]
    }
    if models:
        return sorted(models.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    gpu_queues = sorted(q for q in served if q.startswith(GPU_QUEUE_PREFIX))
    if gpu_queues:  # workers started with --queues: any GPU queue will do
        return gpu_queues[0]
    _raise("a GPU", [f"{GPU_QUEUE_PREFIX}*"], served)


def _arch_seen(workers: list[WorkerInfo], model: str) -> str | None:
    """The architecture of ``model`` as a worker once reported it (for models the table lacks)."""
    for worker in workers:
        if worker.gpu and worker.model == model:
            return worker.arch
    return None


def _raise(what: str, tried: list[str], served: Counter[str], *, known_arch: bool = True) -> NoReturn:
    online = ", ".join(f"{q} ({n} worker{'s' if n != 1 else ''})" for q, n in sorted(served.items()))
    unknown = "" if known_arch else " (its architecture is unknown, so no architecture queue can stand in)"
    raise NoWorkerOnline(
        f"no worker online for {what}: nothing serves {' or '.join(tried)}{unknown}; "
        f"online: {online or 'no workers at all'} (start one with `kernelcrew worker`)"
    )
