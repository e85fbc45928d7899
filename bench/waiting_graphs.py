"""The waiting launch's kept row counters on a GPU: repeated calls, streams and CUDA graphs.

The waiting launch (``rowwise.WAIT_PART``) keeps its per-row counters between calls (no memset
before each launch): a call's programs find their target from the counts. This script checks that
the candidate stays correct wherever that could go wrong, each call against a float64 reference on
inputs it has not seen before:

* many eager calls in a row, with two shapes in turn (each shape has its own counters);
* calls on a second stream (its own counters), then on the default one again;
* a CUDA graph captured around the module (the capture takes fresh zeroed counters, and the memset
  with them) and replayed with new data copied into its static input.

Each GroupNorm task of ``waiting_rows.py`` runs with the suite's configuration (parts of 8192
columns, lag 28) and with an unlagged one. Writes ``waiting_graphs.json`` and ``.md``.

    python bench/waiting_graphs.py OUT_DIR [TASK.py ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from split_rows import build_candidate, rel_error, row_setup, run_suite  # noqa: E402
from waiting_rows import TASKS  # noqa: E402

from kernelcrew.agents.playbook import rows as rowwise  # noqa: E402

CONFIGS = {
    "lag28_8192": {"WAIT_PART": 8192, "WAIT_LAG": 28},
    "unlagged_8192": {"WAIT_PART": 8192, "WAIT_LAG": 0},
}
CALLS = 20  # eager calls per shape
REPLAYS = 10


def run_task(path: Path, sms: int) -> dict:
    del sms
    analysis, plan, task, model, ref64, inputs, _fresh = row_setup(path)
    base = next(c for c in rowwise.tuning_space(plan, "sm_90") if "WAIT_PART" not in c)
    shape = inputs[0].shape
    half = (max(1, shape[0] // 2), *shape[1:])  # a second shape: half the samples

    def fresh(s):
        return [torch.randn(s, dtype=inputs[0].dtype, device="cuda") * 2 + 1]

    def error(new, xs) -> float:
        with torch.no_grad():
            return rel_error(new(*xs), ref64(*[x.double() for x in xs]))

    row = {"task": path.stem, "configs": {}}
    for name, extra in CONFIGS.items():
        text = rowwise.generate_rowwise(analysis, plan, {**base, **extra})
        module, new = build_candidate(text, f"graphs_{path.stem}_{name}", task, model)
        eager = [error(new, fresh(s)) for _ in range(CALLS) for s in (shape, half)]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            streamed = [error(new, fresh(shape)) for _ in range(3)]
        torch.cuda.current_stream().wait_stream(side)
        streamed += [error(new, fresh(shape)) for _ in range(3)]
        static = fresh(shape)
        with torch.no_grad():
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                new(*static)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = new(*static)
        replays = []
        for _ in range(REPLAYS):
            xs = fresh(shape)
            static[0].copy_(xs[0])
            graph.replay()
            torch.cuda.synchronize()
            with torch.no_grad():
                replays.append(rel_error(captured, ref64(*[x.double() for x in xs])))
        after = [error(new, fresh(shape)) for _ in range(3)]
        counters = {str(k[1:]): int(v[:-1].max()) for k, v in module._POSTED.items()}
        entry = {
            "params": {**base, **extra},
            "eager_max": max(eager),
            "second_stream_max": max(streamed),
            "graph_replays_max": max(replays),
            "eager_after_graph_max": max(after),
            "calls": len(eager) + len(streamed) + 1 + len(after),
            "counter_sets": len(module._POSTED),
            "largest_count": counters,
        }
        row["configs"][name] = entry
        print(path.stem, name, entry, flush=True)
    return row


def markdown(result: dict) -> str:
    lines = [
        "# The waiting launch's kept row counters: repeated calls, streams, CUDA graphs",
        "",
        f"Device: {result['device']} ({result['sms']} SMs); torch {result['versions']['torch']}, "
        f"Triton {result['versions']['triton']}; commit {result.get('commit', '?')}. "
        "`python bench/waiting_graphs.py`. Each figure is the largest relative error (norm of the "
        "difference over the norm of a float64 reference) over the calls of its column, each on "
        f"new random inputs: {CALLS} eager calls per shape (the task's and half its samples) in turn, "
        "3 on a second stream then 3 on the default one, "
        f"{REPLAYS} replays of a CUDA graph captured around the module, then 3 eager calls again.",
        "",
        "| task | configuration | eager | second stream | graph replays | eager after | counter sets |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for name, e in row["configs"].items():
            lines.append(
                f"| {row['task']} | {name} | {e['eager_max']:.1e} | {e['second_stream_max']:.1e} | "
                f"{e['graph_replays_max']:.1e} | {e['eager_after_graph_max']:.1e} | {e['counter_sets']} |"
            )
    lines += [
        "",
        "Counter sets: the (stream, shape) sets of counters the module kept; 0: the task's rows fill "
        "the GPU, so it never takes the waiting launch and the check does not apply to it.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    run_suite(
        "waiting_graphs", TASKS, run_task, markdown, commit=os.environ.get("KERNELCREW_COMMIT", "unknown")
    )


if __name__ == "__main__":
    main()
