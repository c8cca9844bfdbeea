"""ARScheduler with tools (`params.tools`): tool calls cut out of the stream, token emits held, released, dropped."""

from __future__ import annotations

from typing import Any

import pytest
from scheduling.ar_fakes import FakeRunner, result, run_all

from voice_server.scheduling import ARScheduler, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSpec, SeqOutput
from voice_server.scheduling.tool_calls import OPEN_TAG

EOS = 0
VOCAB = {
    EOS: "<|im_end|>", 1: "Sure", 2: ", let me check.", 3: "\n", 4: "<tool_call>", 5: '\n{"name": "get_weather", ',
    6: '"arguments": {"city": "Paris? Yes. Sure."}}\n', 7: "</tool_call>", 8: " It is sunny.", 9: " a", 10: " <",
    11: " b", 12: " One.", 13: " Two.", 14: " Three.",
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris? Yes. Sure."}}'
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


class ScriptedRunner(FakeRunner):
    """The fake paged runner with a scripted reply: each token's text from `VOCAB`, and per-token data like the
    thinker's talker feed (the first token's also carries the prompt)."""

    def __init__(self, spec: ARSpec, script: list[int]) -> None:
        super().__init__(spec)
        self.script = script

    def execute(self, batch: ARBatch) -> ARResult:
        for seq in batch.seqs:
            self.forced.setdefault(seq.request_id, list(self.script))
        outputs = []
        for seq, out in zip(batch.seqs, super().execute(batch).outputs):
            if out.token_id is None:
                outputs.append(out)
                continue
            feed: dict[str, Any] = {"embed": out.token_id}
            if len(self.forced[seq.request_id]) == len(self.script) - 1:
                feed["prompt"] = "P"
            outputs.append(SeqOutput(out.token_id, VOCAB[out.token_id], {"_talker": feed}))
        return ARResult(tuple(outputs))


def reply(script: list[int], tools: Any = TOOLS, **sampling: Any) -> list[Emit]:
    spec = ARSpec(64, 4, 256, (EOS,))
    sched = ARScheduler(spec, 8, 64)
    params: dict[str, Any] = {"sampling": sampling}
    if tools is not None:
        params["tools"] = tools
    sched.add(WorkItem("a", WorkKind.NEW, {"token_ids": [1, 2, 3]}, params), 0.0)
    return run_all(sched, ScriptedRunner(spec, script))["a"]


def streams(emits: list[Emit]) -> list[tuple[list[int], str, list[str] | None]]:
    return [(e.payload["token_ids"], e.payload["text"], e.payload.get("tool_calls"))
            for e in emits if e.kind is EmitKind.STREAM]


def test_text_then_a_call_streams_the_text_and_drops_every_token_of_the_call() -> None:
    emits = reply([1, 2, 3, 4, 5, 6, 7, EOS])
    assert streams(emits) == [([1], "Sure", None), ([2], ", let me check.", None), ([3], "\n", None),
                              ([EOS], "", [CALL])]
    assert [e.payload["_talker"]["embed"] for e in emits if e.kind is EmitKind.STREAM] == [1, 2, 3, EOS]
    out = result(emits)
    assert out["text"] == "Sure, let me check.\n" and out["tool_calls"] == [CALL] and out["finish_reason"] == "stop"
    assert out["token_ids"] == [1, 2, 3, 4, 5, 6, 7, EOS]  # NOTE: every generated token, a call's too


def test_a_reply_that_opens_with_a_call_hands_the_first_token_data_to_the_next_released_token() -> None:
    emits = reply([4, 5, 6, 7, 3, 8, EOS])
    # NOTE: token 3, the newline after the call, is dropped with it: a talker would speak it.
    assert streams(emits) == [([8], "It is sunny.", [CALL]), ([EOS], "", None)]
    feeds = [e.payload["_talker"] for e in emits if e.kind is EmitKind.STREAM]
    assert feeds == [{"embed": 8, "prompt": "P"}, {"embed": EOS}]
    assert result(emits)["text"] == "It is sunny."


def test_held_tokens_are_released_in_order_once_their_text_turns_out_plain() -> None:
    emits = reply([9, 10, 11, EOS])
    steps = [e for e in emits if e.kind is EmitKind.STREAM]
    assert streams(emits) == [([9], " a", None), ([10], "", None), ([11], " < b", None), ([EOS], "", None)]
    assert [e.payload["_talker"]["embed"] for e in steps] == [9, 10, 11, EOS]
    out = result(emits)
    assert out["text"] == " a < b" and out["tool_calls"] == []


def test_an_unclosed_call_at_max_tokens_is_reported_raw_on_the_last_token_and_never_spoken() -> None:
    emits = reply([1, 4, 5, 6, 3, 3], max_tokens=4)
    unclosed = OPEN_TAG + CALL  # NOTE: reported with its opening tag: the session refuses it as never closed
    assert streams(emits) == [([1], "Sure", None), ([6], "", [unclosed])]
    out = result(emits)
    assert out["finish_reason"] == "length" and out["text"] == "Sure" and out["tool_calls"] == [unclosed]


def test_sentences_and_repetitions_inside_calls_do_not_count_toward_the_guardrails() -> None:
    script = [12, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 13, 3, 14, EOS]
    with_tools = result(reply(script, max_sentences=2, stop_repeat_len=3))
    assert with_tools["tool_calls"] == [CALL, CALL] and with_tools["text"] == " One.\nTwo."
    without = result(reply(script, tools=None, max_sentences=2, stop_repeat_len=3))
    assert "</tool_call>" not in without["text"]  # NOTE: the call's own sentences ended the reply inside it


def test_text_a_stop_string_held_back_is_fed_to_the_filter_once_released() -> None:
    emits = reply([1, 3, 4, 5, 6, 7, 3, 3], stop=["\n\n"])
    # NOTE: the "\n"s are held by the stop checker first ("\n\n"), so the call rides on the last token.
    assert streams(emits) == [([1], "Sure", None), ([3], "\n", None), ([3], "", None), ([3], "", [CALL])]
    out = result(emits)
    assert out["finish_reason"] == "stop" and out["text"] == "Sure\n" and out["tool_calls"] == [CALL]


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_streams_exactly_as_before_calls_included(tools: Any) -> None:
    script = [1, 10, 4, 5, 6, 7, 8, EOS]
    emits = reply(script, tools=tools)
    assert [e.payload for e in emits if e.kind is EmitKind.STREAM] == [
        {"token_ids": [t], "text": "" if t == EOS else VOCAB[t], "_talker": {"embed": t, **({"prompt": "P"} if i == 0
                                                                                           else {})}}
        for i, t in enumerate(script)]
    out = result(emits)
    assert out["text"] == "".join(VOCAB[t] for t in script[:-1]) and "tool_calls" not in out
    assert list(out) == ["token_ids", "text", "finish_reason", "num_prompt_tokens", "num_cached_tokens"]


@pytest.mark.parametrize(("tools", "message"), [
    ("get_weather", "params.tools: must be a list of {name, description, parameters}, got str"),
    ([{"description": "x"}], "params.tools[0] has no name"),
    ([{"name": "f", "parameters": "{}"}], "params.tools[0].parameters is not a mapping"),
    ([{"name": "f", "description": 3}], "params.tools[0].description is not a string"),
    ([{"name": "f", "argument": {}}], "params.tools[0] has unknown field(s) argument"),
])
def test_malformed_tools_are_refused_naming_the_field(tools: Any, message: str) -> None:
    sched = ARScheduler(ARSpec(64, 4, 256, (EOS,)), 8, 64)
    with pytest.raises(ValueError, match="params.tools") as raised:
        sched.add(WorkItem("a", WorkKind.NEW, {"token_ids": [1]}, {"tools": tools}), 0.0)
    assert message in str(raised.value)
    assert not sched.active_request_ids
