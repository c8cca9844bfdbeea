"""Checking and converting an AR stage's request input into token ids (the runner's `admit`).

NEW payloads: `{"messages": [{"role", "content"}, ...]}` (chat template with generation prompt;
the `input_transcript*` fields beside them, from the asr stage, are ignored; a conversation too long for
the model loses its oldest turns, see `fit_messages`; an assistant message may carry `tool_calls`
[{"id", "name", "arguments": JSON text}], a `tool` message is a call's result with its `tool_call_id`,
and `params["tools"]` [{"name", "description", "parameters"}] go into the prompt: `models/chat_tools.py`,
which also checks `params["tool_choice"]`, enforced by the session, never in the prompt),
`{"prompt": str}` or `{"token_ids": [int, ...]}`; an empty payload only for a streamed request
(its input arrives as CHUNKs). CHUNK payloads: `{"text": str}` or `{"token_ids": [...]}`.
With `params["score_turn_end"]` true and `messages` that end with the user's, the admitted payload also
names the position of the user's last token (`turn_end_pos`: the token before the message's end marker),
whose next-token distribution the runner scores: how likely the user's words end there (`turn_end_p`).
Every refusal is an `AdmissionError` naming the offending field.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from voice_server.models.chat_tools import TOOL_KEYS, Tool, request_tools, tool_fields, tools_section
from voice_server.scheduling import AdmissionError, WorkItem, WorkKind
from voice_server.scheduling.contract import SamplingParams

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 256
"""Messages a prompt keeps at most (the newest; a leading system message stays)."""
MAX_PAYLOAD_MESSAGES = 4096
"""Messages a payload may bring at all (a guard on the work of checking it)."""
_TRANSCRIPT_KEYS = ("input_transcript", "input_transcript_confident", "input_transcript_alternatives")
"""What a transcribing stage before this one (asr) adds to its `messages` result for the client; the
messages already end with that text, so it is ignored here."""
_MAX_CHARS_PER_TOKEN = 32
"""Text longer than this many characters per allowed token is refused before tokenising it."""

Encode = Callable[[str], list[int]]


class EncodeChat(Protocol):
    """Checked messages (and the request's tools) -> the prompt's ids, ending with the generation prompt."""

    def __call__(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Tool] = ...) -> list[int]: ...


@dataclass(frozen=True)
class AdmissionRules:
    vocab_size: int
    max_model_len: int
    sampling_defaults: SamplingParams
    encode: Encode | None = None
    """Text -> ids; None when the stage has no tokenizer (only `token_ids` is accepted)."""
    encode_chat: EncodeChat | None = None
    end_of_message_id: int | None = None
    """The chat template's end-of-message token (ChatML's `<|im_end|>`); None: no `turn_end_pos`."""

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.max_model_len < 2:
            raise ValueError(f"AdmissionRules: bad vocab_size={self.vocab_size} or max_model_len={self.max_model_len}")

    @property
    def max_input_len(self) -> int:
        """Input tokens one request may bring: room stays for at least one output token."""
        return self.max_model_len - 1


def admit(item: WorkItem, rules: AdmissionRules) -> WorkItem:
    if item.kind is WorkKind.DONE:
        return item
    payload = item.payload if isinstance(item.payload, dict) else None
    if payload is None:
        raise AdmissionError(f"payload: must be a mapping, got {type(item.payload).__name__}")
    params = item.params
    if item.kind is WorkKind.NEW:
        params = merged_sampling_params(item.params, rules.sampling_defaults)
        try:
            tools = request_tools(params)
        except ValueError as exc:
            raise AdmissionError(str(exc)) from exc
        if not payload and item.is_stream:
            return dataclasses.replace(item, payload={"token_ids": []}, params=params)
        token_ids = _new_token_ids(payload, rules, params["sampling"]["max_tokens"], tools)
        end_pos = _turn_end_pos(payload, params, token_ids, rules)
        if end_pos is not None:
            return dataclasses.replace(item, payload={"token_ids": token_ids, "turn_end_pos": end_pos}, params=params)
    else:
        token_ids = _chunk_token_ids(payload, rules)
    return dataclasses.replace(item, payload={"token_ids": token_ids}, params=params)


def _turn_end_pos(payload: dict[str, Any], params: dict[str, Any], token_ids: list[int],
                  rules: AdmissionRules) -> int | None:
    """The position of the user's last token, where asked for and the prompt ends with the user's message."""
    messages = payload.get("messages")
    if params.get("score_turn_end") is not True or rules.end_of_message_id is None or not messages:
        return None
    last = messages[-1]
    if last.get("role") != "user" or not isinstance(last.get("content"), str) or (
            rules.end_of_message_id not in token_ids):
        return None  # NOTE: words only: the end of an audio or image part says nothing of the speaker's sentence
    # NOTE: the generation prompt after the user's message holds no end marker, so the last one is the user's.
    end = len(token_ids) - 1 - token_ids[::-1].index(rules.end_of_message_id)
    return end - 1 if end >= 1 else None


def merged_sampling_params(params: dict[str, Any], defaults: SamplingParams) -> dict[str, Any]:
    """`params` with `sampling` replaced by every field of the request's sampling over the defaults."""
    if not isinstance(params, dict):
        raise AdmissionError(f"params: must be a mapping, got {type(params).__name__}")
    try:
        sampling = SamplingParams.from_params(params, defaults)
    except ValueError as exc:
        raise AdmissionError(str(exc)) from exc
    return {**params, "sampling": dataclasses.asdict(sampling)}


def _new_token_ids(
    payload: dict[str, Any], rules: AdmissionRules, max_tokens: int | None, tools: Sequence[Tool]
) -> list[int]:
    # NOTE: `tools` go into a `messages` prompt only: a `prompt` or `token_ids` comes already written.
    keys = [k for k in ("messages", "prompt", "token_ids") if k in payload]
    if len(keys) != 1:
        raise AdmissionError("payload: needs exactly one of 'messages', 'prompt', 'token_ids'")
    ignored = _TRANSCRIPT_KEYS if keys[0] == "messages" else ()
    unknown = sorted(str(k) for k in payload if k != keys[0] and k not in ignored)
    if unknown:
        raise AdmissionError(f"payload: unknown field(s) {', '.join(unknown)}")
    key = keys[0]
    if key == "token_ids":
        ids = check_token_ids("payload.token_ids", payload[key], rules)
    elif key == "prompt":
        ids = _encode_text("payload.prompt", payload[key], rules)
    else:
        messages = _check_messages(payload[key])
        if rules.encode_chat is None:
            raise AdmissionError("payload.messages: this stage has no chat template; send token_ids")
        ids = fit_messages(messages, rules, max_tokens, tools)
        _check_len("payload.messages", len(ids), rules)
    if not ids:
        raise AdmissionError(f"payload.{key}: gives no tokens")
    return ids


def _chunk_token_ids(payload: dict[str, Any], rules: AdmissionRules) -> list[int]:
    keys = [k for k in ("text", "token_ids") if k in payload]
    if len(keys) != 1:
        raise AdmissionError("chunk payload: needs exactly one of 'text', 'token_ids'")
    if keys[0] == "token_ids":
        return check_token_ids("chunk payload.token_ids", payload["token_ids"], rules)
    return _encode_text("chunk payload.text", payload["text"], rules)


def check_token_ids(where: str, value: Any, rules: AdmissionRules) -> list[int]:
    if not isinstance(value, list | tuple):
        raise AdmissionError(f"{where}: must be a list of token ids, got {type(value).__name__}")
    _check_len(where, len(value), rules)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < rules.vocab_size:
            raise AdmissionError(f"{where}: {token!r} is not a token id in [0, {rules.vocab_size})")
    return list(value)


def _encode_text(where: str, value: Any, rules: AdmissionRules) -> list[int]:
    if not isinstance(value, str):
        raise AdmissionError(f"{where}: must be a string, got {type(value).__name__}")
    if len(value) > rules.max_input_len * _MAX_CHARS_PER_TOKEN:
        raise AdmissionError(f"{where}: {len(value)} characters is too long")
    if rules.encode is None:
        raise AdmissionError(f"{where}: this stage has no tokenizer; send token_ids")
    ids = rules.encode(value)
    _check_len(where, len(ids), rules)
    return ids


def fit_messages(
    messages: list[dict[str, Any]], rules: AdmissionRules, max_tokens: int | None, tools: Sequence[Tool] = ()
) -> list[int]:
    """The chat ids of the newest messages that fit: a long conversation (a call of hundreds of turns)
    loses its oldest messages, never a leading system message, rather than every response failing once
    it outgrows the model (what OpenAI Realtime's `truncation: auto` does).

    Fits means: at most `MAX_MESSAGES` messages, the characters bound of `_encode_text`, and a prompt that
    leaves room for `max_tokens` (at most half the context) of reply; the tools' section counts toward both
    bounds. The last message is always kept: if it alone is too long, `_check_len` refuses the request as
    before. A tool result is never kept without the assistant call before it: they are dropped together, so
    the last message, a result, keeps its call."""
    encode_chat = rules.encode_chat
    assert encode_chat is not None
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    # NOTE: where the kept messages may begin: anywhere but at a tool result (results at the very start have
    # no call left to keep).
    starts = [i for i, m in enumerate(turns) if i == 0 or m["role"] != "tool"] or [0]
    last = len(starts) - 1
    char_budget = rules.max_input_len * _MAX_CHARS_PER_TOKEN
    # NOTE: count and characters first (cheap), so a huge payload is never tokenised whole.
    k = min(last, bisect_left(starts, len(turns) - (MAX_MESSAGES - len(system))))
    num_chars = sum(_num_chars(m) for m in system + turns[starts[k]:]) + (len(tools_section(tools)) if tools else 0)
    while k < last and num_chars > char_budget:
        num_chars -= sum(_num_chars(m) for m in turns[starts[k]:starts[k + 1]])
        k += 1
    if num_chars > char_budget:
        raise AdmissionError(f"payload.messages: {num_chars} characters is too long")
    reserve = min(max_tokens or 1, rules.max_model_len // 2)
    token_budget = max(1, min(rules.max_input_len, rules.max_model_len - reserve))

    def encode_from(j: int) -> list[int]:
        kept = system + turns[starts[j]:]
        # NOTE: without tools, the one-argument call every template takes (a stand-in's too)
        return encode_chat(kept, tools=tools) if tools else encode_chat(kept)

    ids = encode_from(k)
    if len(ids) <= token_budget or k == last:
        return ids
    # NOTE: the fewest dropped messages that fit, by bisection (a chat template need not be additive per
    # message, so each candidate is encoded whole); `hi` always fits or is the last start alone.
    lo, hi = k, last
    best = encode_from(hi)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        candidate = encode_from(mid)
        if len(candidate) <= token_budget:
            hi, best = mid, candidate
        else:
            lo = mid
    return best


def _num_chars(message: Mapping[str, Any]) -> int:
    calls = message.get("tool_calls", ())
    return len(message["content"]) + sum(len(call["name"]) + len(call["arguments"]) for call in calls)


def _check_messages(value: Any) -> list[dict[str, Any]]:
    # NOTE: an empty list is a conversation with no turn yet: the prompt is the template's generation prompt
    # alone, and the model speaks first (a telephony bot's greeting).
    if not isinstance(value, list | tuple):
        raise AdmissionError(f"payload.messages: must be a list of {{role, content}}, got {type(value).__name__}")
    if len(value) > MAX_PAYLOAD_MESSAGES:
        raise AdmissionError(f"payload.messages: {len(value)} messages, at most {MAX_PAYLOAD_MESSAGES}")
    messages = []
    for i, message in enumerate(value):
        where = f"payload.messages[{i}]"
        if not isinstance(message, dict) or not {"role", "content"} <= set(message) <= {"role", "content", *TOOL_KEYS}:
            raise AdmissionError(f"{where}: must be a mapping with 'role' and 'content', and besides them only an "
                                 "assistant's 'tool_calls' or a tool result's 'tool_call_id'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise AdmissionError(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}"[:300])
        if not isinstance(content, str):
            raise AdmissionError(f"{where}.content: must be a string, got {type(content).__name__}")
        try:
            fields = tool_fields(where, message)
        except ValueError as exc:
            raise AdmissionError(str(exc)) from exc
        messages.append({"role": role, "content": content, **fields})
    return messages


def _check_len(where: str, num_tokens: int, rules: AdmissionRules) -> None:
    if num_tokens > rules.max_input_len:
        raise AdmissionError(
            f"{where}: {num_tokens} tokens, more than the {rules.max_input_len} this stage accepts "
            f"(max_model_len {rules.max_model_len} less one output token)"
        )
