"""How often a pipeline's thinker calls a tool when it should: 20 varied spoken-style requests, each with the
same four tools, through the thinker stage of a config built in this process exactly as its stage process
builds it (`create_runner`), under the serving scheduler (`run_local`: the one generation loop), so the
prompt rendering (`voice_server/models/chat_tools.py`) and the call cutting (`scheduling/tool_calls.py`) are
the server's. Each raw call is checked as a session checks it (`ToolSet.check`).

Columns per request: `request`; `expected` (the tool it should call, or `-` when none fits); `called` (what the
checked call names, or the refusal code); `spoken` (the text the talker would speak). The summary counts
good calls of the expected tool, calls of another tool, refused calls and no call at all.

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_tool_calls.py [--config configs/default.yaml]
       [--stage thinker] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from table import cpu_description, format_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Get the current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "book_table", "description": "Book a restaurant table for a number of people at a time.",
     "parameters": {"type": "object", "properties": {"people": {"type": "integer", "minimum": 1},
                                                     "time": {"type": "string"}}, "required": ["people"]}},
    {"name": "set_timer", "description": "Set a timer for a number of minutes.",
     "parameters": {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1}},
                    "required": ["minutes"]}},
    {"name": "transfer_call", "description": "Transfer the caller to a human agent in a department.",
     "parameters": {"type": "object", "properties": {"department": {"type": "string"}},
                    "required": ["department"]}},
]
REQUESTS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in London?", "get_weather"),
    ("How cold is it in Oslo today?", "get_weather"),
    ("Tell me the weather in Tokyo.", "get_weather"),
    ("Do I need an umbrella in Seattle?", "get_weather"),
    ("Book a table for two at eight tonight.", "book_table"),
    ("I'd like a table for four people tomorrow at seven.", "book_table"),
    ("Can you reserve a table for six?", "book_table"),
    ("Get me a dinner reservation for three at nine.", "book_table"),
    ("Set a timer for ten minutes.", "set_timer"),
    ("Remind me in five minutes.", "set_timer"),
    ("Start a twenty minute timer please.", "set_timer"),
    ("I want to talk to someone in billing.", "transfer_call"),
    ("Please transfer me to technical support.", "transfer_call"),
    ("Can I speak to a human in sales?", "transfer_call"),
    ("Connect me to the refunds department.", "transfer_call"),
    ("What is the capital of France?", "-"),
    ("Tell me a short joke.", "-"),
    ("How many legs does a spider have?", "-"),
    ("Thanks, that's all for today.", "-"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--stage", default="thinker")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    from voice_server.config import load_pipeline, plan_budget
    from voice_server.engine.local import LocalRequest
    from voice_server.engine.runtime import StageContext, create_runner
    from voice_server.runners.generate import run_local
    from voice_server.scheduling.tool_calls import OPEN_TAG
    from voice_server.session.tools import Tool, ToolCallError, ToolSet

    cfg = load_pipeline(args.config)
    stage = cfg.stage(args.stage)
    budgets = {b.stage: b.num_bytes for b in plan_budget(cfg)}
    runner = create_runner(StageContext(stage, cfg, budgets.get(stage.name), "bench-tool-calls"))
    tools = ToolSet(tuple(Tool(**t) for t in TOOLS))
    system = "You are a helpful voice assistant. Use a tool when one fits the request."
    requests = [LocalRequest(f"r{i}", {"messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": text}]},
                             {"tools": TOOLS, "sampling": {"max_tokens": args.max_tokens, "max_sentences": 0}})
                for i, (text, _) in enumerate(REQUESTS)]
    started = time.perf_counter()
    outcomes = run_local(runner, requests)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - started
    rows, tally = [], Counter()
    for i, (text, expected) in enumerate(REQUESTS):
        result = outcomes[f"r{i}"].result
        named: list[str] = []
        for raw in result.get("tool_calls", []):
            try:
                named.append(tools.check(raw, "c").name)
            except ToolCallError as exc:
                named.append(exc.code)
                if raw.startswith(OPEN_TAG):
                    named[-1] += " (unclosed)"
        if not named:
            outcome = "no call" if expected != "-" else "right: no call"
        elif expected in named:
            outcome = "right tool"
        elif any(n.startswith("tool_call_") for n in named):
            outcome = "refused call"
        else:
            outcome = "wrong tool" if expected != "-" else "call where none fits"
        tally[outcome] += 1
        rows.append({"request": text, "expected": expected, "called": ", ".join(named) or "-",
                     "spoken": " ".join(result["text"].split())[:60]})
    print(f"# {Path(args.config).name} stage {args.stage}, {len(REQUESTS)} requests in {elapsed:.1f} s")
    print(f"# {cpu_description()}")
    print(format_table(rows))
    print()
    print(format_table([{"outcome": k, "requests": v} for k, v in sorted(tally.items())]))


if __name__ == "__main__":
    main()
