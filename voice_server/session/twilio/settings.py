"""`TwilioSettings`: what a deployment sets for its phone calls (token, prompt, turn detection, params,
a listener), and how a call's `start` turns them into its `SessionConfig`.

Apart from the socket handling (`endpoint`): whoever builds the app sets them (`app.state.twilio`, the
server's and the tests' own), and that needs none of the connection's machinery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voice_server.config.voices import VoiceConfig
from voice_server.session.config import SessionConfig
from voice_server.session.events import SessionEvent
from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.twilio.inbound import TWILIO_SAMPLE_RATE
from voice_server.session.twilio.messages import TwilioDtmf, TwilioStart
from voice_server.session.voices import with_voice

__all__ = ["GREETING_PARAMETER", "INSTRUCTIONS_PARAMETER", "CallListener", "TwilioSettings"]

INSTRUCTIONS_PARAMETER = "instructions"
GREETING_PARAMETER = "greeting"
MAX_GREETING_CHARS = 2000

CallListener = Callable[[TwilioStart, "SessionEvent | TwilioDtmf"], None]
"""Called on the server's loop with each session event and key press of a call; must not block."""


@dataclass(frozen=True)
class TwilioSettings:
    token: str | None = None
    """None: no authentication (any client that speaks the protocol gets a session)."""
    instructions: str = ""
    greeting: str = ""
    """What the agent opens the call with: the instructions of a response made at `start`, before the caller
    says anything (e.g. "Greet the caller as Acme's assistant and ask how you can help."); "" waits for
    the caller. `start.customParameters` `greeting` overrides it per call."""
    turn_detection: TurnDetectionConfig | None = None
    """None: the pipeline's default (`PipelineConfig.turn_detection`); a call has no manual turns."""
    params: tuple[tuple[str, Any], ...] = ()
    """Request params of every response (e.g. sampling), as in `SessionConfig`."""
    listener: CallListener | None = None

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("twilio token: must be a non-empty string or None")
        check_greeting(self.greeting)

    def greeting_of(self, start: TwilioStart) -> str:
        """The call's greeting instructions ("" for none); ValueError for one that is not a short string."""
        return check_greeting(start.custom_parameters.get(GREETING_PARAMETER, self.greeting))

    def session_config(self, start: TwilioStart, default_type: str = "server_vad",
                       voice: VoiceConfig | None = None) -> SessionConfig:
        """The call's session config (`voice`: the pipeline's default, whose params go over `params`); ValueError
        for instructions `SessionConfig` refuses."""
        instructions = start.custom_parameters.get(INSTRUCTIONS_PARAMETER, self.instructions)
        turns = self.turn_detection or TurnDetectionConfig(type=default_type)
        return SessionConfig(input_rate=TWILIO_SAMPLE_RATE, output_rate=TWILIO_SAMPLE_RATE, instructions=instructions,
                             turn_detection=turns, params=tuple(with_voice(dict(self.params), voice).items()))


def check_greeting(greeting: Any) -> str:
    if not isinstance(greeting, str) or len(greeting) > MAX_GREETING_CHARS:
        raise ValueError(f"greeting: must be a string of at most {MAX_GREETING_CHARS} characters")
    return greeting
