"""Cross-entropy's loss: a one-program kernel that adds the rows' losses in a fixed order (no atomics)."""

from __future__ import annotations

KERNEL = """@triton.jit
def loss_reduce_kernel(loss_ptr, valid_ptr, out_ptr, n_rows, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    # One program adds the per-row losses (and counts the rows not ignored) in a fixed order:
    # the same inputs give the same bits, unlike atomic adds.
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.load(loss_ptr + offs, mask=offs < n_rows, other=0.0)
        count += tl.load(valid_ptr + offs, mask=offs < n_rows, other=0.0)
    result = tl.sum(total, axis=0)
    if MEAN:
        result = result / tl.sum(count, axis=0)
    tl.store(out_ptr, result.to(out_ptr.dtype.element_ty))
"""


def finish(reduction: str) -> str:
    """The host's last lines: the rows' losses (``out``, counted in ``valid``) reduced to one value."""
    return f"""
    loss = torch.empty((), dtype=DTYPE, device=device)
    loss_reduce_kernel[(1,)](out, valid, loss, n_rows, MEAN={reduction == "mean"}, BLOCK=1024)
    return loss"""
