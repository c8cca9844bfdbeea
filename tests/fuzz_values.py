"""Hypothesis strategies and settings shared by the fuzz tests (tests/fuzz, tests/server/test_fuzz_server.py).

Values are JSON-shaped and drawn partly from each protocol's own vocabulary (key names, event types,
enum values), so that random input gets past the first check and into the nested parsers, and partly
from the corners of JSON: huge integers, NaN/Infinity, deep nesting, odd unicode.

``FUZZ`` runs ``FUZZ_EXAMPLES`` examples per test (default 150, a few seconds each); ``make fuzz-long``
sets ``VOICE_SERVER_FUZZ_EXAMPLES`` to a few thousand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_EXAMPLES = int(os.environ.get("VOICE_SERVER_FUZZ_EXAMPLES", "150"))
# NOTE: deadline=None: a shared 2-core box stalls single examples for seconds; hangs are caught by
# pytest-timeout, not by hypothesis' per-example deadline.
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# NOTE: past int64 and past float range (10**400 overflows float()); built by map to keep reprs short.
HUGE_INTS = st.sampled_from([(1, 20), (-1, 20), (1, 400), (-1, 400), (1, 19)]).map(lambda se: se[0] * 10 ** se[1])


def scalars(words: Iterable[str] = ()) -> st.SearchStrategy[Any]:
    """JSON scalars, with the protocol's own words and numbers' edge cases over-represented."""
    vocabulary = sorted(set(words))
    parts = [st.none(), st.booleans(), st.integers(), HUGE_INTS, st.floats(allow_nan=True, allow_infinity=True),
             st.text(max_size=12), st.sampled_from(["", "0", "1", "-1", "inf", "\x00", "\u0663", " 1", "1e999"])]
    if vocabulary:
        parts.append(st.sampled_from(vocabulary))
    return st.one_of(*parts)


def json_values(words: Iterable[str] = (), *, max_leaves: int = 24) -> st.SearchStrategy[Any]:
    """Nested JSON values whose object keys and string leaves are often the protocol's words."""
    vocabulary = sorted(set(words))
    keys = st.one_of(st.sampled_from(vocabulary), st.text(max_size=8)) if vocabulary else st.text(max_size=8)
    return st.recursive(scalars(vocabulary), lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=6)), max_leaves=max_leaves)


def objects(words: Iterable[str], required: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects holding ``required``'s keys (each drawn from its strategy) plus random vocabulary keys."""
    vocabulary = sorted(set(words))
    return st.builds(lambda fixed, extra: {**extra, **fixed}, st.fixed_dictionaries(required),
                     st.dictionaries(st.sampled_from(vocabulary), json_values(vocabulary), max_size=6))


def frames(structured: st.SearchStrategy[Any]) -> st.SearchStrategy[str | bytes]:
    """WebSocket frames: JSON text of ``structured`` values, garbage text and binary."""
    return st.one_of(
        structured.map(lambda value: json.dumps(value)),
        structured.map(lambda value: json.dumps(value)[: len(json.dumps(value)) // 2]),  # truncated JSON
        st.text(max_size=64),
        st.sampled_from(["[" * 5000, "{\"a\":" * 3000, "null", "1e999", "\"x\"", "[]", "{}", "NaN"]),
        st.binary(max_size=64),
    )


def numbers() -> st.SearchStrategy[Any]:
    """Numbers a field may be given: small and plausible, huge (past float range), non-finite, wrong-typed."""
    return st.one_of(st.integers(-10, 20_000), st.floats(allow_nan=True, allow_infinity=True), HUGE_INTS,
                     st.sampled_from([0, 1, 0.5, 1.0, 8000, 16000, 24000, 48000, True, "1"]))


def shaped(fields: dict[str, st.SearchStrategy[Any]], words: Iterable[str] = (),
           required: dict[str, st.SearchStrategy[Any]] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """Objects of a known shape: ``required`` keys always, each of ``fields`` maybe, sometimes a stray key."""
    vocabulary = sorted(set(words)) or ["x"]
    return st.builds(lambda known, stray: {**known, **stray},
                     st.fixed_dictionaries(required or {}, optional=fields),
                     st.dictionaries(st.sampled_from(vocabulary), scalars(vocabulary), max_size=1))
