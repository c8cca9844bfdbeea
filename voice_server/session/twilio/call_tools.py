"""`CallTools`: a phone call's tool calls, answered by its webhook (`webhook.py`) while the call goes on.

Twilio has no channel back to a client that could run a tool, so the server runs it: each `ToolCalled`
is POSTed to the call's webhook by a task of its own (the session loop never waits on it: the caller's
audio, marks and key presses are handled meanwhile). A response's calls are answered together, once all
of them have an outcome and the response has ended: their `function_call_output` items are added to the
conversation in call order and one response is made, which speaks the results.

A call that fails (no answer within `timeout_s`, a connection error, a status that is not 2xx, a reply
over 64 KiB) gets an output that says so and names the fallback (so the model knows the tool failed), and
the response made is told to say the fallback (`fallback_instructions`). NOTE: the fallback is the
model's to say: every response goes through the pipeline's thinker (there is no path that speaks text
past it), so a thinker that ignores instructions words it its own way; the output carries the fallback
too, for one that follows the conversation rather than the system prompt. Each failure is logged (the
stream sid and the tool's name, never the arguments: they may hold the caller's data) and counted in
`voice_server_protocol_errors_total{endpoint="twilio", type="tool_webhook_timeout" | "tool_webhook_failed"}`.

When the answer waits:
- until the session's running response (the one that called, finishing; or one the caller's next turn
  started meanwhile) has ended: a new response would cut it off;
- a response that did not complete (the caller barged in, the pipeline failed) gets its outputs into the
  conversation but no response of its own: the caller has moved on, and their turn makes the next one.

The answer is made under the connection's input lock, which its receive loop holds while it feeds the
session, so that a turn ending at the same moment cannot start a response of its own in between.
Hang-up: `close` cancels every task (an in-flight POST's connection closes at once); nothing is added or
said after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from voice_server.session.connection import ConnectionTracker
from voice_server.session.conversation import Item, new_id
from voice_server.session.core import Session
from voice_server.session.events import ResponseDone, SessionEvent, ToolCalled
from voice_server.session.tools import ToolCall
from voice_server.session.twilio.messages import TwilioStart
from voice_server.session.twilio.webhook import ToolWebhook, WebhookError, post_call

__all__ = ["MAX_PENDING_CALLS", "CallTools"]

log = logging.getLogger(__name__)
MAX_PENDING_CALLS = 8
"""Webhook requests one call may have in flight; a model that calls more at once gets errors for the rest."""
QUIET_POLL_S = 0.02
"""How often an answer checks whether the running response has ended (it usually has: the calls come at its end)."""


@dataclass
class _Outcome:
    call: ToolCall
    output: str | None = None
    """The webhook's output, or the error text given to the model; None while the call is in flight."""
    is_failed: bool = False


@dataclass
class _Batch:
    """One response's calls."""

    outcomes: list[_Outcome] = field(default_factory=list)
    status: str | None = None
    """The response's `ResponseDone.status`; None while it runs."""

    @property
    def is_ready(self) -> bool:
        return self.status is not None and all(outcome.output is not None for outcome in self.outcomes)


def error_output(reason: str, fallback: str) -> str:
    """What the model reads for a call that failed."""
    return f"error: the tool did not answer ({reason}). Tell the caller: {fallback}"


def fallback_instructions(instructions: str, names: list[str], fallback: str) -> str:
    """The instructions of the response after a failed call: the call's own, then the fallback to say."""
    failed = list(dict.fromkeys(names))
    said = (f"The tool{'s' if len(failed) > 1 else ''} {', '.join(failed)} failed. Say exactly this to the "
            f"caller, and nothing else: {fallback}")
    return "\n\n".join(filter(None, (instructions, said)))


class CallTools:
    """One call's tool calls: a task per webhook request, one answer per response (the module docstring)."""

    def __init__(self, webhook: ToolWebhook, start: TwilioStart, session: Session, input_lock: asyncio.Lock,
                 metrics: ConnectionTracker) -> None:
        self.webhook, self.start, self.session, self.input_lock, self.metrics = (
            webhook, start, session, input_lock, metrics)
        self.batches: dict[str, _Batch] = {}
        """Response id -> its calls, until they are answered."""
        self.tasks: set[asyncio.Task[None]] = set()
        self.is_closed = False

    @property
    def num_pending(self) -> int:
        return sum(1 for batch in self.batches.values() for o in batch.outcomes if o.output is None)

    # -- the session's events (from inside its `emit`: nothing here may wait) ---------------------------

    def on_event(self, event: SessionEvent) -> None:
        if self.is_closed:
            return
        if isinstance(event, ToolCalled):
            self._on_called(event)
        elif isinstance(event, ResponseDone):
            self._on_response_done(event)

    def _on_called(self, event: ToolCalled) -> None:
        outcome = _Outcome(event.call)
        is_full = self.num_pending >= MAX_PENDING_CALLS
        self.batches.setdefault(event.response_id, _Batch()).outcomes.append(outcome)
        if is_full:
            self._fail(outcome, f"more than {MAX_PENDING_CALLS} calls at once", "tool_webhook_failed")
            return
        self._spawn(self._call(event.response_id, outcome), f"twilio-tool-{event.call.call_id}")

    def _on_response_done(self, event: ResponseDone) -> None:
        batch = self.batches.get(event.response_id)
        if batch is not None:
            batch.status = event.status
            self._answer_when_ready(event.response_id)

    async def close(self) -> None:
        """The call ended: cancel every webhook request and answer in flight."""
        self.is_closed = True
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.batches.clear()

    # -- the tasks ----------------------------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(self._guarded(work), name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception:  # NOTE: a bug here must not end the call, nor be an unretrieved task exception
            log.exception("twilio stream %s: answering a tool call failed", self.start.stream_sid)

    async def _call(self, response_id: str, outcome: _Outcome) -> None:
        call, started = outcome.call, time.monotonic()
        body = {"call_id": call.call_id, "name": call.name, "arguments": call.arguments,
                "call_sid": self.start.call_sid, "stream_sid": self.start.stream_sid}
        try:
            outcome.output = await post_call(self.webhook, body)
            log.info("twilio stream %s: tool %s answered in %.0f ms", self.start.stream_sid, call.name,
                     (time.monotonic() - started) * 1000)
        except WebhookError as exc:
            self._fail(outcome, exc.reason, exc.kind)
        except Exception:
            log.exception("twilio stream %s: tool %s failed", self.start.stream_sid, call.name)
            self._fail(outcome, "the server failed to call it", "tool_webhook_failed")
        self._answer_when_ready(response_id)

    def _fail(self, outcome: _Outcome, reason: str, kind: str) -> None:
        # NOTE: the tool's name, never its arguments: they may hold what the caller said (card numbers, addresses).
        log.warning("twilio stream %s: tool %s: %s; the fallback is spoken", self.start.stream_sid,
                    outcome.call.name, reason)
        self.metrics.protocol_error(kind)
        outcome.output, outcome.is_failed = error_output(reason, self.webhook.fallback), True

    def _answer_when_ready(self, response_id: str) -> None:
        batch = self.batches.get(response_id)
        if batch is None or not batch.is_ready:
            return
        del self.batches[response_id]
        # NOTE: a task of its own even from a webhook's: the answer waits for quiet, and `on_event`
        # runs inside the session's emit, where waiting for the session would deadlock.
        self._spawn(self._answer(batch), f"twilio-tool-answer-{response_id}")

    async def _answer(self, batch: _Batch) -> None:
        session = self.session
        while True:
            while session.is_responding():
                await asyncio.sleep(QUIET_POLL_S)
            async with self.input_lock:
                if self.is_closed:
                    return
                if session.is_responding():
                    continue  # NOTE: a turn started a response while this waited for the lock
                for outcome in batch.outcomes:
                    assert outcome.output is not None
                    await session.add_item(Item(new_id("item"), "tool", outcome.output, kind="function_call_output",
                                                call=ToolCall(outcome.call.call_id, "", "")))
                if batch.status != "completed":
                    return
                failed = [outcome.call.name for outcome in batch.outcomes if outcome.is_failed]
                self.metrics.turn_ended()  # NOTE: the reply's latency counts from the results, as a client's would
                instructions = None if not failed else fallback_instructions(
                    session.config.instructions, failed, self.webhook.fallback)
                await session.create_response(instructions=instructions)
                return
