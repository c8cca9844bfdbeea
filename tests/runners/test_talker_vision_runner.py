"""TalkerRunner with a video whose frame times are fractional (in-process, tiny preset, dummy weights).

0.7 s per temporal patch x 13 puts the video's frames 9.1 apart: the talker prefill's positions are float32
(the grids' walk over the talker's own ids) and its decode rows continue one float32 + 1 at a time
(`continue_positions`, as transformers' generate appends them). With decode graphs on, a step holding that reply
runs on the runner's exact path ([3, T] float32 positions), never on the graphs' int64 buffers, while a text reply
beside it steps there once it runs alone. Both replies' frames equal the reference frame loop
(`turn.generate_frames`) on the prefill `build_talker_prefill` gives the whole turn.
"""

from __future__ import annotations

from typing import Any

import torch
from talker_streams import CFG, models

from voice_server.models.qwen3_omni.presets import TINY_IDS
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.prefill import build_talker_prefill
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.rope import continue_positions
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.models.qwen3_omni.turn import generate_frames, talker_rope_layout, turn_token_ids
from voice_server.runners.feed_chunk import TALKER_FEED_KEY
from voice_server.runners.talker_runner import TalkerRunner, TalkerRunnerConfig
from voice_server.scheduling import ARScheduler, WorkItem, WorkKind

torch.set_num_threads(1)
VIDEO_GRID = [3, 2, 2]  # NOTE: the tiny preset merges 1 x 1: 4 placeholders per temporal patch
VIDEO = VisualInputs(video_grid_thw=torch.tensor([VIDEO_GRID]), video_second_per_grid=torch.tensor([0.7]))
IDS = TINY_IDS


def chat(content: list[int]) -> list[int]:
    return [IDS["im_start"], IDS["user"], 10, *content, IDS["im_end"], 10, IDS["im_start"], IDS["assistant"], 10]


class Turn:
    """A prompt and a made-up reply with what the thinker would stream the talker for them (the talker reads
    only the thinker's embeddings and its hidden state at the placeholders, here seeded rows)."""

    def __init__(self, thinker: ThinkerModel, prompt: list[int], reply: list[int], visual: VisualInputs | None):
        self.prompt, self.reply, self.visual = prompt, reply, visual
        embed = thinker.model.language_model.embed_tokens
        ids = torch.tensor(prompt + reply)
        is_video = ids == IDS["video"]
        with torch.no_grad():
            self.embeds, self.tts = embed(ids), embed(torch.tensor(turn_token_ids(CFG).tts_special_ids))
        self.hidden = torch.zeros_like(self.embeds)
        self.hidden[is_video] = torch.randn(int(is_video.sum()), self.embeds.shape[1],
                                            generator=torch.Generator().manual_seed(len(prompt)))

    def chunks(self) -> list[dict[str, Any]]:
        chunks = []
        for k in range(len(self.reply)):
            feed: dict[str, Any] = {"embed": self.embeds[len(self.prompt) + k][None]}
            if k == 0:
                is_video = torch.tensor(self.prompt) == IDS["video"]
                feed.update(prompt_ids=self.prompt, prompt_embeds=self.embeds[:len(self.prompt)],
                            mm_hidden=self.hidden[:len(self.prompt)][is_video], tts_embeds=self.tts)
                if self.visual is not None:
                    feed.update(video_grid_thw=[VIDEO_GRID], video_second_per_grid=[0.7])
            chunks.append({"token_ids": [self.reply[k]], TALKER_FEED_KEY: feed})
        return chunks

    def reference_codes(self, talker: Talker, max_frames: int) -> torch.Tensor:
        consumed = torch.tensor(self.prompt + self.reply[:-1])  # NOTE: the thinker never feeds its last token back
        with torch.no_grad():
            prefill = build_talker_prefill(talker, turn_token_ids(CFG), consumed, len(self.prompt),
                                           self.embeds[:-1], self.hidden[:-1], self.tts, "ethan", self.visual,
                                           talker_rope_layout(CFG))
            if self.visual is not None:
                assert prefill.positions.dtype == torch.float32
            frames = generate_frames(talker, prefill, max_frames, TalkerSampling())
        return torch.stack([f.codes[0] for f in frames], dim=-1)


def test_a_fractional_time_video_reply_steps_exactly_beside_a_text_reply_on_the_graphs() -> None:
    thinker, talker = models()
    config = TalkerRunnerConfig(budget_bytes=256 << 20, thinker_hidden_size=32, page_size=4, decode_graphs="on",
                                graph_max_len=64, graph_buckets=(1, 2))
    runner = TalkerRunner(talker, turn_token_ids(CFG), config, talker_rope_layout(CFG))
    assert runner.graphs is not None
    graph_steps: list[set[str]] = []
    run = runner.graphs.run

    def spy(seqs: Any, *args: Any, **kwargs: Any) -> Any:
        graph_steps.append({s.request_id for s in seqs})
        return run(seqs, *args, **kwargs)

    runner.graphs.run = spy  # type: ignore[method-assign]
    sched = ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=64, prefix_cache=False)
    block = [IDS["vision_start"], *[IDS["video"]] * 12, IDS["vision_end"]]
    turns = {  # request: (turn, max_frames)
        "video": (Turn(thinker, chat([20, *block, 21, 22]), [30, 31, 32, 33, 34, IDS["im_end"]], VIDEO), 10),
        "text": (Turn(thinker, chat([23, 24, 25]), [35, 36, 37, IDS["im_end"]], None), 24),
    }
    for rid, (turn, max_frames) in turns.items():
        sched.add(runner.admit(WorkItem(rid, WorkKind.NEW, {}, {"talker": {"max_frames": max_frames}},
                                        is_stream=True)), 0.0)
        for k, chunk in enumerate(turn.chunks()):
            sched.add(runner.admit(WorkItem(rid, WorkKind.CHUNK, chunk, seq=k)), 0.0)
        sched.add(runner.admit(WorkItem(rid, WorkKind.DONE, {}, seq=len(turn.reply))), 0.0)
    frames: dict[str, list[torch.Tensor]] = {rid: [] for rid in turns}
    while (batch := sched.schedule(0.0)) is not None:
        for emit in sched.update(batch, runner.execute(batch)):
            if "codes" in emit.payload:
                frames[emit.request_id].append(emit.payload["codes"])
    for rid, (turn, max_frames) in turns.items():
        assert torch.equal(torch.cat(frames[rid], dim=1), turn.reference_codes(talker, max_frames)), rid
    assert len(frames["video"]) >= 5 and len(frames["text"]) > len(frames["video"])
    assert graph_steps and all(rids == {"text"} for rids in graph_steps), graph_steps

    # A preempted request recomputes its rows: asked again, in any range, they are the same float32 positions.
    feed = runner.feeds["video"]
    assert feed.is_fractional and feed.prefill_positions is not None
    num_prefill = feed.prefill_positions.shape[1]
    last = feed.prefill_positions[:, -1:]
    expected = torch.cat((last, continue_positions(last[0, 0], 20).expand(3, -1)), dim=1)
    assert torch.equal(feed.rope_rows(num_prefill + 3, num_prefill + 8), expected[:, 4:9])
    rows = feed.rope_rows(num_prefill - 1, num_prefill + 20)
    assert rows is not None and rows.dtype == torch.float32 and torch.equal(rows, expected)
