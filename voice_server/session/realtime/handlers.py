"""What each Realtime client event does to a connection's `Session`: one handler per event type (`HANDLERS`).

Kept apart from the connection (`endpoint`: the socket, the paced output and the receive loop), which parses
each text frame and awaits its handler, one at a time: the protocol's rules live here, the transport there. A
handler answers what it refuses with an `error` event (`RealtimeConnection.error`) and the session goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from voice_server.audio import pcm16_to_float32
from voice_server.session.conversation import Item, new_id, speech_item
from voice_server.session.realtime import events as ce
from voice_server.session.realtime import server_events as se
from voice_server.session.realtime.adapt import MAX_INPUT_PACE, core_config, decode_input, sampling_params, tool_params
from voice_server.session.realtime.errors import (
    ACTIVE_RESPONSE,
    CANCEL_NOT_ACTIVE,
    INPUT_AUDIO_TOO_FAST,
    INVALID_VALUE,
    UNSUPPORTED,
    FieldError,
)
from voice_server.session.realtime.payloads import AudioMessageItem, ClientItem, MessageItem
from voice_server.session.realtime.tool_fields import FunctionCallItem, FunctionCallOutputItem, check_choice
from voice_server.session.tools import ToolCall
from voice_server.session.voices import UnknownVoice, choose_voice, voice_overrides

if TYPE_CHECKING:
    from voice_server.session.realtime.endpoint import RealtimeConnection

RESPONSE_VOICE = "response.audio.output.voice"


async def on_session_update(conn: RealtimeConnection, event: ce.SessionUpdate) -> None:
    try:
        config = conn.config.updated(event.patch)
        core = core_config(config, conn.voices)
    except FieldError as exc:
        await conn.send(exc.to_protocol_error(event.event_id).to_event())
        return
    except ValueError as exc:
        await conn.error(INVALID_VALUE, str(exc), "session.audio.input.turn_detection")
        return
    await conn.session.reconfigure(core)
    conn.config = conn.bridge.session = config
    await conn.send(se.session_updated(config))


async def on_append(conn: RealtimeConnection, event: ce.InputAudioBufferAppend) -> None:
    fmt = conn.config.input_format
    try:
        pcm = decode_input(event.audio, fmt)
    except ValueError as exc:
        await conn.error(INVALID_VALUE, f"Invalid 'audio' for {fmt.type}: {exc}.", "audio")
        return
    num_ms = 1000.0 * pcm.size / fmt.rate_hz
    if not conn.pace.admit(num_ms):
        await conn.error(INPUT_AUDIO_TOO_FAST, f"Audio is arriving faster than {MAX_INPUT_PACE:g}x real time; "
                                               f"this append ({num_ms:.0f} ms) was dropped. Send audio as it "
                                               "is captured.", "audio")
        return
    if pcm.size:
        await conn.session.on_audio(pcm)
        conn.metrics.count_session(conn.session)


async def on_commit(conn: RealtimeConnection, event: ce.InputAudioBufferCommit) -> None:
    await conn.session.commit()  # NOTE: an empty buffer is the session's error event


async def on_clear(conn: RealtimeConnection, event: ce.InputAudioBufferClear) -> None:
    await conn.session.clear()
    await conn.send(se.input_audio_cleared())


async def on_item_create(conn: RealtimeConnection, event: ce.ConversationItemCreate) -> None:
    items = conn.session.conversation.items
    previous = event.previous_item_id
    if previous is not None and previous != (items[-1].item_id if items else "root"):
        if conn.session.conversation.get(previous) is None and previous != "root":
            await conn.error(INVALID_VALUE, f"No item with id '{previous}'.", "previous_item_id")
        else:
            await conn.error(UNSUPPORTED, "Items are added at the end of the conversation only: "
                                          "previous_item_id must be the last item's id.", "previous_item_id")
        return
    if isinstance(event.item, MessageItem | AudioMessageItem) and event.item.images and not conn.takes_images:
        await conn.error(UNSUPPORTED, "This pipeline does not see: input_image parts are not supported (its "
                                      "entry stage runs no vision encoder).", "item.content")
        return
    try:
        item = session_item(event.item, conn)
    except ValueError as exc:
        await conn.error(INVALID_VALUE, f"Invalid 'audio' for {conn.config.input_format.type}: {exc}.",
                         "item.content")
        return
    try:
        await conn.session.add_item(item)
    except ValueError:
        await conn.error(INVALID_VALUE, f"An item with id '{event.item.item_id}' exists already.", "item.id")


def session_item(item: ClientItem, conn: RealtimeConnection) -> Item:
    """A client's item as the conversation keeps it; ValueError for audio the session's input format cannot
    read (e.g. PCM16 of an odd number of bytes)."""
    item_id = item.item_id or new_id("item")
    if isinstance(item, AudioMessageItem):
        fmt = conn.config.input_format
        spoken = speech_item(item_id, pcm16_to_float32(decode_input(item.audio, fmt)), fmt.rate_hz)
        return dataclasses.replace(spoken, images=item.images)
    if isinstance(item, FunctionCallItem):
        return Item(item_id, "assistant", kind="function_call", call=item.call)
    if isinstance(item, FunctionCallOutputItem):
        # NOTE: an output names its call by id only; the call's name and arguments stay on the call's item.
        return Item(item_id, "tool", item.output, kind="function_call_output", call=ToolCall(item.call_id, "", ""))
    return Item(item_id, item.role, item.text, images=item.images)


async def on_truncate(conn: RealtimeConnection, event: ce.ConversationItemTruncate) -> None:
    item = conn.session.conversation.get(event.item_id)
    if item is None or item.role != "assistant":
        await conn.error(INVALID_VALUE, f"No assistant item with id '{event.item_id}'.", "item_id")
        return
    if event.content_index != 0:
        await conn.error(INVALID_VALUE, "Assistant items have one content part: content_index must be 0.",
                         "content_index")
        return
    await _stop_response_of(conn, item.item_id)
    if event.audio_end_ms > item.num_audio_ms:
        await conn.error(INVALID_VALUE, f"Audio content of {item.num_audio_ms}ms is already shorter than "
                                        f"{event.audio_end_ms}ms.", "audio_end_ms")
        return
    await conn.session.truncate(item.item_id, event.audio_end_ms)


async def on_delete(conn: RealtimeConnection, event: ce.ConversationItemDelete) -> None:
    await _stop_response_of(conn, event.item_id)
    if not conn.session.conversation.delete(event.item_id):
        await conn.error(INVALID_VALUE, f"No item with id '{event.item_id}'.", "item_id")
        return
    await conn.send(se.conversation_item_deleted(event.item_id))


async def _stop_response_of(conn: RealtimeConnection, item_id: str) -> None:
    """The client truncates or deletes the item a response is still writing: it has stopped listening
    to that response, so the response stops (as `response.cancel` would) before the item changes."""
    run = conn.bridge.active
    if run is not None and run.item_id == item_id:
        run.cancel_reason = "client_cancelled"
        await conn.session.cancel_response()


async def on_response_create(conn: RealtimeConnection, event: ce.ResponseCreate) -> None:
    overrides = event.response
    conn.metrics.turn_ended()
    if conn.session.is_responding():
        await conn.error(ACTIVE_RESPONSE, "Conversation already has an active response in progress.")
        return
    if overrides.is_out_of_band:
        await conn.error(UNSUPPORTED, "Responses outside the conversation are not supported.",
                         "response.conversation")
        return
    if overrides.output_format is not None and overrides.output_format != conn.config.output_format:
        await conn.error(UNSUPPORTED, "A response's output format must be the session's; change it with "
                                      "session.update.", "response.audio.output.format")
        return
    base = dict(dict(conn.session.config.params).get("sampling", {}))
    if overrides.max_output_tokens == "inf":
        base.pop("max_tokens", None)
    max_tokens = overrides.max_output_tokens if isinstance(overrides.max_output_tokens, int) else None
    sampling = sampling_params(max_tokens, overrides.temperature, base)
    params: dict[str, Any] = {"sampling": sampling} if sampling else {}
    if overrides.tools is not None or overrides.tool_choice is not None:
        tools = conn.config.tools if overrides.tools is None else overrides.tools
        choice = overrides.tool_choice or conn.config.tool_choice
        try:
            check_choice(choice, tools, "response.tool_choice")
        except FieldError as exc:
            await conn.send(exc.to_protocol_error(event.event_id).to_event())
            return
        params.update(tool_params(tools, choice))
    if overrides.voice is not None:
        try:
            voice = choose_voice(conn.voices, overrides.voice)
        except UnknownVoice as exc:
            await conn.error(INVALID_VALUE, f"Invalid value for '{RESPONSE_VOICE}': {exc}", RESPONSE_VOICE)
            return
        if voice is not None:  # NOTE: None: the pipeline declares no voices, the name is metadata
            params.update(voice_overrides(dict(conn.session.config.params), voice))
    conn.bridge.overrides = overrides
    await conn.session.create_response(params or None, overrides.instructions)


async def on_response_cancel(conn: RealtimeConnection, event: ce.ResponseCancel) -> None:
    run = conn.bridge.active
    if run is None or event.response_id not in (None, run.response_id):
        await conn.error(CANCEL_NOT_ACTIVE, "There is no active response to cancel"
                         + (f" with id '{event.response_id}'." if event.response_id else "."), "response_id")
        return
    run.cancel_reason = "client_cancelled"
    await conn.session.cancel_response()


HANDLERS: dict[type, Callable[[RealtimeConnection, Any], Awaitable[None]]] = {
    ce.SessionUpdate: on_session_update,
    ce.InputAudioBufferAppend: on_append,
    ce.InputAudioBufferCommit: on_commit,
    ce.InputAudioBufferClear: on_clear,
    ce.ConversationItemCreate: on_item_create,
    ce.ConversationItemTruncate: on_truncate,
    ce.ConversationItemDelete: on_delete,
    ce.ResponseCreate: on_response_create,
    ce.ResponseCancel: on_response_cancel,
}
