"""Entry points refuse inputs of the wrong layout with a message that says which layout they expect."""

from __future__ import annotations

import pytest
import torch

from voice_server.models.layers import KVCache
from voice_server.models.llama import LlamaConfig, LlamaForCausalLM
from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.shapes import FLOATING, INTEGER, expect_shape, expect_shapes

LONG = torch.long
CFG = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())


def test_expect_shape_message_names_layout_dtype_and_what_came() -> None:
    with pytest.raises(ValueError, match=r"^input_ids: expected \[B, L\] int64, got shape \(3,\) float32$"):
        expect_shape("input_ids", torch.zeros(3), "[B, L]", LONG)
    with pytest.raises(ValueError, match=r"^x: expected a tensor \[B\] floating, got list$"):
        expect_shape("x", [1.0], "[B]", FLOATING)
    with pytest.raises(ValueError, match=r"positions: expected \[B, L\] int64 with B=2, L=3, got shape \(2, 4\) int64"):
        expect_shapes(("input_ids", torch.zeros(2, 3, dtype=LONG), "[B, L]", LONG),
                      ("positions", torch.zeros(2, 4, dtype=LONG), "[B, L]", LONG))
    with pytest.raises(ValueError, match=r"expected \[3, B, L\] integer, got shape \(2, 1, 4\)"):
        expect_shape("position_ids", torch.zeros(2, 1, 4, dtype=LONG), "[3, B, L]", INTEGER)
    dims = expect_shape("p", torch.zeros(3, 2, 5, dtype=torch.int32), "[B, L] | [3, B, L]", INTEGER)
    assert dims == {"B": 2, "L": 5}
    assert expect_shapes(("mask", None, "[B, Lk]", torch.bool), dims={"H": 4}) == {"H": 4}


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    ("ids", "positions", "message"),
    [
        (torch.arange(3), torch.arange(3), r"input_ids: expected \[B, L\] int64, got shape \(3,\) int64"),
        (torch.zeros(1, 3), torch.arange(3)[None], r"input_ids: expected \[B, L\] int64, got shape \(1, 3\) float32"),
        (torch.arange(3)[None], torch.arange(4)[None], r"positions: expected \[B, L\] int64 with B=1, L=3"),
    ],
)
def test_llama_forward_checks_input_layout(
    llama: LlamaForCausalLM, ids: torch.Tensor, positions: torch.Tensor, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llama(ids, positions, KVCache(1))


def test_qwen3_omni_entry_points_check_input_layout() -> None:
    with torch.device("meta"):  # the checks run before any compute; meta keeps the models free to build
        thinker, talker, code2wav = ThinkerModel(CFG.thinker), Talker(CFG.talker), Code2Wav(CFG.code2wav)
        encoder = AudioEncoder(CFG.thinker.audio)
    ids = torch.zeros(1, 4, dtype=LONG)
    # NOTE: positions are int64, or float32 after a video whose frame times are fractional (as transformers has them)
    with pytest.raises(ValueError, match=r"position_ids: expected \[3, B, L\] int64/float32 with B=1, L=4, got "
                                         r"shape \(1, 4\)"):
        thinker(ids, torch.zeros(1, 4, dtype=LONG))
    hidden = CFG.talker.hidden_size
    with pytest.raises(ValueError, match=rf"inputs_embeds: expected \[B, L, H\] floating with H={hidden}"):
        talker(torch.zeros(1, 4, hidden + 1), torch.zeros(1, 4, dtype=LONG), None)
    with pytest.raises(ValueError, match=r"positions: expected \[B, L\] \| \[3, B, L\] int64/float32 with B=1, L=4"):
        talker(torch.zeros(1, 4, hidden), torch.zeros(2, 1, 4, dtype=LONG), None)
    with pytest.raises(ValueError, match=r"text_vec: expected \[B, H\] \| \[B, 1, H\] floating with B=1"):
        talker.step(torch.zeros(1, 4, hidden), torch.zeros(1, 4, dtype=LONG), KVCache(1), torch.zeros(2, hidden))
    with pytest.raises(ValueError, match=r"talker_hidden: expected \[B, H\] floating"):
        talker.code_predictor.fill(torch.zeros(1, 1, hidden), torch.zeros(1, hidden))
    groups = CFG.code2wav.num_quantizers
    wrong_groups = rf"codes: expected \[B, G, T\] int64 with G={groups}, got shape \(1, {groups + 1}, 5\)"
    with pytest.raises(ValueError, match=wrong_groups):
        code2wav(torch.zeros(1, groups + 1, 5, dtype=LONG))
    state = code2wav.new_stream_state(batch_size=2)
    with pytest.raises(ValueError, match=rf"codes: expected \[B, G, T\] int64 with B=2, G={groups}, got shape \(1, "):
        code2wav.decode_chunk(torch.zeros(1, groups, 5, dtype=LONG), state)
    mels = CFG.thinker.audio.num_mel_bins
    wrong_mels = rf"input_features: expected \[num_mel_bins, T\] floating with num_mel_bins={mels}"
    with pytest.raises(ValueError, match=wrong_mels):
        encoder(torch.zeros(mels + 1, 100), torch.tensor([100]))
    with pytest.raises(ValueError, match=r"feature_lens: expected \[num_clips\] integer, got shape \(\) int64"):
        encoder(torch.zeros(mels, 100), torch.tensor(100))
