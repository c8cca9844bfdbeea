"""What this server does with each part of the Realtime protocol, told to the client in ``session.created``
(under the vendor key) so it need not find out by trial: ``served`` acts as OpenAI documents, ``ignored`` is
accepted and echoed but changes nothing, ``refused`` answers an ``unsupported`` error.

The voice is served where the pipeline declares voices (then ``voices`` lists them), else ignored (metadata).

One place for the claim, beside the parsers that make it true (`session_config.py`, `payloads.py`,
`tool_fields.py`): a change to what they take changes this list in the same commit.
"""

from __future__ import annotations

from typing import Any

from voice_server.config.voices import VoiceConfig
from voice_server.session.voices import voices_info

SERVED = (
    "session.output_modalities", "session.instructions", "session.audio.input.format",
    "session.audio.input.turn_detection (server_vad, semantic_vad)",
    "session.audio.input.noise_reduction (near_field, far_field: both RNNoise)", "session.audio.output.format",
    "session.max_output_tokens", "session.temperature (beta)", "session.tools (function)", "session.tool_choice",
    "conversation.item.create (message with input_text/output_text, user message with input_audio, "
    "function_call, function_call_output)",
    "conversation.item.truncate", "conversation.item.delete", "input_audio_buffer.*",
    "response.create (instructions, tools, tool_choice, output_modalities, max_output_tokens, temperature, "
    "metadata)", "response.cancel",
)
IGNORED = (
    "session.audio.input.transcription", "input_audio part transcript",
    "session.audio.input.noise_reduction.strength", "session.audio.output.voice",
    "session.audio.output.speed", "session.parallel_tool_calls", "session.model", "session.tracing",
    "session.truncation", "session.include", "session.reasoning",
)
REFUSED = (
    "session.prompt", "session.type transcription", "tools of type mcp",
    "a message mixing input_audio and input_text parts",
    "response.create input (a custom context)",
    "response.create conversation none (out of band)", "a response output format other than the session's",
)


IMAGES = "conversation.item.create input_image parts (PNG/JPEG data URLs)"
"""Served where the pipeline sees (its entry stage runs a vision encoder), else refused."""
VOICE = "session.audio.output.voice"
VOICE_PER_RESPONSE = "response.create voice (that response only)"


def capabilities(voices: tuple[VoiceConfig, ...] = (), default: VoiceConfig | None = None,
                 takes_images: bool = False) -> dict[str, Any]:
    """What is served, ignored and refused; with the pipeline's voices (`voice_server/session/voices.py`) the
    voice is served, and `voices` lists them (each with the OpenAI names that choose it)."""
    served, refused = (list(SERVED), list(REFUSED))
    (served if takes_images else refused).append(IMAGES)
    if not voices:
        return {"served": served, "ignored": list(IGNORED), "refused": refused}
    return {"served": [*served, VOICE, VOICE_PER_RESPONSE], "ignored": [name for name in IGNORED if name != VOICE],
            "refused": refused, "voices": voices_info(voices, default)}
