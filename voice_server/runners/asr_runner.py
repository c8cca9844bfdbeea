"""Speech recognition runner (`simple` scheduler): a user's 16 kHz audio in, their words out.

One runner for every engine (`asr_recognizer.py`): PocketSphinx (`asr_decoders.py`, the default) decodes
while the user speaks; Whisper (`asr_whisper.py`, opt-in) buffers the turn and transcribes it at DONE.

The entry stage of the embedded CPU pipeline (`asr` -> thinker -> talker); `terminal`, so that the
client sees what was understood, and `next: thinker`, which takes the RESULT's `messages`.

A streamed turn (`submit(..., stream_input=True)`, the user's audio while they speak):
- NEW (`is_stream`) `{"messages": [{"role", "content"}, ...]}`: the conversation so far (may be empty;
  a user message with `audio` instead, never transcribed, is transcribed as in a whole request);
- CHUNK `{"audio": float32 [num_samples]}` (16 kHz mono, typically 20-100 ms): fed to the recogniser at
  once; with PocketSphinx a STREAM `{"input_transcript_partial": text}` follows whenever the hypothesis of
  the whole turn so far changes (it may revise earlier words; at most one per request per batch); Whisper
  gives no partials;
- DONE (the user's turn ended): RESULT `{"input_transcript": text, "messages": history + [{"role":
  "user", "content": text}]}` (`text` may be empty: nothing was recognised), and with PocketSphinx
  `"input_transcript_confident"`: the words of `text` it is sure of (the session confirms an interruption
  only on those), and where the last word is unsure `"input_transcript_alternatives"`: its other
  hypotheses, most likely first (the session's end-of-turn rule reads their last words too).

A whole request, NEW `{"messages": [...]}`: each user message with `audio` (and no or empty `content`)
is transcribed on its own and becomes `{"role": "user", "content": transcript}`; RESULT `{"input_transcript":
<the last transcript, "" if none>, "messages": [...]}` (messages without audio pass unchanged).

Each request borrows one recogniser ("decoder") from the stage's pool from admission until it leaves the stage; with
all of them lent a new request is refused alone as an overload (`CapacityError`). Malformed input refuses
its request alone (`asr_input.py`). A batch may hold items of several requests, in arrival order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

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
    recognizer: Recognizer
    is_stream: bool
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    """A stream's history, transcribed (its turn is appended at the end)."""
    num_samples: int = 0
    """Audio admitted so far (a stream's chunks)."""
    is_in_utterance: bool = False
    partial: str = ""
    """The last partial transcript emitted."""


class AsrRunner(Runner[SimpleBatch, SimpleResult]):
    def __init__(self, pool: RecognizerPool, config: AsrRunnerConfig | None = None) -> None:
        self.pool = pool
        self.config = config or AsrRunnerConfig()
        self._requests: dict[str, _Request] = {}
        self._counters = {"num_utterances": 0, "end_utt_us_total": 0, "end_utt_us_max": 0, "num_busy_refusals": 0}

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
        messages = messages_with_audio(payload.get("messages", [] if item.is_stream else None),
                                       self.config.max_num_samples, is_empty_allowed=item.is_stream)
        recognizer = self.pool.acquire()  # NOTE: last: a refusal above must not hold a decoder
        if recognizer is None:
            self._counters["num_busy_refusals"] += 1
            raise CapacityError(f"all {self.pool.num_decoders} speech decoders are busy (factory_args.max_streams)")
        self._requests[item.request_id] = _Request(recognizer, item.is_stream)
        return dataclasses.replace(item, payload={"messages": messages})

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
            elif item.kind is WorkKind.CHUNK:
                touched[rid] = None
        for rid in touched:
            request = self._requests[rid]
            text = request.recognizer.partial()
            if text is not None and text != request.partial:
                request.partial = text
                emits.append(Emit(rid, EmitKind.STREAM, {"input_transcript_partial": text}))
        return SimpleResult(tuple(emits))

    def _run(self, item: WorkItem, request: _Request) -> Emit | None:
        if item.kind is WorkKind.NEW:
            messages, transcript = self._transcribe_messages(item.payload["messages"], request)
            if not request.is_stream:
                return Emit(item.request_id, EmitKind.RESULT, {"input_transcript": transcript, "messages": messages})
            request.messages = messages
            request.recognizer.start()
            request.is_in_utterance = True
            return None
        if item.kind is WorkKind.CHUNK:
            request.recognizer.feed(item.payload["pcm"])
            return None
        text = self._end_utterance(request)
        messages = [*request.messages, {"role": "user", "content": text}]
        payload: dict[str, Any] = {"input_transcript": text, "messages": messages}
        confident, alternatives = request.recognizer.confident_text(), request.recognizer.alternatives()
        if confident is not None:
            payload["input_transcript_confident"] = confident
        if alternatives:
            payload["input_transcript_alternatives"] = alternatives
        return Emit(item.request_id, EmitKind.RESULT, payload)

    def _transcribe_messages(
        self, admitted: list[dict[str, Any]], request: _Request,
    ) -> tuple[list[dict[str, str]], str]:
        """Messages with each audio clip replaced by its transcript, and the last transcript ("" if none)."""
        messages: list[dict[str, str]] = []
        transcript = ""
        for message in admitted:
            if "pcm" not in message:
                messages.append(message)
                continue
            request.recognizer.start()  # NOTE: each clip is transcribed as if it came alone
            request.is_in_utterance = True
            request.recognizer.feed(message["pcm"], is_whole=True)
            transcript = self._end_utterance(request)
            messages.append({"role": "user", "content": transcript})
        return messages, transcript

    def _end_utterance(self, request: _Request) -> str:
        started = time.perf_counter()
        text = request.recognizer.finish()  # NOTE: Whisper's whole transcription happens here
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
        if request is not None:
            self.pool.give_back(request.recognizer, request.is_in_utterance)

    def stats(self) -> dict[str, int]:
        return {"num_decoders": self.pool.num_decoders, "num_free_decoders": self.pool.num_free,
                "num_requests": len(self._requests), **self._counters}
