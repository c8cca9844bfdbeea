"""Several independent Code2Wav streams decoded in one forward, without touching their states.

`decode_chunk` lock-steps the rows of one state (one position for all). Streams of a server start
and end at different times, but in steady state they still line up: the same number of new frames,
a KV cache trimmed to the same window, the same conv context length and the same emission offset
inside it (`step_key`). Only their RoPE positions differ, which `decode_chunk(start_pos=...)` takes
per row. So streams with equal keys are stacked into one state, decoded once, and split back.

`decode_streams` never mutates the states it is given (a step that raises can be re-run as is):
the stacked state is new tensors, and for a single stream a shallow copy suffices because
`decode_chunk` only ever rebinds the state's tensors (cache `cat`, slicing), never writes into them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from voice_server.models.layers import KVCache
from voice_server.models.qwen3_omni.code2wav.streaming import Code2WavStreamState, decode_chunk

if TYPE_CHECKING:
    from voice_server.models.qwen3_omni.code2wav.model import Code2Wav

StepKey = tuple[int, int, int, int, bool]


def step_key(state: Code2WavStreamState, num_new_frames: int, is_last: bool, upsample: int) -> StepKey:
    """Streams whose keys are equal run the same computation but for RoPE positions: new frames,
    cached frames, conv context frames, first sample to emit inside that context, and `is_last`
    (the number of emitted samples follows from these)."""
    num_context = 0 if state.hidden_context is None else int(state.hidden_context.shape[-1])
    first = state.num_samples_emitted - (state.num_frames - num_context) * upsample
    return (num_new_frames, state.kv_cache.seq_len, num_context, first, is_last)


def _copy(state: Code2WavStreamState) -> Code2WavStreamState:
    cache = KVCache(state.kv_cache.num_layers, list(state.kv_cache.keys), list(state.kv_cache.values))
    return dataclasses.replace(state, kv_cache=cache)


def _stack(states: list[Code2WavStreamState]) -> Code2WavStreamState:
    first = states[0]
    cache = KVCache(first.kv_cache.num_layers)
    for i in range(cache.num_layers):
        keys, values = [s.kv_cache.keys[i] for s in states], [s.kv_cache.values[i] for s in states]
        if all(k is not None for k in keys) and all(v is not None for v in values):
            cache.keys[i] = torch.cat([k for k in keys if k is not None])
            cache.values[i] = torch.cat([v for v in values if v is not None])
    contexts = [s.hidden_context for s in states]
    hidden = torch.cat([c for c in contexts if c is not None]) if contexts[0] is not None else None
    # NOTE: the row-0 counters stand for all rows: the emission arithmetic only uses differences
    # that `step_key` made equal; each row's own counters are restored in `_split`.
    return dataclasses.replace(first, batch_size=len(states), kv_cache=cache, hidden_context=hidden)


def _split(stacked: Code2WavStreamState, states: list[Code2WavStreamState]) -> list[Code2WavStreamState]:
    num_new_frames = stacked.num_frames - states[0].num_frames
    num_new_samples = stacked.num_samples_emitted - states[0].num_samples_emitted
    out = []
    for row, old in enumerate(states):
        cache = KVCache(stacked.kv_cache.num_layers)
        for i in range(cache.num_layers):
            k, v = stacked.kv_cache.keys[i], stacked.kv_cache.values[i]
            cache.keys[i] = None if k is None else k[row : row + 1]
            cache.values[i] = None if v is None else v[row : row + 1]
        hidden = None if stacked.hidden_context is None else stacked.hidden_context[row : row + 1]
        out.append(dataclasses.replace(
            old, kv_cache=cache, hidden_context=hidden, num_frames=old.num_frames + num_new_frames,
            num_samples_emitted=old.num_samples_emitted + num_new_samples, is_finished=stacked.is_finished,
        ))
    return out


@torch.no_grad()
def decode_streams(
    model: Code2Wav, codes: torch.Tensor, states: list[Code2WavStreamState], is_last: bool
) -> tuple[torch.Tensor, list[Code2WavStreamState]]:
    """codes [B, G, T_new] of B one-row streams with equal `step_key`s -> (pcm [B, n], new states).

    The given states are left as they were."""
    if not states or codes.shape[0] != len(states) or any(s.batch_size != 1 for s in states):
        raise ValueError(f"decode_streams: {codes.shape[0]} code rows for {len(states)} one-row states")
    upsample = model.total_upsample
    keys = {step_key(s, codes.shape[-1], is_last, upsample) for s in states}
    if len(keys) != 1 or len({(s.left_context_frames, s.lookahead_samples) for s in states}) != 1:
        raise ValueError(f"decode_streams: states do not line up: {sorted(keys)}")
    if len(states) == 1:
        pcm, state = decode_chunk(model, codes, _copy(states[0]), is_last)
        return pcm, [state]
    start_pos = torch.tensor([s.num_frames for s in states], dtype=torch.long, device=codes.device)
    pcm, stacked = decode_chunk(model, codes, _stack(states), is_last, start_pos=start_pos)
    return pcm, _split(stacked, states)
