"""An own direct convolution: float32 ``nn.Conv1d/2d/3d`` with few channels per group (depthwise).

A depthwise convolution (``nn.Conv2d(C, C * m, k, groups=C)``) computes each output channel as a
short sum of ``C_pg * taps`` products per position (``C_pg`` input channels per group, ``taps`` the
kernel's size): a few FMAs for each element read and written, so it is memory-bound and has no
tensor-core tiles to fill. :mod:`.conv`'s implicit-GEMM kernel refuses it (its tiles would be mostly
padding), and cuDNN's depthwise kernels can be slow: KernelBench level 1 task 83 (input
64 x 8 x 512 x 512, ``nn.Conv2d(8, 8, (3, 1), groups=8, bias=False)``) takes 1.45 ms in eager
PyTorch on an H100 where reading the input and writing the output once at 3 TB/s takes about
0.36 ms.

This kernel computes the convolution directly: program axis 0 runs over blocks of ``BLOCK``
flattened output positions ``(od, oh, ow)`` of one output channel of one image (program axis 1),
loops over the group's input channels and, unrolled, over the kernel's taps, loads the input
masked (zeros outside it, stride, padding and dilation in the index), accumulates in float32 with
plain FMAs (no ``tl.dot``: exact float32, as cuDNN), adds the bias and stores once. Consecutive
positions run along W, so the loads coalesce, and the taps of neighbouring positions overlap in the
caches: each input element comes from DRAM about once. Speed on a GPU: not measured yet.

1-D and 2-D convolutions run as 3-D ones with unit leading dims. Padding modes other than zeros,
and string padding (``"same"``, ``"valid"``), pad the input first (``F.pad``) and run with zero
padding. :func:`eligible` gives the kernel the float32 convolutions with at most
:data:`MAX_GROUP_CHANNELS` input and output channels per group. Transposed convolutions, and
tensors other than float32, stay the library's (the host function calls it).

The host function ``conv_direct(x, weight, bias, spec, params)`` (``spec``: the module's stride,
padding, dilation, groups, padding mode, ``_reversed_padding_repeated_twice``, ``transposed`` and
``output_padding``) and the kernel are :data:`SOURCE`, emitted into candidates after
:data:`.conv.SOURCE`, whose ``library_conv`` (the module's own call) and ``conv_geometry``
(padding, lifting to 3-D, output size) it shares.
"""

from __future__ import annotations

import math
from typing import Any

from kernelcrew.agents.playbook.conv import float32_weight

#: Input and output channels per group up to which the direct kernel applies: each output is a sum
#: of at most 4 x taps FMAs per position, memory-bound, with no tensor-core tile to fill.
MAX_GROUP_CHANNELS = 4
#: The most products per output the kernel unrolls (input channels per group x taps): a 7x7x7
#: kernel's 343 taps would make its compile, in the verifier's time, longer than the step.
MAX_UNROLLED = 128
#: Module types the kernel replaces.
MODULES = frozenset(f"torch.nn.modules.conv.Conv{d}d" for d in (1, 2, 3))
#: The kernel's parameters.
PARAMS = ("BLOCK", "num_warps")
#: (BLOCK, num_warps) per architecture class, first tried first (estimates, not measured yet).
CONFIGS = {
    "sm_90": [(1024, 4), (512, 4), (2048, 8)],
    "sm_80": [(1024, 4), (512, 4), (2048, 8)],
    "cpu": [(64, 4)],
}


def eligible(analysis: Any, node: dict[str, Any]) -> tuple[bool, str]:
    """Whether the direct kernel replaces this call of a convolution module, and why (not)."""
    if node.get("kind") != "call_module" or node.get("module_type") not in MODULES:
        return False, "not a call of an nn.Conv1d/2d/3d module"
    shape, groups, why = float32_weight(analysis, node)
    if why:
        return False, why
    per_group = (shape[1], shape[0] // groups)
    if max(per_group) > MAX_GROUP_CHANNELS:
        return False, (
            f"{per_group[0]} input and {per_group[1]} output channel(s) per group: more than "
            f"{MAX_GROUP_CHANNELS}, a GEMM's work rather than a direct convolution's"
        )
    if per_group[0] * math.prod(shape[2:]) > MAX_UNROLLED:
        return False, f"{per_group[0]} x {math.prod(shape[2:])} taps per output: too many to unroll"
    return True, (
        f"{per_group[0]} input and {per_group[1]} output channel(s) per group: a memory-bound "
        "direct convolution"
    )


def tuning_space(arch_class: str) -> list[dict[str, int]]:
    """Configurations of the kernel on an architecture class (``sm_90``, ``sm_80``, ``cpu``)."""
    configs = CONFIGS.get(arch_class, CONFIGS["sm_90"])
    return [dict(zip(PARAMS, config, strict=True)) for config in configs]


def check_params(params: dict[str, Any]) -> dict[str, int]:
    """``params`` over the first H100 configuration, each checked; ``ValueError`` names a bad key."""
    merged = {**tuning_space("sm_90")[0], **params}
    unknown = set(merged) - set(PARAMS)
    if unknown:
        raise ValueError(f"unknown direct conv parameter(s) {sorted(unknown)} ({', '.join(PARAMS)})")
    block, warps = merged["BLOCK"], merged["num_warps"]
    if type(block) is not int or not 16 <= block <= 8192 or block & (block - 1):
        raise ValueError(f"direct conv BLOCK must be a power of two in [16, 8192], got {block!r}")
    if type(warps) is not int or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"direct conv num_warps must be 1, 2, 4, 8 or 16, got {warps!r}")
    return merged


SOURCE = '''
@triton.jit
def conv_direct_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    # sizes: C and OC per group, G groups
    C, G, D, H, W, OC, OD, OH, OW, ROW0,
    # stride, padding, dilation
    SD, SH, SW, PD, PH, PW, DD, DH, DW,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, INDEX64: tl.constexpr, BLOCK: tl.constexpr,
):
    """BLOCK flattened output positions (od, oh, ow) of one output channel of one image: program
    axis 1 (plus ROW0) is the row n * OC * G + oc of the output."""
    pid = tl.program_id(0)
    row = ROW0 + tl.program_id(1)
    if INDEX64:
        pid = pid.to(tl.int64)
        row = row.to(tl.int64)
    n = row // (OC * G)
    oc = row % (OC * G)
    g = oc // OC
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < OD * OH * OW
    ow = offs % OW
    t = offs // OW
    oh = t % OH
    od = t // OH
    d0 = od * SD - PD
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    x_base = x_ptr + (n * (C * G) + g * C) * (D * H * W)
    w_base = w_ptr + oc * (C * KD * KH * KW)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, C):
        x_c = x_base + c * (D * H * W)
        w_c = w_base + c * (KD * KH * KW)
        for kd in tl.static_range(KD):
            di = d0 + kd * DD
            ok_d = ok & (di >= 0) & (di < D)
            for kh in tl.static_range(KH):
                hi = h0 + kh * DH
                ok_h = ok_d & (hi >= 0) & (hi < H)
                x_row = x_c + (di * H + hi) * W
                for kw in tl.static_range(KW):
                    wi = w0 + kw * DW
                    v = tl.load(x_row + wi, mask=ok_h & (wi >= 0) & (wi < W), other=0.0)
                    acc = tl.fma(v, tl.load(w_c + (kd * KH + kh) * KW + kw), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + oc)
    tl.store(y_ptr + row * (OD * OH * OW) + offs, acc, mask=ok)


def conv_direct(x, w, bias, spec, params):
    """An nn.Conv1d/2d/3d module's call on ``x`` (weight ``w``, ``bias``, ``spec``: stride, padding,
    dilation, groups, padding mode, reversed padding, transposed, output padding): the direct kernel
    for float32 tensors on a GPU (or the interpreter), the library's call otherwise."""
    stride, padding, dilation, groups, padding_mode, reversed_padding, transposed, _ = spec
    nd = w.dim() - 2
    if transposed or x.dtype != torch.float32 or w.dtype != torch.float32:
        return library_conv(x, w, bias, spec)
    if x.dim() == nd + 1:  # an unbatched input
        return conv_direct(x.unsqueeze(0), w, bias, spec, params).squeeze(0)
    if x.dim() != nd + 2 or x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        raise ValueError(
            f"input {tuple(x.shape)} does not fit the weight {tuple(w.shape)} with {groups} group(s)"
        )
    x, size, kernel, stride, dilation, pad, out = conv_geometry(
        x, w, stride, padding, dilation, padding_mode, reversed_padding
    )
    n, c = x.shape[:2]
    oc = w.shape[0]
    y = torch.empty((n, oc, *out), dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y.reshape(n, oc, *out[3 - nd:])
    wc = w.contiguous()
    bc = bias.contiguous() if bias is not None else wc
    rows = n * oc
    blocks = triton.cdiv(out[0] * out[1] * out[2], params["BLOCK"])
    for row0 in range(0, rows, 65535):  # CUDA's limit on grid axis 1
        conv_direct_kernel[(blocks, min(rows - row0, 65535))](
            x, wc, bc, y,
            c // groups, groups, *size, oc // groups, *out, row0,
            *stride, *pad, *dilation,
            KD=kernel[0], KH=kernel[1], KW=kernel[2],
            HAS_BIAS=bias is not None,
            INDEX64=max(x.numel(), y.numel(), wc.numel()) >= 2**31,
            BLOCK=params["BLOCK"], num_warps=params["num_warps"],
        )
    return y.reshape(n, oc, *out[3 - nd:])
'''

__all__ = ["MAX_GROUP_CHANNELS", "MODULES", "SOURCE", "check_params", "eligible", "tuning_space"]
