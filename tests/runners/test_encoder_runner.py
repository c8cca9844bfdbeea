"""AudioEncoderRunner on the tiny preset: batched = alone = the thinker's own `encode_audio`,
placeholder expansion the thinker accepts, pass-through of text-only requests, and refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder, num_audio_tokens
from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd
from voice_server.models.qwen3_omni.chat import chat_prompt, tiny_encode
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.rope import get_rope_index
from voice_server.runners.encoder_runner import AudioEncoderRunner, AudioEncoderRunnerConfig
from voice_server.scheduling import AdmissionError, SimpleBatch, WorkItem, WorkKind

torch.set_num_threads(1)
CFG = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
BLOCK = [TINY_IDS["audio_start"], TINY_IDS["audio"], TINY_IDS["audio_end"]]
# NOTE: a clip's tokens come from the same arithmetic alone or batched (windows never cross clips);
# only the GEMM/conv batch shapes differ, which may change CPU kernel blocking: allow float32 noise.
ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(scope="module")
def thinker() -> ThinkerModel:
    model = load_part("thinker", CFG, load_format="dummy", seed=0)
    assert isinstance(model, ThinkerModel)
    return model


@pytest.fixture(scope="module")
def runner() -> AudioEncoderRunner:
    tower = load_part("audio_tower", CFG, load_format="dummy", seed=0)
    assert isinstance(tower, AudioEncoder)
    return AudioEncoderRunner(tower, AudioEncoderRunnerConfig.from_thinker(CFG.thinker, max_audio_seconds=5))


def pcm(seconds: float, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(int(seconds * 16000), generator=g)).numpy()


def prompt(num_clips: int) -> list[int]:
    base = tiny_prompt_ids(num_user_text=4)
    return base[:3] + BLOCK * num_clips + base[3:]


def new(payload: dict[str, Any], rid: str = "r") -> WorkItem:
    return WorkItem(rid, WorkKind.NEW, payload)


def run(runner: AudioEncoderRunner, *payloads: dict[str, Any]) -> list[dict[str, Any]]:
    items = tuple(runner.admit(new(p, f"r{i}")) for i, p in enumerate(payloads))
    return [e.payload for e in runner.execute(SimpleBatch(items)).emits]


def test_audio_tower_part_is_the_thinkers_audio_tower(thinker: ThinkerModel, runner: AudioEncoderRunner) -> None:
    ours, ref = runner.tower.state_dict(), thinker.model.audio_tower.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@torch.no_grad()
def test_batched_equals_alone_and_the_thinkers_encode_audio(thinker: ThinkerModel, runner: AudioEncoderRunner) -> None:
    two_clips = {"token_ids": prompt(2), "audio": [pcm(2.37, 1), pcm(0.81, 2)], "note": ["kept"]}
    one_clip = {"token_ids": prompt(1), "audio": [pcm(1.3, 3)], "sampling": {"max_tokens": 3}}
    sub_second = {"token_ids": prompt(1), "audio": [pcm(0.6, 7)]}
    text_only = {"token_ids": prompt(0), "note": ["hi"]}
    batched = run(runner, two_clips, one_clip, text_only, sub_second)
    del batched[2:3]
    front_end = LogMelFrontEnd(num_mel_bins=CFG.thinker.audio.num_mel_bins)
    for payload, out in zip((two_clips, one_clip, sub_second), batched):
        alone = run(runner, payload)[0]
        torch.testing.assert_close(out["audio_embeds"], alone["audio_embeds"], atol=ATOL, rtol=RTOL)
        # The thinker's own path on the same weights: HF-style log-mel of the request's clips, conv
        # chunks padded to a full chunk (what the reference does whenever a clip of >= 1 s is in the call).
        mel = front_end(payload["audio"])
        want = thinker.encode_audio(mel.packed(), mel.feature_lens, chunk_pad_len=100)
        torch.testing.assert_close(out["audio_embeds"], want, atol=ATOL, rtol=RTOL)
        if payload is not sub_second:
            reference = thinker.encode_audio(mel.packed(), mel.feature_lens)
            torch.testing.assert_close(out["audio_embeds"], reference, atol=ATOL, rtol=RTOL)
        counts = [num_audio_tokens(int(n)) for n in mel.feature_lens]
        assert out["audio_token_counts"] == counts and out["audio_embeds"].shape == (sum(counts), 32)
        assert "audio" not in out and {k: v for k, v in out.items() if not k.startswith(("audio", "token"))} == \
            {k: v for k, v in payload.items() if k not in ("audio", "token_ids")}
        # The thinker accepts the expanded prompt: block sizes check out and every placeholder is filled.
        ids = torch.tensor([out["token_ids"]])
        get_rope_index(ids, CFG.thinker, audio_feature_lens=mel.feature_lens)
        thinker.embed(ids, out["audio_embeds"])
    assert run(runner, text_only)[0] is text_only  # NOTE: no forward, no copy


def test_precomputed_features_and_exact_placeholder_counts(runner: AudioEncoderRunner) -> None:
    clip = pcm(1.7, 4)
    mel = LogMelFrontEnd(num_mel_bins=CFG.thinker.audio.num_mel_bins)([clip])
    from_pcm = run(runner, {"token_ids": prompt(1), "audio": [clip]})[0]
    count = from_pcm["audio_token_counts"][0]
    exact = prompt(0)[:3] + [TINY_IDS["audio_start"]] + [TINY_IDS["audio"]] * count + [TINY_IDS["audio_end"]] \
        + prompt(0)[3:]
    from_features = run(runner, {"token_ids": exact, "audio": [{"features": mel.features[0].numpy()}]})[0]
    assert from_features["token_ids"] == from_pcm["token_ids"] == exact
    assert torch.equal(from_features["audio_embeds"], from_pcm["audio_embeds"])


def test_empty_audio_list_is_dropped(runner: AudioEncoderRunner) -> None:
    assert run(runner, {"token_ids": prompt(0), "audio": []}) == [{"token_ids": prompt(0)}]


GOOD = pcm(1.0, 5)
BAD_CASES = [
    ({"token_ids": prompt(1), "audio": [GOOD.astype(np.float64)]}, "payload.audio[0]: samples must be float32"),
    ({"token_ids": prompt(2), "audio": [GOOD, GOOD.reshape(2, -1)]}, "payload.audio[1]: must be 1-D"),
    ({"token_ids": prompt(1), "audio": [GOOD[:0]]}, "payload.audio[0]: has 0 samples"),
    ({"token_ids": prompt(1), "audio": [pcm(5.01, 6)]}, "payload.audio[0]: has 80160 samples"),
    ({"token_ids": prompt(1), "audio": [np.where(GOOD > 0.5, np.nan, GOOD).astype(np.float32)]},
     "payload.audio[0]: has non-finite values"),
    ({"token_ids": prompt(1), "audio": [GOOD, GOOD]}, "payload.audio: 2 clips, but payload.token_ids has 1"),
    ({"token_ids": prompt(1), "audio": [GOOD.tolist()]}, "payload.audio[0]: must be a float32 array"),
    ({"token_ids": prompt(1), "audio": [{"features": np.zeros((8, 100), np.float32)}]},
     "payload.audio[0].features: must be [16, frames]"),
    ({"token_ids": prompt(1), "audio": GOOD}, "payload.audio: must be a list"),
    ({"audio": [GOOD]}, "payload.token_ids: with audio"),
    ({"token_ids": prompt(1)}, "payload.audio: the prompt has audio blocks"),
    ({"token_ids": prompt(1)[:3] + [TINY_IDS["audio"]] + prompt(0)[3:], "audio": [GOOD]}, "payload.token_ids[3]"),
    ({"token_ids": prompt(1)[:5] + BLOCK[1:] + prompt(0)[3:], "audio": [GOOD]}, "audio block 0 has 2 placeholders"),
]


@pytest.mark.parametrize(("payload", "needle"), BAD_CASES)
def test_malformed_input_is_refused_at_admission(runner: AudioEncoderRunner, payload: Any, needle: str) -> None:
    with pytest.raises(AdmissionError) as exc:
        runner.admit(new(payload))
    assert needle in str(exc.value)


def test_streams_are_refused(runner: AudioEncoderRunner) -> None:
    with pytest.raises(AdmissionError, match="entry stage"):
        runner.admit(WorkItem("r", WorkKind.NEW, {}, is_stream=True))


def test_factory_builds_the_runner_and_names_bad_arguments() -> None:
    from voice_server.config import PipelineConfig, StageConfig
    from voice_server.config.errors import ConfigError
    from voice_server.engine.runtime import StageContext
    from voice_server.stages.audio_encoder import create_audio_encoder

    def build(scheduler: str = "simple", **args: Any) -> AudioEncoderRunner:
        stage = StageConfig(name="encoder", factory="voice_server.stages.audio_encoder:create_audio_encoder",
                            scheduler=scheduler, terminal=True,
                            factory_args={"preset": "tiny", "num_threads": 1, **args})
        return create_audio_encoder(StageContext(stage, PipelineConfig(name="t", stages=(stage,)), None, "t"))

    assert build(max_audio_seconds=2).config.max_num_samples == 32000
    assert build().config.max_audio_seconds == 600
    with pytest.raises(ConfigError, match="factory_args.max_audio_seconds"):
        build(max_audio_seconds=0)
    with pytest.raises(ConfigError, match="factory_args.max_audio_secs"):
        build(max_audio_secs=3)
    with pytest.raises(ConfigError, match="'scheduler'"):
        build(scheduler="ar")


def test_chat_messages_become_the_prompt_the_thinker_reads() -> None:
    # NOTE: the session layer's requests: the chat template lays out roles, one audio block per spoken
    # turn and the assistant's opening; the result equals sending those token ids and clips directly.
    from voice_server.stages.audio_encoder import _chat

    tower = load_part("audio_tower", CFG, load_format="dummy", seed=0)
    assert isinstance(tower, AudioEncoder)
    chat_runner = AudioEncoderRunner(tower, AudioEncoderRunnerConfig.from_thinker(CFG.thinker, 5),
                                     lambda messages: _chat(messages, CFG, tiny_encode))
    clip = pcm(1.2, 7)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "", "audio": clip},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}]
    token_ids, clips = chat_prompt(messages, CFG, tiny_encode)
    ids = TINY_IDS
    assert token_ids[:3] == [ids["im_start"], ids["system"], 10] and token_ids[-3:] == [ids["im_start"],
                                                                                       ids["assistant"], 10]
    assert token_ids.count(ids["audio"]) == 1 and len(clips) == 1
    via_chat = run(chat_runner, {"messages": messages, "sampling": {"max_tokens": 3}})[0]
    direct = run(chat_runner, {"token_ids": token_ids, "audio": [clip], "sampling": {"max_tokens": 3}})[0]
    assert via_chat["token_ids"] == direct["token_ids"] and via_chat["sampling"] == {"max_tokens": 3}
    torch.testing.assert_close(torch.as_tensor(via_chat["audio_embeds"]), torch.as_tensor(direct["audio_embeds"]))
    with pytest.raises(AdmissionError, match="only user turns carry audio"):
        chat_runner.admit(new({"messages": [{"role": "assistant", "content": "", "audio": clip}]}))
    with pytest.raises(AdmissionError, match="no tokenizer"):
        AudioEncoderRunner(tower, AudioEncoderRunnerConfig.from_thinker(CFG.thinker, 5)).admit(
            new({"messages": messages}))
