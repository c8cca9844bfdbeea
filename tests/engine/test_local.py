"""LocalStage: the shell's admit/schedule/execute/update loop in one process (no sockets)."""

from __future__ import annotations

from ar_stages import FakeARRunner, expected_tokens

from voice_server.engine.local import LocalRequest, LocalStage
from voice_server.scheduling import ARScheduler


def make(num_pages: int = 32) -> LocalStage:
    runner = FakeARRunner(num_pages=num_pages, page_size=4, step_delay_s=0.0)
    return LocalStage(ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=16), runner)


def test_staggered_requests_finish_with_their_own_tokens_and_time_to_first_token() -> None:
    stage = make()
    requests = [LocalRequest(f"r{i}", {"token_ids": [3 + i] * (1 + 5 * i)}, {"sampling": {"max_tokens": 4 + i}},
                             arrival_step=2 * i) for i in range(6)]
    outcomes = stage.run(requests)
    for request in requests:
        outcome = outcomes[request.request_id]
        want = expected_tokens(request.payload["token_ids"], request.params["sampling"]["max_tokens"])
        assert outcome.result["token_ids"] == want
        assert outcome.first_emit_s is not None and outcome.first_emit_s >= 0
    assert stage.scheduler.stats()["num_used_pages"] == 0


def test_refused_and_aborted_requests_end_without_a_result() -> None:
    stage = make()

    def abort_after_three(s: LocalStage) -> None:
        if s.num_steps == 3:
            s.abort("long")

    outcomes = stage.run([
        LocalRequest("bad", {"token_ids": "nope"}),
        LocalRequest("long", {"token_ids": [5, 6]}, {"sampling": {"max_tokens": 50}}),
        LocalRequest("ok", {"token_ids": [7]}, {"sampling": {"max_tokens": 5}}),
    ], on_step=abort_after_three)
    assert outcomes["bad"].error is not None and "payload.token_ids" in outcomes["bad"].error
    assert 0 < len(outcomes["long"].emits) < 50 and outcomes["long"].error is None
    assert outcomes["ok"].result["token_ids"] == expected_tokens([7], 5)
    assert stage.scheduler.stats()["num_used_pages"] == 0
