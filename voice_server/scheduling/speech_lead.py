"""`SpeechLead`: under load, an `ar` stage whose text becomes speech serves first the replies whose listeners
are still waiting.

A reply is spoken at a few tokens a second, but decoded on a CPU it runs seconds ahead of its playout once
its first clause is out. In one batch every sequence makes each step dearer (w4a8 SmolLM2, one core: 8.9 ms
a step for one sequence, 15 ms for 4, 26 ms for 8), so replies already seconds ahead slow down those whose
listeners hear nothing yet. So a running request whose output is at least `lead_s` of speech ahead sits out
steps while another request is behind (it has no output yet, or less than `lead_s` of it ahead); with none
behind, every request steps, and a stage where no one waits loses nothing.

The playout is reckoned from the request's first output at `TOKENS_PER_SPEECH_S`, faster than people speak
(~3-4 tokens a second of English): a reply's audio starts after its first token and plays slower than that,
so its real lead is never shorter than the reckoned one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from voice_server.scheduling.ar_request import Request

TOKENS_PER_SPEECH_S = 6.0
"""Output tokens a second of speech is taken to hold (more than it does: see the module docstring)."""


class SpeechLead:
    def __init__(self, lead_s: float) -> None:
        if isinstance(lead_s, bool) or not isinstance(lead_s, int | float) or not 0 < lead_s < math.inf:
            raise ValueError(f"SpeechLead.lead_s: must be a number > 0, got {lead_s!r}")
        self.lead_s = float(lead_s)

    def lead_of(self, request: Request, now: float) -> float:
        """Seconds of speech `request` has output beyond what its listener has heard (-inf: no output yet)."""
        num_outputs = request.num_tokens - request.num_prompt_tokens
        if num_outputs == 0:
            return -math.inf
        if request.first_output_at is None:
            request.first_output_at = now  # NOTE: the step after the first token's: one step late, ~10-25 ms
        return num_outputs / TOKENS_PER_SPEECH_S - (now - request.first_output_at)

    def ahead(self, running: Iterable[Request], is_admitting: bool, now: float) -> set[Request]:
        """The running requests to leave out of this step: those `lead_s` ahead while another is behind
        (`is_admitting`: a waiting request will be admitted this step, and it is behind)."""
        ready = [r for r in running if r.num_ready_tokens > 0]
        ahead = {r for r in ready if self.lead_of(r, now) >= self.lead_s}
        if len(ahead) == len(ready) and not is_admitting:
            return set()
        return ahead
