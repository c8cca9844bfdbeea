"""Function calling at admission: `params.tools`/`tool_choice` and the tool fields of `payload.messages` are
checked (a refusal names the field), the prompt is the tokenizer's with the tools, a long conversation drops
a call and its results together, and the asr and audio encoder entry stages take the same messages."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np
import pytest

from voice_server.models.chat_tools import MAX_TOOLS, Tool
from voice_server.models.llama import GGUFTokenizer
from voice_server.models.llama.gguf_file import GGUFFile
from voice_server.models.llama.loader import find_smollm2_gguf
from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.chat import chat_prompt, tiny_encode
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.runners.admission import AdmissionRules, admit
from voice_server.runners.asr_input import messages_with_audio
from voice_server.runners.encoder_runner import AudioEncoderRunner, AudioEncoderRunnerConfig
from voice_server.scheduling import AdmissionError, WorkItem, WorkKind
from voice_server.scheduling.contract import SamplingParams
from voice_server.stages.audio_encoder import _chat

TOOL = {"name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PARAMS: dict[str, Any] = {"tools": [TOOL], "tool_choice": "auto", "sampling": {"max_tokens": 60}}
SYSTEM = {"role": "system", "content": "You are a helpful voice assistant."}
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "get_weather",
                                                            "arguments": '{"city": "Paris"}'}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "clear"}'}


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf_metadata(GGUFFile(find_smollm2_gguf()).metadata)


@pytest.fixture(scope="module")
def rules(tok: GGUFTokenizer) -> AdmissionRules:
    return AdmissionRules(vocab_size=49152, max_model_len=2048, sampling_defaults=SamplingParams(),
                          encode=tok.encode, encode_chat=tok.encode_chat)


def new(messages: list[dict[str, Any]], params: dict[str, Any] | None = None) -> WorkItem:
    return WorkItem("r", WorkKind.NEW, {"messages": messages}, PARAMS if params is None else params)


def test_the_admitted_prompt_is_the_chat_template_with_the_tools(tok: GGUFTokenizer, rules: AdmissionRules) -> None:
    messages = [SYSTEM, USER, CALL, RESULT]
    admitted = admit(new(messages), rules)
    tools = (Tool(**TOOL),)  # type: ignore[arg-type]
    assert admitted.payload == {"token_ids": tok.encode_chat(messages, tools=tools)}
    assert admitted.params["tools"] == [TOOL] and admitted.params["tool_choice"] == "auto"  # NOTE: for the parser
    for choice in ("required", {"name": "get_weather"}):
        again = admit(new(messages, {**PARAMS, "tool_choice": choice}), rules)
        assert again.payload == admitted.payload  # NOTE: enforced by the session, never written into the prompt
    no_tools = admit(new(messages, {"tools": []}), rules)
    assert no_tools.payload == {"token_ids": tok.encode_chat(messages)}


def _bad_tool(**fields: Any) -> dict[str, Any]:
    return {**PARAMS, "tools": [{**TOOL, **fields}]}


@pytest.mark.parametrize(("params", "match"), [
    ({"tools": "get_weather"}, r"params.tools: must be a list of at most 128"),
    ({"tools": [TOOL] * (MAX_TOOLS + 1)}, r"params.tools: must be a list of at most 128"),
    ({"tools": [TOOL, TOOL]}, r"params.tools: function names must be unique"),
    ({"tools": [{"name": "f"}]}, r"params.tools\[0\]: must be a mapping with exactly 'name', 'description'"),
    (_bad_tool(name="get weather"), r"params.tools\[0\].name: must match \^\[a-zA-Z0-9_-\]\{1,64\}\$"),
    (_bad_tool(name="x" * 65), r"params.tools\[0\].name: must match"),
    (_bad_tool(description=None), r"params.tools\[0\].description: must be a string, got NoneType"),
    (_bad_tool(parameters="{}"), r"params.tools\[0\].parameters: must be a JSON schema object, got str"),
    (_bad_tool(parameters={"x": {1, 2}}), r"params.tools\[0\].parameters: must be JSON"),
    ({**PARAMS, "tool_choice": "none"}, r"params.tool_choice: must be 'auto', 'required' or \{'name': str\}"),
    ({**PARAMS, "tool_choice": {"name": "get_time"}}, r"params.tool_choice.name: names no function"),
    ({"tool_choice": "required"}, r"params.tool_choice: 'required' needs params.tools"),
])
def test_bad_tools_are_refused_naming_the_field(rules: AdmissionRules, params: dict[str, Any], match: str) -> None:
    with pytest.raises(AdmissionError, match=match):
        admit(new([USER], params), rules)


def _call(**fields: Any) -> dict[str, Any]:
    return {**CALL, "tool_calls": [{**CALL["tool_calls"][0], **fields}]}  # type: ignore[index]


@pytest.mark.parametrize(("message", "match"), [
    ({"role": "tool", "content": "x"}, r"messages\[1\].tool_call_id: a tool result needs the id of its call"),
    ({**RESULT, "tool_call_id": ""}, r"messages\[1\].tool_call_id: a tool result needs"),
    ({**USER, "tool_calls": []}, r"messages\[1\].tool_calls: only assistant messages carry tool calls"),
    ({**RESULT, "tool_calls": []}, r"messages\[1\].tool_calls: only assistant messages carry tool calls"),
    ({**CALL, "tool_call_id": "c1"}, r"messages\[1\].tool_call_id: only tool messages carry a tool_call_id"),
    ({**CALL, "tool_calls": {"id": "c1"}}, r"messages\[1\].tool_calls: must be a list of at most 128"),
    (_call(name=""), r"payload.messages\[1\].tool_calls\[0\].name: must be a non-empty string"),
    (_call(id=7), r"payload.messages\[1\].tool_calls\[0\].id: must be a non-empty string"),
    (_call(arguments='{"city": '), r"messages\[1\].tool_calls\[0\].arguments: must be a JSON object as text"),
    (_call(arguments='["Paris"]'), r"messages\[1\].tool_calls\[0\].arguments: must be a JSON object as text"),
    (_call(arguments={"city": "Paris"}), r"messages\[1\].tool_calls\[0\].arguments: must be a JSON object"),
    ({**CALL, "tool_calls": [{"name": "f", "arguments": "{}"}]}, r"tool_calls\[0\]: must be a mapping with exactly"),
    ({"role": "tool", "tool_call_id": "c1"}, r"messages\[1\]: must be a mapping with 'role' and 'content'"),
    ({**USER, "name": "x"}, r"messages\[1\]: must be a mapping with 'role' and 'content'"),
    ({"role": "function", "content": "x"}, r"messages\[1\].role: must be one of system, user, assistant, tool"),
])
def test_bad_tool_messages_are_refused_naming_the_field(
    rules: AdmissionRules, message: dict[str, Any], match: str,
) -> None:
    with pytest.raises(AdmissionError, match=match):
        admit(new([SYSTEM, message]), rules)


def test_a_long_conversation_drops_a_call_and_its_results_together(tok: GGUFTokenizer, rules: AdmissionRules) -> None:
    tools = (Tool(**TOOL),)  # type: ignore[arg-type]
    long_result = {**RESULT, "content": "sunny and mild, light wind from the west " * 6}
    group = [USER, CALL, long_result, long_result, long_result]
    turns = [dict(m) for _ in range(12) for m in group]
    tight = dataclasses.replace(rules, max_model_len=1160)  # NOTE: 1100 tokens of prompt, 60 of reply

    def window(start: int, tools: tuple[Tool, ...] = tools) -> list[int]:
        return tok.encode_chat([SYSTEM, *turns[start:]], tools=tools)

    def kept(ids: list[int], tools: tuple[Tool, ...] = tools) -> int:
        return next(i for i in range(len(turns)) if window(i, tools) == ids)

    ids = admit(new([SYSTEM, *turns]), tight).payload["token_ids"]
    start = kept(ids)
    assert turns[start]["role"] != "tool" and len(ids) <= 1100 < len(window(start - 5))
    # Windows starting at an orphan result would have fitted more: the rule, not the budget, cut them.
    assert [i for i in range(start) if len(window(i)) <= 1100] == [start - 2, start - 1]
    assert turns[start - 2]["role"] == turns[start - 1]["role"] == "tool"
    # The tools' section counts toward the budget: without tools, more of the conversation fits.
    plain = admit(new([SYSTEM, *turns], {"sampling": {"max_tokens": 60}}), tight).payload["token_ids"]
    assert kept(plain, ()) < start
    # When even the last call and its results overflow the budget, they are kept together, alone.
    tiny = dataclasses.replace(rules, max_model_len=600)
    ids = admit(new([SYSTEM, *turns], {**PARAMS, "sampling": {"max_tokens": 300}}), tiny).payload["token_ids"]
    assert ids == window(len(turns) - 4)
    with pytest.raises(AdmissionError, match="payload.messages: .* characters is too long"):
        admit(new([USER], {"tools": [{**TOOL, "description": "x" * 600 * 32}]}), tiny)


def test_the_asr_stage_passes_tool_messages_to_the_thinker() -> None:
    messages = [SYSTEM, USER, CALL, RESULT, {"role": "user", "audio": np.zeros(1600, np.float32)}]
    checked = messages_with_audio(messages, 16000, is_empty_allowed=False)
    assert checked[:4] == [SYSTEM, USER, CALL, RESULT] and set(checked[4]) == {"role", "pcm"}
    with pytest.raises(AdmissionError, match=r"messages\[1\].tool_calls\[0\].arguments: must be a JSON object"):
        messages_with_audio([SYSTEM, _call(arguments="Paris")], 16000, is_empty_allowed=False)
    with pytest.raises(AdmissionError, match=r"messages\[0\].audio: only user messages may carry audio"):
        messages_with_audio([{**RESULT, "content": "", "audio": np.zeros(9, np.float32)}], 16000, False)


def test_the_audio_encoder_writes_the_tools_into_its_prompt() -> None:
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    tower = load_part("audio_tower", cfg, load_format="dummy", seed=0)
    assert isinstance(tower, AudioEncoder)
    runner = AudioEncoderRunner(tower, AudioEncoderRunnerConfig.from_thinker(cfg.thinker, 5),
                                partial(_chat, cfg=cfg, encode=tiny_encode))
    messages = [SYSTEM, USER, CALL, RESULT]
    admitted = runner.admit(WorkItem("r", WorkKind.NEW, {"messages": messages}, PARAMS))
    tools = (Tool(**TOOL),)  # type: ignore[arg-type]
    assert admitted.payload["token_ids"] == chat_prompt(messages, cfg, tiny_encode, tools)[0]
    plain = runner.admit(WorkItem("r", WorkKind.NEW, {"messages": messages}, {}))
    assert plain.payload["token_ids"] == chat_prompt(messages, cfg, tiny_encode)[0] != admitted.payload["token_ids"]
    with pytest.raises(AdmissionError, match=r"params.tools\[0\].name: must match"):
        runner.admit(WorkItem("r", WorkKind.NEW, {"messages": messages}, _bad_tool(name="a b")))
