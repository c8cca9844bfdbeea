"""`voice-server ask`: start a pipeline's stage processes, send one chat request, stream the reply's
text to stdout as it is produced, then stop. The quickest check that a text pipeline serves (the
same coordinator, processes and relay as `serve`, without HTTP)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, TextIO

from voice_server.config import PipelineConfig
from voice_server.config.errors import one_line
from voice_server.engine.coordinator import Coordinator, RequestError, StartupError


async def ask(cfg: PipelineConfig, messages: list[dict[str, str]], sampling: dict[str, Any], out: TextIO) -> int:
    coordinator = Coordinator(cfg)
    try:
        await coordinator.start()
    except StartupError as exc:
        print(f"start-up error: {one_line(str(exc), max_len=2000)}", file=sys.stderr)
        return 2
    try:
        start = time.perf_counter()
        first_s: float | None = None
        final: dict[str, Any] = {}
        async for output in coordinator.submit({"messages": messages}, {"sampling": sampling}):
            if output.is_final:
                final = output.payload
                continue
            first_s = first_s if first_s is not None else time.perf_counter() - start
            out.write(str(output.payload.get("text", "")))
            out.flush()
        total_s = time.perf_counter() - start
        num_tokens = len(final.get("token_ids", []))
        decode_s = total_s - (first_s or 0.0)
        rate = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0
        print(f"\n[{num_tokens} tokens, finish {final.get('finish_reason')}, "
              f"first token {1e3 * (first_s or 0):.0f} ms, {rate:.1f} tok/s after it, "
              f"{final.get('num_cached_tokens', 0)} prompt tokens from the prefix cache]", file=sys.stderr)
        return 0
    except RequestError as exc:
        print(f"request failed: {one_line(str(exc), max_len=2000)}", file=sys.stderr)
        return 1
    finally:
        await coordinator.stop()


def run_ask(cfg: PipelineConfig, question: str, system: str | None, max_tokens: int | None) -> int:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    sampling = {"max_tokens": max_tokens} if max_tokens else {}
    return asyncio.run(ask(cfg, messages, sampling, sys.stdout))
