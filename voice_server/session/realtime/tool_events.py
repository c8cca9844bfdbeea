"""The server events and items of function calling (OpenAI Realtime GA): a ``function_call`` item the model made,
a ``function_call_output`` item the client added, and the arguments' ``delta``/``done`` events."""

from __future__ import annotations

from typing import Any

from voice_server.session.realtime.server_events import server_event


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, *,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def function_call_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call_output", "status": "completed",
            "call_id": call_id, "output": output}


def function_call_arguments_delta(response_id: str, item_id: str, output_index: int, call_id: str,
                                  delta: str) -> dict[str, Any]:
    return server_event("response.function_call_arguments.delta", response_id=response_id, item_id=item_id,
                  output_index=output_index, call_id=call_id, delta=delta)


def function_call_arguments_done(response_id: str, item_id: str, output_index: int, call_id: str, name: str,
                                 arguments: str) -> dict[str, Any]:
    return server_event("response.function_call_arguments.done", response_id=response_id, item_id=item_id,
                  output_index=output_index, call_id=call_id, name=name, arguments=arguments)
