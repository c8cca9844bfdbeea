"""Function calling in the prompt (`voice_server/models/chat_tools.py`): the exact text for SmolLM2's ChatML,
the same text as Qwen2.5's and Qwen3's own chat templates render (transformers' jinja machinery), the same
turns on Qwen3-Omni's token path, and SmolLM2's prompt without tools unchanged."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from qwen_chat_templates import QWEN3, QWEN25
from transformers.utils.chat_template_utils import render_jinja_template

from voice_server.models.chat_tools import Tool, tools_section
from voice_server.models.llama import GGUFTokenizer
from voice_server.models.llama.gguf_file import GGUFFile
from voice_server.models.llama.loader import find_smollm2_gguf
from voice_server.models.qwen3_omni.chat import chat_prompt, tiny_encode
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import tiny_config_dict

WEATHER = Tool("get_weather", "Current weather in a city (°C).",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = Tool("get-time_2", "", {"type": "object", "properties": {}})
TOOLS = (WEATHER, TIME)
SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city (°C).", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get-time_2", "description": "", '
    '"parameters": {"type": "object", "properties": {}}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CALLS = [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"id": "c2", "name": "get-time_2", "arguments": "{}"}]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
    {"role": "assistant", "content": "21 degrees, and it is five past two."},
    {"role": "user", "content": "And in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c3", "name": "get_weather",
                                                         "arguments": '{"city": "Rome"}'}]},
    {"role": "tool", "tool_call_id": "c3", "content": '{"temp": 25}'},
]
EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n" + SECTION + "<|im_end|>\n"
    "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n"
    '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get-time_2", "arguments": {}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n14:05\n</tool_response>'
    "<|im_end|>\n"
    "<|im_start|>assistant\n21 degrees, and it is five past two.<|im_end|>\n"
    "<|im_start|>user\nAnd in Rome?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    "<|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp": 25}\n</tool_response><|im_end|>\n'
)


@pytest.fixture(scope="module")
def smollm2() -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf_metadata(GGUFFile(find_smollm2_gguf()).metadata)


@pytest.fixture(scope="module")
def qwen_like(smollm2: GGUFTokenizer) -> GGUFTokenizer:
    # NOTE: Qwen's templates (and a checkpoint's tokenizer_config.json, `stages/llm.py`) write no default prompt
    return dataclasses.replace(smollm2, default_system_prompt=None)


def reference(template: str, messages: list[dict[str, Any]], tools: tuple[Tool, ...]) -> str:
    """What transformers' `apply_chat_template(messages, tools=..., chat_template=template)` renders, with the
    calls in OpenAI's nesting and their arguments as objects (Qwen2.5's template dumps them itself)."""
    def openai(message: dict[str, Any]) -> dict[str, Any]:
        calls = [{"type": "function", "id": c["id"], "function": {"name": c["name"],
                                                                  "arguments": json.loads(c["arguments"])}}
                 for c in message.get("tool_calls", [])]
        return {**message, "tool_calls": calls} if calls else message

    schemas = [json.loads(tool.signature()) for tool in tools] or None
    rendered, _ = render_jinja_template([[openai(m) for m in messages]], tools=schemas, chat_template=template)
    return str(rendered[0])


def test_the_tools_section_is_qwens_text() -> None:
    assert tools_section(TOOLS) == SECTION
    assert WEATHER.signature() == json.dumps({"type": "function", "function": dataclasses.asdict(WEATHER)},
                                             ensure_ascii=False)


def test_smollm2_renders_tools_calls_and_results_in_the_hermes_form(smollm2: GGUFTokenizer) -> None:
    assert smollm2.apply_chat_template(CONVERSATION, tools=TOOLS) == EXPECTED + "<|im_start|>assistant\n"
    assert smollm2.encode_chat(CONVERSATION, tools=TOOLS) == smollm2.encode(EXPECTED + "<|im_start|>assistant\n")
    # Without a system message the default one comes first, then the tools section (SmolLM2's template has no
    # tools section of its own: this is its fallback).
    default = smollm2.default_system_prompt
    assert default is not None
    assert smollm2.apply_chat_template(CONVERSATION[1:2], tools=TOOLS) == (
        f"<|im_start|>system\n{default}\n\n{SECTION}<|im_end|>\n"
        "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template", [QWEN25, QWEN3], ids=["qwen2.5", "qwen3"])
def test_the_prompt_is_what_qwens_own_template_renders(qwen_like: GGUFTokenizer, template: str) -> None:
    for end in (2, 5, 7, len(CONVERSATION)):
        messages = CONVERSATION[:end]
        ours = qwen_like.apply_chat_template(messages, add_generation_prompt=False, tools=TOOLS)
        assert ours == reference(template, messages, TOOLS), end
        assert qwen_like.apply_chat_template(messages, add_generation_prompt=False) == \
            reference(template, messages, ()), end
    assert qwen_like.apply_chat_template(CONVERSATION, tools=TOOLS) == EXPECTED + "<|im_start|>assistant\n"


def test_without_a_system_message_the_tools_section_is_qwen3s_system_turn(qwen_like: GGUFTokenizer) -> None:
    # NOTE: Qwen3 writes the section alone (Qwen2.5 would put its "You are Qwen" default before it).
    for end in (2, 5, len(CONVERSATION)):
        messages = CONVERSATION[1:end]
        assert qwen_like.apply_chat_template(messages, add_generation_prompt=False, tools=TOOLS) == \
            reference(QWEN3, messages, TOOLS)


def test_smollm2_without_tools_is_byte_identical_to_before(smollm2: GGUFTokenizer) -> None:
    default = smollm2.default_system_prompt
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Name a colour."}]
    assert smollm2.apply_chat_template(plain) == (
        f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    )
    system = [{"role": "system", "content": "S"}, *plain]
    assert smollm2.apply_chat_template(system, tools=()) == smollm2.apply_chat_template(system)
    assert smollm2.apply_chat_template(system, False).startswith("<|im_start|>system\nS<|im_end|>")


def test_qwen3_omni_writes_the_same_turns_as_token_ids(qwen_like: GGUFTokenizer) -> None:
    # NOTE: an invertible stand-in tokenizer: the ids read back as the text, with the role tokens as names.
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    names = {cfg.im_start_token_id: "<|im_start|>", cfg.im_end_token_id: "<|im_end|>", cfg.system_token_id: "system",
             cfg.user_token_id: "user", cfg.assistant_token_id: "assistant"}

    def encode(text: str) -> list[int]:
        return [10_000 + ord(c) for c in text]

    for messages in (CONVERSATION, CONVERSATION[1:]):
        ids, clips = chat_prompt(messages, cfg, encode, TOOLS)
        text = "".join(names.get(i) or chr(i - 10_000) for i in ids)
        assert text == qwen_like.apply_chat_template(messages, tools=TOOLS) and clips == []
    plain, _ = chat_prompt(CONVERSATION[:2], cfg, tiny_encode)
    assert plain == chat_prompt(CONVERSATION[:2], cfg, tiny_encode, ())[0]
    with pytest.raises(ValueError, match=r"payload.messages\[1\].tool_call_id: a tool result needs"):
        chat_prompt([CONVERSATION[0], {"role": "tool", "content": "x"}], cfg, tiny_encode)
    with pytest.raises(ValueError, match=r"payload.messages\[0\].audio: only user turns"):
        chat_prompt([{"role": "tool", "tool_call_id": "c", "content": "", "audio": [0.0]}], cfg, tiny_encode)
