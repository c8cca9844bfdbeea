"""Code2WavRunner on the tiny preset with the real Code2WavScheduler: streamed PCM (any chunking,
any batching) equals the full decode `Code2Wav.forward(codes, keep_tail=True)`; malformed codes are
refused at admission naming `payload.codes`; the factory checks its own key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from voice_server.config import ConfigError, PipelineConfig, StageConfig
from voice_server.engine.runtime import StageContext
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.code2wav.streaming import conv_context_frames
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.runners.code2wav_runner import Code2WavRunner
from voice_server.scheduling import AdmissionError, Code2WavScheduler, EmitKind, WorkItem, WorkKind
from voice_server.stages.code2wav import create_code2wav

torch.set_num_threads(1)

CFG = Qwen3OmniConfig.from_hf_dict(tiny_config_dict(), where="preset tiny")
G, CODEBOOK = CFG.code2wav.num_quantizers, CFG.code2wav.codebook_size


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    part = load_part("code2wav", CFG, None, load_format="dummy", dtype=torch.float32, device="cpu", seed=0)
    assert isinstance(part, Code2Wav)
    return part


def random_codes(num_frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODEBOOK, (G, num_frames), generator=torch.Generator().manual_seed(seed))


def full_decode(model: Code2Wav, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(codes[None], keep_tail=True)[0, 0]


class Local:
    """The shell's loop without processes: admit -> add -> schedule -> execute -> update."""

    def __init__(self, runner: Code2WavRunner, sched: Code2WavScheduler) -> None:
        self.runner, self.sched = runner, sched
        self.pcm: dict[str, list[torch.Tensor]] = {}
        self.results: dict[str, dict[str, Any]] = {}

    def add(self, rid: str, kind: WorkKind, payload: dict[str, Any] | None = None, is_stream: bool = True) -> None:
        item = WorkItem(rid, kind, payload or {}, is_stream=is_stream and kind is WorkKind.NEW)
        self.sched.add(self.runner.admit(item), 0.0)

    def step(self) -> bool:
        batch = self.sched.schedule(0.0)
        if batch is None:
            return False
        for emit in self.sched.update(batch, self.runner.execute(batch)):
            if emit.kind is EmitKind.STREAM:
                assert emit.payload["sample_rate"] == CFG.code2wav.sample_rate
                assert emit.payload["pcm"].dtype == torch.float32
                self.pcm.setdefault(emit.request_id, []).append(emit.payload["pcm"])
            else:
                self.results[emit.request_id] = emit.payload
                self.runner.release(emit.request_id)
        return True

    def drain(self) -> None:
        while self.step():
            pass

    def audio(self, rid: str) -> torch.Tensor:
        return torch.cat(self.pcm.get(rid, [torch.zeros(0)]))


def local(model: Code2Wav, max_batch_size: int = 8, initial: int = 2, chunk: int = 10) -> Local:
    runner = Code2WavRunner(model)
    return Local(runner, Code2WavScheduler(runner.code2wav_spec, max_batch_size, initial, chunk))


@pytest.mark.parametrize(("initial", "chunk", "piece"), [(2, 10, 1), (1, 1, 7), (3, 7, 5), (2, 10, 64)])
def test_streamed_pcm_equals_the_full_decode(model: Code2Wav, initial: int, chunk: int, piece: int) -> None:
    codes = random_codes(64, seed=1)
    loop = local(model, initial=initial, chunk=chunk)
    loop.add("a", WorkKind.NEW)
    for start in range(0, 64, piece):
        part = codes[:, start : start + piece]
        # NOTE: the relay hands numpy arrays to a stage process; clients may send lists.
        loop.add("a", WorkKind.CHUNK, {"codes": part.numpy() if start % 2 else part.tolist()})
        loop.step()
    loop.add("a", WorkKind.DONE)
    loop.drain()
    want = full_decode(model, codes)
    got = loop.audio("a")
    assert got.shape == want.shape == (64 * model.total_upsample,)
    assert (got - want).abs().max().item() <= 1e-5
    assert loop.results["a"] == {"num_samples": want.shape[0], "num_frames": 64}


def test_whole_input_and_empty_streams(model: Code2Wav) -> None:
    loop = local(model)
    codes = random_codes(9, seed=2)
    loop.add("whole", WorkKind.NEW, {"codes": codes}, is_stream=False)
    loop.add("empty", WorkKind.NEW)
    loop.add("empty", WorkKind.DONE)
    loop.drain()
    assert (loop.audio("whole") - full_decode(model, codes)).abs().max().item() <= 1e-5
    assert "empty" not in loop.pcm and loop.results["empty"] == {"num_samples": 0, "num_frames": 0}


def test_a_batched_step_gives_each_stream_what_it_gets_alone(model: Code2Wav) -> None:
    """Three streams of different lengths, started at different times so their RoPE positions differ,
    run batched once their states line up; each stream's PCM matches it decoded alone, and the full
    decode. Measured: batched vs alone agree to ~1e-8 (not bit-exact: the GEMMs/convs of a 3-row
    batch may block their reductions differently than 1 row); asserted within 1e-6."""
    lengths = {"a": 97, "b": 83, "c": 71}
    codes = {rid: random_codes(n, seed=10 + i) for i, (rid, n) in enumerate(lengths.items())}

    def play(loop: Local, stagger_steps: int) -> None:
        for i, rid in enumerate(lengths):
            loop.add(rid, WorkKind.NEW)
            loop.add(rid, WorkKind.CHUNK, {"codes": codes[rid]})
            loop.add(rid, WorkKind.DONE)
            for _ in range(stagger_steps if i < len(lengths) - 1 else 0):
                loop.step()
        loop.drain()

    batched = local(model)
    play(batched, stagger_steps=2)
    assert batched.runner.num_rows > batched.runner.num_forwards  # some forward ran several streams
    for rid in lengths:
        alone = local(model, max_batch_size=1)
        play(alone, stagger_steps=0)
        assert alone.runner.num_rows == alone.runner.num_forwards
        diff = (batched.audio(rid) - alone.audio(rid)).abs().max().item()
        print(f"{rid}: batched vs alone max abs diff {diff:.2e}")
        assert diff <= 1e-6
        assert (batched.audio(rid) - full_decode(model, codes[rid])).abs().max().item() <= 1e-5


def test_a_step_that_raises_leaves_the_streams_as_they_were(model: Code2Wav, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = local(model)
    codes = {rid: random_codes(30, seed=20 + i) for i, rid in enumerate("ab")}
    for rid in codes:
        loop.add(rid, WorkKind.NEW)
        loop.add(rid, WorkKind.CHUNK, {"codes": codes[rid]})
        loop.add(rid, WorkKind.DONE)
    loop.step()
    batch = loop.sched.schedule(0.0)
    assert batch is not None and len(batch.chunks) == 2
    real = model.pre_transformer.forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # NOTE: the KV cache it was given grows first, then the step raises
        raise RuntimeError("device lost")

    monkeypatch.setattr(model.pre_transformer, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        loop.runner.execute(batch)
    monkeypatch.undo()
    assert loop.sched.fail(batch, "RuntimeError: device lost") == []  # each chunk re-runs alone, as is
    loop.drain()
    for rid in codes:
        assert (loop.audio(rid) - full_decode(model, codes[rid])).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("codes", "needle"), [
    ([[1, 2]] * (G + 1), "got shape"),
    ([[1, 2]] * (G - 1) + [[1]], "payload.codes"),
    ([[0.5, 1.0]] * G, "dtype float"),
    ([[True, False]] * G, "dtype bool"),
    ([[1, CODEBOOK]] * G, f"values in [1, {CODEBOOK}]"),
    (np.full((G, 3), -1, dtype=np.int16), "values in [-1, -1]"),
    ("codes", "got str"),
    (None, "got NoneType"),
])
def test_malformed_codes_are_refused_naming_the_field(model: Code2Wav, codes: Any, needle: str) -> None:
    runner = Code2WavRunner(model)
    runner.admit(WorkItem("a", WorkKind.NEW, is_stream=True))
    with pytest.raises(AdmissionError, match="payload.codes") as info:
        runner.admit(WorkItem("a", WorkKind.CHUNK, {"codes": codes}))
    assert needle in str(info.value)


def stage_ctx(**factory_args: Any) -> StageContext:
    stage = StageConfig("voc", "voice_server.stages.code2wav:create_code2wav", scheduler="code2wav",
                        terminal=True, factory_args=factory_args)
    return StageContext(stage, PipelineConfig(name="t", stages=(stage,)), 1 << 30, "test")


def test_factory_reads_left_context_frames() -> None:
    runner = create_code2wav(stage_ctx(preset="tiny"))
    assert runner.left_context_frames == conv_context_frames(CFG.code2wav)
    assert runner.code2wav_spec.sample_rate == CFG.code2wav.sample_rate
    assert create_code2wav(stage_ctx(preset="tiny", left_context_frames=5)).left_context_frames == 5
    for bad in (0, "10", True):
        with pytest.raises(ConfigError, match="field 'factory_args.left_context_frames'"):
            create_code2wav(stage_ctx(preset="tiny", left_context_frames=bad))
    with pytest.raises(ConfigError, match="field 'factory_args.left_context_framez'"):
        create_code2wav(stage_ctx(preset="tiny", left_context_framez=5))
