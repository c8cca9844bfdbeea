"""A model-free "LLM" for tests of stages fed text deltas (an `ar` stage, like the thinker).

Input: `{"text": str}` (or a session's `{"messages": [...]}`, whose last user message is taken as
the text, so a typed turn over `/ws` is echoed back; a tool result after it as "The tool says:
<result>"), the reply it "generates": one token per step,
each streaming a delta of that text (words with their leading space, punctuation marks apart, as an
LLM's tokens come), then EOS.
Every delta streams as `{"token_ids": [id], "text": delta}` to `stream_to` stages; the final
result carries the whole text, as a text LLM's does.

A request may hold its stream open to make an ordering observable without timing: with params
`gate_path` and `gate_after`, the step that would stream delta `gate_after` waits (up to
`gate_timeout_s`, default 30) until the file at `gate_path` exists, e.g. until the test has seen
the downstream stage's first output. On timeout it goes on, and the test's ordering check fails.
"""

from __future__ import annotations

import os
import re
import time

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import AdmissionError, Runner, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSpec, SeqOutput

EOS = 1
_FIRST_TOKEN = 10
_DELTA = re.compile(r"\s*[^\s\w]|\s*\w+")


def text_deltas(text: str) -> list[str]:
    """`text` as an LLM would stream it: `["Hello", ",", " how", " are", ...]`; joined, equal to `text`
    but for trailing whitespace."""
    return _DELTA.findall(text)


class ScriptedTextRunner(Runner[ARBatch, ARResult]):
    def __init__(self) -> None:
        self.ar_spec = ARSpec(num_pages=256, page_size=16, max_model_len=4096, eos_token_ids=(EOS,))
        self.deltas: dict[str, list[str]] = {}
        self.gates: dict[str, tuple[int, str, float]] = {}
        """Request id -> (gate_after, gate_path, gate_timeout_s)."""

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is not WorkKind.NEW:
            raise AdmissionError("this stage takes whole requests")
        text = item.payload.get("text")
        if text is None and isinstance(item.payload.get("messages"), list):
            last = next((m for m in reversed(item.payload["messages"])
                         if isinstance(m, dict) and m.get("role") in ("user", "tool")), {})
            text = last.get("content")
            if last.get("role") == "tool":
                text = f"The tool says: {text}"
        if not isinstance(text, str):
            raise AdmissionError("payload.text: must be a string")
        self.deltas[item.request_id] = text_deltas(text)
        if "gate_path" in item.params:
            self.gates[item.request_id] = (int(item.params["gate_after"]), str(item.params["gate_path"]),
                                           float(item.params.get("gate_timeout_s", 30.0)))
        return WorkItem(item.request_id, item.kind, {"token_ids": [2]}, item.params, item.seq)

    def release(self, request_id: str) -> None:
        self.deltas.pop(request_id, None)
        self.gates.pop(request_id, None)

    def execute(self, batch: ARBatch) -> ARResult:
        outputs = []
        for seq in batch.seqs:
            if not seq.is_sampling:
                outputs.append(SeqOutput(None))
                continue
            index = seq.start_pos + len(seq.token_ids) - 1  # NOTE: the prompt is one token
            deltas = self.deltas.get(seq.request_id, [])
            gate = self.gates.get(seq.request_id)
            if gate is not None and index == gate[0]:
                _wait_for(gate[1], gate[2])
            if index < len(deltas):
                outputs.append(SeqOutput(_FIRST_TOKEN + index, deltas[index]))
            else:
                outputs.append(SeqOutput(EOS, ""))
        return ARResult(tuple(outputs))


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def create_scripted_text(ctx: StageContext) -> ScriptedTextRunner:
    return ScriptedTextRunner()
