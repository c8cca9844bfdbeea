"""Talker prefill layout, fused step and an 8-frame greedy rollout against transformers' full
`Qwen3OmniMoeForConditionalGeneration.generate` (fp32, tiny preset).

The HF thinker is replaced by a fixed `generate` result (random embeddings / hidden states for a known
token sequence), so the reference glue (`_get_talker_user_parts`, `_get_talker_assistant_parts`, role
masks, trailing text) and `talker.generate` (code predictor per frame, feedback sum, repetition penalty,
suppressed ids) run unmodified on inputs we also give to our builder.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict
from voice_server.models.qwen3_omni.talker.config import TalkerConfig
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.prefill import TurnTokenIds, build_talker_prefill
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.turn import generate_frames

torch.set_num_threads(1)
ATOL = 1e-4
NUM_PASSES = 9  # talker passes: prefill + 8 decode steps -> 8 complete frames in HF
IDS = TINY_IDS


def conversation() -> tuple[list[int], list[int]]:
    """(prompt, reply): system turn, user turn with audio, an earlier assistant turn, a text user turn."""
    system = [IDS["im_start"], IDS["system"], 10, 30, 31, IDS["im_end"], 10]
    audio = [IDS["audio_start"], IDS["audio"], IDS["audio"], IDS["audio"], IDS["audio_end"]]
    user1 = [IDS["im_start"], IDS["user"], 10, *audio, 20, 21, 22, IDS["im_end"], 10]
    history = [IDS["im_start"], IDS["assistant"], 10, 40, 41, IDS["im_end"], 10]
    user2 = [IDS["im_start"], IDS["user"], 10, 23, 24, IDS["im_end"], 10]
    prompt = system + user1 + history + user2 + [IDS["im_start"], IDS["assistant"], 10]
    reply = [50, 51, 52, 53, 54, 55, IDS["im_end"]]
    return prompt, reply


def seeded_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if name.endswith("norm.weight") else (r if "embed" in name else 0.3 * r))


class HFRun:
    """One HF `generate` with the thinker replaced by a fixed result; records the talker's inputs."""

    def __init__(self, seed: int, is_sampled: bool = False) -> None:
        d = tiny_config_dict()
        self.model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**d)).eval()
        seeded_(self.model, seed)
        prompt, reply = conversation()
        self.prompt_len = len(prompt)
        self.sequences = torch.tensor([prompt + reply])
        num_fed = self.sequences.shape[1] - 1  # the last generated token is never fed to the thinker
        g = torch.Generator().manual_seed(seed + 1)
        width = d["thinker_config"]["text_config"]["hidden_size"]
        self.embed = torch.randn(1, num_fed, width, generator=g)
        self.hidden = torch.randn(1, num_fed, width, generator=g)
        steps = [(0, self.prompt_len)] + [(j, j + 1) for j in range(self.prompt_len, num_fed)]
        hidden_states = tuple(
            (self.embed[:, a:b], self.hidden[:, a:b], torch.zeros(1, b - a, width)) for a, b in steps
        )
        self.model.thinker.generate = lambda **_: SimpleNamespace(  # type: ignore[method-assign]
            sequences=self.sequences, hidden_states=hidden_states
        )
        self.talker_kwargs: dict[str, Any] = {}
        self.talker_inputs: list[torch.Tensor] = []
        talker_generate = self.model.talker.generate

        def record_generate(**kwargs: Any) -> Any:
            self.talker_kwargs.update(kwargs)
            self.talker_kwargs["result"] = talker_generate(**kwargs)
            return self.talker_kwargs["result"]

        self.model.talker.generate = record_generate  # type: ignore[method-assign]
        self.model.talker.model.register_forward_pre_hook(
            lambda _m, _a, kw: self.talker_inputs.append(kw["inputs_embeds"]), with_kwargs=True
        )
        # NOTE: HF samples code 0 and the residual codes from the global generator, in the same order
        # as `Talker.step` (code 0 of frame i, then its codes 1..G-1), so one seed gives one rollout.
        torch.manual_seed(seed)
        with torch.no_grad():
            self.model.generate(
                input_ids=self.sequences[:, : self.prompt_len], speaker="Ethan", thinker_eos_token_id=IDS["im_end"],
                talker_max_new_tokens=NUM_PASSES, talker_do_sample=is_sampled,
            )
        result = self.talker_kwargs["result"]
        self.code0 = result.sequences[0]  # [passes]
        self.frames = torch.cat([h[-1] for h in result.hidden_states if h[-1] is not None])  # [frames, G]


@pytest.fixture(scope="module")
def run() -> HFRun:
    return HFRun(seed=8)  # a seed where the 1.05 repetition penalty changes the greedy rollout


def build_ours(run: HFRun) -> tuple[Talker, Any]:
    d = tiny_config_dict()
    talker = Talker(TalkerConfig.from_hf_dict(d["talker_config"])).eval()
    talker.load_state_dict(run.model.talker.state_dict())
    ids = TurnTokenIds.from_hf_dict(d)
    tts_embeds = run.model.thinker.get_input_embeddings()(torch.tensor(ids.tts_special_ids))
    num_fed = run.embed.shape[1]
    prefill = build_talker_prefill(
        talker, ids, run.sequences[0, :num_fed], run.prompt_len, run.embed[0], run.hidden[0], tts_embeds, "Ethan"
    )
    return talker, prefill


def test_prefill_tensors_match_hf(run: HFRun) -> None:
    _, prefill = build_ours(run)
    kw = run.talker_kwargs
    # user turns only: 13 + 7 positions (system turn and the earlier assistant turn dropped), + 9 assistant.
    assert prefill.inputs_embeds.shape == kw["inputs_embeds"].shape == (1, 13 + 7 + 9, 16)
    assert torch.equal(prefill.input_ids, kw["talker_input_ids"])
    assert (prefill.inputs_embeds - kw["inputs_embeds"]).abs().max().item() <= ATOL
    assert (prefill.trailing_text - kw["trailing_text_hidden"]).abs().max().item() <= ATOL
    assert (prefill.tts_pad - kw["tts_pad_embed"]).abs().max().item() <= ATOL
    # reply tokens 2..6 (the EOS is generated but never fed, so it is not talker text) + tts_eos
    assert prefill.trailing_text.shape[1] == 6
    assert torch.equal(prefill.positions, torch.arange(29).expand(3, 1, -1))


def test_greedy_rollout_codes_and_feedback_match_hf(run: HFRun) -> None:
    talker, prefill = build_ours(run)
    frames = generate_frames(talker, prefill, max_frames=NUM_PASSES)
    assert run.frames.shape == (NUM_PASSES - 1, 4)  # no EOS in this seed: 8 complete frames
    ours = torch.cat([f.codes for f in frames])
    assert torch.equal(ours[: NUM_PASSES - 1], run.frames)
    assert torch.equal(ours[:, 0], run.code0[: len(frames)])
    # The next talker input (sum of the frame's G codebook embeddings + text vector) per decode pass.
    for i in range(NUM_PASSES - 1):
        ref = run.talker_inputs[i + 1]
        assert (frames[i].next_input_embeds - ref).abs().max().item() <= ATOL
    # The repetition penalty mattered: some code 0 repeats, and dropping the penalty changes the rollout.
    assert len(set(ours[:, 0].tolist())) < len(frames)


def test_sampled_rollout_matches_hf_with_same_seed() -> None:
    hf = HFRun(seed=8, is_sampled=True)
    talker, prefill = build_ours(hf)
    gen = torch.Generator().manual_seed(8)
    frames = generate_frames(talker, prefill, NUM_PASSES, TalkerSampling.hf_sampling(), gen)
    ours = torch.cat([f.codes for f in frames])
    assert len(hf.frames) >= 4
    assert torch.equal(ours[: len(hf.frames)], hf.frames)
    greedy = torch.cat([f.codes for f in generate_frames(talker, prefill, NUM_PASSES)])
    assert not torch.equal(ours[: len(greedy)], greedy[: len(ours)])  # sampling really changed the codes


def test_rollout_without_penalty_differs(run: HFRun) -> None:
    talker, prefill = build_ours(run)
    plain = generate_frames(talker, prefill, NUM_PASSES, TalkerSampling(repetition_penalty=1.0))
    default = generate_frames(talker, prefill, NUM_PASSES)
    assert [f.codes.tolist() for f in plain] != [f.codes.tolist() for f in default]


def test_prefill_rejects_prompt_without_assistant_turn(run: HFRun) -> None:
    talker, _ = build_ours(run)
    ids = TurnTokenIds.from_hf_dict(tiny_config_dict())
    tokens = run.sequences[0, :10]
    with pytest.raises(ValueError, match="assistant"):
        build_talker_prefill(talker, ids, tokens, 10, run.embed[0, :10], run.hidden[0, :10],
                             torch.zeros(3, 32), "Ethan")
