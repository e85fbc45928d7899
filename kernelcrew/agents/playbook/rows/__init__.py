"""Row reduction strategy: softmax, log-softmax, norms, sums and cross-entropy over the last dim.

:func:`match` lowers the traced graph (:mod:`.lowering`) to the pointwise IR of
:mod:`..pointwise` extended with *row reductions* over the last dim (:mod:`.ir`: ``rsum``,
``rmean``, ``rmax``, ``rmin``; ``rlse``: running max and sum of ``exp(x - max)``; ``rmoments``:
mean and biased variance; ``rce``: the cross-entropy of each row). Library ops become IR
(``softmax`` is ``exp(x - m) / s`` over an ``rlse``, ``layer_norm`` ``(x - mean) * rsqrt(var +
eps) * w + b`` over an ``rmoments``); hand-written spellings are lowered op by op, so elementwise
prologues (scale, mask, residual add, casts) and epilogues (affine weights, activation) fuse into
the same kernel. :mod:`.matching` places every value per element of a row (``[ROWS, BLOCK_N]``
tiles) or per row (``[ROWS, 1]``) and reads operands in place through per-dimension strides.

:mod:`.tuning` gives the configurations worth timing and :func:`.tuning.select_paths` the kernels
a candidate carries, from the plan, the parameters and the example's rows (:mod:`.host` writes
the module):

* rows that fit in ``MAX_SINGLE`` columns stay in registers (:mod:`.passes`, single pass), next to
  the multi-pass loop that keeps the candidate correct for rows of any length: one pass over
  ``CHUNK``-column blocks per reduction level (online max/sum, Chan's merge of moments), then one
  that writes, each walking the other way from the one before;
* few long rows of a plan whose states merge are split over several programs (:mod:`.split`: two
  launches) or, with ``WAIT_PART``, over one launch of waiting parts (:mod:`.waiting`: per-row
  counters kept between calls, each element read once from DRAM);
* GroupNorm rows are (sample, group) pairs of an ``(N, C, *)`` tensor (:mod:`.grouped`);
* cross-entropy's per-row losses are reduced by a one-program kernel in a fixed order (:mod:`.loss`).

Accumulation is fp32 (fp64 when the module computes in float64), the output is stored once in the
reference's dtype; only core ``tl.*`` math is used, so the kernels run under ``TRITON_INTERPRET=1``.
Known limits: max/min reductions do not propagate NaN as ``torch.amax`` does; an operand needed
both per element and per row is refused.
"""

from kernelcrew.agents.playbook.rows.host import generate, generate_rowwise
from kernelcrew.agents.playbook.rows.ir import REDUCTIONS, RowPlan
from kernelcrew.agents.playbook.rows.lowering import ROW_OPS
from kernelcrew.agents.playbook.rows.matching import match
from kernelcrew.agents.playbook.rows.tuning import (
    DEFAULT_PARAMS,
    row_count,
    row_length,
    select_paths,
    splittable,
    tuning_space,
)

__all__ = [
    "DEFAULT_PARAMS",
    "REDUCTIONS",
    "ROW_OPS",
    "RowPlan",
    "generate",
    "generate_rowwise",
    "match",
    "row_count",
    "row_length",
    "select_paths",
    "splittable",
    "tuning_space",
]
