"""Where a golden child's seconds go: ``harness.golden_child`` in this process, under cProfile.

The golden child makes a task's input sets, runs the reference in float64 and in its own dtype and
saves them; on the H100 it took 15-23 s of every run's baseline. This calls it directly (no sandbox,
a fresh interpreter as the sandbox's children are) and prints its phases and the 45 most expensive
calls by cumulative time. ``bench/results/golden_child_profile/h100_log_softmax.txt`` is its output
for ``bench/suite/log_softmax_vocab_bf16.py`` on the H100 (torch 2.11, a torch without bytecode:
``builtins.compile`` is the interpreter compiling torch's sources).

    python bench/profile_golden_child.py TASK.py [cuda|cpu]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from kernelcrew.tools.harness import golden_child  # torch itself is imported inside, profiled

    source = Path(sys.argv[1]).read_text()
    workdir = Path(tempfile.mkdtemp())
    (workdir / "child").mkdir()
    payload = {
        "device": sys.argv[2] if len(sys.argv) > 2 else "cpu",
        "seed": 1,
        "precision": "strict",
        "task_source": source,
        "task_path": "task.py",
        "n_seeds": 5,
    }
    profiler = cProfile.Profile()
    profiler.enable()
    out = golden_child(payload, workdir)
    profiler.disable()
    print(out.get("phase_s"))
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
