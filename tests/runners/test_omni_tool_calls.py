"""Tool calls through the streaming Qwen3-Omni pipeline (thinker -> talker -> code2wav, one process each, the
tiny config with the weights of `omni_reference.save_reference`): the thinker writes a given reply
(`omni_stages.create_scripted_thinker`, in a toy tokenizer where Qwen's tags are single tokens).

- Text then a call: the client's text stream has the text and none of the call, which comes under
  `tool_calls`; the talker speaks the text alone: the same frames, and the same audio, as the reply without
  the call.
- A reply with no token to speak (only a call, or only its EOS) is silent: the talker ends with no frame, the
  vocoder with no sample, and the request completes without an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import Pipeline, shm_segments
from omni_reference import save_reference
from omni_stages import TOOL_CLOSE, TOOL_OPEN, write_toy_tokenizer

from voice_server.config import pipeline_from_dict
from voice_server.engine.requests import TerminalOutput
from voice_server.models.qwen3_omni.presets import TINY_CODEC_IDS, TINY_IDS, TINY_TEXT_VOCAB, tiny_prompt_ids
from voice_server.runners.detok import token_bytes_table
from voice_server.stages.llm import load_hf_tokenizer

torch.set_num_threads(1)
EOS = TINY_IDS["im_end"]
NL, HI, DOT = 10, 40, 41
CALL_IDS = [TOOL_OPEN, NL, 42, 43, 44, 45, NL, TOOL_CLOSE]
"""`<tool_call>\\n{...}\\n</tool_call>`, as Qwen writes a call."""
CALL = '{"name": "get_time", "arguments": {}}'
TOOLS = [{"name": "get_time", "description": "The time now.", "parameters": {"type": "object", "properties": {}}}]
MAX_FRAMES = 9


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    ckpt: Path = tmp_path_factory.mktemp("tiny_qwen3_omni_tools")
    save_reference(ckpt)
    write_toy_tokenizer(ckpt)
    common = {"checkpoint": str(ckpt), "num_threads": 1}
    pipeline = Pipeline(pipeline_from_dict({
        "name": "omni-tools",
        "stages": [
            {"name": "thinker", "factory": "omni_stages:create_scripted_thinker", "scheduler": "ar", "terminal": True,
             "stream_to": ["talker"], "max_batch_size": 4, "max_step_tokens": 64, "factory_args": common},
            # NOTE: terminal here so the test sees the codes; a deployment streams only text and audio.
            {"name": "talker", "factory": "voice_server.stages.talker:create_talker", "scheduler": "ar",
             "terminal": True, "stream_to": ["code2wav"], "max_batch_size": 4, "max_step_tokens": 64,
             "factory_args": {**common, "max_frames": MAX_FRAMES}},
            {"name": "code2wav", "factory": "voice_server.stages.code2wav:create_code2wav", "scheduler": "code2wav",
             "terminal": True, "max_batch_size": 4, "factory_args": common},
        ],
    }))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def reply(omni: Pipeline, script: list[int], tools: list[dict[str, Any]] | None) -> list[TerminalOutput]:
    params: dict[str, Any] = {"script": script, "sampling": {"max_tokens": 32}}
    if tools is not None:
        params["tools"] = tools
    payload = {"token_ids": tiny_prompt_ids(num_user_text=5)}

    async def go() -> list[TerminalOutput]:
        return [o async for o in omni.coordinator.submit(payload, params)]

    # NOTE: one request at a time, so every stage steps it alone and equal inputs give bit-equal outputs; a
    # generous timeout, as the pipeline's other tests, for a loaded machine.
    return omni.run(go(), timeout=120)


def stage(outputs: list[TerminalOutput], name: str) -> list[dict[str, Any]]:
    return [o.payload for o in outputs if o.stage == name]


def codes(outputs: list[TerminalOutput]) -> torch.Tensor:
    frames = [torch.tensor(np.array(p["codes"])) for p in stage(outputs, "talker") if "codes" in p]
    return torch.cat(frames, dim=1) if frames else torch.zeros(0, 0, dtype=torch.long)


def pcm(outputs: list[TerminalOutput]) -> np.ndarray:
    pieces = [np.asarray(p["pcm"]).reshape(-1) for p in stage(outputs, "code2wav") if "pcm" in p]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def test_the_toy_tokenizer_spells_the_reply_and_the_call_as_qwen_does(tmp_path: Path) -> None:
    write_toy_tokenizer(tmp_path)
    tokenizer = load_hf_tokenizer(tmp_path)
    assert tokenizer is not None
    table = token_bytes_table(tokenizer.tokenizer)
    assert len(table) == TINY_TEXT_VOCAB
    text = b"".join(table[t] for t in [HI, DOT, *CALL_IDS, EOS]).decode()
    assert text == f"Hi.<tool_call>\n{CALL}\n</tool_call>"  # NOTE: the EOS, special, decodes to nothing


def test_text_then_a_call_streams_the_call_apart_and_speaks_the_text_alone(omni: Pipeline) -> None:
    with_call = reply(omni, [HI, DOT, *CALL_IDS, EOS], TOOLS)
    plain = reply(omni, [HI, DOT, EOS], None)
    thinker = stage(with_call, "thinker")
    streamed = thinker[:-1]
    assert "".join(p["text"] for p in streamed) == "Hi."
    assert [c for p in streamed for c in p.get("tool_calls", [])] == [CALL]
    # NOTE: no token of the call streams, tags included (the client sees ids too).
    assert [t for p in streamed for t in p["token_ids"]] == [HI, DOT, EOS]
    result = thinker[-1]
    assert result["text"] == "Hi." and result["tool_calls"] == [CALL] and result["finish_reason"] == "stop"
    assert result["token_ids"] == [HI, DOT, *CALL_IDS, EOS]
    assert stage(plain, "thinker")[-1]["text"] == "Hi."
    # The talker heard "Hi." and the thinker's end, exactly as without the call.
    assert codes(with_call).numel() > 0 and torch.equal(codes(with_call), codes(plain))
    audio = pcm(with_call)
    assert audio.size > 0 and np.abs(audio).max() > 1e-3 and np.array_equal(audio, pcm(plain))


@pytest.mark.parametrize(("script", "tools", "calls"), [
    ([*CALL_IDS, EOS], TOOLS, [CALL]),
    ([EOS], None, None),
], ids=["call-only", "eos-only"])
def test_a_reply_with_no_token_to_speak_completes_in_silence(
    omni: Pipeline, script: list[int], tools: list[dict[str, Any]] | None, calls: list[str] | None,
) -> None:
    got = reply(omni, script, tools)
    thinker = stage(got, "thinker")
    assert thinker[-1]["text"] == "" and thinker[-1].get("tool_calls") == calls
    # The talker's one step is the codec EOS: no frame; the vocoder's stream ends empty.
    talker = stage(got, "talker")
    assert codes(got).numel() == 0 and [p["token_ids"] for p in talker] == [[TINY_CODEC_IDS["eos"]]] * 2
    assert pcm(got).size == 0 and stage(got, "code2wav") == [{"num_samples": 0, "num_frames": 0}]
