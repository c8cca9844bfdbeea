"""`Bridge`: a `Session`'s events -> Realtime server events (GA names), with the per-response state they need.

One session event may become several server events; the endpoint sends them in order under its send
lock, so the state here changes in the order the client sees it. The sequence of a response follows
OpenAI's: ``response.created``, ``response.output_item.added``, ``conversation.item.added``,
``response.content_part.added``, then deltas (``response.output_audio.delta`` and
``response.output_audio_transcript.delta``, or ``response.output_text.delta`` for text-only output),
then ``*.done`` for the audio and transcript (or text), the content part, the output item and the
conversation item, and ``response.done``.

A user's spoken turn gives ``input_audio_buffer.committed``, then ``conversation.item.added`` and
``conversation.item.done`` (content ``input_audio``, transcript null: nothing transcribes yet); an item the
client created (typed, or spoken as ``input_audio`` parts) only the latter two.

Decisions:

- A cancelled response is ``cancelled`` with reason ``client_cancelled`` when the client asked
  (``response.cancel``, or a truncate/delete of its item, see ``endpoint``), else ``turn_detected``
  (barge-in, or a new turn's response replacing it). A response that hits its token limit reports
  ``completed``: the pipeline stops at ``max_tokens`` and at EOS alike and the session does not tell
  them apart.
- ``usage`` is best effort: the prompt's tokens (text and audio together) as input text tokens, the
  generated tokens as output text tokens (``ResponseRun.usage``).
- The per-stage timings ride on ``response.done`` under the protocol layer's vendor key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from voice_server.session.conversation import Conversation, Item
from voice_server.session.events import (
    AudioDelta,
    InputCommitted,
    InputTranscriptDelta,
    InputTranscriptDone,
    ItemTruncated,
    ResponseDone,
    ResponsePaused,
    ResponseResumed,
    ResponseStarted,
    SessionError,
    SessionEvent,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    ToolCalled,
)
from voice_server.session.realtime import server_events as se
from voice_server.session.realtime import tool_events as te
from voice_server.session.realtime.adapt import encode_output
from voice_server.session.realtime.payloads import ResponseOverrides
from voice_server.session.realtime.server_events import ResponseUsage
from voice_server.session.realtime.session_config import SessionConfig as RealtimeConfig
from voice_server.session.realtime.session_fields import AudioFormat

Event = dict[str, Any]


@dataclass
class ActiveResponse:
    response_id: str
    item_id: str
    is_audio: bool
    output_format: AudioFormat
    """Fixed at the start: a `session.update` mid-response changes the format from the next one."""
    metadata: dict[str, str] | None
    max_output_tokens: int | None
    cancel_reason: str = "turn_detected"
    calls: list[Event] = field(default_factory=list)
    """The response's function call items (output index 1, 2, ... after its message), for ``response.done``."""


class Bridge:
    def __init__(self, conversation: Conversation, session: RealtimeConfig) -> None:
        self.conversation = conversation
        self.session = session
        self.active: ActiveResponse | None = None
        self.overrides: ResponseOverrides | None = None
        """The next response's `response.create` overrides (none for a response turn detection starts)."""
        self.client_event_id: str | None = None
        """The client event being handled: a session error it causes names it."""

    def events(self, event: SessionEvent) -> list[Event]:
        if isinstance(event, SpeechStarted):
            return [se.speech_started(event.audio_start_ms, event.item_id)]
        if isinstance(event, SpeechStopped):
            return [se.speech_stopped(event.audio_end_ms, event.item_id)]
        if isinstance(event, InputCommitted):
            return self._committed(event)
        if isinstance(event, ResponseStarted):
            return self._started(event)
        if isinstance(event, TextDelta | AudioDelta):
            return self._delta(event)
        if isinstance(event, ResponseDone):
            return self._done(event)
        if isinstance(event, ToolCalled):
            return self._tool_called(event)
        if isinstance(event, ItemTruncated):
            return [se.conversation_item_truncated(event.item_id, 0, event.audio_end_ms)]
        if isinstance(event, InputTranscriptDelta):
            return [se.input_transcription_delta(event.item_id, event.delta)]
        if isinstance(event, ResponsePaused | ResponseResumed):
            # NOTE: OpenAI's protocol has no pause: its clients flush on `speech_started`, which the session
            # sends only once speech over a reply is confirmed as a turn; meanwhile the reply's new audio
            # is held in the server, and the client plays what it already has.
            return []
        if isinstance(event, InputTranscriptDone):
            item = self.conversation.get(event.item_id)
            return [se.input_transcription_completed(event.item_id, event.transcript,
                                                     item.num_audio_ms if item is not None else 0)]
        assert isinstance(event, SessionError)
        return [se.error_event(event.code, event.message, client_event_id=self.client_event_id)]

    def previous_item_id(self, item_id: str) -> str | None:
        ids = [item.item_id for item in self.conversation.items]
        index = ids.index(item_id) if item_id in ids else len(ids)
        return ids[index - 1] if index > 0 else None

    def _committed(self, event: InputCommitted) -> list[Event]:
        item = self.conversation.get(event.item_id)
        if item is None:
            return []
        previous = self.previous_item_id(item.item_id)
        wire = wire_item(item)
        added = [se.conversation_item_added(wire, previous), se.conversation_item_done(wire, previous)]
        if not event.is_buffer:
            return added  # NOTE: an item the client created (spoken or typed): OpenAI commits no buffer for it
        return [se.input_audio_committed(item.item_id, previous), *added]

    def _started(self, event: ResponseStarted) -> list[Event]:
        overrides, self.overrides = self.overrides or ResponseOverrides(), None
        modalities = overrides.output_modalities or self.session.output_modalities
        metadata = None if overrides.metadata is None else dict(overrides.metadata)
        max_tokens = overrides.max_output_tokens if overrides.max_output_tokens is not None else \
            self.session.max_output_tokens
        run = self.active = ActiveResponse(event.response_id, event.item_id, modalities == ("audio",),
                                           self.session.output_format, metadata,
                                           None if max_tokens == "inf" else max_tokens)
        item = se.message_item(run.item_id, "assistant", [], status="in_progress")
        return [se.response_created(self._response(run, "in_progress")),
                se.output_item_added(run.response_id, 0, item),
                se.conversation_item_added(item, self.previous_item_id(run.item_id)),
                se.content_part_added(run.response_id, run.item_id, 0, 0, is_audio=run.is_audio)]

    def _delta(self, event: TextDelta | AudioDelta) -> list[Event]:
        run = self.active
        if run is None or run.response_id != event.response_id:
            return []  # NOTE: a straggler of a response already done; the client has its response.done
        if isinstance(event, AudioDelta):
            if not run.is_audio:
                return []
            return [se.output_audio_delta(run.response_id, run.item_id, 0, 0,
                                          encode_output(event.pcm16, run.output_format))]
        if run.is_audio:
            return [se.output_audio_transcript_delta(run.response_id, run.item_id, 0, 0, event.delta)]
        return [se.output_text_delta(run.response_id, run.item_id, 0, 0, event.delta)]

    def _tool_called(self, event: ToolCalled) -> list[Event]:
        """A checked call: its item is added, its arguments stream whole (they were checked before any of
        them is sent: fail closed), and it is done; ``response.done`` lists it after the message."""
        run = self.active
        if run is None or run.response_id != event.response_id:
            return []
        rid, item_id, call = run.response_id, event.item_id, event.call
        index = 1 + len(run.calls)
        added = te.function_call_item(item_id, call.call_id, call.name, "", status="in_progress")
        done = te.function_call_item(item_id, call.call_id, call.name, call.arguments)
        run.calls.append(done)
        previous = self.previous_item_id(item_id)
        return [se.output_item_added(rid, index, added), se.conversation_item_added(added, previous),
                te.function_call_arguments_delta(rid, item_id, index, call.call_id, call.arguments),
                te.function_call_arguments_done(rid, item_id, index, call.call_id, call.name, call.arguments),
                se.output_item_done(rid, index, done), se.conversation_item_done(done, previous)]

    def _done(self, event: ResponseDone) -> list[Event]:
        run = self.active
        if run is None or run.response_id != event.response_id:
            return []
        self.active = None
        rid, item_id = run.response_id, run.item_id
        if run.is_audio:
            part = se.output_audio_part(event.text)
            events = [se.output_audio_done(rid, item_id, 0, 0),
                      se.output_audio_transcript_done(rid, item_id, 0, 0, event.text)]
        else:
            part = se.output_text_part(event.text)
            events = [se.output_text_done(rid, item_id, 0, 0, event.text)]
        item = se.message_item(item_id, "assistant", [part],
                               status="completed" if event.status == "completed" else "incomplete")
        events += [se.content_part_done(rid, item_id, 0, 0, is_audio=run.is_audio, text=event.text),
                   se.output_item_done(rid, 0, item)]
        if self.conversation.get(item_id) is not None:
            events.append(se.conversation_item_done(item, self.previous_item_id(item_id)))
        return [*events, se.response_done(self._response(run, event.status, event, item))]

    def _response(self, run: ActiveResponse, status: str, done: ResponseDone | None = None,
                  item: Event | None = None) -> Event:
        return se.response_object(
            run.response_id, status, output=[] if item is None else [item, *run.calls],
            output_modalities=("audio",) if run.is_audio else ("text",),
            reason=run.cancel_reason if status == "cancelled" else None,
            error=None if done is None or status != "failed" else {
                "type": "server_error", "code": "pipeline_error", "message": done.error or "the response failed"},
            usage=None if done is None else usage_of(done.usage), metadata=run.metadata,
            max_output_tokens=run.max_output_tokens, timings_ms=None if done is None else done.timings_ms)


def wire_item(item: Item) -> Event:
    """The wire form of a client's item: a user, system or typed assistant message, a function call or
    its output (what `conversation.item.*` carries)."""
    if item.call is not None:
        if item.kind == "function_call":
            return te.function_call_item(item.item_id, item.call.call_id, item.call.name, item.call.arguments)
        return te.function_call_output_item(item.item_id, item.call.call_id, item.text)
    # NOTE: images are not echoed (as audio is not): the client has them; a part per image keeps their order.
    parts = [se.input_image_part() for _ in item.images]
    if item.audio is not None:
        parts.append(se.input_audio_part())
    elif item.role == "assistant":
        parts.append(se.output_text_part(item.text))
    elif item.text or not item.images:
        parts.append(se.input_text_part(item.text))
    return se.message_item(item.item_id, item.role, parts)


def usage_of(counts: dict[str, int]) -> ResponseUsage:
    prompt = max(0, counts.get("num_prompt_tokens", 0))
    cached = min(prompt, max(0, counts.get("num_cached_tokens", 0)))
    return ResponseUsage(num_input_text_tokens=prompt, num_cached_tokens=cached,
                         num_output_text_tokens=max(0, counts.get("num_output_tokens", 0)))
