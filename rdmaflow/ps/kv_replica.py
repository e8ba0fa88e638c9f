"""Replicated key ranges: each shard's keys (key range r, the keys of shard r) are held by R shard
processes, r, r+1, ... (mod S); the first live one of them serves the range (its primary), the
others keep a mirror of its values in their registered memory (its backups). After FaRM
(Dragojević et al., "No compromises: distributed transactions with consistency, availability,
and performance", SOSP '15): the primary writes its changes one-sidedly into the backups' memory
and makes a change visible (an acknowledgement, a pull reply) only once every live backup holds
it; a backup's CPU does nothing per request. docs/parameter-server.md, "Replicated shards",
draws the protocol; this module holds its two halves that are not the plain key-value protocol:

- ``replicate``: the primary's round. After it applied the push requests it saw, it WRITEs into
  each backup's block of the range a *record* (round | count | every worker's applied request
  number | the touched key indices | their new values), fence, the round into ``commit``, fence,
  the new values in place into the mirror and the applied numbers into ``mapplied``, fence, the
  round into ``mround``; then it waits until every WRITE is visible there. A backup whose WRITE
  fails is dropped from the range, in the job's store, before anything is acknowledged.
- ``redo`` and the owner keys: a successor's takeover. ``commit > mround`` means the last record
  landed whole and its in-place WRITEs perhaps not: the successor applies it again (new values,
  not increments: doing it twice is doing it once). Otherwise the mirror is the state after the
  last whole round. Workers name the successor in the store (``kv/owner/r`` = "epoch:shard", by
  compare-and-set) and ring its ``takeover`` word.
"""
from __future__ import annotations

import torch

from rdmaflow import READ, WRITE, RdmaflowError
from rdmaflow.deadline import Deadline
from rdmaflow.ps.kv_layout import U64, words

EPOCH_SHIFT = 40  # a round number is epoch << 40 | the round within the epoch: later epochs rank higher
SPAN_SLACK = 64 << 10  # bytes: touched keys this close together go as one in-place WRITE of their span


def owner_key(r: int) -> str:
    return f"kv/owner/{r}"


def out_key(r: int, c: int) -> str:
    """Set once shard c's copy of range r may be stale (its primary dropped it): never its successor."""
    return f"kv/out/{r}/{c}"


def owner(store, r: int) -> tuple[int, int, str]:
    """(epoch, shard, the key's text) of range r's primary; epoch 0 is its first, shard r."""
    text = store.get(owner_key(r)) if store.check(owner_key(r)) else ""
    if not text:
        return 0, r, ""
    e, c = text.split(":")
    return int(e), int(c), text


def dead(store, c: int) -> bool:
    return store.check(f"dead/shard/{c}")


def candidates(store, spec, r: int) -> list[int]:
    """Range r's holders that may serve it: not declared dead, not dropped, in succession order."""
    return [c for c in spec.holders(r) if not dead(store, c) and not store.check(out_key(r, c))]


def lost_message(spec, r: int) -> str:
    holders = spec.holders(r)
    return (f"key range {r} (the keys k with k % {spec.ns} == {r}) is lost: every shard that held a copy of it "
            f"(shard{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}) died")


def replicate(rng, rows: torch.Tensor | None, timeout: float) -> None:
    """One replication round of ``rng`` (a KVRange serving as primary): ``rows`` the local key
    indices its pushes touched (repeats allowed), None for every key (a new primary's first
    round). Returns once every live backup holds the new values and applied numbers."""
    if not rng.backups:
        return
    L, raw, nw = rng.layout, rng.raw, rng.nw
    rows = torch.arange(rng.n, dtype=torch.int64) if rows is None else torch.unique(rows)
    count = len(rows)
    rng.round += 1
    rnd = rng.epoch << EPOCH_SHIFT | rng.round
    head = words(raw, L.rec(0), 2 + nw)  # the record is built in slot 0 here, whatever slot it goes to
    head[0], head[1] = rnd, count
    head[2:] = rng.applied
    words(raw, L.rec_rows(0), count)[:] = rows
    where = rng._where(rows)
    k = rng._count(where)
    values = raw[L.rec_values(0) : L.rec_values(0) + k * L.itemsize].view(rng.spec.dtype)
    if isinstance(where, slice):
        values.copy_(rng.stored[where])
    else:
        torch.index_select(rng.stored, 0, where, out=values)
    words(raw, L.mround_src, 1)[0] = rnd
    commit_src = words(raw, L.commit_src, rng.spec.ns)
    spans = _spans(rng, rows, where, k)
    pending = []
    for b in list(rng.backups):
        futs = []
        slot = b["slot"]
        commit_src[b["proc"]] = rnd << 1 | slot
        try:
            post = _poster(rng, b, futs)
            post(L.rec(0), L.rec(slot), U64 * (2 + nw + count))
            post(L.rec_values(0), L.rec_values(slot), k * L.itemsize)
            b["channel"].fence()  # the record lands whole before its commit word
            post(L.commit_src + U64 * b["proc"], L.commit, U64)
            b["channel"].fence()  # and the commit before any in-place value
            for a, e in spans:
                post(a * L.itemsize, a * L.itemsize, (e - a) * L.itemsize)
            post(L.rec(0) + 2 * U64, L.mapplied, U64 * nw)
            b["channel"].fence()
            post(L.mround_src, L.mround, U64)
        except RdmaflowError as e:
            drop(rng, b, e)
            continue
        pending.append((b, futs))
    deadline = Deadline(timeout)
    for b, futs in pending:
        try:
            for f in futs:
                f.result(deadline.left())
            b["slot"] ^= 1  # the next record goes to the other slot: this one stays whole until then
        except RdmaflowError as e:  # a PeerError, or a backup that stopped answering: not a copy any more
            drop(rng, b, e)
    rng.stats["replicated"] = rng.stats.get("replicated", 0) + 1


def first_slot(rng, b: dict, timeout: float) -> int:
    """The record slot a new primary writes backup ``b`` first: the one its last committed
    record is not in (one READ of its commit word)."""
    L = rng.layout
    b["channel"].memcpy(rng.region, rng.base + L.peek, b["remote"], b["base"] + L.commit, U64,
                        READ).result(timeout)
    return 1 - (int(words(rng.raw, L.peek, 1)[0]) & 1)


def _poster(rng, b: dict, futs: list):
    def post(local: int, remote: int, nbytes: int) -> None:
        if nbytes:
            futs.append(b["channel"].memcpy(rng.region, rng.base + local, b["remote"], b["base"] + remote, nbytes,
                                            WRITE))
    return post


def _spans(rng, rows: torch.Tensor, where, k: int) -> list[tuple[int, int]]:
    """The element ranges of ``stored`` the in-place WRITEs cover: one span from the first touched
    key to the last when it is not much more than their values (the keys between hold the same
    values on both sides, so rewriting them changes nothing), else one per run of consecutive keys."""
    if not len(rows):
        return []
    if isinstance(where, slice):
        return [(where.start, where.stop)]
    first, last = int(rows[0]), int(rows[-1])
    a, e = rng.offsets[first], rng.offsets[last] + rng.numels[last]
    if (e - a) * rng.layout.itemsize <= max(SPAN_SLACK, 2 * k * rng.layout.itemsize):
        return [(a, e)]
    breaks = (torch.nonzero(rows[1:] - rows[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, len(rows)]
    rl = rows.tolist()
    return [(rng.offsets[rl[s]], rng.offsets[rl[t - 1]] + rng.numels[rl[t - 1]]) for s, t in zip(starts, ends)]


def drop(rng, b: dict, why) -> None:
    """Takes backup ``b`` out of ``rng``'s range for good: recorded in the store (so that it is
    never elected with a stale copy) before the primary acknowledges anything more."""
    rng.backups.remove(b)
    rng.store.set(out_key(rng.r, b["proc"]), f"dropped by shard {rng.proc}: {why}")
    rng.stats["backups_dropped"] = rng.stats.get("backups_dropped", 0) + 1


def redo(rng) -> torch.Tensor:
    """A successor's first step: the mirror made whole (the last committed record applied again
    if its in-place WRITEs may not all have landed); returns the applied request numbers."""
    L, raw, nw = rng.layout, rng.raw, rng.nw
    commit, mround = int(words(raw, L.commit, 1)[0]), int(words(raw, L.mround, 1)[0])
    mapplied = words(raw, L.mapplied, nw)
    slot = commit & 1
    if commit >> 1 > mround:
        head = words(raw, L.rec(slot), 2 + nw)
        count = int(head[1])
        rows = words(raw, L.rec_rows(slot), count).clone()
        where = rng._where(rows)
        values = raw[L.rec_values(slot) : L.rec_values(slot) + rng._count(where) * L.itemsize].view(rng.spec.dtype)
        if isinstance(where, slice):
            rng.stored[where].copy_(values)
        else:
            rng.stored.index_copy_(0, where, values)
        mapplied.copy_(head[2:])
        rng.stats["redone"] = rng.stats.get("redone", 0) + 1
    return mapplied.clone()
