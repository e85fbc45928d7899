"""Triton candidate for examples/elementwise_chain.py: one fused kernel for gelu(x * scale + bias) * sigmoid(x).

Each program handles BLOCK_SIZE consecutive elements of the flattened input: one load of x, one
(cached) load of the bias, the arithmetic in fp32 registers, one store.
"""

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def elementwise_chain_kernel(
    x_ptr,
    bias_ptr,
    out_ptr,
    n_elements,
    n_cols,
    scale,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    z = x * scale + b
    gelu = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))  # exact (erf) GELU, as F.gelu
    out = gelu * tl.sigmoid(x)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def elementwise_chain(x: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """gelu(x * scale + bias) * sigmoid(x), bias broadcast over the last dimension of x."""
    if x.dim() < 1 or bias.dim() != 1 or x.shape[-1] != bias.shape[0]:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match x of shape {tuple(x.shape)}")
    if x.device != bias.device:
        raise ValueError(f"x is on {x.device} but bias is on {bias.device}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    x = x.contiguous()
    bias = bias.contiguous()
    out = torch.empty_like(x)
    n_elements = x.numel()
    if n_elements == 0:
        return out
    grid = lambda META: (triton.cdiv(n_elements, META["BLOCK_SIZE"]),)
    elementwise_chain_kernel[grid](x, bias, out, n_elements, x.shape[-1], float(scale), BLOCK_SIZE=1024)
    return out


class ModelNew(nn.Module):
    def __init__(self, hidden: int, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.zeros(hidden))  # overwritten by load_state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise_chain(x, self.bias, self.scale)
