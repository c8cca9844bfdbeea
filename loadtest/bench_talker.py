"""One Talker + MTP frame of the tiny preset: our fused `Talker.step` vs the transformers reference.

Per frame the reference does what `Qwen3OmniMoeTalkerForConditionalGeneration.generate` does: a fresh
`code_predictor.generate` for codes 1..G-1, the feedback sum, one talker decode pass and the logits
processors (repetition penalty 1.05, suppressed control ids) + argmax for code 0. A third row times whole
`talker.generate` calls (their own loop overhead included) divided by the frames they produce. Both
implementations load one seeded state dict and run greedy; the bench checks they emit the same codes.
1 thread, fp32, CPU.

Usage: python loadtest/bench_talker.py [--frames 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from voice_server.models.layers import KVCache  # noqa: E402
from voice_server.models.qwen3_omni.presets import tiny_config_dict  # noqa: E402
from voice_server.models.qwen3_omni.talker.config import TalkerConfig  # noqa: E402
from voice_server.models.qwen3_omni.talker.model import Talker  # noqa: E402

PREFILL_LEN = 12


def _build(seed: int = 0) -> tuple[Talker, Any]:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    d = tiny_config_dict()["talker_config"]
    hf = Qwen3OmniMoeTalkerForConditionalGeneration(Qwen3OmniMoeTalkerConfig(**d)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(hf.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if name.endswith("norm.weight") else (r if "embedding" in name else 0.3 * r))
    ours = Talker(TalkerConfig.from_hf_dict(d)).eval()
    ours.load_state_dict(hf.state_dict())
    return ours, hf


def _stats(name: str, times: list[float], base: float | None) -> dict[str, Any]:
    mean_ms, median_ms = 1e3 * statistics.fmean(times), 1e3 * statistics.median(times)
    return {"impl": name, "frames": len(times), "mean_ms": mean_ms, "median_ms": median_ms,
            "ratio_vs_ours": 1.0 if base is None else mean_ms / base}


@torch.no_grad()
def _ours(talker: Talker, prefill: torch.Tensor, text: torch.Tensor, num_frames: int) -> tuple[list, list]:
    kv = KVCache(len(talker.model.layers))
    seen = torch.zeros(1, talker.cfg.vocab_size, dtype=torch.bool)
    out = talker.step(prefill, torch.arange(PREFILL_LEN)[None], kv, text[0], seen)
    codes, times = [out.codes], []
    for i in range(num_frames):
        t0 = time.perf_counter()
        out = talker.step(out.next_input_embeds, torch.tensor([[PREFILL_LEN + i]]), kv, text[i + 1], seen)
        times.append(time.perf_counter() - t0)
        codes.append(out.codes)
    return times, codes


@torch.no_grad()
def _reference(hf: Any, prefill: torch.Tensor, text: torch.Tensor, num_frames: int) -> tuple[list, list]:
    from transformers.cache_utils import DynamicCache
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    cfg = hf.config
    vocab = cfg.text_config.vocab_size
    suppress = [i for i in range(vocab - 1024, vocab) if i != cfg.codec_eos_token_id]
    processors = [RepetitionPenaltyLogitsProcessor(1.05), SuppressTokensLogitsProcessor(suppress)]
    generated = torch.zeros(1, 0, dtype=torch.long)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        nonlocal generated
        scores = logits[:, -1].float()
        for proc in processors:
            scores = proc(generated, scores)
        code0 = scores.argmax(-1, keepdim=True)
        generated = torch.cat((generated, code0), dim=1)
        return code0

    cache = DynamicCache(config=cfg.text_config)
    out = hf(inputs_embeds=prefill, cache=cache, use_cache=True, output_hidden_states=True)
    code0, hidden = pick(out.logits), out.hidden_states[0][-1][:, -1:]
    codes, times = [], []
    for i in range(num_frames + 1):
        t0 = time.perf_counter()
        last_id_hidden = hf.get_input_embeddings()(code0)
        pred = hf.code_predictor.generate(
            inputs_embeds=torch.cat((hidden, last_id_hidden), dim=1), max_new_tokens=cfg.num_code_groups - 1,
            do_sample=False, output_hidden_states=True, return_dict_in_generate=True,
        )
        mids = [h[0] for h in pred.hidden_states[1:]]
        last = hf.code_predictor.get_input_embeddings()[-1](pred.sequences[..., -1:])
        codes.append(torch.cat((code0, pred.sequences), dim=-1))
        if i == num_frames:
            break
        embeds = torch.cat([last_id_hidden, *mids, last], dim=1).sum(1, keepdim=True) + text[i][:, None]
        out = hf(inputs_embeds=embeds, cache=cache, use_cache=True, output_hidden_states=True, generation_step=i)
        code0, hidden = pick(out.logits), out.hidden_states[0][-1][:, -1:]
        times.append(time.perf_counter() - t0)  # one frame: MTP + feedback + talker pass + pick
    return times, codes


@torch.no_grad()
def _reference_generate(hf: Any, prefill: torch.Tensor, text: torch.Tensor, num_frames: int) -> list[float]:
    times = []
    for max_new in (2, num_frames + 1):
        t0 = time.perf_counter()
        hf.generate(inputs_embeds=prefill, trailing_text_hidden=text.transpose(0, 1), tts_pad_embed=text[-1:],
                    max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, repetition_penalty=1.05,
                    output_hidden_states=True, return_dict_in_generate=True)
        times.append(time.perf_counter() - t0)
    # NOTE: the difference removes the prefill and first frame, leaving num_frames - 1 decode frames.
    per_frame = (times[1] - times[0]) / (num_frames - 1)
    return [per_frame] * (num_frames - 1)


def _best_round(rounds: list[list[float]]) -> list[float]:
    # NOTE: on a shared CPU the quietest round (lowest median) is the least contaminated measurement.
    return min(rounds, key=statistics.median)


def run(num_frames: int = 32, num_rounds: int = 3) -> list[dict[str, Any]]:
    if num_frames < 2:
        raise ValueError(f"num_frames must be >= 2, got {num_frames}")
    torch.set_num_threads(1)
    ours, hf = _build()
    g = torch.Generator().manual_seed(1)
    hidden = ours.cfg.hidden_size
    prefill = torch.randn(1, PREFILL_LEN, hidden, generator=g)
    text = torch.randn(num_frames + 1, 1, hidden, generator=g)  # text vector per decode step
    _ours(ours, prefill, text, num_frames)  # warm-up
    _reference(hf, prefill, text, num_frames)
    our_rounds, ref_rounds, gen_rounds = [], [], []
    for _ in range(num_rounds):  # interleaved, so load spikes hit every implementation alike
        our_times, our_codes = _ours(ours, prefill, text, num_frames)
        ref_times, ref_codes = _reference(hf, prefill, text, num_frames)
        if not all(torch.equal(a, b) for a, b in zip(our_codes, ref_codes, strict=True)):
            raise AssertionError("our fused step and the transformers reference emitted different codes")
        our_rounds.append(our_times)
        ref_rounds.append(ref_times)
        gen_rounds.append(_reference_generate(hf, prefill, text, num_frames))
    our_best = _best_round(our_rounds)
    base = 1e3 * statistics.fmean(our_best)
    return [
        _stats("ours: Talker.step (fused)", our_best, None),
        _stats("transformers: talker fwd + code_predictor.generate", _best_round(ref_rounds), base),
        _stats("transformers: talker.generate per frame", _best_round(gen_rounds), base),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = run(args.frames, args.rounds)
    print(f"tiny preset talker+MTP frame step, {args.frames} frames, best of {args.rounds} rounds, "
          "1 thread, fp32, CPU")
    print(f"{'impl':<52} {'frames':>6} {'mean ms':>9} {'median ms':>10} {'x ours':>7}")
    for r in rows:
        print(f"{r['impl']:<52} {r['frames']:>6} {r['mean_ms']:>9.3f} {r['median_ms']:>10.3f} "
              f"{r['ratio_vs_ours']:>7.2f}")


if __name__ == "__main__":
    main()
