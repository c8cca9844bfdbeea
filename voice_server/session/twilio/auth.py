"""Authenticating a Twilio Media Stream by a bearer token in the ``start`` message's custom parameters.

Twilio's WebSocket connection carries no credential of ours, but the TwiML that opens the stream is
written by our own HTTP handler, which adds ``<Parameter name="token" value="..."/>`` inside
``<Stream>``; Twilio forwards it in ``start.customParameters``. The key is ``token`` (the raw token) or
``authorization`` (``Bearer <token>`` or the raw token); keys match case-insensitively.

NOTE: a ``start`` holding more than one such key is refused: two candidates that might differ leave no
safe choice. The comparison is ``hmac.compare_digest`` on UTF-8 bytes (surrogates passed through, so a
lone surrogate in client JSON cannot raise), in constant time for equal lengths.
"""

from __future__ import annotations

import hmac

from voice_server.session.twilio.messages import TwilioStart

__all__ = ["TOKEN_PARAMETER_NAMES", "is_authorized", "start_token"]

TOKEN_PARAMETER_NAMES = ("token", "authorization")


def start_token(start: TwilioStart) -> str | None:
    """The bearer token in ``start.custom_parameters``, or None when absent, empty or ambiguous."""
    values = [v for k, v in start.custom_parameters.items() if k.lower() in TOKEN_PARAMETER_NAMES]
    if len(values) != 1:
        return None
    token = values[0].strip()
    scheme, _, rest = token.partition(" ")
    if scheme.lower() == "bearer":
        token = rest.strip()
    return token or None


def is_authorized(start: TwilioStart, expected_token: str) -> bool:
    """Whether ``start`` carries ``expected_token`` (ValueError if that is empty: a configuration error)."""
    if not isinstance(expected_token, str) or not expected_token:
        raise ValueError("expected_token must be a non-empty string")
    token = start_token(start)
    if token is None:
        return False
    return hmac.compare_digest(token.encode("utf-8", "surrogatepass"), expected_token.encode("utf-8", "surrogatepass"))
