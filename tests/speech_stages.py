"""A model-free "speech" stage standing in for a voice pipeline in session tests (an `ar` stage).

Input: the session layer's request `{"messages": [{"role", "content", "audio"?}]}`. Each step streams
one word of text and `AUDIO_MS` of a tone as `{"text", "pcm", "sample_rate"}`, like a thinker and a
vocoder would, paced by `step_delay_ms` so a barge-in lands mid-response. The first word reports
what the request saw, so tests can check the history: `m<num_messages>a<num_audio_turns>`, then
`p<words of the last assistant message>` (what the previous reply kept after a truncation), then, where the
request's params name a talker speaker (a pipeline's voice: `params.talker.speaker`), `s<speaker>`; last,
`l<RMS level of the last spoken turn's audio, whole dBFS>` (`lnone` without one: what noise reduction left).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import AdmissionError, Runner, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSpec, SeqOutput

SAMPLE_RATE = 24000
AUDIO_MS = 80
VOCAB = 1000


class FakeSpeechRunner(Runner[ARBatch, ARResult]):
    def __init__(self, step_delay_s: float) -> None:
        self.ar_spec = ARSpec(num_pages=256, page_size=16, max_model_len=4096, eos_token_ids=())
        self.step_delay_s = step_delay_s
        self.first_words: dict[str, list[str]] = {}

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is not WorkKind.NEW:
            raise AdmissionError("this stage takes whole requests")
        messages = item.payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise AdmissionError("payload.messages: must be a non-empty list")
        num_audio = sum(1 for m in messages if m.get("audio") is not None)
        last_reply = next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")
        words = [f"m{len(messages)}a{num_audio}", f"p{len(last_reply.split())}"]
        talker = item.params.get("talker")
        if isinstance(talker, dict) and "speaker" in talker:
            words.append(f"s{talker['speaker']}")
        words.append(f"l{level_db(next((m['audio'] for m in reversed(messages) if m.get('audio') is not None), None))}")
        self.first_words[item.request_id] = words
        return WorkItem(item.request_id, item.kind, {"token_ids": [1, 2, 3]}, item.params, item.seq)

    def release(self, request_id: str) -> None:
        self.first_words.pop(request_id, None)

    def execute(self, batch: ARBatch) -> ARResult:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs = []
        for seq in batch.seqs:
            if not seq.is_sampling:
                outputs.append(SeqOutput(None))
                continue
            index = seq.start_pos + len(seq.token_ids) - 3  # NOTE: the reply's word index
            words = self.first_words.get(seq.request_id, [])
            word = words[index] if index < len(words) else f"w{index}"
            outputs.append(SeqOutput(10 + index % VOCAB, f" {word}", {"pcm": tone(index), "sample_rate": SAMPLE_RATE}))
        return ARResult(tuple(outputs))


def level_db(audio: Any) -> str:
    """A turn's RMS level in whole dBFS (`none` for no audio)."""
    if audio is None or not np.size(audio):
        return "none"
    return str(round(float(10 * np.log10(np.mean(np.square(np.asarray(audio, np.float64))) + 1e-12))))


def tone(index: int) -> np.ndarray:
    t = np.arange(SAMPLE_RATE * AUDIO_MS // 1000) / SAMPLE_RATE
    return (0.2 * np.sin(2 * np.pi * (220 + 20 * (index % 10)) * t)).astype(np.float32)


def create_fake_speech(ctx: StageContext) -> FakeSpeechRunner:
    args: dict[str, Any] = ctx.args
    return FakeSpeechRunner(float(args.get("step_delay_ms", 0.0)) / 1000.0)
