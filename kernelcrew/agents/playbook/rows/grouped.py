"""GroupNorm rows: each (sample, group) of an (N, C, *) tensor is a row; kernel indexing and host layouts."""

from __future__ import annotations

from typing import Protocol

from kernelcrew.agents.playbook.rows.ir import RowPlan


class KernelWriter(Protocol):
    """What GroupNorm's pieces read of the kernel writer (:class:`.kernel.KernelWriter`)."""

    plan: RowPlan

    def ptr(self, i: int) -> str: ...
    def off(self, i: int) -> str: ...
    def stride(self, i: int, dim: str) -> str: ...
    def mode(self, i: int) -> str: ...


def row_offsets(w: KernelWriter) -> list[str]:
    """Each operand's offset of each row: row = (sample, group), dim1 groups of dim2 channels."""
    lines = [
        "# row = (sample, group): dim1 groups of dim2 channels of dim3 positions",
        "n_idx = (rows32 // dim1).to(rows.dtype)",
        "g_idx = rows - n_idx * dim1",
    ]
    return lines + [
        f"{w.off(i)} = n_idx * {w.stride(i, '_n')} + g_idx * dim2 * {w.stride(i, '_c')}"
        for i in range(len(w.plan.operands))
    ]


def column_channels(start: str) -> list[str]:
    """The channel ``ch`` and position ``sp`` of each column of a chunk starting at ``start``
    (needed where an operand is not one flat run, HAS_SPLIT; dim3: positions per channel)."""
    return [
        "if HAS_SPLIT:",
        "    if WIDE_POSITIONS:  # a block spans at most two channels: a compare, not a division",
        f"        ch0 = ({start or '0'}) // dim3",
        "        if ONE_CHANNEL:  # blocks never straddle two: one channel",
        "            ch = ch0 + tl.zeros_like(cols)",
        "        else:",
        "            ch = ch0 + (cols >= (ch0 + 1) * dim3).to(tl.int32)",
        "    else:",
        "        ch = cols // dim3",
        "    sp = cols - ch * dim3",
    ]


def load_row(w: KernelWriter, i: int, hint: str, convert: str) -> list[str]:
    """Operand ``i`` per column of a grouped row: its mode 0 walks the columns flat (x itself), mode
    2 is one value per channel (weights: where a block spans at most two channels, two loads), mode
    1 reads by channel and position."""
    ptr, off = w.ptr(i), f"{w.off(i)}[:, None]"
    sc, sp = w.stride(i, "_c"), w.stride(i, "_p")
    flat = f"{ptr} + {off} + cols[None, :] * {sp}"
    split = f"{ptr} + {off} + ch[None, :] * {sc} + sp[None, :] * {sp}"
    first = f"{ptr} + {off} + ch0 * {sc}"
    second = f"{ptr} + {off} + tl.minimum(ch0 + 1, dim2 - 1) * {sc}"
    mode = w.mode(i)
    return [
        f"if {mode} == 0:",
        f"    v{i} = tl.load({flat}, mask=mask, other=0{hint}){convert}",
        f"elif {mode} == 2 and WIDE_POSITIONS:",
        f"    v{i}_a = tl.load({first}, mask=rmask[:, None], other=0)",
        "    if ONE_CHANNEL:",
        f"        v{i} = v{i}_a{convert}",
        "    else:",
        f"        v{i}_b = tl.load({second}, mask=rmask[:, None], other=0)",
        f"        v{i} = tl.where(ch[None, :] == ch0, v{i}_a, v{i}_b){convert}",
        "else:",
        f"    v{i} = tl.load({split}, mask=mask, other=0{hint}){convert}",
    ]


def meta(modes: list[str]) -> list[str]:
    """The grouped kernels' layout switches, as host keyword arguments (``modes``: their names)."""
    return [
        *(f"{m}=modes[{i}]" for i, m in enumerate(modes)),
        "HAS_SPLIT=any(modes)",
        "WIDE_POSITIONS=positions >= block",
        "ONE_CHANNEL=positions % block == 0",
    ]


def layout(channel: list[bool]) -> str:
    """The host's lines that shape a grouped launch: rows, columns, each operand's view and strides."""
    return f"""    # (C,) weights apply along dim 1, whatever the input's rank
    channel = {channel}
    shape = torch.broadcast_shapes(*[t.shape for t, c in zip(ops, channel) if not c])
    ops = [t.reshape(-1, *([1] * (len(shape) - 2))) if c else t for t, c in zip(ops, channel)]
    shape = tuple(torch.broadcast_shapes(*[t.shape for t in ops]))
    if len(shape) < 2 or shape[1] % GROUPS:
        raise ValueError(f"group_norm needs an (N, C, *) input with C divisible by {{GROUPS}}, got {{shape}}")
    positions = math.prod(shape[2:])
    n_rows = shape[0] * GROUPS
    n_cols = shape[1] // GROUPS * positions
    out = torch.empty(shape, dtype=DTYPE, device=device)
    if out.numel() == 0:
        return out
    dims = [1, GROUPS, shape[1] // GROUPS, positions]
    views, strides, modes = [], [], []
    for t in ops:
        v, s, mode = _grouped(torch.broadcast_to(t, shape), positions)
        views.append(v)
        strides += s
        modes.append(mode)"""


HOST = '''def _grouped(v, positions):
    """An operand broadcast to (N, C, *): itself (or a contiguous copy), its (sample, channel, position)
    strides, and mode 0 when its channels and positions are one flat run (x itself), 2 when it has one
    value per channel (weights), 1 otherwise."""
    kept = [(size, stride) for size, stride in zip(v.shape[2:], v.stride()[2:]) if size != 1]
    if any(kept[i][1] != kept[i + 1][1] * kept[i + 1][0] for i in range(len(kept) - 1)):
        v = v.contiguous()
        kept = [(size, stride) for size, stride in zip(v.shape[2:], v.stride()[2:]) if size != 1]
    if positions == 1:  # no positions: a column is a channel
        return v, (v.stride(0), v.stride(1), v.stride(1)), 0
    position_stride = kept[-1][1] if kept else 0
    mode = 0 if v.stride(1) == positions * position_stride else 2 if position_stride == 0 else 1
    return v, (v.stride(0), v.stride(1), position_stride), mode


#: Chunks of grouped rows (see _grouped_chunk): the fewest columns one shrinks to within a channel,
#: the most columns of one that spans channels, and its columns per thread.
MIN_GROUPED_CHUNK = 1024
MAX_GATHER_CHUNK = 4096
GATHER_PER_THREAD = 16


def _grouped_chunk(positions, modes):
    """CHUNK, unless a CHUNK-column block would span more than two channels while an operand is not
    one flat run (weights: a value per channel): such a block gathers that operand column by column,
    dividing each column by the channel's positions, which takes many registers. Then the largest
    power of two within a channel, if at least MIN_GROUPED_CHUNK; else at most MAX_GATHER_CHUNK
    columns, and GATHER_PER_THREAD a thread (see the launch)."""
    if positions >= CHUNK or not any(modes):
        return CHUNK
    if positions >= MIN_GROUPED_CHUNK:
        return _pow2_at_most(positions, CHUNK)
    return min(CHUNK, MAX_GATHER_CHUNK)


#: Samples per operand read as columns (see _per_column): its copy is at most 1/8 of the input.
PER_COLUMN_SAMPLES = 8


def _per_column(views, strides, modes, shape, positions):
    """Operands with one value per channel, the same for every sample (weights), copied to one
    value per column of a sample and read like the input, where blocks would gather them: no
    gather and no division by the positions. Only where the batch has PER_COLUMN_SAMPLES samples
    per copied operand: each call makes the copies. Whether it copied any."""
    copied = [i for i, (v, mode) in enumerate(zip(views, modes)) if mode == 2 and v.stride(0) == 0]
    if not copied or len(copied) * PER_COLUMN_SAMPLES > shape[0]:
        return False
    for i in copied:
        columns = views[i][0].contiguous().unsqueeze(0).expand(shape)
        views[i], strides[3 * i : 3 * i + 3], modes[i] = _grouped(columns, positions)
    return True


'''
"""The host helpers of GroupNorm rows (emitted only for grouped plans)."""
