"""An own convolution kernel: float32 ``nn.Conv1d/2d/3d`` (and ``nn.ConvTranspose1d/2d/3d`` of stride 1) as
one implicit-GEMM Triton kernel in TF32x3.

cuDNN runs a float32 convolution on the CUDA cores when TF32 is off (``strict`` precision): on an
H100 a seventh of the tensor cores' TF32 rate (67 against 495 TFLOP/s, datasheet). This kernel treats the convolution as a GEMM
whose rows are the output positions ``(n, od, oh, ow)``, whose columns are one group's output
channels and whose reduction runs over ``(c, kd, kh, kw)``: each ``BLOCK_M x BLOCK_K`` tile of the
input is gathered from the input tensor (stride, padding and dilation in the index, zeros outside),
each ``BLOCK_K x BLOCK_N`` tile of the weight is a plain load, and the products run on the tensor
cores in TF32x3 (``input_precision="tf32x3"``: each operand split into a TF32 high part and its
remainder, three products summed), which keeps float32 accuracy as :mod:`.matmul` does. The bias is
added to the fp32 tile before its one store.

1-D and 2-D convolutions run as 3-D ones with unit leading dims. Padding modes other than zeros,
and ``padding="same"``, pad the input first (``F.pad``) and run with zero padding. Groups are a
second grid axis. :func:`eligible` keeps the library's convolution where the kernel lost to cuDNN's
float32 one in a one-off comparison on an H200 (not kept as a result file, so its thresholds are
estimates until a KernelBench run measures them; it won on wide 3x3 and 1x1 convolutions):

* fewer than :data:`MIN_GROUP_CHANNELS` input or output channels per group: the reduction or the
  tile's columns are mostly padding (3 and 8 input channels lost; depthwise convolutions are
  memory-bound: :mod:`.depthwise`'s direct kernel takes them);
* fewer than :data:`MIN_TILES` output tiles of 128 x 128 (in a convolution of a quarter GFLOP or
  more): without a split over the reduction a few programs run long loops while most SMs idle (a
  256->256 3x3 convolution over ten 14x14 images, 32 tiles, lost).

A transposed convolution of stride 1 is the forward convolution it equals (per group the weight's
input and output channels swapped, its taps flipped, padding ``d * (k - 1) - p``, its
``output_padding`` as extra positions at the end), built from the weight on each call. One of a
larger stride stays the library's: as a forward convolution of its zero-interleaved input, all but
one in ``stride**dims`` of the products would be zeros, and split into one stride-1 convolution per
output phase (each phase's taps, written through strides) its candidate ran at 0.54x eager on
KernelBench's level-2 task 10 on an H100, against cuDNN's (a one-off run, not kept as a result).

The host function ``conv_tf32x3(x, weight, bias, spec, params)`` (``spec``: ``conv_spec(module)``,
the module's stride, padding, dilation, groups and padding mode) and the kernel are :data:`SOURCE`,
emitted into candidates (``anchored_fusion`` replaces each eligible module call of its graph).
"""

from __future__ import annotations

import math
from typing import Any

from kernelcrew.agents.playbook.matmul import PARAMS, check_tiles

#: Input and output channels per group from which the kernel's tiles are worth it.
MIN_GROUP_CHANNELS = 16
#: The fewest 128 x 128 output tiles (positions x channels, all groups) worth the kernel, where the
#: convolution has ``MIN_SPLIT_FLOP`` or more (below that, idle SMs cost microseconds).
MIN_TILES, MIN_SPLIT_FLOP = 48, 2**28
#: Module types the kernel replaces (transposed ones of stride 1 only: see :func:`eligible`).
TRANSPOSED = frozenset(f"torch.nn.modules.conv.ConvTranspose{d}d" for d in (1, 2, 3))
MODULES = frozenset(f"torch.nn.modules.conv.Conv{d}d" for d in (1, 2, 3)) | TRANSPOSED
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per architecture class, first tried first.
CONFIGS = {
    # 128 x 128 tiles beat 128 x 64 ones in the comparison above
    "sm_90": [(128, 128, 32, 8, 3), (128, 64, 32, 4, 3), (64, 64, 32, 4, 4)],
    "sm_80": [(128, 64, 16, 4, 3), (64, 64, 16, 4, 4)],
    "cpu": [(16, 16, 16, 4, 1)],
}


def float32_weight(analysis: Any, node: dict[str, Any]) -> tuple[list[int], int, str]:
    """A convolution module call's weight shape and groups, and why an own kernel cannot take it
    ("" when it can): the call or its weight not float32, the groups or the shape unreadable."""
    weight = next((e for e in analysis.state_dict if e["name"] == f"{node['target']}.weight"), None)
    if node.get("dtype") != "float32" or weight is None or weight.get("dtype") != "float32":
        return [], 1, "not float32 (cuDNN's tensor-core kernels serve half precision)"
    groups = node.get("kwargs", {}).get("groups", 1)
    shape = weight.get("shape") or []
    if not isinstance(groups, int) or groups < 1 or len(shape) < 3 or shape[0] % groups:
        return [], 1, f"groups {groups!r} or weight shape {shape} unreadable"
    return shape, groups, ""


def eligible(analysis: Any, node: dict[str, Any]) -> tuple[bool, str]:
    """Whether the kernel replaces this call of a convolution module, and why (not)."""
    if node.get("kind") != "call_module" or node.get("module_type") not in MODULES:
        return False, "not a call of an nn.Conv1d/2d/3d or nn.ConvTranspose1d/2d/3d module"
    transposed = node["module_type"] in TRANSPOSED
    stride = node.get("kwargs", {}).get("stride")
    if transposed and (not isinstance(stride, list | tuple) or any(s != 1 for s in stride)):
        return False, (
            f"a transposed convolution of stride {stride}: as a forward one it multiplies mostly "
            "zeros, the library's"
        )
    if transposed and len(node.get("args") or []) != 1:
        return False, "a transposed convolution called with an output size: the library's"
    shape, groups, why = float32_weight(analysis, node)
    if why:
        return False, why
    # (input, output) channels per group: a transposed weight is (in, out per group, *kernel)
    per_group = (shape[0] // groups, shape[1]) if transposed else (shape[1], shape[0] // groups)
    if min(per_group) < MIN_GROUP_CHANNELS:
        return False, (
            f"{per_group[0]} input and {per_group[1]} output channel(s) per group: mostly padding in "
            "the kernel's tiles (few channels, depthwise), the library's"
        )
    out = node.get("shape") or []
    rank = len(shape) - 2
    if len(out) not in (rank + 1, rank + 2):
        return False, f"output shape {out} unreadable"
    positions = math.prod(out[-rank:]) * (out[0] if len(out) == rank + 2 else 1)
    tiles = math.ceil(positions / 128) * math.ceil(per_group[1] / 128) * groups
    flop = 2 * positions * groups * math.prod(per_group) * math.prod(shape[2:])
    if tiles < MIN_TILES and flop >= MIN_SPLIT_FLOP:
        return False, f"{tiles} output tiles of 128 x 128: too few to fill the GPU without a split over K"
    return True, "a float32 convolution: implicit GEMM in TF32x3"


def tuning_space(arch_class: str) -> list[dict[str, int]]:
    """Tile configurations of the kernel on an architecture class (``sm_90``, ``sm_80``, ``cpu``)."""
    configs = CONFIGS.get(arch_class, CONFIGS["sm_90"])
    return [dict(zip(PARAMS, (bm, bn, bk, 8, w, s), strict=True)) for bm, bn, bk, w, s in configs]


def check_params(params: dict[str, Any]) -> dict[str, int]:
    """The kernel's tiles: ``params`` over the first H100 configuration, checked as the matmul's."""
    return check_tiles(params, tuning_space("sm_90")[0], max_block=256, what="conv ")


SOURCE = '''
@triton.jit
def conv_tf32x3_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, C, D, H, W, OC, OD, OH, OW,
    SD, SH, SW, PD, PH, PW, DD, DH, DW,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, INDEX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of output positions x one group's output channels; C and OC are
    per group, the group is program axis 1."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    M = N * OD * OH * OW
    K = C * KD * KH * KW
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(OC, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < OC
    ow = rm % OW
    t = rm // OW
    oh = t % OH
    t = t // OH
    od = t % OD
    n = t // OD
    if INDEX64:
        n = n.to(tl.int64)
    d0 = od * SD - PD
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    x_base = (n * (C * tl.num_programs(1)) + g * C) * (D * H * W)
    w_base = (g * OC + rn) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        kw = rk % KW
        rest = rk // KW  # a name of its own: Triton types a loop's variables once
        kh = rest % KH
        rest = rest // KH
        kd = rest % KD
        c = rest // KD
        di = d0[:, None] + kd[None, :] * DD
        hi = h0[:, None] + kh[None, :] * DH
        wi = w0[:, None] + kw[None, :] * DW
        inside = (di >= 0) & (di < D) & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
        a_mask = m_ok[:, None] & k_ok[None, :] & inside
        a_off = x_base[:, None] + c[None, :] * (D * H * W) + (di * H + hi) * W + wi
        a = tl.load(x_ptr + a_off, mask=a_mask, other=0.0)
        b = tl.load(w_ptr + w_base[None, :] + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    if HAS_BIAS:
        acc += tl.load(b_ptr + g * OC + rn, mask=n_ok, other=0.0)[None, :]
    spatial = (od * OH + oh) * OW + ow
    y_off = ((n * tl.num_programs(1) + g)[:, None] * OC + rn[None, :]) * (OD * OH * OW) + spatial[:, None]
    tl.store(y_ptr + y_off, acc, mask=m_ok[:, None] & n_ok[None, :])


def conv_spec(conv):
    """What the kernel needs of an nn.Conv1d/2d/3d or nn.ConvTranspose1d/2d/3d module besides its
    parameters (plain values)."""
    transposed = bool(getattr(conv, "transposed", False))
    return (
        tuple(conv.stride), conv.padding if isinstance(conv.padding, str) else tuple(conv.padding),
        tuple(conv.dilation), conv.groups, conv.padding_mode,
        tuple(getattr(conv, "_reversed_padding_repeated_twice", ())),
        transposed, tuple(conv.output_padding) if transposed else (),
    )


def _as_forward_conv(w, spec):
    """A stride-1 transposed convolution as the forward one it equals: per group, the weight's
    input and output channels swapped and its taps flipped, padding d * (k - 1) - p (negative where
    the transposed one crops), and its output_padding as extra output positions at the end."""
    stride, padding, dilation, groups, _, _, _, output_padding = spec
    nd = w.dim() - 2
    cin, ocg = w.shape[:2]
    w = w.reshape(groups, cin // groups, ocg, *w.shape[2:]).transpose(1, 2)
    w = w.reshape(groups * ocg, cin // groups, *w.shape[3:]).flip(list(range(2, 2 + nd)))
    pad = tuple(d * (k - 1) - p for d, k, p in zip(dilation, w.shape[2:], padding))
    return w, pad, tuple(output_padding)


def conv_geometry(x, w, stride, padding, dilation, padding_mode, reversed_padding, extra=None):
    """A forward convolution's launch geometry, 1-D and 2-D lifted to 3-D with unit leading dims:
    ``(x, size, kernel, stride, dilation, pad, out)``, ``x`` contiguous and, for a padding mode
    other than zeros or a string padding, padded first (``pad`` then zeros); ``extra`` output
    positions at the end of each dim (a transposed convolution's ``output_padding``)."""
    nd = w.dim() - 2
    if padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if padding_mode == "zeros" else padding_mode
        x = F.pad(x, reversed_padding, mode=mode)
        padding = (0,) * nd
    lift = (1,) * (3 - nd)
    x = x.contiguous()
    size = lift + tuple(x.shape[2:])
    kernel = lift + tuple(w.shape[2:])
    stride = lift + tuple(stride)
    dilation = lift + tuple(dilation)
    pad = (0,) * (3 - nd) + tuple(padding)
    extra = (0,) * (3 - nd) + tuple(extra or (0,) * nd)
    out = tuple(
        (i + 2 * p - d * (k - 1) - 1) // s + 1 + e
        for i, p, d, k, s, e in zip(size, pad, dilation, kernel, stride, extra)
    )
    if min(out) <= 0:
        raise RuntimeError(f"the input {tuple(x.shape)} is smaller than the convolution's kernel")
    return x, size, kernel, stride, dilation, pad, out


def library_conv(x, w, bias, spec):
    """The module's own call of the library on ``x`` (:func:`conv_spec`), transposed or not."""
    stride, padding, dilation, groups, padding_mode, reversed_padding, transposed, output_padding = spec
    nd = w.dim() - 2
    if transposed:
        call = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        return call(x, w, bias, stride, padding, output_padding, groups, dilation)
    if padding_mode != "zeros":
        x, padding = F.pad(x, reversed_padding, mode=padding_mode), 0
    return (F.conv1d, F.conv2d, F.conv3d)[nd - 1](x, w, bias, stride, padding, dilation, groups)


def conv_tf32x3(x, w, bias, spec, params):
    """An nn.Conv1d/2d/3d module's call on ``x`` (weight ``w``, ``bias``, :func:`conv_spec`): the
    implicit-GEMM kernel in TF32x3 for float32 tensors on a GPU (or the interpreter)."""
    stride, padding, dilation, groups, padding_mode, reversed_padding, transposed, output_padding = spec
    nd = w.dim() - 2
    if x.dtype != torch.float32 or w.dtype != torch.float32 or (transposed and max(stride) > 1):
        return library_conv(x, w, bias, spec)
    if x.dim() == nd + 1:  # an unbatched input
        return conv_tf32x3(x.unsqueeze(0), w, bias, spec, params).squeeze(0)
    extra = None
    if transposed:
        w, padding, extra = _as_forward_conv(w, spec)
    x, size, kernel, stride, dilation, pad, out = conv_geometry(
        x, w, stride, padding, dilation, padding_mode, reversed_padding, extra
    )
    n, c = x.shape[:2]
    oc = w.shape[0]
    y = torch.empty((n, oc, *out), dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y.reshape(n, oc, *out[3 - nd:])
    wc = w.contiguous()
    m = n * out[0] * out[1] * out[2]
    grid = (triton.cdiv(m, params["BLOCK_M"]) * triton.cdiv(oc // groups, params["BLOCK_N"]), groups)
    conv_tf32x3_kernel[grid](
        x, wc, bias if bias is not None else wc, y,
        n, c // groups, *size, oc // groups, *out,
        *stride, *pad, *dilation,
        KD=kernel[0], KH=kernel[1], KW=kernel[2],
        HAS_BIAS=bias is not None,
        INDEX64=max(x.numel(), y.numel(), wc.numel()) >= 2**31,
        BLOCK_M=params["BLOCK_M"], BLOCK_N=params["BLOCK_N"], BLOCK_K=params["BLOCK_K"],
        GROUP_M=params["GROUP_M"], num_warps=params["num_warps"], num_stages=params["num_stages"],
    )
    return y.reshape(n, oc, *out[3 - nd:])
'''

__all__ = ["MODULES", "SOURCE", "check_params", "eligible", "tuning_space"]
