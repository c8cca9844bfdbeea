"""PocketSphinx settings (search bound, starting cepstral mean): CPU per second of speech against word
error rate, side by side.

The asr stage decodes every open turn as it is spoken, so its CPU per second of speech is what limits
how many people can talk at once on a small machine (8 sessions on 2 vCPUs: at a real-time factor of
0.2, eight speakers need 1.6 cores for recognition alone). `end_utt` (the final search after the last
frame) is on the first-audio path.

Speech: the turn-taking set's spoken items (`turntaking_set.py`: complete questions, barge-ins and
prompts, hibari-tts at three rates and three levels, half of the questions in white noise at 20 dB SNR,
a -60 dBFS floor under all; the hesitations without their pause), fed in 20 ms chunks as a session
streams them. Each setting decodes every item on one decoder (one thread), in turn, each from the
setting's starting cepstral mean, twice; the table has the faster pass (this VM's neighbours are
noisy). WER is over the items' words (`tests/speech_text.py`'s normalisation), clean and noisy apart.

`--search`: instead, PocketSphinx's other search bounds on top of the stage's default (phonetic lookahead,
Gaussians per frame, beams, frame skipping, words per frame), passed to its `Decoder` as they are.

`--narrowband`: instead, the same items as a phone call brings them (8 kHz u-law, back up to 16 kHz as a
session resamples them) from the speech and the narrowband starting means, and on a decoder whose model is
adapted to phone audio (`NARROWBAND_MLLR`), beside the 16 kHz items. `--seed`: the set's seed.

Usage: OMP_NUM_THREADS=1 python loadtest/bench_asr.py [--search | --narrowband] [--seed N]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]

import numpy as np  # noqa: E402
from speech_text import by_phone, word_error_rate  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from turntaking_set import Item, make_items  # noqa: E402

from voice_server.audio import float32_to_pcm16  # noqa: E402
from voice_server.runners.asr_decoders import (  # noqa: E402
    NARROWBAND_CMN,
    DecoderOptions,
    SphinxRecognizer,
    build_decoder,
)

GENERIC_CMN = "40,3,-1,0,0,0,0,0,0,0,0,0,0"
"""PocketSphinx's own starting cepstral mean (`cmninit`), where the asr stage started every utterance before."""
SETTINGS: dict[str, dict[str, Any]] = {
    "maxhmmpf 30000, generic CMN (PocketSphinx's defaults; the stage before)": {
        "max_hmms_per_frame": 30000, "initial_cmn": GENERIC_CMN},
    "maxhmmpf 3000, generic CMN": {"initial_cmn": GENERIC_CMN},
    "maxhmmpf 30000, speech CMN": {"max_hmms_per_frame": 30000},
    "maxhmmpf 3000, speech CMN (the stage's default now)": {},
    "maxhmmpf 2000, speech CMN": {"max_hmms_per_frame": 2000},
}
SEARCH_SETTINGS: dict[str, dict[str, float]] = {
    "the stage's default": {},
    "pl_window 10": {"pl_window": 10},
    "pl_window 0": {"pl_window": 0},
    "topn 2": {"topn": 2},
    "beam 1e-40, wbeam 1e-24": {"beam": 1e-40, "wbeam": 1e-24},
    "pbeam 1e-40": {"pbeam": 1e-40},
    "ds 2": {"ds": 2},
    "maxwpf 10": {"maxwpf": 10},
}
"""`--search`: PocketSphinx arguments on top of the stage's default `DecoderOptions`."""
CHUNK = 320  # NOTE: 20 ms at 16 kHz, as a session streams a turn


def decode(decoder: Any, options: DecoderOptions, item: Item) -> tuple[str, float, float]:
    """(transcript, CPU seconds feeding the audio, CPU seconds in `end_utt`), every item started as the asr
    stage starts a turn (`SphinxRecognizer.start`: the feature module rebuilt, the same starting cepstral mean)."""
    pcm = float32_to_pcm16(item.audio)
    SphinxRecognizer(decoder, options).start()
    start = time.process_time()
    for i in range(0, pcm.size, CHUNK):
        decoder.process_raw(pcm[i:i + CHUNK].tobytes(), False, False)
    fed = time.process_time()
    decoder.end_utt()
    hyp = decoder.hyp()
    return (hyp.hypstr if hyp is not None else ""), fed - start, time.process_time() - fed


def measure(name: str, options: DecoderOptions, items: list[Item], search: dict[str, float] | None = None,
            is_narrowband: bool = False) -> dict[str, Any]:
    decoder = build_decoder(options, is_narrowband, **(search or {}))
    best: tuple[float, list[float]] | None = None
    for _ in range(2):
        results = [decode(decoder, options, item) for item in items]
        feed_s = sum(r[1] + r[2] for r in results)
        if best is None or feed_s < best[0]:
            best = (feed_s, [r[2] for r in results])
        errors = [word_error_rate(item.name, r[0]) for item, r in zip(items, results, strict=True)]
    assert best is not None
    speech_s = sum(item.duration_s for item in items)
    return {"setting": name, "rtf": best[0] / speech_s,
            "end_utt_p50_ms": float(np.median(best[1])) * 1000,
            "wer_clean": float(np.mean([e for item, e in zip(items, errors, strict=True) if item.snr_db is None])),
            "wer_noisy": float(np.mean([e for item, e in zip(items, errors, strict=True) if item.snr_db is not None])),
            "num_items": len(items)}


def phoned(item: Item) -> Item:
    """`item` as a call brings it (`speech_text.by_phone`)."""
    return dataclasses.replace(item, audio=by_phone(item.audio))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--search", action="store_true", help="PocketSphinx's other search bounds instead")
    parser.add_argument("--narrowband", action="store_true", help="8 kHz u-law items from both starting means")
    parser.add_argument("--seed", type=int, default=0, help="the turn-taking set's seed")
    args = parser.parse_args()
    items = [item for category, count in (("complete", 12), ("barge_in", 10), ("hesitation", 10), ("prompt", 6))
             for item in make_items(category, count, args.seed)]
    items = [Item(i.category, i.name.replace(",", ""), i.audio, i.speech, None, i.speed, i.level_db, i.snr_db)
             for i in items]
    if args.narrowband:
        by_call = [phoned(item) for item in items]
        rows = [measure("16 kHz, speech CMN", DecoderOptions(), items),
                measure("8 kHz u-law, speech CMN (the stage before)", DecoderOptions(), by_call),
                measure("8 kHz u-law, narrowband CMN (a call on a 16 kHz decoder)",
                        DecoderOptions(initial_cmn=NARROWBAND_CMN), by_call),
                measure("8 kHz u-law, narrowband CMN, adapted model (a call on a narrowband decoder)",
                        DecoderOptions(initial_cmn=NARROWBAND_CMN), by_call, is_narrowband=True)]
    elif args.search:
        rows = [measure(name, DecoderOptions(), items, search) for name, search in SEARCH_SETTINGS.items()]
    else:
        rows = [measure(name, DecoderOptions(**fields), items) for name, fields in SETTINGS.items()]
    base = rows[0]["rtf"]
    for row in rows:
        row["rtf_vs_defaults"] = row["rtf"] / base
    print(f"{cpu_description()}\n")
    print(f"== PocketSphinx settings over {len(items)} items "
          f"({sum(i.duration_s for i in items):.1f} s of speech, one thread) ==")
    print(format_table(rows))
    print(f"\n{cpu_description()}")


if __name__ == "__main__":
    main()
