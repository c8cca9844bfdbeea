"""Locust load test of the voice sessions: `WS /ws`, `WS /v1/realtime` and `WS /twilio/media`.

Each simulated user holds one session and talks like a person on an open microphone: it speaks one of
the reference utterances (`loadtest/make_utterances.py`) at real-time pace, the microphone streams on
(a -60 dBFS floor), it waits for the reply and listens to it at real time, then speaks again. On a
fraction of the turns (`--barge-in`) it speaks over the reply instead, which must stop it.

Reported per turn as locust entries (request type = the endpoint; times in ms):
- `time_to_first_audio`: the last voiced sample sent -> the first *audible* reply audio as the client
  plays it (the first 10 ms frame at -40 dBFS or more, `PlayoutClock`; the end-of-turn wait included:
  what a caller waits); `time_to_first_byte`: the same to the first reply audio byte received;
- `turn`: the last voiced sample sent -> the reply's end (`response_done` / `response.done`; for
  Twilio, the arrival of its last audio);
- `underrun`: ms a player starting at the first byte and playing at 1x real time would have starved;
- `gen_ms_per_audio_s`: the reply's generation time per second of its audio, first byte to end
  (real-time factor x 1000; replies of 0.25 s of audio or more);
- `barge_in`: the barge-in's first voiced frame sent -> the server stopping the reply;
- `errors` (failures): protocol error events, failed responses, closed connections, timeouts.

Options (locust arguments, or the environment: LOCUST_ENDPOINT, ...): `--endpoint ws|realtime|twilio`
(or a comma list: users take them in turn), `--barge-in 0.2` (fraction of turns), `--utterances DIR`,
`--max-tokens N` (sampling limit sent with every response; not settable over Twilio), `--reply-timeout S`,
`--session-turns N` (hang up and call again after N turns: bounds a conversation's length).

Usage: locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 2m --host http://127.0.0.1:8000 --csv runs/x
(or `make loadtest`, which starts the server: loadtest/run_locust.py).
"""

from __future__ import annotations

import itertools
import random
import sys
import time
import wave
from pathlib import Path
from typing import Any

import gevent
import numpy as np
from locust import User, between, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from voice_clients import CLIENTS, Reply, TwilioClient, VoiceClient  # noqa: E402

HERE = Path(__file__).resolve().parent


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--endpoint", default="ws", env_var="LOCUST_ENDPOINT", help="ws, realtime, twilio or a list")
    parser.add_argument("--barge-in", type=float, default=0.0, env_var="LOCUST_BARGE_IN",
                        help="fraction of turns on which the user speaks over the reply")
    parser.add_argument("--utterances", default=str(HERE / "utterances"), env_var="LOCUST_UTTERANCES",
                        help="folder written by loadtest/make_utterances.py")
    parser.add_argument("--max-tokens", type=int, default=0, env_var="LOCUST_MAX_TOKENS",
                        help="sampling max_tokens of each response (0: the server's default)")
    parser.add_argument("--reply-timeout", type=float, default=60.0, env_var="LOCUST_REPLY_TIMEOUT")
    parser.add_argument("--session-turns", type=int, default=0, env_var="LOCUST_SESSION_TURNS",
                        help="hang up and call again after this many turns (0: one session per user)")


def load_utterances(folder: str, rate: int) -> list[np.ndarray]:
    paths = sorted((Path(folder) / str(rate)).glob("*.wav"))
    if not paths:
        raise FileNotFoundError(f"no utterances in {folder}/{rate}: run loadtest/make_utterances.py")
    out = []
    for path in paths:
        with wave.open(str(path), "rb") as f:
            out.append(np.frombuffer(f.readframes(f.getnframes()), dtype="<i2"))
    return out


class VoiceUser(User):
    """One voice session per user; its single task is one conversational turn."""

    wait_time = between(0.5, 2.0)  # NOTE: a pause between turns; the microphone streams on meanwhile
    _numbers = itertools.count()

    def on_start(self) -> None:
        options = self.environment.parsed_options
        endpoints = [e.strip() for e in options.endpoint.split(",") if e.strip()]
        number = next(self._numbers)
        self.endpoint = endpoints[number % len(endpoints)]
        self.barge_in = options.barge_in
        self.timeout = options.reply_timeout
        cls = CLIENTS[self.endpoint]
        self.utterances = load_utterances(options.utterances, cls.rate)
        self.next_utterance = number % len(self.utterances)
        self.params = {"sampling": {"max_tokens": options.max_tokens}} if options.max_tokens else {}
        self.client: VoiceClient | None = None
        self.connect()
        gevent.sleep(random.uniform(0.0, 1.0))  # NOTE: users' turns end at different moments, as real ones do

    def connect(self) -> None:
        self.num_turns = 0
        try:
            self.client = CLIENTS[self.endpoint](self.host, self.params)
        except Exception as exc:
            self.fail(f"connect: {type(exc).__name__}: {exc}")
            raise

    def on_stop(self) -> None:
        if self.client is not None:
            self.client.close()

    @task
    def turn(self) -> None:
        # NOTE: a closed session was reported when it closed: the user calls again.
        limit = self.environment.parsed_options.session_turns
        if self.client is None or not self.client.is_open or (limit and self.num_turns >= limit):
            if self.client is not None:
                self.client.close()
            self.connect()
        client = self.client
        assert client is not None
        barge = random.random() < self.barge_in
        spoke_at = self.speak(client)
        reply = self.wait_reply(client, len(client.replies), spoke_at)
        if reply is None:
            return
        if barge and self.wait_playing(client, reply, random.uniform(0.3, 0.8)):
            start = time.monotonic()
            n = len(client.replies)
            spoke_at = self.speak(client)
            if self.wait(client, lambda: reply.stopped is not None, "the reply was not stopped by a barge-in"):
                assert reply.stopped is not None
                self.report("barge_in", 1000 * (reply.stopped - start))
            reply = self.wait_reply(client, n, spoke_at)
            if reply is None:
                return
        self.wait(client, lambda: reply.done is not None, "no end of response")
        if reply.done is None:
            return
        starved, play_end = reply.player()
        self.num_turns += 1
        self.report("turn", 1000 * (reply.done - spoke_at))
        self.report("underrun", 1000 * starved)
        if reply.audio_s >= 0.25:
            self.report("gen_ms_per_audio_s", 1000 * (reply.done - reply.chunks[0][0]) / reply.audio_s)
        self.wait(client, lambda: time.monotonic() >= play_end, "")  # NOTE: listens to the reply to its end

    def speak(self, client: VoiceClient) -> float:
        client.say(self.utterances[self.next_utterance % len(self.utterances)])
        self.next_utterance += 1
        self.wait(client, lambda: client.spoke_at is not None, "the microphone stalled")
        return client.spoke_at or time.monotonic()

    def wait_reply(self, client: VoiceClient, index: int, spoke_at: float) -> Reply | None:
        """The first reply after `index` with audio; reports `time_to_first_audio`."""
        if not self.wait(client, lambda: len(client.replies) > index and bool(client.replies[index].chunks),
                         "no reply audio"):
            return None
        reply = client.replies[index]
        self.report("time_to_first_byte", 1000 * (reply.chunks[0][0] - spoke_at))
        if self.wait(client, lambda: reply.heard.first_audible_at is not None or reply.done is not None, ""):
            heard_at = reply.heard.first_audible_at
            if heard_at is not None:
                self.report("time_to_first_audio", 1000 * (heard_at - spoke_at))
        return reply

    def wait_playing(self, client: VoiceClient, reply: Reply, seconds: float) -> bool:
        """Listens `seconds`; whether the reply is still playing then (and so can be spoken over)."""
        gevent.sleep(seconds)
        # NOTE: a reply still coming counts as playing: a server that paces its audio (`/v1/realtime`,
        # `/twilio/media`) keeps only ~0.2 s of it ahead of the player.
        return reply.stopped is None and (reply.done is None or time.monotonic() < reply.player()[1] - 0.3)

    def wait(self, client: VoiceClient, condition: Any, what: str) -> bool:
        """Until `condition()`; a failure named `what` on a timeout or a problem of the session."""
        deadline = time.monotonic() + self.timeout
        while not condition():
            if isinstance(client, TwilioClient):
                client.settle(time.monotonic())
            if self.flush_problems(client) or time.monotonic() > deadline:
                if what and time.monotonic() > deadline:
                    self.fail(f"timeout: {what}")
                return False
            gevent.sleep(0.01)
        return not self.flush_problems(client)

    def flush_problems(self, client: VoiceClient) -> bool:
        found = False
        while client.problems:
            self.fail(client.problems.popleft())
            found = True
        return found

    def report(self, name: str, ms: float) -> None:
        self.environment.events.request.fire(request_type=self.endpoint, name=name, response_time=ms,
                                             response_length=0, exception=None, context={})

    def fail(self, message: str) -> None:
        self.environment.events.request.fire(request_type=getattr(self, "endpoint", "?"), name="errors",
                                             response_time=0, response_length=0,
                                             exception=RuntimeError(message), context={})
