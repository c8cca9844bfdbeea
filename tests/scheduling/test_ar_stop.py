"""StopChecker: stop tokens, stop strings with hold-back, length limits."""

from __future__ import annotations

from typing import Any

from voice_server.scheduling.ar_stop import StopChecker
from voice_server.scheduling.contract import SamplingParams


def checker(eos: tuple[int, ...] = (0,), max_model_len: int = 1000, **sampling: Any) -> StopChecker:
    return StopChecker(SamplingParams.from_params({"sampling": sampling}), eos, max_model_len)


def feed(stop: StopChecker, pieces: list[tuple[int, str]]) -> tuple[list[str], str | None]:
    deltas, reason = [], None
    for i, (token, text) in enumerate(pieces):
        step = stop.append(token, text, num_seq_tokens=10 + i)
        deltas.append(step.delta)
        reason = step.finish_reason
        if reason is not None:
            break
    return deltas, reason


def test_stop_string_split_across_tokens_is_held_back_and_dropped() -> None:
    stop = checker(stop=["END"])
    deltas, reason = feed(stop, [(5, "ab"), (6, "cE"), (7, "N"), (8, "Dzz")])
    assert deltas == ["ab", "c", "", ""]
    assert reason == "stop" and stop.text == "abc"


def test_held_back_text_is_released_when_the_match_breaks() -> None:
    stop = checker(stop=["END"])
    deltas, reason = feed(stop, [(5, "xE"), (6, "N"), (7, "x"), (8, "y")])
    assert deltas == ["x", "", "ENx", "y"] and reason is None
    assert "".join(deltas) == stop.text


def test_the_earliest_of_several_stop_strings_wins() -> None:
    stop = checker(stop=["cd", "bcx"])
    deltas, reason = feed(stop, [(5, "abcdef")])
    assert deltas == ["ab"] and reason == "stop" and stop.text == "ab"


def test_stream_never_shows_text_the_result_drops() -> None:
    stop = checker(stop=["<3>"])
    deltas, reason = feed(stop, [(1, "<1>"), (2, "<"), (3, "3"), (4, ">"), (5, "<4>")])
    assert deltas == ["<1>", "", "", ""] and reason == "stop"
    assert "".join(deltas) == stop.text == "<1>"
    spanning = checker(stop=["><"])
    deltas, reason = feed(spanning, [(1, "<1>"), (2, "<2>")])
    assert deltas == ["<1", ""] and reason == "stop" and spanning.text == "<1"


def test_eos_stops_and_its_text_is_not_returned_unless_ignored() -> None:
    stop = checker(eos=(0,), stop=["zz"])
    assert feed(stop, [(5, "az"), (0, "</s>")]) == (["a", "z"], "stop")
    assert stop.text == "az"
    ignoring = checker(eos=(0,), ignore_eos=True, max_tokens=2)
    assert feed(ignoring, [(0, "</s>"), (0, "</s>")]) == (["</s>", "</s>"], "length")


def test_stop_token_ids_stop_like_eos() -> None:
    stop = checker(eos=(), stop_token_ids=[9])
    assert feed(stop, [(5, "a"), (9, "!"), (5, "b")]) == (["a", ""], "stop")


def test_length_limits_flush_held_text() -> None:
    stop = checker(max_tokens=2, stop=["xy"])
    assert feed(stop, [(5, "a"), (6, "x")]) == (["a", "x"], "length")
    by_model = StopChecker(SamplingParams(), (), max_model_len=12)
    assert [by_model.append(5, "a", n).finish_reason for n in (10, 11, 12)] == [None, None, "length"]


def test_max_sentences_stops_once_the_last_sentence_is_known_to_end() -> None:
    stop = checker(max_sentences=2)
    pieces = [(5, "Paris is"), (6, " 3.5 km."), (7, " It is"), (8, " old!"), (9, " And"), (10, " more.")]
    deltas, reason = feed(stop, pieces)
    # NOTE: "3.5" ends nothing; " And" shows the second sentence ended, and is itself not returned.
    assert reason == "stop" and stop.text == "Paris is 3.5 km. It is old!"
    assert "".join(deltas) == stop.text and len(deltas) == 5


def test_max_sentences_counts_closing_quotes_and_newlines() -> None:
    stop = checker(max_sentences=1)
    deltas, reason = feed(stop, [(5, 'He said "hi."'), (6, "\nNext")])
    assert reason == "stop" and stop.text == 'He said "hi."'


def test_stop_repeat_len_ends_a_looping_reply() -> None:
    stop = checker(stop_repeat_len=3)
    tokens = [11, 12, 13, 14, 11, 12, 13, 99]
    deltas, reason = feed(stop, [(t, f" w{t}") for t in tokens])
    # NOTE: the 3-gram 11 12 13 recurs at the 7th token: the reply ends there.
    assert reason == "stop" and len(deltas) == 7


def test_guardrails_off_by_default_and_validated() -> None:
    stop = checker()
    deltas, reason = feed(stop, [(11, "A. "), (12, "B. "), (11, "A. "), (12, "B. ")])
    assert reason is None and stop.text == "A. B. A. B. "
    for bad in ({"max_sentences": -1}, {"stop_repeat_len": 1.5}, {"max_sentences": True}):
        try:
            SamplingParams.from_params({"sampling": bad})
        except ValueError as exc:
            assert next(iter(bad)) in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")
