"""A deterministic fake AR runner over a simulated paged KV cache, and page-accounting checks.

The fake writes each computed token into the page its page table names, and samples from what it
reads back out of the pages for positions 0..end: a wrong page table, a prefix hit on the wrong
page, or a page overwritten by another request changes the output. The next token is a stable hash
of the whole sequence mod `vocab`, so output depends only on the sequence; its text is `<tok>`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from voice_server.scheduling import ARScheduler, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSpec, SeqOutput


def next_token(seq: list[int], vocab: int) -> int:
    digest = hashlib.blake2b(repr(seq).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


class FakeRunner:
    def __init__(self, spec: ARSpec, vocab: int = 50) -> None:
        self.spec = spec
        self.vocab = vocab
        self.pages: dict[int, list[int | None]] = {}
        self.num_computed_tokens = 0
        self.forced: dict[str, list[int]] = {}
        """Request id -> tokens to sample next, in order, before falling back to the hash."""

    def execute(self, batch: ARBatch) -> ARResult:
        size = self.spec.page_size
        outputs = []
        for seq in batch.seqs:
            assert seq.token_ids, "an ARSeq computes at least one token"
            end = seq.start_pos + len(seq.token_ids)
            assert len(seq.page_ids) * size >= end, "page table does not cover the chunk"
            for offset, token in enumerate(seq.token_ids):
                pos = seq.start_pos + offset
                page = self.pages.setdefault(seq.page_ids[pos // size], [None] * size)
                page[pos % size] = token
            self.num_computed_tokens += len(seq.token_ids)
            if not seq.is_sampling:
                outputs.append(SeqOutput(None))
                continue
            history = [self.pages[seq.page_ids[p // size]][p % size] for p in range(end)]
            assert None not in history, "read a position no step wrote"
            forced = self.forced.get(seq.request_id)
            token = forced.pop(0) if forced else next_token([t for t in history if t is not None], self.vocab)
            outputs.append(SeqOutput(token, f"<{token}>"))
        return ARResult(tuple(outputs))


def new(rid: str, token_ids: list[int] | None = None, is_stream: bool = False, **sampling: Any) -> WorkItem:
    payload = {} if token_ids is None else {"token_ids": token_ids}
    return WorkItem(rid, WorkKind.NEW, payload, {"sampling": sampling}, is_stream=is_stream)


def chunk(rid: str, token_ids: list[int]) -> WorkItem:
    return WorkItem(rid, WorkKind.CHUNK, {"token_ids": token_ids})


def done(rid: str) -> WorkItem:
    return WorkItem(rid, WorkKind.DONE)


def step(sched: ARScheduler, runner: FakeRunner) -> tuple[ARBatch | None, list[Emit]]:
    """One schedule -> execute -> update, checking the batch and the page accounting."""
    batch = sched.schedule(0.0)
    check_pages(sched)
    if batch is None:
        return None, []
    check_batch(sched, batch)
    emits = sched.update(batch, runner.execute(batch))
    check_pages(sched)
    return batch, emits


def run_all(sched: ARScheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, list[Emit]]:
    """Step until nothing is left to run; emits by request id."""
    by_rid: dict[str, list[Emit]] = {}
    for _ in range(max_steps):
        batch, emits = step(sched, runner)
        if batch is None:
            return by_rid
        for emit in emits:
            by_rid.setdefault(emit.request_id, []).append(emit)
    raise AssertionError("did not drain")


def result(emits: list[Emit]) -> dict[str, Any]:
    finals = [e for e in emits if e.kind is EmitKind.RESULT]
    assert len(finals) == 1 and emits[-1] is finals[0], emits
    return finals[0].payload


def check_pages(sched: ARScheduler) -> None:
    """Every page is exactly one of free / held / evictable; refcounts match the holders."""
    cache, alloc = sched.cache, sched.allocator
    tables = sched.page_tables()
    holders: dict[int, int] = {}
    for table in tables.values():
        assert len(set(table)) == len(table), "a page twice in one page table"
        for page in table:
            holders[page] = holders.get(page, 0) + 1
    free = {p for p in range(alloc.num_pages) if alloc.is_free(p)}
    evictable = set(cache.evictable_pages())
    assert len(free) == alloc.num_free_pages
    assert not free & set(holders), "a free page is in a page table"
    assert not evictable & set(holders), "an evictable page is in a page table"
    assert not free & evictable
    assert len(free) + len(holders) + len(evictable) == alloc.num_pages, "a page leaked"
    for page, count in holders.items():
        if cache.is_cached(page):
            assert cache.refcount(page) == count
        else:
            assert count == 1, f"private page {page} shared by {count} requests"
    for page in evictable:
        assert cache.is_cached(page) and cache.refcount(page) == 0
    stats = sched.stats()
    assert stats["num_free_pages"] + stats["num_used_pages"] + stats["num_evictable_pages"] == stats["num_pages"]
    assert stats["num_used_pages"] == len(holders)


def check_batch(sched: ARScheduler, batch: ARBatch) -> None:
    """Budget, slots, and that a step only writes pages its request holds alone."""
    size = sched.page_size
    assert batch.num_tokens <= sched.max_step_tokens
    assert len(batch.seqs) <= sched.max_batch_size
    assert len({s.request_id for s in batch.seqs}) == len(batch.seqs)
    tables = sched.page_tables()
    for seq in batch.seqs:
        end = seq.start_pos + len(seq.token_ids)
        assert tables[seq.request_id] == seq.page_ids
        assert len(seq.page_ids) * size >= end
        for page in seq.page_ids[seq.start_pos // size:(end - 1) // size + 1]:
            assert not sched.cache.is_cached(page), f"{seq.request_id} writes cached page {page}"
            others = [rid for rid, t in tables.items() if rid != seq.request_id and page in t]
            assert not others, f"{seq.request_id} writes page {page} that {others} hold"
