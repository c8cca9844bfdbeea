"""`PromptPositions`: the M-RoPE positions of a request's rows in the steps of the thinker and the talker, when its
prompt has images or videos (without them a row's position is its index, the paged context's own).

A prompt row takes its stored position ([3, L], from `get_rope_index`); a later row (streamed prompt text,
generated tokens, talker frames) sits at `p + delta` on every axis, `delta` = the prompt's largest position + 1
- L. Where a video's frame times are fractional the positions are float32, and a later row is the row before
+ 1 instead, as transformers' generate appends them: `p + delta` rounds once and lands an ulp away on long
prompts (`voice_server/models/qwen3_omni/thinker/rope.py` `continue_positions`). Those are kept on the host as
steps reach them, so a re-run row (a preempted request, a failed step) gets the same value.
"""

from __future__ import annotations

import torch

from voice_server.models.qwen3_omni.thinker.rope import continue_positions


class PromptPositions:
    def __init__(self, positions: torch.Tensor) -> None:
        """positions [3, L]: the prompt's, int64 or float32."""
        self.positions = positions
        self.delta = int(positions.max()) + 1 - positions.shape[1] if not positions.is_floating_point() else 0
        """Whole positions: row p past the prompt sits at p + delta on every axis."""
        self._later = positions[0, -1:].cpu() if positions.is_floating_point() else None
        """Fractional positions: the last prompt row's, then those of the rows past it reached so far ([n])."""

    @property
    def is_fractional(self) -> bool:
        return self._later is not None

    def rows(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of rows [start, end), in the prompt positions' dtype and device."""
        num_prompt = self.positions.shape[1]
        parts = [self.positions[:, start:min(end, num_prompt)]] if start < num_prompt else []
        if end > num_prompt:
            first = max(start, num_prompt)
            if self._later is None:
                later = torch.arange(first, end, device=self.positions.device) + self.delta
            else:
                # NOTE: _later[0] is the last prompt row's.
                if self._later.shape[0] < end - num_prompt + 1:
                    more = continue_positions(self._later[-1], end - num_prompt + 1 - self._later.shape[0])
                    self._later = torch.cat((self._later, more))
                later = self._later[first - num_prompt + 1:end - num_prompt + 1].to(self.positions.device)
            parts.append(later.expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
