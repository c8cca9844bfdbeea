"""`TalkerRunner`: the Qwen3-Omni talker + MTP code predictor on the AR core (feedback AR).

The scheduler sees an ordinary AR request whose "tokens" are talker positions (prefill placeholders,
then each frame's code 0) and whose outputs are frames. One `execute` does, for the whole batch:
talker pass over the flat rows (prefill chunks and decode rows mixed, paged KV) -> code 0 at each
sampling row -> the code predictor fills codebooks 1..G-1 for all of them in one batched call -> each
frame's codebook-embedding sum is kept for the next input (`TalkerFeed`: input rows are rebuilt from
stored vectors, never taken from the token ids). Upstream input is the thinker's token stream;
`admit` turns it into prompt positions and the output limit the scheduler keeps (talker_feed.py).

Each frame streams out as `{"codes": [G, 1]}`; the codec EOS step streams no codes and ends the request. A reply
with no token to speak ends so at once, with no frame (a silent reply: `TalkerFeed.is_silent`).

Positions are the scheduler's flat ones (0..L-1, then one per frame) unless a prompt has images or videos:
a step holding one runs on [3, T] positions, its prefill rows at their grid positions and later rows at
`p + delta` (`TalkerFeed.rope_rows`), and in the decode graphs at `start_pos + delta` on all three axes.
Where a video's frame times are fractional the prompt's positions are float32 (`TalkerFeed.is_fractional`):
a step holding such a sequence runs all its rows on float32 [3, T] positions (whole ones are exact in
float32), on the exact path: the decode graphs replay the rotary's int64 table lookup, and float32 positions
take its computed path, which would need a second graph per bucket (twice the capture time and graph memory).
Building such a prefill needs `rope_layout`, the talker's M-RoPE layout (`talker_rope_layout` in
`voice_server/models/qwen3_omni/turn.py`); without it a prompt with images or videos is refused.

Request params: `params.talker` = {`speaker`, `max_frames`} (defaults from the factory).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from voice_server.models.paged import PagedKVCache, build_attention_context
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.prefill import TurnTokenIds
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.talker.step import FrameNoise, step_paged
from voice_server.models.qwen3_omni.thinker.rope import RopeLayout
from voice_server.runners.feed_chunk import TALKER_FEED_KEY, FeedChunk
from voice_server.runners.sampler import Sampler
from voice_server.runners.sizing import activation_reserve_bytes, plan_kv_cache, weight_bytes
from voice_server.runners.talker_feed import TalkerFeed
from voice_server.runners.talker_graphs import DEFAULT_BUCKETS, TalkerDecodeGraphs
from voice_server.scheduling import AdmissionError, Runner, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSeq, ARSpec, SeqOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TalkerRunnerConfig:
    budget_bytes: int
    thinker_hidden_size: int
    page_size: int = 16
    max_step_tokens: int = 512
    max_num_seqs: int = 8
    speaker: str = "ethan"
    max_frames: int = 4096
    """Default `params.talker.max_frames`: frames per reply at most (12.5 frames per second of audio)."""
    max_model_len: int = 32768
    """Talker positions (prompt + frames) per request at most; capped at the model's `max_position_embeddings`."""
    sampling: TalkerSampling = TalkerSampling()
    seed: int | None = None
    decode_graphs: str = "auto"
    """Decode-only steps on fixed-shape buffers (`talker_graphs.py`): `on`, `off`, or `auto` (on for
    CUDA, where they are captured as CUDA graphs; on the CPU they only run eagerly)."""
    graph_max_len: int = 4096
    """Positions the decode graphs cover; longer sequences step eagerly."""
    graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    """Batch sizes with their own decode graph (a step of S sequences runs in the smallest >= S)."""
    compile: bool = False
    """CPU: compile each bucket's decode step with torch.compile at start-up (~20 s per bucket on
    the tiny config); on CUDA the graphs are captured instead."""

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "thinker_hidden_size", "page_size", "max_step_tokens", "max_num_seqs",
                     "max_frames", "max_model_len", "graph_max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TalkerRunnerConfig.{name} must be an integer >= 1, got {value!r}")
        if not self.graph_buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                         for b in self.graph_buckets):
            raise ValueError(f"TalkerRunnerConfig.graph_buckets must be integers >= 1, got {self.graph_buckets!r}")
        if self.decode_graphs not in ("auto", "on", "off"):
            raise ValueError(f"TalkerRunnerConfig.decode_graphs must be auto, on or off, got {self.decode_graphs!r}")


class TalkerRunner(Runner[ARBatch, ARResult]):
    def __init__(
        self, talker: Talker, ids: TurnTokenIds, config: TalkerRunnerConfig, rope_layout: RopeLayout | None = None,
    ) -> None:
        cfg = talker.cfg
        self.talker, self.ids, self.config, self.rope_layout = talker, ids, config, rope_layout
        weight = talker.codec_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        elem = weight.element_size()
        self.plan = plan_kv_cache(
            budget_bytes=config.budget_bytes,
            weight_bytes=weight_bytes(talker),
            reserve_bytes=activation_reserve_bytes(config.max_step_tokens, config.max_num_seqs, cfg.hidden_size,
                                                   cfg.intermediate_size, cfg.vocab_size, elem),
            bytes_per_page=PagedKVCache.bytes_per_page(cfg.num_hidden_layers, config.page_size,
                                                       cfg.num_key_value_heads, cfg.head_dim, self.dtype),
            page_size=config.page_size,
            # NOTE: the paged path indexes a cos/sin table of max_position_embeddings rows (`mrope.py`):
            # a longer sequence would index past it (IndexError mid-reply) instead of stopping at the limit.
            max_model_len=min(config.max_model_len, cfg.max_position_embeddings),
        )
        self.cache = PagedKVCache(cfg.num_hidden_layers, self.plan.num_pages, config.page_size,
                                  cfg.num_key_value_heads, cfg.head_dim, self.dtype, self.device)
        # NOTE: talker inputs are embeddings, not ids: equal ids need not mean equal keys/values.
        self.ar_spec = ARSpec(self.plan.num_pages, config.page_size, self.plan.max_model_len,
                              (cfg.codec_eos_token_id,), is_prefix_cacheable=False)
        self.feeds: dict[str, TalkerFeed] = {}
        self.sampler = Sampler(config.seed)
        """Per-request generators (only drawn from when `sampling` samples)."""
        self.is_sampled = not (config.sampling.code0.is_greedy and config.sampling.residual.is_greedy)
        is_graphs = config.decode_graphs == "on" or (config.decode_graphs == "auto" and self.device.type == "cuda")
        self.graphs = TalkerDecodeGraphs(
            talker, self.cache, config.sampling, min(config.graph_max_len, self.plan.max_model_len),
            config.graph_buckets, is_compiled=config.compile) if is_graphs else None
        log.info("talker KV cache: %d pages x %d positions", self.plan.num_pages, config.page_size)

    # -- admission: the thinker's token stream -> prompt positions and output limits -------------------

    def admit(self, item: WorkItem) -> WorkItem:
        rid = item.request_id
        if not isinstance(item.payload, dict):
            raise AdmissionError(f"payload: must be a mapping, got {type(item.payload).__name__}")
        if item.kind is WorkKind.NEW:
            if not item.is_stream:
                raise AdmissionError("the talker takes the thinker's stream (list it in the thinker's stream_to)")
            speaker, max_frames = self._talker_params(item.params)
            self.feeds[rid] = TalkerFeed(speaker, self.device)
            params = {"sampling": {"max_tokens": max_frames}}
            return dataclasses.replace(item, payload={"token_ids": [], "max_num_outputs": 0}, params=params)
        feed = self.feeds.get(rid)
        if feed is None:
            return item  # a request that already left: the scheduler drops it
        if item.kind is WorkKind.CHUNK:
            feed.add_chunk(FeedChunk.from_wire(item.payload.get(TALKER_FEED_KEY), self.config.thinker_hidden_size,
                                               is_first=not feed.reply_embeds))
        else:
            feed.is_thinker_done = True
        with torch.inference_mode():
            prefill_ids = feed.advance(self.talker, self.ids, self.rope_layout)
        payload: dict[str, Any] = {"max_num_outputs": feed.max_num_outputs}
        if prefill_ids is not None:
            payload.update(token_ids=prefill_ids, is_input_done=True)
        # NOTE: every upstream item becomes a CHUNK: the talker's own input (its prompt) ended with
        # the prefill, the thinker's end only lifts the output limit.
        return dataclasses.replace(item, kind=WorkKind.CHUNK, payload=payload)

    def _talker_params(self, params: dict[str, Any]) -> tuple[str, int]:
        raw = params.get("talker") or {}
        if not isinstance(raw, dict) or not set(raw) <= {"speaker", "max_frames"}:
            raise AdmissionError("params.talker: must be a mapping with at most 'speaker' and 'max_frames'")
        speaker = raw.get("speaker", self.config.speaker)
        names = [name for name, _ in self.talker.cfg.speaker_ids]
        if not isinstance(speaker, str) or speaker.lower() not in names:
            raise AdmissionError(f"params.talker.speaker: must be one of {', '.join(names)}, got {speaker!r}")
        max_frames = raw.get("max_frames", self.config.max_frames)
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or not 1 <= max_frames <= 65536:
            raise AdmissionError(f"params.talker.max_frames: must be an integer in [1, 65536], got {max_frames!r}")
        return speaker, max_frames

    def release(self, request_id: str) -> None:
        self.feeds.pop(request_id, None)
        self.sampler.release(request_id)

    # -- the step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ARBatch) -> ARResult:
        silent = [self.feeds[s.request_id].is_silent for s in batch.seqs]
        if not any(silent):
            return self._step(batch)
        # NOTE: a silent reply (no token to speak, `talker_feed.py`) has one position, whose step is the codec
        # EOS: decided here, without the model, so the request ends with no frame. The others step as usual,
        # exactly as in a batch without it.
        spoken = ARBatch(tuple(s for s, is_silent in zip(batch.seqs, silent) if not is_silent))
        outputs = iter(self._step(spoken).outputs if spoken.seqs else ())
        eos = SeqOutput(self.talker.cfg.codec_eos_token_id)
        return ARResult(tuple((eos if seq.is_sampling else SeqOutput(None)) if is_silent else next(outputs)
                              for seq, is_silent in zip(batch.seqs, silent)))

    def _step(self, batch: ARBatch) -> ARResult:
        seqs = batch.seqs
        feeds = [self.feeds[s.request_id] for s in seqs]
        inputs = torch.cat([f.input_rows(s.start_pos, s.start_pos + len(s.token_ids)) for s, f in zip(seqs, feeds)])
        sampling = [i for i, seq in enumerate(seqs) if seq.is_sampling]
        frame_feeds = [feeds[i] for i in sampling]
        vocab = self.talker.cfg.vocab_size
        seen = torch.stack([f.code0_seen if f.code0_seen is not None
                            else torch.zeros(vocab, dtype=torch.bool, device=self.device) for f in frame_feeds]
                           ) if sampling else torch.zeros(0, vocab, dtype=torch.bool, device=self.device)
        noise, forks = None, None
        if self.is_sampled and sampling:
            # NOTE: both paths draw with noise pre-drawn from each request's generator, so a sampled
            # request gets the same frames in a graph or eagerly (and in any batch). The noise comes from
            # copies (`Sampler.fork`), kept only once the whole step succeeded (see the end of the step).
            forks = self.sampler.fork([seqs[i].request_id for i in sampling], [None] * len(sampling), self.device)
            noise = FrameNoise.draw(self.talker, [gen for _, gen in forks.generators], self.device)
        rope_positions = [s.start_pos + f.rope_delta for s, f in zip(seqs, feeds)]
        is_whole = not any(f.is_fractional for f in feeds)
        if self.graphs is not None and is_whole and self.graphs.can_run(seqs, rope_positions):
            codes, codec_sums, seen = self.graphs.run(seqs, rope_positions, inputs, seen, noise)
        else:
            ctx, positions = build_attention_context(
                self.cache, [(s.start_pos, len(s.token_ids), s.page_ids) for s in seqs], batch.num_tokens,
                self.device)
            if any(f.prefill_positions is not None for f in feeds):
                positions = self._rope_positions(seqs, feeds, positions)
            ends = torch.tensor([len(s.token_ids) for s in seqs], device=self.device).cumsum(0) - 1
            if not sampling:
                self.talker.forward_paged(inputs, positions, ctx, ends[-1:])  # prefill chunks only: KV, no frame
                return ARResult(tuple(SeqOutput(None) for _ in seqs))
            # NOTE: a zero text vector makes `next_input_embeds` the codebook-embedding sum itself; the
            # feed adds each frame's text vector when that row is fed (the same sum `Talker.step` does).
            step = step_paged(
                self.talker, inputs, positions, ctx, ends[sampling],
                text_vec=torch.zeros(len(sampling), self.talker.cfg.hidden_size, dtype=self.dtype,
                                     device=self.device),
                code0_seen=seen, samplings=[self.config.sampling] * len(sampling),
                generators=[None] * len(sampling), noise=noise,
            )
            codes, codec_sums = step.codes, step.next_input_embeds
        code0s = codes[:, 0].tolist()
        eos = self.talker.cfg.codec_eos_token_id
        outputs: list[SeqOutput] = [SeqOutput(None) for _ in seqs]
        for j, (i, code0) in enumerate(zip(sampling, code0s)):
            # NOTE: the reference never fills the EOS frame; it ends the reply.
            outputs[i] = SeqOutput(code0) if code0 == eos else SeqOutput(code0, "", self._frame_data(seqs[i], codes[j]))
        # NOTE: per-request state moves only now that nothing of the step can raise: a step that raised is
        # re-run (its requests alone, `scheduling/solo.py`) and must then draw and feed back what it would have.
        if forks is not None:
            self.sampler.commit(forks)
        for j, (feed, code0) in enumerate(zip(frame_feeds, code0s)):
            feed.code0_seen = seen[j]
            if code0 != eos:
                feed.codec_sums.append(codec_sums[j])
        return ARResult(tuple(outputs))

    @staticmethod
    def _rope_positions(seqs: tuple[ARSeq, ...], feeds: list[TalkerFeed], flat: torch.Tensor) -> torch.Tensor:
        """[3, T] positions of a step holding a prompt with images or videos (the others' rows: flat), float32
        on every row when any prompt's are (as transformers keeps them; whole positions stay exact)."""
        is_float = any(f.is_fractional for f in feeds)
        positions = flat.expand(3, -1).contiguous().to(torch.float32 if is_float else flat.dtype)
        row = 0
        for seq, feed in zip(seqs, feeds):
            end = seq.start_pos + len(seq.token_ids)
            rows = feed.rope_rows(seq.start_pos, end)
            if rows is not None:
                positions[:, row:row + len(seq.token_ids)] = rows
            row += len(seq.token_ids)
        return positions

    def _frame_data(self, seq: ARSeq, codes: torch.Tensor) -> dict[str, Any]:
        """What a frame streams, from its codes [G]. Changes no state: the step commits once it succeeded."""
        return {"codes": codes[:, None].clone()}
