"""Drive an AR runner with hand-built `ARBatch`es (no scheduler): a trivial page allocator and a
continuous-batching loop where every active request is in every step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from voice_server.scheduling.contract import ARBatch, ARResult, ARSeq, SamplingParams


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 8
    chunk_sizes: Sequence[int] = ()
    """Prefill chunk sizes in order (the rest of the prompt goes in one last chunk)."""
    start_step: int = 0
    """Step at which the request joins the batch."""
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    text: str = ""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def is_done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.free = list(range(num_pages))
        self.page_size = page_size

    def grow(self, pages: list[int], num_positions: int) -> None:
        while len(pages) * self.page_size < num_positions:
            # NOTE: from the end, so requests get scattered, non-contiguous pages.
            pages.append(self.free.pop())

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)
        pages.clear()


def next_seq(rid: str, req: Request, allocator: PageAllocator) -> ARSeq:
    tokens = req.tokens
    num_chunks_done = 0
    done = 0
    for size in req.chunk_sizes:
        if done >= req.num_computed:
            break
        done += size
        num_chunks_done += 1
    if req.num_computed < len(req.prompt) and num_chunks_done < len(req.chunk_sizes):
        end = min(req.num_computed + req.chunk_sizes[num_chunks_done], len(tokens))
    else:
        end = len(tokens)
    allocator.grow(req.pages, end)
    return ARSeq(
        request_id=rid,
        token_ids=tuple(tokens[req.num_computed : end]),
        start_pos=req.num_computed,
        page_ids=tuple(req.pages),
        is_sampling=end == len(tokens),
        sampling=req.sampling,
        history=tuple(tokens) if req.sampling.repetition_penalty != 1.0 else (),
    )


def run(runner: object, requests: Mapping[str, Request], max_steps: int = 10_000) -> dict[str, Request]:
    """Step until every request has its tokens; returns the requests (output, text filled)."""
    spec = runner.ar_spec  # type: ignore[attr-defined]
    allocator = PageAllocator(spec.num_pages, spec.page_size)
    for step in range(max_steps):
        active = {rid: r for rid, r in requests.items() if r.start_step <= step and not r.is_done}
        if not active and all(r.is_done for r in requests.values()):
            break
        if not active:
            continue
        seqs = tuple(next_seq(rid, r, allocator) for rid, r in active.items())
        result: ARResult = runner.execute(ARBatch(seqs))  # type: ignore[attr-defined]
        for seq, out in zip(seqs, result.outputs, strict=True):
            req = requests[seq.request_id]
            req.num_computed = seq.start_pos + len(seq.token_ids)
            if seq.is_sampling:
                assert out.token_id is not None
                req.output.append(out.token_id)
                req.text += out.text
            else:
                assert out.token_id is None
            if req.is_done:
                allocator.release(req.pages)
                runner.release(seq.request_id)  # type: ignore[attr-defined]
    return dict(requests)
