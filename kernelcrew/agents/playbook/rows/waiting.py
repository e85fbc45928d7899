"""Waiting parts: one launch, a part of a row per program, that waits on per-row counters to write it."""

from __future__ import annotations

from kernelcrew.agents.playbook.rows.kernel import KernelWriter, indent
from kernelcrew.agents.playbook.rows.split import merged_reductions, post_partials, row_reductions

#: Polls of its row's count before a waiting program stops waiting and reduces the row itself.
SPIN_POLLS = 20000


def wait_kernel(w: KernelWriter, name: str) -> list[str]:
    """``name``: few long rows in one launch, each element read once from DRAM.

    Program ``flat`` reduces part ``flat`` (one BLOCK_N part of a row, its loads hinted
    ``evict_last``), stores its partial states and counts itself in its row's counter (a release:
    the states are visible before the count); and it writes part ``flat - lag``: it polls that
    part's row until all its parts have posted (an acquire), merges their states, reads the part
    again from L2 (hinted ``evict_first``) and stores it streaming (``.cs``).

    The counters are kept between calls, so no launch zeroes them first: each call adds SPLITS to
    every row's, and a row is whole when its count reaches ``target``, the next multiple of SPLITS
    above what it held before the call. A lagged program (LAGGED), which writes before it posts,
    reads that from its own row's count first; an unlagged one from the count its post returns; the
    lag's trailing programs, which own no part, count themselves in one more counter.

    Unlagged, a program writes its own part after the row's other parts (its neighbours) have
    posted. Lagged (``lag`` at least a row's parts), it first writes a part whose row was read by
    programs started well before it: it rarely waits, and only for programs started before it.
    After ``spin`` polls a program reduces the whole row itself, in chunks of an eighth of a part,
    for itself alone, so no order of execution deadlocks (the CPU interpreter, which runs programs
    one at a time in order, passes 0)."""
    header = w.row_header(every_row=True)
    reductions = w.plan.reductions
    red_args = [s.args[0] for s in reductions]
    reduce = [line for s in reductions for line in w.reduce_init(s)]
    reduce += ["if start < n_cols:  # a row's last parts may be empty"]
    reduce += indent([line for s in reductions for line in w.reduce_update(s)])

    def part(flat: str) -> list[str]:
        return [
            f"split = {flat} % SPLITS",
            f"pid = {flat} // SPLITS",
            *header,
            "lo = split * BLOCK_N",
            "start = lo",
        ]

    post = [*part("flat"), *w.chunk(red_args, "evict_last"), *reduce, *post_partials(w, "split")]
    post.append('old = tl.atomic_add(posted_ptr + pid, 1, sem="release")  # after its states')
    write = [
        *part("(flat - lag)"),
        'seen = tl.atomic_add(posted_ptr + pid, 0, sem="acquire")',
        "polls = tl.zeros_like(seen)",
        "while (seen < target) & (polls < spin):",
        '    seen = tl.atomic_add(posted_ptr + pid, 0, sem="acquire")',
        "    polls += 1",
        "if seen < target:  # not all posted after spin polls: reduce the whole row here",
        *indent(row_reductions(w, "(BLOCK_N // 8)")),
        "else:",
        *indent(merged_reductions(w)),
        *w.emitter.section(w.per_row_steps(1)),
        "start = lo",
        *w.chunk([w.plan.result], "evict_first"),
        *w.store(streaming=True),
    ]
    body = [
        "flat = tl.program_id(0)",
        "if LAGGED:  # it writes first: its row's count, read before it posts, is below target",
        "    if flat < n_rows * SPLITS:",
        '        epoch = tl.atomic_add(posted_ptr + flat // SPLITS, 0, sem="relaxed") // SPLITS',
        "    else:  # the last lag programs only write: they count themselves after the rows",
        '        epoch = tl.atomic_add(posted_ptr + n_rows, 1, sem="relaxed") // lag',
        "    target = (epoch + 1) * SPLITS",
        "else:  # it posts first: the count before its own",
        "    target = tl.full([], 0, tl.int64)",
        "for step in tl.static_range(2):  # lagged: write, then reduce; else reduce, then write",
        "    if (step == 0) == LAGGED:",
        "        if flat >= lag:  # write part flat - lag once its row's parts have posted",
        *indent(write, 3),
        "    elif flat < n_rows * SPLITS:  # reduce part flat and post its states",
        *indent(post, 2),
        "        if not LAGGED:",
        "            target = (old // SPLITS + 1) * SPLITS",
    ]
    extra = ["ws_ptr", "posted_ptr", "spin", "lag"]
    return [*w.signature(name, extra, ["SPLITS", "LAGGED"]), *indent(body)]


HOST = '''def _wait_lag(programs, parts, part_bytes, device):
    """How many parts behind its own a waiting program writes: enough that the part's row was read
    by programs started well before it (it rarely waits), few enough that the part is still in L2
    (the parts read in between span WAIT_LAG % of it). At least a row's parts, so that a program
    waits only for programs started before it; at most every part."""
    if not WAIT_LAG:
        return 0
    lag = WAIT_LAG_PARTS
    if lag is None:
        lag = parts
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            lag = int(WAIT_LAG / 100 * l2) // max(1, part_bytes)
    return min(max(lag, parts), programs)


#: The waiting launch's per-row counters, one set per device, stream and shape, kept between calls.
_POSTED = {}


def _posted(n_rows, parts, lag, device):
    """Row counters for a waiting launch, without a memset per call: each launch adds ``parts`` to
    every row's, so each call's count starts at a multiple of it. A stream keeps its own, so that
    no two launches use one at once. While a CUDA graph is being captured they are new zeros each
    call (the memset is captured with the launch, so every replay starts from zero)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n_rows + 1, dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, n_rows, parts, lag)
    posted = _POSTED.get(key)
    if posted is None:
        posted = _POSTED.setdefault(key, torch.zeros(n_rows + 1, dtype=torch.int64, device=device))
    return posted


'''
"""The host helpers of the waiting launch (emitted only where it is reachable)."""
