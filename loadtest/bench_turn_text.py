"""The thinker's reading of a turn's words: how likely the user's message ends where its words do
(`turn_end_p`, `voice_server/runners/ar_runner.py`), on the turn-taking set's text.

The default pipeline's thinker stage (`configs/default.yaml`: SmolLM2-135M, its quantisation and system
prompt) is built as a server builds it, and each text goes through its admission, the AR scheduler and the
runner, as a speculative response's prompt does (`score_turn_end`). The text is what a recogniser writes:
lowercase, no punctuation. Categories:
- complete: the set's whole questions;
- cut: each hesitation's words up to its pause (where the speaker stops mid-sentence);
- cut-earlier: the same words at every shorter length of at least two words (a voice's gaps between words);
- question-prefix: the questions' words at every length of at least two words, short of the whole;
- hesitation-whole: the hesitation sentences, whole.
Reported: each category's lowest and highest score, and how many score under each threshold (a turn the
session then holds where Smart Turn is not sure of it: `MIN_TEXT_COMPLETE`, `voice_server/session/pause_words.py`).

Usage: OMP_NUM_THREADS=1 python loadtest/bench_turn_text.py [--details]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from table import cpu_description, format_table  # noqa: E402
from turntaking_set import COMPLETE, HESITATION  # noqa: E402

from voice_server.config.loading import load_pipeline  # noqa: E402
from voice_server.engine.runtime import StageContext  # noqa: E402
from voice_server.runners import DecoderRunner  # noqa: E402
from voice_server.scheduling import ARScheduler, EmitKind, WorkItem, WorkKind  # noqa: E402
from voice_server.session.pause_words import MIN_TEXT_COMPLETE  # noqa: E402
from voice_server.stages.llm import create_llm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = (0.0005, 0.001, MIN_TEXT_COMPLETE, 0.005, 0.01)


def words_of(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", "", text.lower().replace("-", " ")).split()


def texts() -> list[tuple[str, str]]:
    out = []
    for question in COMPLETE:
        words = words_of(question)
        out.append(("complete", " ".join(words)))
        out += [("question-prefix", " ".join(words[:k])) for k in range(2, len(words))]
    for sentence in HESITATION:
        cut = words_of(sentence.split(",")[0])
        out.append(("cut", " ".join(cut)))
        out += [("cut-earlier", " ".join(cut[:k])) for k in range(2, len(cut))]
        out.append(("hesitation-whole", " ".join(words_of(sentence))))
    return out


def turn_end_p(runner: DecoderRunner, request_id: str, words: str) -> float:
    item = runner.admit(WorkItem(request_id, WorkKind.NEW, {"messages": [{"role": "user", "content": words}]},
                                 {"score_turn_end": True}))
    sched = ARScheduler(runner.ar_spec, max_batch_size=1, max_step_tokens=256)
    sched.add(item, 0.0)
    while (batch := sched.schedule(0.0)) is not None:
        for emit in sched.update(batch, runner.execute(batch)):
            if emit.kind is EmitKind.STREAM:
                sched.abort(request_id)
                runner.release(request_id)
                return float(emit.payload["turn_end_p"])
    raise RuntimeError(f"no output for {words!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--details", action="store_true", help="a line per text")
    args = parser.parse_args()
    pipeline = load_pipeline(ROOT / "configs" / "default.yaml")
    stage = next(s for s in pipeline.stages if s.name == "thinker")
    runner = create_llm(StageContext(stage, pipeline, 1 << 30, "bench"))
    scores: dict[str, list[float]] = {}
    for i, (category, words) in enumerate(texts()):
        p = turn_end_p(runner, f"t{i}", words)
        scores.setdefault(category, []).append(p)
        if args.details:
            print(f"{category:16s} {p:.5f}  {words}")
    rows = []
    for category, values in scores.items():
        row: dict[str, object] = {"category": category, "num_texts": len(values), "lowest": min(values),
                                  "highest": max(values)}
        row.update({f"under {t:g}": sum(v < t for v in values) for t in THRESHOLDS})
        rows.append(row)
    print(format_table(rows))
    print(cpu_description())


if __name__ == "__main__":
    main()
