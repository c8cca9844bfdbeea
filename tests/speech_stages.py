"""A model-free "speech" stage standing in for a voice pipeline in session tests (an `ar` stage).

Input: the session layer's request `{"messages": [{"role", "content", "audio"?}]}`. Each step streams
one word of text and `AUDIO_MS` of a tone as `{"text", "pcm", "sample_rate"}`, like a thinker and a
vocoder would, paced by `step_delay_ms` so a barge-in lands mid-response. The first word reports
what the request saw, so tests can check the history: `m<num_messages>a<num_audio_turns>`, then
`p<words of the last assistant message>` (what the previous reply kept after a truncation), then, where the
request's params name a talker speaker (a pipeline's voice: `params.talker.speaker`), `s<speaker>`; last,
`l<RMS level of the last spoken turn's audio, whole dBFS>` (`lnone` without one: what noise reduction left);
with `factory_args.vision: true` (a pipeline that sees, for the session layer: `PipelineConfig.takes_images`)
then `i<num_images>b<their total bytes>`.

Scripted (`factory_args.scripted: true`, for tool calls over `/twilio/media`, where the caller speaks): a spoken
turn is answered with the request's instructions (its system message), split at ` || ` into one reply per spoken
turn (the n-th spoken turn gets the n-th part, the last part repeating), so a test writes exactly what the
"model" says, `<tool_call>`s included; a request whose last message is a tool's output answers
"The tool says: <output>". Each delta of the reply (`text_stages.text_deltas`, as an LLM's tokens come) is one
step with its `AUDIO_MS` tone, then EOS (no audio): the audio a reply sends counts its spoken deltas.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from text_stages import text_deltas

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import AdmissionError, Runner, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSpec, SeqOutput

SAMPLE_RATE = 24000
AUDIO_MS = 80
VOCAB = 1000
EOS = 1
TURN_SEPARATOR = " || "


class FakeSpeechRunner(Runner[ARBatch, ARResult]):
    def __init__(self, step_delay_s: float, is_scripted: bool = False, is_vision: bool = False) -> None:
        self.ar_spec = ARSpec(num_pages=256, page_size=16, max_model_len=4096,
                              eos_token_ids=(EOS,) if is_scripted else ())
        self.step_delay_s = step_delay_s
        self.is_scripted = is_scripted
        self.is_vision = is_vision
        self.first_words: dict[str, list[str]] = {}
        """Request id -> its first words (scripted: every delta of its reply)."""

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is not WorkKind.NEW:
            raise AdmissionError("this stage takes whole requests")
        messages = item.payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise AdmissionError("payload.messages: must be a non-empty list")
        num_audio = sum(1 for m in messages if m.get("audio") is not None)
        if self.is_scripted:
            self.first_words[item.request_id] = text_deltas(scripted_reply(messages, num_audio))
            return WorkItem(item.request_id, item.kind, {"token_ids": [2, 3, 4]}, item.params, item.seq)
        last_reply = next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")
        words = [f"m{len(messages)}a{num_audio}", f"p{len(last_reply.split())}"]
        talker = item.params.get("talker")
        if isinstance(talker, dict) and "speaker" in talker:
            words.append(f"s{talker['speaker']}")
        words.append(f"l{level_db(next((m['audio'] for m in reversed(messages) if m.get('audio') is not None), None))}")
        if self.is_vision:
            # NOTE: the images it was given, and their bytes: what arrived is what the client sent.
            images = [image for m in messages for image in m.get("images", [])]
            words.append(f"i{len(images)}b{sum(len(image) for image in images)}")
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
            if self.is_scripted:
                # NOTE: EOS sends an empty pcm of its own: the tool-call gate carries a dropped token's data over
                # to the next released token that lacks it, and a thinker's last token is never spoken.
                is_end = index >= len(words)
                pcm = np.zeros(0, np.float32) if is_end else tone(index)
                outputs.append(SeqOutput(EOS if is_end else 10 + index % VOCAB, "" if is_end else words[index],
                                         {"pcm": pcm, "sample_rate": SAMPLE_RATE}))
                continue
            word = words[index] if index < len(words) else f"w{index}"
            outputs.append(SeqOutput(10 + index % VOCAB, f" {word}", {"pcm": tone(index), "sample_rate": SAMPLE_RATE}))
        return ARResult(tuple(outputs))


def scripted_reply(messages: list[dict[str, Any]], num_audio: int) -> str:
    last = messages[-1]
    if last.get("role") == "tool":
        return f"The tool says: {last.get('content')}"
    system = next((m.get("content", "") for m in messages if m.get("role") == "system"), "")
    replies = str(system).split(TURN_SEPARATOR)
    return replies[min(max(num_audio, 1), len(replies)) - 1]


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
    return FakeSpeechRunner(float(args.get("step_delay_ms", 0.0)) / 1000.0, bool(args.get("scripted", False)),
                            bool(args.get("vision", False)))
