"""ToolCallFilter and ToolCallGate: tool calls cut out of streamed text and out of a request's STREAM emits."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from voice_server.scheduling.tool_calls import CLOSE_TAG, OPEN_TAG, ToolCallFilter, ToolCallGate, is_in_call

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def reference(text: str) -> tuple[str, list[str], list[tuple[int, int]]]:
    """The whole text at once: its plain text, raw calls and each call's [start, end) (an open one: all the rest)."""
    plain, calls, spans = [], [], []
    pos = 0
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        plain.append(text[pos:start])
        close = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if close < 0:
            calls.append(OPEN_TAG + text[start + len(OPEN_TAG):].strip())  # NOTE: never closed: tag kept
            spans.append((start, len(text) + 1))  # NOTE: past the end: an empty token at the end is in it too
            return "".join(plain), calls, spans
        calls.append(text[start + len(OPEN_TAG):close].strip())
        end = close + len(CLOSE_TAG)
        spans.append((start, end))
        pos = end + len(text[end:]) - len(text[end:].lstrip())
    plain.append(text[pos:])
    return "".join(plain), calls, spans


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run(deltas: list[str]) -> tuple[list[str], list[tuple[str, ...]], str, list[str]]:
    """Feed deltas: per-delta text and calls, then the text and calls at finish."""
    cut = ToolCallFilter()
    steps = [cut.feed(d) for d in deltas]
    end = cut.finish()
    return [s.text for s in steps], [s.calls for s in steps], end.text, list(end.calls)


# -- ToolCallFilter -----------------------------------------------------------------------------------------


def test_a_call_fed_character_by_character_streams_nothing_of_it_and_closes_on_its_last_character() -> None:
    text = f"Sure, one moment. {OPEN_TAG}\n{CALL}\n{CLOSE_TAG}\n Done."
    texts, calls, end_text, end_calls = run(list(text))
    assert "".join(texts) == "Sure, one moment. Done." and end_text == "" and end_calls == []
    assert not any("<" in t for t in texts)
    closing = len(text) - len("\n Done.") - 1
    assert [i for i, c in enumerate(calls) if c] == [closing] and calls[closing] == (CALL,)


def test_text_then_a_call_in_one_delta() -> None:
    assert run([f"Let me check.\n{OPEN_TAG}{CALL}{CLOSE_TAG}"]) == (["Let me check.\n"], [(CALL,)], "", [])


def test_two_calls_in_one_delta_and_across_deltas_drop_the_whitespace_between() -> None:
    both = f"{OPEN_TAG}a{CLOSE_TAG}\n\n{OPEN_TAG} b {CLOSE_TAG}\nok"
    assert run([both]) == (["ok"], [("a", "b")], "", [])
    texts, calls, _, _ = run([f"{OPEN_TAG}a{CLOSE_TAG}", "\n", "\n", f"{OPEN_TAG} b ", CLOSE_TAG, "\nok"])
    assert texts == ["", "", "", "", "", "ok"] and calls == [("a",), (), (), (), ("b",), ()]


def test_a_lone_angle_bracket_or_tag_prefix_is_held_then_streams_as_text() -> None:
    assert run(["a ", "<", " b"]) == (["a ", "", "< b"], [(), (), ()], "", [])
    assert run(["x <tool", "box> y"]) == (["x ", "<toolbox> y"], [(), ()], "", [])
    assert run(["a <tool_call", "!"]) == (["a ", "<tool_call!"], [(), ()], "", [])
    assert run([f"a {CLOSE_TAG} b"]) == ([f"a {CLOSE_TAG} b"], [()], "", [])  # a close with no open is text


def test_a_held_prefix_at_finish_is_text() -> None:
    assert run(["1 <", "tool_c"]) == (["1 ", ""], [(), ()], "<tool_c", [])


def test_an_unclosed_call_at_finish_is_reported_raw_and_nothing_of_it_streams() -> None:
    assert run(["Hi ", OPEN_TAG, ' {"name": "x"', "</tool_"]) == (["Hi ", "", "", ""], [(), (), (), ()], "",
                                                                  [OPEN_TAG + '{"name": "x"</tool_'])
    assert run([OPEN_TAG]) == ([""], [()], "", [OPEN_TAG])


@given(st.sampled_from([
    f"Sure. {OPEN_TAG}\n{CALL}\n{CLOSE_TAG}\n Done.",
    f"{OPEN_TAG}a{CLOSE_TAG}{OPEN_TAG}b{CLOSE_TAG}  x < y <tool_ca",
    f"a < b <tool {OPEN_TAG}{OPEN_TAG}nested{CLOSE_TAG}{CLOSE_TAG} c",
    f"open {OPEN_TAG} never closed </tool_cal",
    "no calls at all <b>, 1 < 2",
]), st.lists(st.integers(0, 200), max_size=30))
def test_any_split_streams_what_the_whole_text_gives_and_never_text_it_takes_back(text: str, cuts: list[int]) -> None:
    plain, calls, _ = reference(text)
    texts, step_calls, end_text, end_calls = run(split(text, cuts))
    assert "".join(texts) + end_text == plain
    assert [c for cs in step_calls for c in cs] + end_calls == calls


def test_is_in_call_reads_positions_as_the_filter_does() -> None:
    text = f"a. {OPEN_TAG}b? c{CLOSE_TAG} d. {OPEN_TAG}e"
    inside = [i for i in range(len(text) + 1) if is_in_call(text, i)]
    first, close, second = text.index(OPEN_TAG), text.index(CLOSE_TAG), text.rindex(OPEN_TAG)
    assert inside == [*range(first + len(OPEN_TAG), close + len(CLOSE_TAG)), *range(second + len(OPEN_TAG),
                                                                                     len(text) + 1)]


# -- ToolCallGate -------------------------------------------------------------------------------------------


def gate_run(pieces: list[str], data: list[dict[str, Any]] | None = None) -> list[list[dict[str, Any]]]:
    """Each piece one token (id = its index), its text all released by the stop checker; the last ends it."""
    gate = ToolCallGate()
    return [gate.step({"token_ids": [i], "text": piece, **(data[i] if data else {})}, piece, i == len(pieces) - 1)
            for i, piece in enumerate(pieces)]


def ids(steps: list[list[dict[str, Any]]]) -> list[list[int]]:
    return [[p["token_ids"][0] for p in step] for step in steps]


def test_gate_releases_text_tokens_at_once_and_drops_call_tokens() -> None:
    steps = gate_run(["Hi", ".", "\n", OPEN_TAG, CALL, CLOSE_TAG, ""])  # NOTE: "": EOS, whose text never streams
    assert ids(steps) == [[0], [1], [2], [], [], [], [6]]
    assert [p["text"] for step in steps for p in step] == ["Hi", ".", "\n", ""]
    assert [p.get("tool_calls") for step in steps for p in step] == [None, None, None, [CALL]]


def test_gate_holds_an_undecided_token_and_releases_it_in_order() -> None:
    steps = gate_run(["a", " <", " b", "!"])
    assert ids(steps) == [[0], [], [1, 2], [3]]
    assert [[p["text"] for p in step] for step in steps] == [["a"], [], ["", " < b"], ["!"]]


def test_gate_drops_a_tag_split_across_tokens_and_the_token_straddling_it() -> None:
    steps = gate_run(["ok", " <", "tool", "_call>", CALL, "</tool", "_call>", "\n", "x"])
    # NOTE: "\n" alone after the call is dropped too (a talker would speak it); " " of the dropped " <" streams.
    assert ids(steps) == [[0], [], [], [], [], [], [], [], [8]]
    assert [p["text"] for step in steps for p in step] == ["ok", " x"]
    assert steps[8][0]["tool_calls"] == [CALL]


def test_gate_always_releases_the_last_token_with_an_unclosed_call() -> None:
    steps = gate_run(["Hi", OPEN_TAG, '{"name"'])
    assert ids(steps) == [[0], [], [2]]
    assert steps[2][0]["text"] == "" and steps[2][0]["tool_calls"] == [OPEN_TAG + '{"name"']


def test_gate_carries_one_off_data_of_dropped_tokens_to_the_next_released_one() -> None:
    data = [{"_feed": {"embed": 0, "prompt": "P"}}, {"_feed": {"embed": 1}}, {"_feed": {"embed": 2}},
            {"_feed": {"embed": 3}}, {"_feed": {"embed": 4}}]
    steps = gate_run([OPEN_TAG, CALL, CLOSE_TAG, "Done", ""], data)
    assert ids(steps) == [[], [], [], [3], [4]]
    assert steps[3][0]["_feed"] == {"embed": 3, "prompt": "P"} and steps[4][0]["_feed"] == {"embed": 4}
    assert steps[3][0]["tool_calls"] == [CALL] and steps[3][0]["text"] == "Done"


@given(st.sampled_from([
    f"Sure. {OPEN_TAG}\n{CALL}\n{CLOSE_TAG}\n Done. a < b",
    f"{OPEN_TAG}a{CLOSE_TAG}\n{OPEN_TAG}b{CLOSE_TAG} x <tool_c",
    f"x {OPEN_TAG} open",
]), st.lists(st.integers(0, 200), max_size=30))
def test_gate_any_tokenization_releases_in_order_every_text_token_and_no_call_token(text: str,
                                                                                 cuts: list[int]) -> None:
    plain, calls, spans = reference(text)
    pieces = split(text, cuts) + [""]  # NOTE: EOS last (its text never streams): always released
    steps = gate_run(pieces)
    released = [i for step in ids(steps) for i in step]
    assert released == sorted(released) and released[-1] == len(pieces) - 1
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    for i, piece in enumerate(pieces[:-1]):
        start, end = starts[i], starts[i] + len(piece)
        # NOTE: a token that is only the whitespace after a call goes with the call.
        blanks = [(e, e + len(text[e:]) - len(text[e:].lstrip())) for _, e in spans]
        is_call = any(start < e and end > s if piece else s < start < e for s, e in spans) or (
            bool(piece) and any(a <= start and end <= b for a, b in blanks))
        assert (i in released) is not is_call, (i, piece)
    payloads = [p for step in steps for p in step]
    assert "".join(p["text"] for p in payloads) == plain
    assert [c for p in payloads for c in p.get("tool_calls", [])] == calls
