"""The row_reduction candidate of GroupNorm + SiLU with its rows split for TARGET programs, run for ncu.

Builds the CONFIG-th (default: the first) tuning configuration's candidate of ``bench/suite/groupnorm_silu_fp16.py`` with
``SPLIT_TARGET = TARGET`` and calls it three times, so that ``ncu --launch-skip 4 --launch-count 2``
profiles the third call's stats launch and output launch::

    ncu --clock-control none --kernel-name regex:row_reduction --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 bench/split_rows_ncu.py TARGET [CONFIG]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.split_rows import row_plan  # noqa: E402
from kernelcrew.agents.playbook.rows import generate_rowwise, tuning_space  # noqa: E402
from kernelcrew.task import import_source, load_task  # noqa: E402

TASK = ROOT / "bench/suite/groupnorm_silu_fp16.py"


def main() -> None:
    target = int(sys.argv[1])
    config = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    source, analysis, plan = row_plan(TASK)
    candidate = generate_rowwise(analysis, plan, tuning_space(plan, "sm_90")[config])
    candidate = candidate.replace("SPLIT_TARGET = None", f"SPLIT_TARGET = {target}")
    file = Path(tempfile.mkdtemp()) / "split_candidate.py"  # Triton reads a kernel's source from its file
    file.write_text(candidate)
    module = import_source(candidate, file.stem, str(file))
    task = load_task(source, TASK.name)
    model = module.ModelNew(*task.get_init_inputs()).cuda()
    inputs = [t.cuda() for t in task.get_inputs()]
    for _ in range(3):
        model(*inputs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
