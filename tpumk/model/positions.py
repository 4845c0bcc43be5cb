"""The positions contract of a decode step, checked on the host before any cache row is touched.

The reference (`tpumk.model.reference.decode_step`) and the megakernel
(`tpumk.kernel.attention`) share one paged cache and assume, for every sequence b of a step
with positions `[B, q]` over a cache of capacity C = pages_per_seq * page_size:

1. `0 <= lengths[b] <= C`;
2. the step's positions are consecutive: `positions[b, i] == positions[b, 0] + i`;
3. no gap: `0 <= positions[b, 0] <= lengths[b]` (a start below the length rewrites rows from
   there on, as speculative rollback and draft catch-up do; a start above it would leave
   rows below the new length that no step wrote);
4. inside the pages: `positions[b, q - 1] < C`;
5. the block-table entries of the pages the step reads or writes are page ids in
   [0, num_pages); no page the step writes belongs to another sequence's written pages, nor
   to another sequence's read pages (pages 0 .. its last position's page: the kernel streams
   them while the write-back is in flight, so a shared page must not be written in that step);
6. no page id appears twice among the entries of a sequence's read pages (two logical pages
   of one sequence on one physical page would overwrite each other's rows).

A hybrid model's cache also carries its linear layers' state pool (`cache.states`,
`tpumk.model.linear_attention.LinearStates`), and then:

7. each sequence's state slot `states.slots[b]` is in [0, num_slots), and no two sequences of
   the step share a slot (both would read one state and write it twice);
8. a step whose tokens must stay pending (`keep_pending`: a speculative verify step, which may
   be rolled back, and a loaded megakernel artifact's step, which leaves every step's tokens
   pending) has at least q pending rows per slot (`reference.init_cache(..., pending=q)`); a
   longer step on a smaller pool would apply its tokens at once, and a rollback would then
   keep rejected tokens in the state.

`check_tokens` checks that a step's token ids are in [0, vocab_size).

`check_step` raises a one-line `PositionError` naming the sequence, the position and what was
expected (numpy over [B, pages_per_seq] masks: no per-page Python loop). Generation,
speculation and loaded artifacts (`tpumk.load(...)(...)`) call it by default; serving loops
that guarantee their inputs (it costs a device-to-host read of the positions and lengths per
step) opt out with `step(..., check=False)`, `step.check_inputs = False` or
`tpumk.load(path, check_inputs=False)`. Without the check the kernel and the reference still
never write outside a sequence's own pages: out-of-range positions, block-table entries
outside [0, num_pages) and token ids outside the vocabulary write nothing (see
`tpumk.model.reference`, "Defined behaviour"), and a state slot outside the pool is read
clipped and written nothing (`tpumk.model.linear_attention.layer_step`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tpumk.errors import NonFiniteError, PositionError, TokenError


def new_lengths(positions, lengths, capacity: int):
    """Lengths after a step (the reference's and the kernel's rule): max(lengths, largest
    in-range position + 1); positions outside [0, capacity) write nothing and move nothing."""
    written = jnp.where((positions >= 0) & (positions < capacity), positions, -1)
    return jnp.maximum(lengths, jnp.max(written, axis=1) + 1)


def check_step(positions, cache, where: str = "decode step", keep_pending: bool = False) -> None:
    """Raise PositionError unless `positions` [B, q] satisfy the contract above for `cache`
    (a `tpumk.model.reference.KVCache`; a hybrid's state pool in `cache.states`, rules 7 and 8:
    `keep_pending` for a step whose tokens must stay pending). `where` prefixes the message
    (e.g. "generate step 3"). Of several violations, the one reported is the first a
    per-sequence scan would meet; the pool's after the positions'."""
    pos = np.asarray(positions)
    lengths = np.asarray(cache.lengths)
    tables = np.asarray(cache.block_tables)
    page_size = int(cache.page_size)
    num_pages = int(cache.num_pages)
    if (pos.ndim != 2 or tables.ndim != 2 or lengths.shape != (tables.shape[0],) or pos.shape[0] != tables.shape[0]
            or pos.shape[1] == 0):
        raise PositionError(f"{where}: positions {tuple(pos.shape)}, lengths {tuple(lengths.shape)} and block "
                            f"tables {tuple(tables.shape)} disagree (expected [B, q] with q >= 1, [B] and "
                            "[B, pages_per_seq])")
    if not (np.issubdtype(pos.dtype, np.integer) and np.issubdtype(lengths.dtype, np.integer)):
        raise PositionError(f"{where}: positions and lengths must be integers, got {pos.dtype} and {lengths.dtype}")
    pos, lengths = pos.astype(np.int64), lengths.astype(np.int64)
    B, q = pos.shape
    pps = tables.shape[1]
    cap = int(cache.max_context)  # pages_per_seq * page_size
    pages_of = f"({pps} pages x {page_size})"
    rows = np.arange(B)

    def first_true(mask):  # [B, n] -> per row the first True column, or -1
        return np.where(mask.any(axis=1), np.argmax(mask, axis=1), -1)

    bad_len = (lengths < 0) | (lengths > cap)
    out_pos = (pos < 0) | (pos >= cap)
    not_consec = pos != pos[:, :1] + np.arange(q)[None]
    # per token, the first problem a scan of the tokens would meet: range, then consecutiveness
    tok_bad = first_true(out_pos | not_consec)
    start = pos[:, 0]
    bad_start = start > lengths
    last_page = np.clip(pos[:, -1], 0, max(cap - 1, 0)) // page_size
    lp = np.arange(pps)[None]
    reads = lp <= last_page[:, None]  # [B, pps]
    writes = reads & (lp >= (np.clip(start, 0, None) // page_size)[:, None])
    bad_entry = reads & ((tables < 0) | (tables >= num_pages))
    entry_bad = first_true(bad_entry)
    # a page id twice among one sequence's read entries: stable sort of each row's read entries
    # (unread ones keyed past every page id), then equal neighbours; report the later entry
    keyed = np.where(reads, tables.astype(np.int64), np.int64(num_pages) + 1 + lp)
    order = np.argsort(keyed, axis=1, kind="stable")
    srt = np.take_along_axis(keyed, order, axis=1)
    dup_sorted = np.zeros_like(reads)
    dup_sorted[:, 1:] = srt[:, 1:] == srt[:, :-1]
    dup = np.zeros_like(reads)
    np.put_along_axis(dup, order, dup_sorted, axis=1)
    dup_entry = first_true(dup & reads)
    # page conflicts with earlier sequences: the first sequence to write / read each page
    pages = np.clip(tables, 0, max(num_pages - 1, 0))
    bw, lw = np.nonzero(writes)
    br, lr = np.nonzero(reads)
    first_w = np.full(max(num_pages, 1), B)
    first_r = np.full(max(num_pages, 1), B)
    np.minimum.at(first_w, pages[bw, lw], bw)
    np.minimum.at(first_r, pages[br, lr], br)
    ww = writes & (first_w[pages] < rows[:, None])
    wr = (reads & ~writes & (first_w[pages] < rows[:, None])) | (writes & (first_r[pages] < rows[:, None]))
    failing = (bad_len | (tok_bad >= 0) | bad_start | (entry_bad >= 0) | (dup_entry >= 0) | ww.any(axis=1)
               | wr.any(axis=1))
    if not failing.any():
        states = getattr(cache, "states", None)
        if states is not None:
            check_states(states, B, q, where, keep_pending)
        return
    b = int(np.argmax(failing))
    n = int(lengths[b])
    if bad_len[b]:
        raise PositionError(f"{where}: sequence {b} has length {n}, expected 0 <= length <= capacity {cap} {pages_of}")
    if tok_bad[b] >= 0:
        i = int(tok_bad[b])
        p = int(pos[b, i])
        if out_pos[b, i]:
            raise PositionError(f"{where}: sequence {b} token {i} has position {p}, expected "
                                f"0 <= position < capacity {cap} {pages_of}")
        raise PositionError(f"{where}: sequence {b} token {i} has position {p}, expected {int(pos[b, 0]) + i} "
                            "(a step's positions are consecutive)")
    if bad_start[b]:
        raise PositionError(f"{where}: sequence {b} starts at position {int(start[b])} but holds {n} tokens, expected "
                            f"a first position <= {n} (no gap between the cache and the step)")
    if entry_bad[b] >= 0:
        e = int(entry_bad[b])
        raise PositionError(f"{where}: sequence {b} block table entry {e} is page {int(tables[b, e])}, expected a "
                            f"page id in [0, {num_pages})")
    if dup_entry[b] >= 0:
        e = int(dup_entry[b])
        page = int(tables[b, e])
        e0 = int(np.argmax(reads[b] & (tables[b] == page)))
        raise PositionError(f"{where}: sequence {b} block table entries {e0} and {e} are both page {page}, expected "
                            "distinct pages (one would overwrite the other's rows)")
    if ww[b].any():
        page = int(tables[b, int(np.argmax(ww[b]))])
        raise PositionError(f"{where}: sequences {int(first_w[page])} and {b} both write page {page} in one step, "
                            "expected pages a step writes to belong to one sequence")
    page = int(tables[b, int(np.argmax(wr[b]))])
    writer, reader = (int(first_w[page]), b) if first_w[page] < b else (b, int(first_r[page]))
    raise PositionError(f"{where}: sequence {writer} writes page {page} that sequence {reader} reads in one step, "
                        "expected a page a step writes to be read by no other sequence (the kernel streams it "
                        "while the write-back is in flight)")


def check_states(states, batch: int, q: int, where: str = "decode step", keep_pending: bool = False) -> None:
    """Raise PositionError unless a hybrid's state pool (`LinearStates`) serves a step of
    `batch` sequences x `q` tokens: one slot per sequence, each in the pool, none shared, and
    with `keep_pending` at least q pending rows (rules 7 and 8 above)."""
    slots = np.asarray(states.slots)
    num_slots, rows = int(states.num_slots), int(states.pending_rows)
    if slots.shape != (batch,) or not np.issubdtype(slots.dtype, np.integer):
        raise PositionError(f"{where}: the state pool's slots are {slots.dtype} {tuple(slots.shape)}, expected one "
                            f"integer slot per sequence ({batch},)")
    slots = slots.astype(np.int64)
    outside = (slots < 0) | (slots >= num_slots)
    order = np.argsort(slots, kind="stable")  # a slot an earlier sequence already has
    shared = np.zeros(batch, bool)
    shared[order[1:]] = slots[order[1:]] == slots[order[:-1]]
    bad = outside | shared
    if bad.any():
        b = int(np.argmax(bad))
        s = int(slots[b])
        if outside[b]:
            raise PositionError(f"{where}: sequence {b} has state slot {s}, expected a slot in [0, {num_slots}) "
                                f"(the pool's {num_slots} slots)")
        first = int(np.argmax(slots == s))
        raise PositionError(f"{where}: sequences {first} and {b} both have state slot {s}, expected one slot per "
                            "sequence (both would read one state and write it twice)")
    if keep_pending and rows < q:
        raise PositionError(f"{where}: sequence 0 (state slot {int(slots[0])}): a step of {q} tokens that must stay "
                            f"pending on a pool of {rows} pending row{'s' if rows != 1 else ''} per slot, expected "
                            f"at least {q} (reference.init_cache(..., pending={q}); a smaller pool applies the "
                            "tokens at once, and a rollback would keep rejected ones in the state)")


def check_tokens(tokens, vocab_size: int, where: str = "decode step") -> None:
    """Raise TokenError naming the first sequence and token whose id is outside [0, vocab_size)
    (unchecked, such a token embeds as zeros and writes no cache row: see
    `tpumk.model.reference`)."""
    t = np.asarray(tokens)
    if t.ndim != 2 or not np.issubdtype(t.dtype, np.integer):
        raise TokenError(f"{where}: token ids must be integers [B, q], got {t.dtype} {tuple(t.shape)}")
    bad = (t < 0) | (t >= vocab_size)
    if bad.any():
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise TokenError(f"{where}: sequence {b} token {i} has id {int(t[b, i])}, expected a token id in "
                         f"[0, {vocab_size}) (the model's vocabulary)")


def check_finite(logits, where: str, rows=None, names=None) -> None:
    """Raise NonFiniteError naming the first sequence whose logits [B, ...] hold a NaN or an
    infinity (greedy decoding would otherwise read argmax(NaN) = token 0). `rows` restricts
    the check to those batch rows; `names[row]` is the sequence number to report (default row)."""
    a = np.asarray(logits)
    bad = ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    for r in (range(a.shape[0]) if rows is None else rows):
        if bad[r]:
            kind = "NaN" if np.isnan(a[r]).any() else "infinite"
            seq = r if names is None else names[r]
            raise NonFiniteError(f"{where}: sequence {seq} has {kind} logits (check the weights and the model "
                                 "config, e.g. rope_theta, rms_eps)")
