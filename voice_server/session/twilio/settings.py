"""`TwilioSettings`: what a deployment sets for its phone calls (token, prompt, greeting, tools and their
webhook, turn detection, params, a listener), and how a call's `start` turns them into its `SessionConfig`
and its `ToolWebhook`.

Apart from the socket handling (`endpoint`): whoever builds the app sets them (`app.state.twilio`: `serve`
from the pipeline config's `twilio:` section, `TwilioSettings.from_config`; the tests their own), and that
needs none of the connection's machinery.

A call's `start.customParameters` (strings, set by the TwiML that opens the stream) may set, per call:
`instructions`, `greeting`, `tools` (a JSON array of function tools, in place of the settings' tools) and
`tool_webhook` (a URL that must start with one of `allowed_tool_webhooks`: without a token anyone can set
these, and an unchecked URL would make the server POST wherever a caller says). A bad one is a ValueError
naming the parameter, which closes the call with 1008. A call with tools and no webhook is refused the
same way: nobody would answer its calls.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from voice_server.config import PipelineConfig
from voice_server.config.errors import ConfigError, fail, quoted
from voice_server.config.fields import check_fields
from voice_server.config.twilio import (
    DEFAULT_TOOL_FALLBACK,
    DEFAULT_TOOL_TIMEOUT_S,
    MAX_GREETING_CHARS,
    NO_WEBHOOK,
    TOOL_RULES,
    TwilioConfig,
    is_allowed_webhook,
    webhook_problem,
)
from voice_server.config.voices import VoiceConfig
from voice_server.session.config import SessionConfig
from voice_server.session.events import SessionEvent
from voice_server.session.realtime.errors import FieldError
from voice_server.session.realtime.tool_fields import parse_tools
from voice_server.session.tools import Tool, ToolSet
from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.twilio.inbound import TWILIO_SAMPLE_RATE
from voice_server.session.twilio.messages import TwilioDtmf, TwilioStart
from voice_server.session.twilio.webhook import ToolWebhook
from voice_server.session.voices import with_voice

__all__ = ["GREETING_PARAMETER", "INSTRUCTIONS_PARAMETER", "TOOLS_PARAMETER", "TOOL_WEBHOOK_PARAMETER", "CallListener",
           "TwilioSettings", "twilio_settings"]

INSTRUCTIONS_PARAMETER = "instructions"
GREETING_PARAMETER = "greeting"
TOOLS_PARAMETER = "tools"
TOOL_WEBHOOK_PARAMETER = "tool_webhook"

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
    """Request params of every response (e.g. sampling), as in `SessionConfig` (tools go in `tools`)."""
    listener: CallListener | None = None
    tools: tuple[Tool, ...] = ()
    """The functions every call's model may call (`customParameters.tools` replaces them for a call)."""
    tool_webhook: str = ""
    """Where each call the model makes is POSTed (`customParameters.tool_webhook` replaces it, if allowed)."""
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    """How long a webhook may take to answer a call (connecting included); then the fallback is spoken."""
    tool_fallback: str = DEFAULT_TOOL_FALLBACK
    """What the agent says when a webhook times out or fails (`call_tools.py`)."""
    allowed_tool_webhooks: tuple[str, ...] = ()
    """URL prefixes a call's own `tool_webhook` must start with; none: a call may not name one."""
    tool_webhook_secret: str = field(default="", repr=False)
    """Signs each webhook request (`webhook.py`); "" signs nothing."""

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("twilio token: must be a non-empty string or None")
        check_greeting(self.greeting)
        check_fields("twilio", self, TOOL_RULES)
        if not isinstance(self.tools, tuple) or not all(isinstance(tool, Tool) for tool in self.tools):
            raise fail("twilio", "tools", "must be a tuple of Tool")
        ToolSet(self.tools)  # NOTE: unique names, at most MAX_TOOLS
        if self.tools and not self.tool_webhook:
            raise fail("twilio", "tools", NO_WEBHOOK)
        if any(key in ("tools", "tool_choice") for key, _ in self.params):
            raise fail("twilio", "params", "must not set tools or tool_choice: give the tools in `tools`")

    @classmethod
    def from_config(cls, config: TwilioConfig, where: str = "twilio") -> TwilioSettings:
        """A pipeline config's `twilio:` section as settings (`where`: the pipeline, for messages); ConfigError
        naming `twilio.tools[i].<field>` for a tool `parse_tools` refuses (the rest `TwilioConfig` checked)."""
        try:
            tools = parse_tools(list(config.tools), "twilio.tools")
        except FieldError as exc:
            raise ConfigError(f"{where}: field '{exc.param}': {field_problem(exc)}") from exc
        secret = ""
        if config.tool_webhook_secret_env:
            secret = os.environ.get(config.tool_webhook_secret_env, "")
            if not secret:
                raise ConfigError(f"{where}: field 'twilio.tool_webhook_secret_env': the environment variable "
                                  f"{config.tool_webhook_secret_env} is not set (or empty)")
        return cls(instructions=config.instructions, greeting=config.greeting, tools=tools,
                   tool_webhook=config.tool_webhook, tool_timeout_s=float(config.tool_timeout_s),
                   tool_fallback=config.tool_fallback, allowed_tool_webhooks=config.allowed_tool_webhooks,
                   tool_webhook_secret=secret)

    def open_call(self, start: TwilioStart, pipeline: PipelineConfig) -> tuple[SessionConfig, str, ToolWebhook | None]:
        """What a call's `start` decides: its session config, greeting and tool webhook; ValueError naming the
        customParameter at fault (the call is closed with 1008)."""
        config = self.session_config(start, pipeline.turn_detection, pipeline.default_voice_config)
        return config, self.greeting_of(start), self.webhook_of(start)

    def greeting_of(self, start: TwilioStart) -> str:
        """The call's greeting instructions ("" for none); ValueError for one that is not a short string."""
        return check_greeting(start.custom_parameters.get(GREETING_PARAMETER, self.greeting))

    def session_config(self, start: TwilioStart, default_type: str = "server_vad",
                       voice: VoiceConfig | None = None) -> SessionConfig:
        """The call's session config (`voice`: the pipeline's default, whose params go over `params`; the call's
        tools, `tool_choice` auto); ValueError for instructions `SessionConfig` refuses or tools `tools_of` does."""
        instructions = start.custom_parameters.get(INSTRUCTIONS_PARAMETER, self.instructions)
        turns = self.turn_detection or TurnDetectionConfig(type=default_type)
        params = with_voice(dict(self.params), voice)
        tools = self.tools_of(start)
        if tools:
            params = {**params, **ToolSet(tools).to_params()}
        return SessionConfig(input_rate=TWILIO_SAMPLE_RATE, output_rate=TWILIO_SAMPLE_RATE, instructions=instructions,
                             turn_detection=turns, params=tuple(params.items()))

    def tools_of(self, start: TwilioStart) -> tuple[Tool, ...]:
        """The call's tools: `customParameters.tools` (a JSON array, as `parse_tools` takes it), else the
        settings'; ValueError naming the parameter's field."""
        raw = start.custom_parameters.get(TOOLS_PARAMETER)
        if raw is None:
            return self.tools
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # NOTE: RecursionError: "[[[[..." nested past the limit
            raise ValueError(f"{TOOLS_PARAMETER}: must be a JSON array of function tools") from exc
        try:
            return parse_tools(value, TOOLS_PARAMETER)
        except FieldError as exc:
            raise ValueError(f"{exc.param}: {field_problem(exc)}") from exc

    def webhook_of(self, start: TwilioStart) -> ToolWebhook | None:
        """Where the call's tool calls go (None: it has no tools); ValueError for a `customParameters.tool_webhook`
        that is not an allowed URL, or for tools with no webhook."""
        url = start.custom_parameters.get(TOOL_WEBHOOK_PARAMETER)
        if url is None:
            url = self.tool_webhook
        else:
            problem = webhook_problem(url)
            if problem is None and not is_allowed_webhook(url, self.allowed_tool_webhooks):
                problem = "not allowed: it must start with one of the server's allowed_tool_webhooks"
            if problem is not None:
                raise ValueError(f"{TOOL_WEBHOOK_PARAMETER}: {problem}")
        if not self.tools_of(start):
            return None
        if not url:
            raise ValueError(f"{TOOLS_PARAMETER}: {NO_WEBHOOK}")
        return ToolWebhook(url, self.tool_timeout_s, self.tool_fallback, self.tool_webhook_secret)


def twilio_settings(pipeline: PipelineConfig) -> TwilioSettings | None:
    """The pipeline config's `twilio:` section as the endpoint's settings (None: it has none); ConfigError naming
    the field (`TwilioSettings.from_config`)."""
    if pipeline.twilio is None:
        return None
    return TwilioSettings.from_config(pipeline.twilio, f"pipeline {quoted(pipeline.name)}")


def field_problem(exc: FieldError) -> str:
    """A parser's message without its "Invalid value for 'x': " lead, for messages that name the field already."""
    for kind in ("Invalid value", "Invalid type"):
        lead = f"{kind} for '{exc.param}': "
        if exc.message.startswith(lead):
            return exc.message[len(lead):]
    return exc.message


def check_greeting(greeting: Any) -> str:
    """`greeting` if it is a string of at most MAX_GREETING_CHARS characters, else ValueError."""
    if not isinstance(greeting, str) or len(greeting) > MAX_GREETING_CHARS:
        raise ValueError(f"greeting: must be a string of at most {MAX_GREETING_CHARS} characters")
    return greeting
