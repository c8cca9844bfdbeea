"""Per-request state of the AR scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from voice_server.scheduling.ar_stop import StopChecker
from voice_server.scheduling.contract import SamplingParams
from voice_server.scheduling.pages import PageKey
from voice_server.scheduling.tool_calls import ToolCallGate


@dataclass(eq=False)
class Request:
    request_id: str
    sampling: SamplingParams
    stop: StopChecker
    token_ids: list[int]
    """Prompt then output ids. The prompt only grows while input is open, before any output."""
    is_input_done: bool
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    """Leading `token_ids` whose keys/values are in the request's pages."""
    page_ids: list[int] = field(default_factory=list)
    page_keys: list[PageKey] = field(default_factory=list)
    """Hash chain of the leading full, computed pages (one per page, in order)."""
    num_cached_tokens: int | None = None
    """Prompt tokens served by the prefix cache at first admission (None until admitted)."""
    num_preemptions: int = 0
    max_num_outputs: int | None = None
    """Output tokens this request may have so far (None: no limit but its stop conditions). A
    feedback stage's runner raises it as upstream input arrives (the talker makes a frame only once
    the text vector it feeds in is known); a sampling step beyond it waits."""
    num_cacheable_tokens: int | None = None
    """Leading tokens whose ids alone determine their keys/values (None: all). Tokens past it (audio
    placeholders, whose embeddings come from the audio) never hit or fill the prefix cache."""
    first_output_at: float | None = None
    """When the scheduler first saw an output of this request (`SpeechLead`); None before."""
    tools: ToolCallGate | None = None
    """Cuts tool calls out of the stream when the request offers tools (`params.tools`); None: off."""
    turn_end_pos: int | None = None
    """Position of the user's last prompt token, whose next token the runner scores as the end of the user's
    message (`payload.turn_end_pos`); None: not asked, or already streamed with the first output."""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_target_tokens(self) -> int:
        """Tokens to have computed before the next step can stop.

        All known tokens once input is done (the last chunk samples). While input is open the
        last known token is held back: when DONE comes there is still a token to compute, so the
        sampling step has logits even if no more input arrives.
        """
        return self.num_tokens if self.is_input_done else max(0, self.num_tokens - 1)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_target_tokens - self.num_computed_tokens

    @property
    def is_output_gated(self) -> bool:
        """The step that reaches the last known token would sample an output it may not have yet."""
        return (self.is_input_done and self.max_num_outputs is not None
                and self.num_tokens - self.num_prompt_tokens >= self.max_num_outputs)

    @property
    def num_ready_target_tokens(self) -> int:
        """`num_target_tokens`, but a gated request stops one short of the sampling step."""
        return max(0, self.num_target_tokens - (1 if self.is_output_gated else 0))

    @property
    def num_ready_tokens(self) -> int:
        """Tokens a step may compute for this request now."""
        return max(0, self.num_ready_target_tokens - self.num_computed_tokens)

    def extend_prompt(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    def reset_pages(self) -> None:
        """Forget the KV cache state (preemption: everything is recomputed on resume)."""
        self.num_computed_tokens = 0
        self.page_ids = []
        self.page_keys = []
