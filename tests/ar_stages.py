"""A model-free AR runner for engine tests of the `ar` scheduler in real stage processes.

Its next token depends only on the previous token and its position, so a request's output is the
same alone, batched, chunked or preempted, and tests can predict it (`expected_tokens`). A prompt
containing `POISON` makes every step it is in raise (failure isolation), a payload with `raise_at_admit`
makes admission raise a RuntimeError (a runner's own bug, not a refusal); `step_delay_ms` slows each step
so aborts land mid-decode.
"""

from __future__ import annotations

import time

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import (
    AdmissionError,
    Emit,
    EmitKind,
    Runner,
    SimpleBatch,
    SimpleResult,
    WorkItem,
    WorkKind,
)
from voice_server.scheduling.contract import ARBatch, ARResult, ARSpec, SeqOutput

VOCAB = 1000
EOS = 1
POISON = 999


def next_token(prev: int, pos: int) -> int:
    """Never EOS or POISON: requests run to `max_tokens` unless a stop condition says otherwise."""
    return 2 + (prev * 7 + pos * 13) % (VOCAB - 3)


def expected_tokens(prompt: list[int], num_tokens: int) -> list[int]:
    out: list[int] = []
    prev, pos = prompt[-1], len(prompt) - 1
    for _ in range(num_tokens):
        prev = next_token(prev, pos)
        out.append(prev)
        pos += 1
    return out


class FakeARRunner(Runner[ARBatch, ARResult]):
    def __init__(self, num_pages: int, page_size: int, step_delay_s: float) -> None:
        self.ar_spec = ARSpec(num_pages=num_pages, page_size=page_size, max_model_len=num_pages * page_size,
                              eos_token_ids=(EOS,))
        self.step_delay_s = step_delay_s

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is WorkKind.DONE or (item.is_stream and not item.payload):
            return item  # NOTE: a stream opens empty; its tokens come in chunks
        if item.payload.get("raise_at_admit"):
            raise RuntimeError("admission bug")
        ids = item.payload.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < VOCAB for t in ids):
            raise AdmissionError(f"payload.token_ids: must be a list of ids in [0, {VOCAB})")
        return item

    def execute(self, batch: ARBatch) -> ARResult:
        if any(POISON in seq.token_ids for seq in batch.seqs):
            raise RuntimeError("poisoned step")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs = []
        for seq in batch.seqs:
            if not seq.is_sampling:
                outputs.append(SeqOutput(None))
                continue
            pos = seq.start_pos + len(seq.token_ids) - 1
            token = next_token(seq.token_ids[-1], pos)
            outputs.append(SeqOutput(token, f" w{token}"))
        return ARResult(tuple(outputs))


def create_fake_ar(ctx: StageContext) -> FakeARRunner:
    args = ctx.args
    return FakeARRunner(int(args.get("num_pages", 64)), int(args.get("page_size", 4)),
                        float(args.get("step_delay_ms", 0.0)) / 1000.0)


class TokenChunker(Runner[SimpleBatch, SimpleResult]):
    """Streams `payload["token_ids"]` downstream in chunks of `payload["chunk_len"]` (an upstream
    stage whose output is an AR stage's streaming input), `chunk_delay_ms` apart."""

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits = []
        for item in batch.items:
            ids, size = item.payload["token_ids"], int(item.payload.get("chunk_len", 3))
            for start in range(0, len(ids), size):
                time.sleep(float(item.payload.get("chunk_delay_ms", 0)) / 1000.0)
                emits.append(Emit(item.request_id, EmitKind.STREAM, {"token_ids": ids[start:start + size]}))
            emits.append(Emit(item.request_id, EmitKind.RESULT, {}))
        return SimpleResult(tuple(emits))


def create_token_chunker(ctx: StageContext) -> TokenChunker:
    return TokenChunker()
