"""Speech recognition runner (`simple` scheduler): a user's 16 kHz audio in, their words out.

One runner for every engine (`asr_recognizer.py`): PocketSphinx (`asr_decoders.py`, the default) decodes
while the user speaks; Whisper (`asr_whisper.py`, opt-in) buffers the turn and transcribes it at DONE.

The entry stage of the embedded CPU pipeline (`asr` -> thinker -> talker); `terminal`, so that the
client sees what was understood, and `next: thinker`, which takes the RESULT's `messages`.

A streamed turn (`submit(..., stream_input=True)`, the user's audio while they speak):
- NEW (`is_stream`) `{"messages": [{"role", "content"}, ...]}`: the conversation so far (may be empty;
  a user message with `audio` instead, never transcribed, is transcribed as in a whole request);
- CHUNK `{"audio": int16 [num_samples]}` (16 kHz mono, typically 20-100 ms; what a session streams) or
  float32 in [-1, 1]: fed to the recogniser at
  once; with PocketSphinx a STREAM `{"input_transcript_partial": text}` follows whenever the hypothesis of
  the whole turn so far changes (it may revise earlier words; at most one per request per batch); Whisper
  gives no partials;
- DONE (the user's turn ended): RESULT `{"input_transcript": text, "messages": history + [{"role":
  "user", "content": text}]}` (`text` may be empty: nothing was recognised), and with PocketSphinx
  `"input_transcript_confident"`: the words of `text` it is sure of (the session confirms an interruption
  only on those), and where the last word is unsure `"input_transcript_alternatives"`: its other
  hypotheses, most likely first (the session's end-of-turn rule reads their last words too).

Either kind may say in `params["source_rate"]` (an integer, Hz) what rate the user's audio was captured at before
it was resampled to 16 kHz: at 8 kHz or less (a phone call) PocketSphinx hears it with a decoder adapted to phone
audio where the pool has one free (`asr_decoders.NARROWBAND_MLLR`), from its narrowband cepstral mean
(`asr_decoders.NARROWBAND_CMN`); a turn of either kind takes a decoder of the other kind rather than wait. Sessions
send their input rate.

A whole request, NEW `{"messages": [...]}`: each user message with `audio` (and no or empty `content`)
is transcribed on its own and becomes `{"role": "user", "content": transcript}`; RESULT `{"input_transcript":
<the last transcript, "" if none>, "messages": [...]}` (messages without audio pass unchanged).

Each request borrows one recogniser ("decoder") from the stage's pool until it leaves the stage. With all of
them lent, a streamed turn waits for one (first come, first served): its audio is kept and fed once it has
one, so more people speaking at once than there are decoders lose no turn. A turn that ends still waiting,
and a whole request that finds none free, get one more built (`RecognizerPool.grow`, within the stage's
memory budget); past that they are refused alone as an overload (`CapacityError`), as are streamed turns
beyond as many waiting as the pool's maximum. Malformed input refuses its request alone (`asr_input.py`). A
batch may hold items of several requests, in arrival order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from voice_server.audio import NARROWBAND_MAX_RATE
from voice_server.runners.asr_decoders import SAMPLING_RATE
from voice_server.runners.asr_input import messages_with_audio, pcm16
from voice_server.runners.asr_recognizer import Recognizer, RecognizerPool
from voice_server.scheduling import AdmissionError, Emit, EmitKind, Runner, SimpleBatch, SimpleResult, WorkItem
from voice_server.scheduling.base import CapacityError, WorkKind

log = logging.getLogger(__name__)

DEFAULT_MAX_AUDIO_SECONDS = 60.0
"""One turn (or one whole request's audio, all messages together). PocketSphinx decodes at ~0.08x real
time on one core, so a whole request's minute of audio holds the stage for ~5 s."""


@dataclass(frozen=True)
class AsrRunnerConfig:
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS

    def __post_init__(self) -> None:
        value = self.max_audio_seconds
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"AsrRunnerConfig.max_audio_seconds: must be a number > 0, got {value!r}")

    @property
    def max_num_samples(self) -> int:
        return int(self.max_audio_seconds * SAMPLING_RATE)


@dataclass
class _Request:
    recognizer: Recognizer | None
    """None while a streamed turn waits for a free one."""
    is_stream: bool
    is_narrowband: bool = False
    """Its audio was captured at `NARROWBAND_MAX_RATE` or lower (`params["source_rate"]`)."""
    pending: list[WorkItem] = dataclasses.field(default_factory=list)
    """A waiting turn's NEW and CHUNK items, run in order once it has a recogniser."""

    @property
    def lent(self) -> Recognizer:
        """The recogniser of a request that has one (every request the runner runs items of)."""
        assert self.recognizer is not None
        return self.recognizer
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """A stream's history, transcribed (its turn is appended at the end)."""
    num_samples: int = 0
    """Audio admitted so far (a stream's chunks)."""
    is_in_utterance: bool = False
    partial: str = ""
    """The last partial transcript emitted."""


class AsrRunner(Runner[SimpleBatch, SimpleResult]):
    next_only_keys = frozenset({"messages"})
    """The whole conversation goes to the thinker each turn; the client has it already."""

    def __init__(self, pool: RecognizerPool, config: AsrRunnerConfig | None = None) -> None:
        self.pool = pool
        self.config = config or AsrRunnerConfig()
        self._requests: dict[str, _Request] = {}
        self._waiting: dict[str, None] = {}
        """Streamed turns waiting for a recogniser, in arrival order."""
        self._counters = {"num_utterances": 0, "end_utt_us_total": 0, "end_utt_us_max": 0, "num_busy_refusals": 0,
                          "num_waits": 0, "num_grown": 0}

    # -- admission -------------------------------------------------------------------------------

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is WorkKind.NEW:
            return self._admit_new(item)
        request = self._requests.get(item.request_id)
        if request is None or not request.is_stream:
            raise AdmissionError("payload: stream chunks for a request that is not a streamed turn")
        if item.kind is WorkKind.DONE:
            return item
        payload = item.payload
        if not isinstance(payload, dict) or set(payload) != {"audio"}:
            keys = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
            raise AdmissionError(f"chunk payload: must be {{'audio': float32 array}}, got {keys}")
        pcm = pcm16("payload.audio", payload["audio"], self.config.max_num_samples - request.num_samples)
        request.num_samples += len(pcm) // 2
        return dataclasses.replace(item, payload={"pcm": pcm})

    def _admit_new(self, item: WorkItem) -> WorkItem:
        payload = item.payload
        if not isinstance(payload, dict):
            raise AdmissionError(f"payload: must be a mapping, got {type(payload).__name__}")
        unknown = sorted(str(k) for k in payload if k != "messages")
        if unknown:
            raise AdmissionError(f"payload: unknown field(s) {', '.join(unknown)} (only 'messages')")
        # NOTE: an empty conversation is a response with no user turn yet: the agent speaks first (a greeting).
        messages = messages_with_audio(payload.get("messages", [] if item.is_stream else None),
                                       self.config.max_num_samples, is_empty_allowed=True)
        is_narrowband = _source_rate(item.params) <= NARROWBAND_MAX_RATE
        # NOTE: last: a refusal above must not hold a decoder. A turn queued behind waiting ones waits too.
        recognizer = None if item.is_stream and self._waiting else self.pool.acquire(is_narrowband)
        if recognizer is None and not item.is_stream:
            recognizer = self._grow(is_narrowband)
        if recognizer is None and (not item.is_stream or len(self._waiting) >= self.pool.max_decoders):
            self._counters["num_busy_refusals"] += 1
            raise CapacityError(f"all {self.pool.num_decoders} speech decoders are busy and "
                                f"{len(self._waiting)} turns wait for one (factory_args.max_streams, memory_fraction)")
        self._requests[item.request_id] = _Request(recognizer, item.is_stream, is_narrowband)
        if recognizer is None:
            self._waiting[item.request_id] = None
            self._counters["num_waits"] += 1
        return dataclasses.replace(item, payload={"messages": messages})

    def _grow(self, is_narrowband: bool) -> Recognizer | None:
        recognizer = self.pool.grow(is_narrowband)
        self._counters["num_grown"] += recognizer is not None
        return recognizer

    def _lend(self, rid: str, request: _Request, is_ending: bool) -> bool:
        """Give a waiting turn a recogniser if one is free and none waits before it (or, for a turn that has
        ended, one more built), and run the items it kept; False: it goes on waiting."""
        band = request.is_narrowband
        if next(iter(self._waiting)) != rid:
            recognizer = self._grow(band) if is_ending else None
        else:
            recognizer = self.pool.acquire(band) or (self._grow(band) if is_ending else None)
        if recognizer is None:
            return False
        del self._waiting[rid]
        request.recognizer = recognizer
        pending, request.pending = request.pending, []
        for item in pending:
            self._run(item, request)
        return True

    # -- execution -------------------------------------------------------------------------------

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits: list[Emit] = []
        touched: dict[str, None] = {}
        """Streams that decoded audio in this batch and owe a partial (in first-touch order)."""
        failed: set[str] = set()
        for item in batch.items:
            rid = item.request_id
            request = self._requests.get(rid)
            if request is None or rid in failed:
                continue
            try:
                # NOTE: each request fails alone, here: a batch that raised would be replayed request by
                # request (SimpleScheduler.fail), decoding a stream's chunks twice.
                emit = self._run(item, request)
            except Exception as exc:
                log.exception("asr: request %s failed", rid)
                failed.add(rid)
                touched.pop(rid, None)
                emits.append(Emit(rid, EmitKind.ERROR, message=f"speech recognition failed: {exc}"))
                continue
            if emit is not None:
                touched.pop(rid, None)  # NOTE: the final transcript supersedes a partial
                emits.append(emit)
            elif item.kind is WorkKind.CHUNK and request.recognizer is not None:
                touched[rid] = None
        for rid in touched:
            request = self._requests[rid]
            text = request.lent.partial()
            if text is not None and text != request.partial:
                request.partial = text
                emits.append(Emit(rid, EmitKind.STREAM, {"input_transcript_partial": text}))
        return SimpleResult(tuple(emits))

    def _run(self, item: WorkItem, request: _Request) -> Emit | None:
        if request.recognizer is None and not self._lend(item.request_id, request, item.kind is WorkKind.DONE):
            if item.kind is WorkKind.DONE:
                raise CapacityError(f"the turn ended while all {self.pool.num_decoders} speech decoders were busy "
                                    "and no more fit the stage's memory budget (memory_fraction)")
            request.pending.append(item)
            return None
        if item.kind is WorkKind.NEW:
            messages, transcript = self._transcribe_messages(item.payload["messages"], request)
            if not request.is_stream:
                return Emit(item.request_id, EmitKind.RESULT, {"input_transcript": transcript, "messages": messages})
            request.messages = messages
            request.lent.start(request.is_narrowband)
            request.is_in_utterance = True
            return None
        if item.kind is WorkKind.CHUNK:
            request.lent.feed(item.payload["pcm"])
            return None
        text = self._end_utterance(request)
        messages = [*request.messages, {"role": "user", "content": text}]
        payload: dict[str, Any] = {"input_transcript": text, "messages": messages}
        confident, alternatives = request.lent.confident_text(), request.lent.alternatives()
        if confident is not None:
            payload["input_transcript_confident"] = confident
        if alternatives:
            payload["input_transcript_alternatives"] = alternatives
        return Emit(item.request_id, EmitKind.RESULT, payload)

    def _transcribe_messages(
        self, admitted: list[dict[str, Any]], request: _Request,
    ) -> tuple[list[dict[str, Any]], str]:
        """Messages with each audio clip replaced by its transcript, and the last transcript ("" if none)."""
        messages: list[dict[str, Any]] = []
        transcript = ""
        for message in admitted:
            if "pcm" not in message:
                messages.append(message)
                continue
            request.lent.start(request.is_narrowband)  # NOTE: each clip is transcribed as if it came alone
            request.is_in_utterance = True
            request.lent.feed(message["pcm"], is_whole=True)
            transcript = self._end_utterance(request)
            messages.append({"role": "user", "content": transcript})
        return messages, transcript

    def _end_utterance(self, request: _Request) -> str:
        started = time.perf_counter()
        text = request.lent.finish()  # NOTE: Whisper's whole transcription happens here
        end_utt_us = int((time.perf_counter() - started) * 1e6)
        request.is_in_utterance = False
        counters = self._counters
        counters["num_utterances"] += 1
        counters["end_utt_us_total"] += end_utt_us
        counters["end_utt_us_max"] = max(counters["end_utt_us_max"], end_utt_us)
        return text

    # -- bookkeeping -----------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        self._waiting.pop(request_id, None)
        if request is not None and request.recognizer is not None:
            self.pool.give_back(request.recognizer, request.is_in_utterance)

    def stats(self) -> dict[str, int]:
        return {"num_decoders": self.pool.num_decoders, "num_free_decoders": self.pool.num_free,
                "num_requests": len(self._requests), "num_waiting": len(self._waiting), **self._counters}


def _source_rate(params: Any) -> int:
    """`params["source_rate"]`: the rate the audio was captured at (16 kHz when not given)."""
    value = params.get("source_rate", SAMPLING_RATE) if isinstance(params, dict) else SAMPLING_RATE
    if isinstance(value, bool) or not isinstance(value, int) or not 1000 <= value <= 384_000:
        raise AdmissionError(f"params.source_rate: must be an integer in [1000, 384000] (Hz), got {value!r}")
    return value
