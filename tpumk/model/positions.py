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
   [0, num_pages), and no page the step writes belongs to another sequence's written pages.

`check_step` raises a one-line `PositionError` naming the sequence, the position and what was
expected. Generation, speculation and loaded artifacts (`tpumk.load(...)(...)`) call it by
default; `DecodeStep(..., check=False)` / `step.check_inputs = False` skip it for serving
loops that guarantee their inputs (a device-to-host read of the positions and lengths per
step). Without the check the kernel and the reference still never write outside a sequence's
own pages: out-of-range positions write nothing (see `tpumk.model.reference`).
"""

from __future__ import annotations

import numpy as np

from tpumk.errors import NonFiniteError, PositionError


def capacity_of(cache) -> int:
    """Token positions each sequence's pages hold: pages_per_seq * page_size."""
    return int(cache.block_tables.shape[1]) * int(cache.k.shape[2])


def check_step(positions, cache, where: str = "decode step") -> None:
    """Raise PositionError unless `positions` [B, q] satisfy the contract above for `cache`
    (a `tpumk.model.reference.KVCache`). `where` prefixes the message (e.g. "generate step 3")."""
    pos = np.asarray(positions)
    lengths = np.asarray(cache.lengths)
    tables = np.asarray(cache.block_tables)
    page_size = int(cache.k.shape[2])
    num_pages = int(cache.k.shape[1])
    cap = tables.shape[1] * page_size if tables.ndim == 2 else 0
    if pos.ndim != 2 or tables.ndim != 2 or lengths.shape != (tables.shape[0],) or pos.shape[0] != tables.shape[0]:
        raise PositionError(f"{where}: positions {tuple(pos.shape)}, lengths {tuple(lengths.shape)} and block "
                            f"tables {tuple(tables.shape)} disagree (expected [B, q], [B] and [B, pages_per_seq])")
    if not (np.issubdtype(pos.dtype, np.integer) and np.issubdtype(lengths.dtype, np.integer)):
        raise PositionError(f"{where}: positions and lengths must be integers, got {pos.dtype} and {lengths.dtype}")
    pos, lengths = pos.astype(np.int64), lengths.astype(np.int64)
    q = pos.shape[1]
    written: dict[int, int] = {}
    for b in range(pos.shape[0]):
        n = int(lengths[b])
        if not 0 <= n <= cap:
            raise PositionError(f"{where}: sequence {b} has length {n}, expected 0 <= length <= capacity {cap} "
                                f"({tables.shape[1]} pages x {page_size})")
        for i in range(q):
            p = int(pos[b, i])
            if not 0 <= p < cap:
                raise PositionError(f"{where}: sequence {b} token {i} has position {p}, expected "
                                    f"0 <= position < capacity {cap} ({tables.shape[1]} pages x {page_size})")
            if p != int(pos[b, 0]) + i:
                raise PositionError(f"{where}: sequence {b} token {i} has position {p}, expected {int(pos[b, 0]) + i} "
                                    "(a step's positions are consecutive)")
        start = int(pos[b, 0])
        if start > n:
            raise PositionError(f"{where}: sequence {b} starts at position {start} but holds {n} tokens, expected "
                                f"a first position <= {n} (no gap between the cache and the step)")
        last_page = int(pos[b, -1]) // page_size
        for lp in range(last_page + 1):
            page = int(tables[b, lp])
            if not 0 <= page < num_pages:
                raise PositionError(f"{where}: sequence {b} block table entry {lp} is page {page}, expected a page id "
                                    f"in [0, {num_pages})")
        for lp in range(start // page_size, last_page + 1):
            page = int(tables[b, lp])
            other = written.setdefault(page, b)
            if other != b:
                raise PositionError(f"{where}: sequences {other} and {b} both write page {page} in one step, "
                                    "expected pages a step writes to belong to one sequence")


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
