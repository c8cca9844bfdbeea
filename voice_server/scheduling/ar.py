"""ARScheduler: continuous batching over a paged KV cache, with chunked prefill and a prefix cache.

Every step, running requests (at most `max_batch_size`) each get a chunk under `max_step_tokens`:
decoding requests their one token first, then prefilling ones a chunk each in FCFS order (the last
one may be cut to the remaining budget). Waiting requests are then admitted FCFS while there are
slots, budget and pages for their first chunk, skipping the full pages the prefix cache holds.
Pages are allocated as chunks need them; when they run out, the most recently admitted running
request is preempted by recompute: it drops its pages and goes back to the front of the queue
with its output, which is recomputed on resume (so it continues with the same tokens).

With `speech_lead_s` (a stage whose text becomes speech), requests that are that far ahead of their
listeners sit out the steps while another request is behind (`speech_lead.py`).
"""

from __future__ import annotations

from collections import deque

from voice_server.scheduling.ar_input import apply_chunk, apply_done, new_request
from voice_server.scheduling.ar_request import Request
from voice_server.scheduling.base import BaseScheduler, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSeq, ARSpec, SeqOutput
from voice_server.scheduling.pages import PageAllocator, PageKey, PrefixCache
from voice_server.scheduling.solo import SoloQueue
from voice_server.scheduling.speech_lead import SpeechLead


class ARScheduler(BaseScheduler[ARBatch, ARResult]):
    def __init__(self, spec: ARSpec, max_batch_size: int, max_step_tokens: int, prefix_cache: bool = True,
                 speech_lead_s: float = 0.0) -> None:
        if max_batch_size < 1 or max_step_tokens < 1:
            raise ValueError(f"max_batch_size and max_step_tokens must be >= 1, got {max_batch_size} and "
                             f"{max_step_tokens}")
        self.spec = spec
        self.page_size = spec.page_size
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.allocator = PageAllocator(spec.num_pages, spec.page_size)
        self.cache = PrefixCache(self.allocator, is_enabled=prefix_cache)
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        """In admission order: preemption takes from the end."""
        self._is_stalled = False
        """The last `schedule` found nothing it could run; only new input or an exit changes that."""
        self.num_preemptions = 0
        self._lead = SpeechLead(speech_lead_s) if speech_lead_s else None
        self.num_lead_skips = 0
        """Request steps sat out by requests ahead of their listeners (`speech_lead_s`)."""
        self._suspects: SoloQueue[str] = SoloQueue(lambda request_id: request_id)
        """Members of a step that raised, each to run one step alone before anything else (ids of requests
        that left since are skipped when their turn comes)."""

    # -- input -------------------------------------------------------------------------------------

    def add(self, item: WorkItem, now: float) -> None:
        self._is_stalled = False
        rid = item.request_id
        if item.kind is WorkKind.NEW:
            if rid in self._requests:
                raise ValueError(f"request {rid} is already in this stage")
            fresh = new_request(item, self.spec)
            self._requests[rid] = fresh
            self._waiting.append(fresh)
            return
        request = self._requests.get(rid)
        if request is None:
            return  # late input of a request that already left (finished, aborted or failed)
        if item.kind is WorkKind.CHUNK:
            apply_chunk(request, item.payload, self.spec)
        else:
            apply_done(request)

    def abort(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._drop(request)
        return True

    # -- scheduling --------------------------------------------------------------------------------

    def next_wakeup(self, now: float) -> float | None:
        if self._is_stalled:
            return None
        has_work = any(r.num_ready_tokens > 0 for r in self._running) or any(
            r.num_ready_target_tokens > 0 for r in self._waiting)
        return 0.0 if has_work else None

    def schedule(self, now: float) -> ARBatch | None:
        solo = self._schedule_suspect()
        if solo is not None:
            return solo
        ahead: set[Request] = set()
        if self._lead is not None:
            is_admitting = len(self._running) < self.max_batch_size and any(
                r.num_ready_target_tokens > 0 for r in self._waiting)
            ahead = self._lead.ahead(self._running, is_admitting, now)
        batch = self._plan(ahead)
        if batch is None and ahead:
            batch = self._plan(set())  # NOTE: those behind could not run (no pages): nobody sits out
        elif batch is not None:
            self.num_lead_skips += len(ahead)
        self._is_stalled = batch is None
        return batch

    def _plan(self, ahead: set[Request]) -> ARBatch | None:
        """This step's batch with the requests in `ahead` left out."""
        budget = self.max_step_tokens
        chunks: dict[str, int] = {}
        """Request id -> tokens to compute this step, in batch order."""
        is_preempted = False
        # NOTE: decodes first (a token each keeps every stream moving), then prefill chunks FCFS.
        running = [r for r in self._running if r not in ahead]
        order = [r for r in running if r.num_ready_tokens == 1]
        order += [r for r in running if r.num_ready_tokens > 1]
        for request in order:
            if request not in self._running:
                continue  # preempted for an earlier request of this step
            num = min(request.num_ready_tokens, budget)
            if num == 0:
                continue
            while not self._grow(request, request.num_computed_tokens + num):
                victim = self._running[-1]
                if victim is request and len(self._running) == 1:
                    # NOTE: unreachable: `add` and `update` keep every sequence within the whole
                    # cache, and a lone running request can take every page.
                    raise RuntimeError(f"request {request.request_id} cannot fit in an empty KV cache")
                self._preempt(victim)
                is_preempted = True
                budget += chunks.pop(victim.request_id, 0)
                if victim is request:
                    break
            else:
                chunks[request.request_id] = num
                budget -= num
        if not is_preempted:
            # NOTE: no admission in a step that preempted: the queue's head is the request just
            # preempted for lack of pages, readmitting it would only thrash.
            budget = self._admit(budget, chunks)
        batch = ARBatch(tuple(self._seq(self._requests[rid], num) for rid, num in chunks.items()))
        return batch if batch.seqs else None

    def _schedule_suspect(self) -> ARBatch | None:
        """One step of the next suspect alone: a culprit then fails by itself, the others go on."""
        while (request_id := self._suspects.pop()) is not None:
            request = self._requests.get(request_id)
            if request is None or request not in self._running or request.num_ready_tokens == 0:
                continue
            num = min(request.num_ready_tokens, self.max_step_tokens)
            if self._grow(request, request.num_computed_tokens + num):
                return ARBatch((self._seq(request, num),))
        return None

    def _admit(self, budget: int, chunks: dict[str, int]) -> int:
        for request in list(self._waiting):
            if len(self._running) >= self.max_batch_size or budget == 0:
                break
            if request.num_ready_target_tokens == 0:
                continue  # streaming input with nothing to compute yet: it must not block the rest
            num_matchable = request.num_cacheable_tokens
            if request.turn_end_pos is not None:  # NOTE: the scored row is computed, never served from the cache
                num_matchable = min(request.num_tokens if num_matchable is None else num_matchable,
                                    request.turn_end_pos + 1)
            hit_pages = self.cache.match(request.token_ids[:num_matchable])
            num_hit = len(hit_pages) * self.page_size
            num = min(request.num_ready_target_tokens - num_hit, budget)
            if num <= 0:
                continue
            self.cache.acquire(hit_pages)
            fresh = self.cache.allocate(-(-(num_hit + num) // self.page_size) - len(hit_pages))
            if fresh is None:
                self.cache.release(hit_pages)
                break  # FCFS: a later request does not jump a head that does not fit
            self.cache.record_query(request.num_tokens, num_hit)
            self._waiting.remove(request)
            self._running.append(request)
            request.page_ids = hit_pages + fresh
            request.page_keys = [self.cache.key_of(p) for p in hit_pages]
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            chunks[request.request_id] = num
            budget -= num
        return budget

    def _grow(self, request: Request, num_tokens: int) -> bool:
        num_new = -(-num_tokens // self.page_size) - len(request.page_ids)
        if num_new <= 0:
            return True
        pages = self.cache.allocate(num_new)
        if pages is None:
            return False
        request.page_ids.extend(pages)
        return True

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.cache.release(request.page_ids)
        request.reset_pages()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request)

    def _seq(self, request: Request, num: int) -> ARSeq:
        start = request.num_computed_tokens
        is_sampling = request.is_input_done and start + num == request.num_tokens
        is_history = is_sampling and request.sampling.repetition_penalty != 1.0
        end_pos = request.turn_end_pos
        return ARSeq(
            request.request_id, tuple(request.token_ids[start:start + num]), start, tuple(request.page_ids),
            is_sampling, request.sampling, tuple(request.token_ids) if is_history else (),
            end_pos - start if end_pos is not None and start <= end_pos < start + num else None,
        )

    # -- results -----------------------------------------------------------------------------------

    def update(self, batch: ARBatch, result: ARResult) -> list[Emit]:
        self._is_stalled = False
        if len(result.outputs) != len(batch.seqs):
            return self.fail(batch, f"runner returned {len(result.outputs)} outputs for {len(batch.seqs)} sequences")
        emits: list[Emit] = []
        for seq, output in zip(batch.seqs, result.outputs):
            request = self._requests.get(seq.request_id)
            if request is None or request.num_computed_tokens != seq.start_pos:
                continue  # aborted while the batch ran
            request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            self._commit_pages(request)
            if seq.is_sampling:
                emits.extend(self._on_sample(request, output))
        return emits

    def _commit_pages(self, request: Request) -> None:
        """Register the pages this step filled, so a request with the same prefix can hit them."""
        size = self.page_size
        num_cacheable = request.num_computed_tokens
        if request.num_cacheable_tokens is not None:
            num_cacheable = min(num_cacheable, request.num_cacheable_tokens)
        for i in range(len(request.page_keys), num_cacheable // size):
            parent: PageKey = request.page_keys[-1] if request.page_keys else b""
            request.page_keys.append(
                self.cache.commit(parent, request.token_ids[i * size:(i + 1) * size], request.page_ids[i]))

    def _on_sample(self, request: Request, output: SeqOutput) -> list[Emit]:
        rid = request.request_id
        if output.token_id is None:
            self._drop(request)
            return [Emit(rid, EmitKind.ERROR, message="runner sampled no token for a sampling sequence")]
        request.token_ids.append(output.token_id)
        request.turn_end_pos = None  # NOTE: its score went out with this first token
        step = request.stop.append(output.token_id, output.text, request.num_tokens)
        is_final = step.finish_reason is not None
        payload = {"token_ids": [output.token_id], "text": step.delta, **output.data}
        # NOTE: with tools, a token's emit may be held, released later with others, or dropped (tool_calls.py).
        payloads = [payload] if request.tools is None else request.tools.step(payload, output.text, is_final)
        emits = [Emit(rid, EmitKind.STREAM, p) for p in payloads]
        if is_final:
            self._drop(request)
            emits.append(Emit(rid, EmitKind.RESULT, {
                "token_ids": request.output_ids, "text": request.stop.text, "finish_reason": step.finish_reason,
                "num_prompt_tokens": request.num_prompt_tokens, "num_cached_tokens": request.num_cached_tokens or 0,
                **(request.tools.result() if request.tools is not None else {}),
            }))
        elif request.num_tokens > self.spec.num_pages * self.page_size:
            # NOTE: the next step would need more pages than the whole cache: fail rather than loop.
            self._drop(request)
            emits.append(Emit(rid, EmitKind.ERROR, message=(
                f"sequence of {request.num_tokens} tokens outgrew the KV cache "
                f"({self.spec.num_pages} pages of {self.page_size} tokens)")))
        return emits

    def fail(self, batch: ARBatch, message: str) -> list[Emit]:
        self._is_stalled = False
        held = [seq.request_id for seq in batch.seqs if seq.request_id in self._requests]
        # NOTE: one bad request must not fail those batched with it (`SoloQueue`): each member runs one
        # step alone first. Safe: a step writes KV only at positions past each request's computed tokens
        # (not advanced by a failed step), and the runner commits sampler and detokenizer state only
        # once a step succeeded.
        if self._suspects.defer(held):
            return []
        emits = []
        for seq in batch.seqs:
            request = self._requests.get(seq.request_id)
            if request is not None:
                self._drop(request)
                emits.append(Emit(seq.request_id, EmitKind.ERROR, message=message))
        return emits

    def _drop(self, request: Request) -> None:
        """The request leaves the stage: its pages go back (cached full pages stay, evictable)."""
        del self._requests[request.request_id]
        if request in self._running:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.cache.release(request.page_ids)
        request.reset_pages()
        self._is_stalled = False

    # -- introspection -----------------------------------------------------------------------------

    @property
    def active_request_ids(self) -> set[str]:
        return set(self._requests)

    def page_tables(self) -> dict[str, tuple[int, ...]]:
        """Request id -> its page table (running requests; waiting ones hold no pages)."""
        return {r.request_id: tuple(r.page_ids) for r in self._running}

    def stats(self) -> dict[str, int]:
        return {
            "num_pages": self.allocator.num_pages,
            "num_free_pages": self.allocator.num_free_pages,
            "num_used_pages": self.allocator.num_used_pages - self.cache.num_evictable_pages,
            "num_cached_pages": self.cache.num_cached_pages,
            "num_evictable_pages": self.cache.num_evictable_pages,
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "num_preemptions": self.num_preemptions,
            "num_lead_skips": self.num_lead_skips,
            "num_prefix_hit_tokens": self.cache.num_hit_tokens,
            "num_prefix_query_tokens": self.cache.num_query_tokens,
        }

