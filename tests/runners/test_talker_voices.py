"""Qwen3-Omni's voices at the talker: `params.talker.speaker` (what a pipeline's voice sends) chooses the speaker
token of each request's prefill, an unknown one is refused at admission, and the talker stage refuses a pipeline
whose voices name a speaker the model lacks before loading any weight."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from talker_streams import CFG, models, thinker_chunks

from voice_server.config import ConfigError, VoiceConfig, load_pipeline
from voice_server.engine.runtime import StageContext
from voice_server.models.qwen3_omni.presets import tiny_prompt_ids
from voice_server.models.qwen3_omni.turn import run_greedy_thinker, turn_token_ids
from voice_server.runners.talker_runner import TalkerRunner, TalkerRunnerConfig
from voice_server.scheduling import AdmissionError, WorkItem, WorkKind
from voice_server.stages.omni_parts import preset_config
from voice_server.stages.talker import check_voice_speakers, create_talker

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen3-omni-tiny.yaml"


def test_the_speaker_param_chooses_the_prefills_speaker_and_an_unknown_one_is_refused() -> None:
    # NOTE: what is checked is the talker's input, not its codes: the tiny talker's dummy weights make the same
    # codes for either speaker (greedy or sampled), so the codes could not tell whether the choice arrived.
    thinker, talker = models()
    config = TalkerRunnerConfig(budget_bytes=256 << 20, thinker_hidden_size=32, page_size=4, decode_graphs="off")
    runner = TalkerRunner(talker, turn_token_ids(CFG), config)
    prompt = tiny_prompt_ids(num_user_text=5)
    turn = run_greedy_thinker(thinker, torch.tensor([prompt]), CFG.talker.accept_hidden_layer, 10**6, 6)
    chunks = thinker_chunks(thinker, turn, len(prompt))
    for rid, speaker in (("ethan", "ethan"), ("chelsie", "Chelsie"), ("default", None)):
        talker_params = {"max_frames": 12, **({"speaker": speaker} if speaker else {})}
        runner.admit(WorkItem(rid, WorkKind.NEW, {}, {"talker": talker_params}, is_stream=True))
        for k, chunk in enumerate(chunks[:2]):  # NOTE: the prefill is built once the second reply token is in
            runner.admit(WorkItem(rid, WorkKind.CHUNK, chunk, seq=k))
    prefills = {rid: feed.prefill for rid, feed in runner.feeds.items()}
    assert all(p is not None for p in prefills.values())
    ethan, chelsie, default = prefills["ethan"], prefills["chelsie"], prefills["default"]
    assert ethan is not None and chelsie is not None and default is not None
    rows = (ethan != chelsie).any(dim=-1).nonzero().flatten().tolist()
    assert len(rows) == 1, "the speakers' prefills differ in the speaker's row alone"
    codec = talker.model.codec_embedding.weight
    speaker_rows = codec[CFG.talker.speaker_token_id("ethan")] - codec[CFG.talker.speaker_token_id("chelsie")]
    assert torch.allclose(ethan[rows[0]] - chelsie[rows[0]], speaker_rows)
    assert torch.equal(default, ethan), "the runner's default speaker is ethan"
    with pytest.raises(AdmissionError, match=r"params.talker.speaker: must be one of chelsie, ethan, got 'aiden'"):
        runner.admit(WorkItem("x", WorkKind.NEW, {}, {"talker": {"speaker": "aiden"}}, is_stream=True))


def test_the_talker_stage_checks_the_voices_against_the_models_speakers() -> None:
    cfg = load_pipeline(TINY)
    names = [name for name, _ in preset_config("tiny-full-rate").talker.speaker_ids]
    check_voice_speakers(cfg, names)  # the shipped tiny config names the preset's speakers
    aiden = dataclasses.replace(cfg, voices=(*cfg.voices, VoiceConfig("aiden", {"talker": {"speaker": "aiden"}})))
    with pytest.raises(ConfigError, match=r"^pipeline 'qwen3-omni-tiny': field 'voices.aiden.params.talker.speaker': "
                                          r"must be one of the model's speakers \(chelsie, ethan\), got 'aiden'"):
        create_talker(StageContext(aiden.stage("talker"), aiden, None, "test"))
    pitch = dataclasses.replace(cfg, voices=tuple(dataclasses.replace(v, params={"talker": {"pitch": 2}})
                                                  for v in cfg.voices))
    with pytest.raises(ConfigError, match=r"field 'voices.ethan.params.talker': must be a mapping with at most "
                                          r"speaker and max_frames"):
        check_voice_speakers(pitch, names)
