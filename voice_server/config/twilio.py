"""The `twilio:` section of a pipeline config: what a deployment sets for its phone calls (`WS /twilio/media`,
`voice_server/session/twilio/`), and the rules of the tool webhook URLs.

In YAML (every field optional):

    twilio:
      instructions: "You are Acme's phone assistant. Be brief."
      greeting: "Greet the caller as Acme's assistant."   # the agent speaks first; "" waits for the caller
      tools:                                              # OpenAI function tools, as `/v1/realtime` takes them
        - {type: function, name: get_weather, description: "The weather in a city now.",
           parameters: {type: object, properties: {city: {type: string}}, required: [city]}}
      tool_webhook: https://tools.example.com/calls       # each call the model makes is POSTed here
      tool_timeout_s: 5                                   # no answer by then: the fallback is spoken
      tool_fallback: "Sorry, I can't look that up right now."
      allowed_tool_webhooks: [https://tools.example.com/] # prefixes a call's own `tool_webhook` must start with
      tool_webhook_secret_env: TOOL_WEBHOOK_SECRET        # sign each POST with the secret in this env variable

Rules (each a `ConfigError` naming `twilio.<field>`):
- `tools` need a `tool_webhook`: a call the model makes with nobody to answer it would hang the call;
- a webhook URL is `http` or `https`, with a host, without `user:password@`, without `.` or `..` path segments
  (a prefix check could be walked out of with them) and at most `MAX_URL_CHARS`;
- `tool_webhook_secret_env` names an environment variable (the secret stays out of the YAML), which must be set
  and non-empty when the settings are built;
- an allowed prefix is such a URL whose path ends with `/`: `https://tools.example.com` would also allow
  `https://tools.example.com.evil.net/`. A call may name its own webhook only where one is listed, because
  without a token anyone can set a call's `customParameters` (and make the server POST anywhere).

Here `tools` is checked for its shape (a list of mappings); each tool's fields and JSON schema are the
session's parser's (`parse_tools`, `voice_server/session/realtime/tool_fields.py`), run when `check-config` and
`serve` build the endpoint's settings (`TwilioSettings.from_config`): the config package imports no session code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from voice_server.config.errors import ConfigError, fail, quoted, show
from voice_server.config.fields import Number, Rule, check_fields

__all__ = ["TOOL_RULES", "TwilioConfig", "is_allowed_webhook", "twilio_from_dict", "webhook_problem"]

MAX_GREETING_CHARS = 2000
MAX_INSTRUCTIONS_CHARS = 100_000
"""`SessionConfig`'s own limit (`voice_server/session/config.py`)."""
MAX_URL_CHARS = 2048
MAX_ALLOWED_WEBHOOKS = 64
DEFAULT_TOOL_TIMEOUT_S = 5.0
MAX_TOOL_TIMEOUT_S = 60.0
"""The caller waits in silence meanwhile: a minute is already far past what a phone call bears."""
DEFAULT_TOOL_FALLBACK = "Sorry, I can't look that up right now."
NO_WEBHOOK = "needs a tool_webhook: a call the model makes would have nobody to answer it"
_UNSAFE = re.compile(r"[\x00-\x20\x7f\\]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


@dataclass(frozen=True)
class EnvName(Rule):
    """The name of an environment variable, or "" (none)."""

    def problem(self, value: object) -> str | None:
        if value == "" or (isinstance(value, str) and _ENV_NAME.fullmatch(value)):
            return None
        return f"must be an environment variable's name (letters, digits, _), got {show(value)}"


@dataclass(frozen=True)
class BoundedText(Rule):
    """A string of at most `max_chars` characters; empty only when `is_empty_allowed`."""

    max_chars: int
    is_empty_allowed: bool = True

    def problem(self, value: object) -> str | None:
        if not isinstance(value, str) or len(value) > self.max_chars:
            return f"must be a string of at most {self.max_chars} characters, got {show(value)}"
        return None if value or self.is_empty_allowed else "must not be empty"


@dataclass(frozen=True)
class WebhookURL(Rule):
    """An http(s) URL a webhook may have (`webhook_problem`), or "" (none) where `is_empty_allowed`."""

    is_empty_allowed: bool = True

    def problem(self, value: object) -> str | None:
        if value == "" and self.is_empty_allowed:
            return None
        return webhook_problem(value)


@dataclass(frozen=True)
class WebhookPrefixes(Rule):
    """A tuple of allowed webhook URL prefixes (`prefix_problem`)."""

    def problem(self, value: object) -> str | None:
        if not isinstance(value, tuple) or len(value) > MAX_ALLOWED_WEBHOOKS:
            return f"must be a list of at most {MAX_ALLOWED_WEBHOOKS} URL prefixes, got {show(value)}"
        for prefix in value:
            problem = prefix_problem(prefix)
            if problem is not None:
                return f"{quoted(prefix, 80)}: {problem}"
        return None


TOOL_RULES: dict[str, Rule] = {
    "greeting": BoundedText(MAX_GREETING_CHARS),
    "tool_webhook": WebhookURL(),
    "tool_timeout_s": Number(float, minimum=0.0, maximum=MAX_TOOL_TIMEOUT_S, is_min_exclusive=True),
    "tool_fallback": BoundedText(MAX_GREETING_CHARS, is_empty_allowed=False),
    "allowed_tool_webhooks": WebhookPrefixes(),
}
"""The fields `TwilioConfig` and the endpoint's `TwilioSettings` share, one rule each."""
_RULES: dict[str, Rule] = {"instructions": BoundedText(MAX_INSTRUCTIONS_CHARS), **TOOL_RULES,
                           "tool_webhook_secret_env": EnvName()}


@dataclass(frozen=True)
class TwilioConfig:
    instructions: str = ""
    """The calls' instructions (a call's `customParameters.instructions` replaces them)."""
    greeting: str = ""
    """The instructions of a response made at the call's start, before the caller speaks; "" waits."""
    tools: tuple[dict[str, Any], ...] = ()
    """OpenAI function tools (`{type: function, name, description, parameters}`) every call offers its model."""
    tool_webhook: str = ""
    """Where each call the model makes is POSTed (the contract: docs/PROTOCOLS.md, "WS /twilio/media")."""
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    """How long a webhook may take to answer; then the call's fallback is spoken."""
    tool_fallback: str = DEFAULT_TOOL_FALLBACK
    """What the agent says when a webhook times out, fails or answers with an error."""
    allowed_tool_webhooks: tuple[str, ...] = ()
    """URL prefixes a call's `customParameters.tool_webhook` must start with; none: a call may not name one."""
    tool_webhook_secret_env: str = ""
    """An environment variable holding the secret each webhook request is signed with (HMAC-SHA256); "" signs
    nothing."""

    def __post_init__(self) -> None:
        check_fields("twilio", self, _RULES)
        if not isinstance(self.tools, tuple) or not all(isinstance(tool, dict) for tool in self.tools):
            raise fail("twilio", "tools", f"must be a list of function tools (mappings), got {show(self.tools)}")
        if self.tools and not self.tool_webhook:
            raise fail("twilio", "tools", NO_WEBHOOK)


def twilio_from_dict(where: str, raw: object) -> TwilioConfig | None:
    """YAML's `twilio` mapping as a TwilioConfig (None when absent); ConfigErrors name `twilio.<field>`."""
    if raw is None:
        return None
    known = tuple(_RULES) + ("tools",)
    if not isinstance(raw, dict):
        raise fail(where, "twilio", f"must be a mapping of {', '.join(known)}, got {show(raw)}")
    unknown = sorted(str(key) for key in raw if key not in known)
    if unknown:
        raise fail(where, f"twilio.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})")
    kwargs = dict(raw)
    for name in ("tools", "allowed_tool_webhooks"):
        value = kwargs.get(name)
        if value is None:
            kwargs.pop(name, None)  # NOTE: `tools:` with nothing after it reads as null: none
        elif isinstance(value, list):
            kwargs[name] = tuple(value)
    try:
        return TwilioConfig(**kwargs)
    except ConfigError as exc:
        # NOTE: said from the pipeline, with the field's YAML path: `twilio.tool_timeout_s`.
        message = str(exc)
        prefix = "twilio: field '"
        if message.startswith(prefix):
            message = "field 'twilio." + message[len(prefix):]
        raise ConfigError(f"{where}: {message}") from exc


def webhook_problem(url: object) -> str | None:
    """What is wrong with `url` as a tool webhook, or None."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        return f"must be an http or https URL of at most {MAX_URL_CHARS} characters, got {show(url)}"
    if _UNSAFE.search(url):
        return "must not contain spaces, control characters or backslashes"
    try:
        parts = urlsplit(url)
        port = parts.port  # NOTE: raises ValueError for a port out of range or not a number
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    if port == 0 or "@" in parts.netloc:
        return "must name a host (and port) without user:password@"
    if parts.fragment:
        return "must not have a #fragment"
    if any(segment in (".", "..") for segment in unquote(parts.path).split("/")):
        return "must not have '.' or '..' path segments"
    return None


def prefix_problem(prefix: object) -> str | None:
    """What is wrong with `prefix` as an allowed webhook prefix (a webhook URL whose path ends with `/`), or None."""
    problem = webhook_problem(prefix)
    if problem is not None:
        return problem
    assert isinstance(prefix, str)
    parts = urlsplit(prefix)
    if parts.query or not parts.path.endswith("/"):
        return (f"must end its path with '/' and have no query (e.g. '{parts.scheme}://{parts.netloc}/'): "
                "a prefix without it also allows other hosts or paths")
    return None


def is_allowed_webhook(url: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `url` (a checked webhook URL) starts with one of `prefixes`, compared as written."""
    return any(url.startswith(prefix) for prefix in prefixes)
