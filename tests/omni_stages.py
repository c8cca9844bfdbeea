"""Test stages around the Qwen3-Omni stages, run in real stage processes.

- `create_recorder`: a terminal stage that reports what it received from the stage before it (every
  payload key as it arrived through the relay), standing in for the thinker behind the encoder.
- `create_code_streamer`: an upstream that streams codec frames (what the talker sends) into a
  `code2wav` stage, so the vocoder runs in a real pipeline. `code_frames(num_frames, seed)` gives the
  frames a request asks for, so a test can decode them whole and compare. `bad_chunk` makes one
  chunk's codes out of range (admission must refuse that request alone); `chunk_delay_ms` spaces
  the chunks.
- `create_scripted_thinker`: the Qwen3-Omni thinker stage whose picks are a request's `params.script` (reply
  token ids, its EOS last): the step runs as ever (forward, detokenizer, talker feed) with the logits pinned
  to the script, so a test chooses the reply (e.g. a tool call) that random weights never write. Its
  checkpoint folder needs the toy `tokenizer.json` of `write_toy_tokenizer` (the tiny vocabulary has none;
  no Qwen tokenizer is installed), which spells `REPLY_TEXT` and Qwen's tool-call tags as single tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel

from voice_server.engine.runtime import StageContext
from voice_server.models.llama.tokenizer import bytes_to_unicode
from voice_server.models.paged import AttentionContext
from voice_server.models.qwen3_omni.presets import TINY_CODEBOOK, TINY_IDS, TINY_NUM_CODE_GROUPS, TINY_TEXT_VOCAB
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.runners.ar_config import DecoderRunnerConfig
from voice_server.runners.thinker_runner import ThinkerRunner
from voice_server.scheduling import Emit, EmitKind, Runner, SimpleBatch, SimpleResult, WorkItem, WorkKind
from voice_server.scheduling.contract import ARSeq
from voice_server.scheduling.tool_calls import CLOSE_TAG, OPEN_TAG
from voice_server.stages.llm import load_hf_tokenizer
from voice_server.stages.omni_parts import read_omni_args


class Recorder(Runner[SimpleBatch, SimpleResult]):
    def execute(self, batch: SimpleBatch) -> SimpleResult:
        # NOTE: the payload goes back as it came (relayed arrays are sent on again), plus its keys,
        # so a test sees exactly what a downstream stage would have been given.
        return SimpleResult(tuple(
            Emit(item.request_id, EmitKind.RESULT, {**item.payload, "received_keys": sorted(item.payload)})
            for item in batch.items
        ))


def create_recorder(ctx: StageContext) -> Recorder:
    return Recorder()


def code_frames(num_frames: int, seed: int) -> torch.Tensor:
    """[G, num_frames] codes of the tiny preset, the same in every process."""
    return torch.randint(0, TINY_CODEBOOK, (TINY_NUM_CODE_GROUPS, num_frames),
                         generator=torch.Generator().manual_seed(seed))


class CodeStreamer(Runner[SimpleBatch, SimpleResult]):
    """payload: `num_frames`, `seed`, `chunk_len` (frames per stream chunk, default 3), optional
    `bad_chunk` (index of a chunk sent out of range) and `chunk_delay_ms`."""

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits = []
        for item in batch.items:
            p = item.payload
            codes = code_frames(int(p["num_frames"]), int(p["seed"]))
            size = int(p.get("chunk_len", 3))
            for index, start in enumerate(range(0, codes.shape[1], size)):
                time.sleep(float(p.get("chunk_delay_ms", 0)) / 1000.0)
                part = codes[:, start : start + size]
                if index == p.get("bad_chunk"):
                    part = part + TINY_CODEBOOK
                emits.append(Emit(item.request_id, EmitKind.STREAM, {"codes": part}))
            emits.append(Emit(item.request_id, EmitKind.RESULT, {}))
        return SimpleResult(tuple(emits))


def create_code_streamer(ctx: StageContext) -> CodeStreamer:
    return CodeStreamer()


# -- a thinker that writes a given reply ------------------------------------------------------------------

REPLY_TEXT: dict[int, str] = {
    10: "\n", 40: "Hi", 41: ".", 42: '{"name":', 43: ' "get_time",', 44: ' "arguments":', 45: " {}}",
}
"""Ids of the tiny thinker vocabulary with text in the toy tokenizer (10 is "\n" there too, `presets.py`)."""
TOOL_OPEN, TOOL_CLOSE = 150, 151
"""`<tool_call>` and `</tool_call>`: single added tokens, not special (they decode to text), as in Qwen's vocabulary."""


def write_toy_tokenizer(directory: Path) -> None:
    """`directory/tokenizer.json` over the tiny thinker vocabulary: `REPLY_TEXT` spelled byte-level (as Qwen's
    tokens are), the chat specials of `TINY_IDS` special (they decode to nothing), the tool tags, and a filler
    word for every other id."""
    spell = bytes_to_unicode()
    names = {i: f"w{i}" for i in range(TINY_TEXT_VOCAB)}
    names.update({i: "".join(spell[b] for b in text.encode()) for i, text in REPLY_TEXT.items()})
    specials = {i: f"<|{name}|>" for name, i in TINY_IDS.items()}
    names.update({**specials, TOOL_OPEN: OPEN_TAG, TOOL_CLOSE: CLOSE_TAG})
    tokenizer = Tokenizer(WordLevel({name: i for i, name in names.items()}, unk_token="w0"))
    # NOTE: tokens already in the vocabulary keep their ids; added, they decode as added tokens do.
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in specials.values()])
    tokenizer.add_tokens([AddedToken(OPEN_TAG, special=False), AddedToken(CLOSE_TAG, special=False)])
    tokenizer.save(str(directory / "tokenizer.json"))


class ScriptedThinker(ThinkerRunner):
    """Picks reply token k of a request from its `params.script`, or else from the stage's `scripts` in the order
    requests arrive (a session's client sends no such param): every other logit of its sampling row is -inf."""

    def __init__(self, *args: Any, scripts: list[list[int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scripts: dict[str, list[int]] = {}
        self.next_scripts, self.num_admitted = scripts, 0

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is WorkKind.NEW:
            script = item.params.get("script")
            if script is None:
                script = self.next_scripts[self.num_admitted % len(self.next_scripts)]
                self.num_admitted += 1
            self.scripts[item.request_id] = list(script)
        return super().admit(item)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.scripts.pop(request_id, None)

    def _forward(self, seqs: tuple[ARSeq, ...], ids: list[int], positions: torch.Tensor, ctx: AttentionContext,
                 logits_rows: list[int]) -> torch.Tensor:
        logits = super()._forward(seqs, ids, positions, ctx, logits_rows)
        for row, seq in enumerate(s for s in seqs if s.is_sampling):
            # NOTE: a sampling row ends the known tokens: the reply tokens before it are the ones sampled so far.
            k = seq.start_pos + len(seq.token_ids) - len(self.prompts[seq.request_id].token_ids)
            logits[row] = -torch.inf
            logits[row, self.scripts[seq.request_id][k]] = 0.0
        return logits


def create_scripted_thinker(ctx: StageContext) -> ScriptedThinker:
    """factory_args: `checkpoint` (with `write_toy_tokenizer`'s tokenizer), `num_threads`, and `scripts` (the replies
    of requests without `params.script`, in turn); the stage streams to the talker."""
    args = read_omni_args(ctx, ("scripts",))
    assert args.checkpoint is not None
    model = args.load("thinker")
    assert isinstance(model, ThinkerModel)
    config = DecoderRunnerConfig(ctx.memory_budget_bytes(), max_step_tokens=ctx.stage.max_step_tokens,
                                 max_num_seqs=ctx.stage.max_batch_size)
    scripts = ctx.args.get("scripts") or [[TINY_IDS["im_end"]]]
    return ScriptedThinker(model, args.cfg, config, feeds_talker=True, tokenizer=load_hf_tokenizer(args.checkpoint),
                           scripts=scripts)
