"""Matmul with a fused epilogue (kernelcrew playbook, strategy matmul_epilogue).

Layers: proj.weight ([N, K]), float32, products in TF32x3 (float32 accuracy).
Epilogue ops: mul, add. Loaded operands: residual (input), gamma (parameter), proj.bias (parameter). Output: float32.
One Triton kernel: fp32 accumulators per output tile, the epilogue in registers, one store.
"""

import math

import torch
import torch.nn as nn
import triton
import triton.language as tl

FULL, COL, ROW, SCALAR = 0, 1, 2, 3


@triton.jit
def matmul_epilogue_kernel(
    a_ptr, w0_ptr, e1_ptr, e2_ptr, e4_ptr, out_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk,
    MODE1: tl.constexpr, MODE2: tl.constexpr, MODE4: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # programs of one group of GROUP_M tile rows
    first_m = (pid // width) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # rows and columns past the edge read row/column 0 again; their results are not stored
    am = (rm % M).to(tl.int64)
    wn = (rn % N).to(tl.int64)
    a_ptrs = a_ptr + am[:, None] * stride_am + rk[None, :] * stride_ak
    w_off = wn[None, :] * stride_wn + rk[:, None] * stride_wk
    w0_ptrs = w0_ptr + w_off
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b0 = tl.load(w0_ptrs, mask=k_mask[:, None], other=0.0)
        if WIDEN:  # the interpreter multiplies bfloat16 as raw bits
            a = a.to(tl.float32)
            b0 = b0.to(tl.float32)
        acc0 = tl.dot(a, b0, acc0, input_precision="tf32x3")
        w0_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
    # the epilogue, on the fp32 tile
    rows = rm.to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    v3 = acc0
    # operand 1: input residual (float32)
    if MODE1 == 0:  # FULL
        v1 = tl.load(e1_ptr + rows[:, None] * N + rn[None, :], mask=mask, other=0).to(tl.float32)
    elif MODE1 == 1:  # COL: one value per output column
        v1 = tl.load(e1_ptr + rn[None, :], mask=rn[None, :] < N, other=0).to(tl.float32)
    elif MODE1 == 2:  # ROW: one value per output row
        v1 = tl.load(e1_ptr + rows[:, None], mask=rm[:, None] < M, other=0).to(tl.float32)
    else:  # SCALAR
        v1 = tl.load(e1_ptr).to(tl.float32)
    # operand 2: parameter gamma (float32)
    if MODE2 == 0:  # FULL
        v2 = tl.load(e2_ptr + rows[:, None] * N + rn[None, :], mask=mask, other=0).to(tl.float32)
    elif MODE2 == 1:  # COL: one value per output column
        v2 = tl.load(e2_ptr + rn[None, :], mask=rn[None, :] < N, other=0).to(tl.float32)
    elif MODE2 == 2:  # ROW: one value per output row
        v2 = tl.load(e2_ptr + rows[:, None], mask=rm[:, None] < M, other=0).to(tl.float32)
    else:  # SCALAR
        v2 = tl.load(e2_ptr).to(tl.float32)
    # operand 4: parameter proj.bias (float32)
    if MODE4 == 0:  # FULL
        v4 = tl.load(e4_ptr + rows[:, None] * N + rn[None, :], mask=mask, other=0).to(tl.float32)
    elif MODE4 == 1:  # COL: one value per output column
        v4 = tl.load(e4_ptr + rn[None, :], mask=rn[None, :] < N, other=0).to(tl.float32)
    elif MODE4 == 2:  # ROW: one value per output row
        v4 = tl.load(e4_ptr + rows[:, None], mask=rm[:, None] < M, other=0).to(tl.float32)
    else:  # SCALAR
        v4 = tl.load(e4_ptr).to(tl.float32)
    t_proj_bias = v3 + v4
    t_mul = v2 * t_proj_bias
    t_add = v1 + t_mul
    tl.store(out_ptr + rows[:, None] * N + rn[None, :], tl.broadcast_to(t_add, (BLOCK_M, BLOCK_N)).to(out_ptr.dtype.element_ty), mask=mask)


def operand_mode(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> int | None:
    """FULL, COL, ROW or SCALAR for an operand of ``shape`` broadcast to ``out_shape``; None when it
    broadcasts otherwise (the kernel then reads a materialized copy). Emitted into candidates too."""
    if len(shape) > len(out_shape):
        return None
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    numel = math.prod(padded)
    if numel == 1:
        return SCALAR
    if padded == tuple(out_shape):
        return FULL
    if padded[-1] == out_shape[-1] and numel == out_shape[-1]:
        return COL
    if padded[-1] == 1 and padded[:-1] == tuple(out_shape[:-1]):
        return ROW
    return None


def matmul_epilogue(x, w0, e1, e2, e4):
    """The layers of ``x`` and the epilogue, one kernel; returns a new float32 tensor."""
    K = x.shape[-1]
    N = w0.shape[0]
    a = x.reshape(-1, K)  # a view where the strides allow it
    M = a.shape[0]
    out_shape = (*x.shape[:-1], N)
    w0 = w0.contiguous()
    for t in [w0, e1, e2, e4]:
        if t.device != x.device:
            raise ValueError(f"all operands must be on one device, got {t.device} and {x.device}")
    out = torch.empty(out_shape, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    ops, modes = [], []
    for t in [e1, e2, e4]:
        mode = operand_mode(tuple(t.shape), out_shape)
        if mode is None:  # another broadcast: read a materialized copy
            t, mode = t.expand(out_shape), FULL
        ops.append(t.contiguous())
        modes.append(mode)
    grid = (triton.cdiv(M, 128) * triton.cdiv(N, 64),)
    matmul_epilogue_kernel[grid](
        a, w0, *ops, out,
        M, N, K,
        a.stride(0), a.stride(1), w0.stride(0), w0.stride(1),
        MODE1=modes[0], MODE2=modes[1], MODE4=modes[2], WIDEN=x.dtype == torch.bfloat16 and x.device.type == "cpu",
        BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=8,
        num_warps=4, num_stages=4,
    )
    return out


def _container(root, path):
    """The submodule at dotted ``path`` of ``root``, made of empty nn.Module()s where missing."""
    module = root
    for part in path.split(".") if path else []:
        try:
            module = module.get_submodule(part)
        except AttributeError:
            child = nn.Module()
            module.add_module(part, child)
            module = child
    return module


class ModelNew(nn.Module):
    """The task's module as one matmul-epilogue kernel; same state dict names and shapes."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.register_parameter('gamma', nn.Parameter(torch.zeros((2048,), dtype=torch.float32)))
        _container(self, 'proj').register_parameter('weight', nn.Parameter(torch.zeros((2048, 2048), dtype=torch.float32)))
        _container(self, 'proj').register_parameter('bias', nn.Parameter(torch.zeros((2048,), dtype=torch.float32)))

    def forward(self, x, residual):
        return matmul_epilogue(x, self.get_parameter('proj.weight'), residual, self.get_parameter('gamma'), self.get_parameter('proj.bias'))


# --- kernelcrew: torch.compile packaging (generated; `kernelcrew verify` checks it) ---
import threading as _kc_threading
import weakref as _kc_weakref

import torch.func as _kc_func

_KC_OP = "kernelcrew_bceeb5a84888::forward"
_KC_LAUNCHED = ('matmul_epilogue_kernel',)  # the kernels this file launches with kernel[grid](...)
_kc_modules = {}  # id -> weak reference to a ModelNew, for the op to find its module
_kc_local = _kc_threading.local()  # shapes_only: launches are skipped (this thread, fake tensors)
_kc_eager_init = ModelNew.__init__
_kc_eager_forward = ModelNew.forward


class _KcLaunch:
    """A launched kernel: itself, except while this thread only computes shapes."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        if getattr(_kc_local, "shapes_only", False):
            return lambda *args, **kwargs: None
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


for _kc_name in _KC_LAUNCHED:
    globals()[_kc_name] = _KcLaunch(globals()[_kc_name])


def _kc_shapes(module, state, inputs):
    """The forward on fake tensors (``state`` in place of the module's parameters and buffers),
    launching nothing: the output's shape, dtype and device."""
    params = [n for n, _ in module.named_parameters()]
    names = params + [n for n, _ in module.named_buffers()]
    state = [  # parameters stay parameters (a forward may read them with get_parameter)
        t if i >= len(params) or isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
        for i, t in enumerate(state)
    ]
    _kc_local.shapes_only = True
    try:
        return _kc_func.functional_call(module, dict(zip(names, state)), tuple(inputs))
    finally:
        _kc_local.shapes_only = False


@torch.library.custom_op(_KC_OP, mutates_args=())
def _kc_forward_op(key: int, state: list[torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    # the module's own parameters are ``state``: passed so that the graph depends on them
    return _kc_eager_forward(_kc_modules[key](), *inputs)


@_kc_forward_op.register_fake
def _kc_forward_fake(key, state, inputs):
    return _kc_shapes(_kc_modules[key](), state, inputs)


def _kc_init(self, *args, **kwargs):
    _kc_eager_init(self, *args, **kwargs)
    # here, not in forward (Dynamo would trace it); the entry goes with the module
    key = id(self)
    _kc_modules[key] = _kc_weakref.ref(self, lambda _, key=key: _kc_modules.pop(key, None))


def _kc_forward(self, *inputs):
    if getattr(_kc_local, "shapes_only", False) or not torch.compiler.is_compiling():
        return _kc_eager_forward(self, *inputs)
    if not all(isinstance(t, torch.Tensor) for t in inputs) or id(self) not in _kc_modules:
        return _kc_eager_forward(self, *inputs)  # traced as it is (a copy made without __init__, say)
    state = [t for _, t in self.named_parameters()] + [t for _, t in self.named_buffers()]
    return _kc_forward_op(id(self), state, list(inputs))


ModelNew.__init__ = _kc_init
ModelNew.forward = _kc_forward
