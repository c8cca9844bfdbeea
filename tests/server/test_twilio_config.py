"""What a deployment sets for its phone calls: the pipeline config's `twilio:` section
(`voice_server/config/twilio.py`), the endpoint's `TwilioSettings` built from it (the tools by the session's own
parser), what a call's `customParameters` may change (tools, and a webhook only where the server allows its
URL), and the section reaching `WS /twilio/media` through `check-config` and `serve` on real processes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from serving import NUMERIC_CONFIG, ServerProcess
from twilio_phone import Phone

from voice_server.cli import main
from voice_server.config import ConfigError, pipeline_from_dict
from voice_server.config.twilio import DEFAULT_TOOL_FALLBACK, DEFAULT_TOOL_TIMEOUT_S
from voice_server.session.tools import Tool
from voice_server.session.twilio import TwilioMediaFormat, TwilioStart
from voice_server.session.twilio.settings import TwilioSettings, twilio_settings

WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HOOK = "https://tools.example.com/calls"
ALLOWED = "https://tools.example.com/"
STAGES = [{"name": "a", "factory": "voice_server.stages.numeric:create_sink", "terminal": True}]


def pipeline(**twilio: Any) -> dict[str, Any]:
    return {"name": "p", "stages": STAGES, "twilio": twilio}


def start(**custom: str) -> TwilioStart:
    return TwilioStart(1, "MZ1", "AC1", "CA1", ("inbound",), custom, TwilioMediaFormat("audio/x-mulaw", 8000, 1))


def test_a_twilio_section_becomes_the_endpoints_settings() -> None:
    cfg = pipeline_from_dict(pipeline(instructions="Be brief.", greeting="Say hello.", tools=[WEATHER],
                                      tool_webhook=HOOK, tool_timeout_s=2, allowed_tool_webhooks=[ALLOWED]))
    settings = twilio_settings(cfg)
    assert settings is not None
    assert (settings.instructions, settings.greeting, settings.tool_webhook, settings.tool_timeout_s) == (
        "Be brief.", "Say hello.", HOOK, 2.0)
    assert settings.tools == (Tool("get_weather", WEATHER["description"], WEATHER["parameters"]),)
    assert settings.tool_fallback == DEFAULT_TOOL_FALLBACK and settings.allowed_tool_webhooks == (ALLOWED,)
    # Absent, or every field left out: the defaults.
    assert twilio_settings(pipeline_from_dict({"name": "p", "stages": STAGES})) is None
    empty = twilio_settings(pipeline_from_dict(pipeline()))
    assert empty is not None and empty.tools == () and empty.tool_timeout_s == DEFAULT_TOOL_TIMEOUT_S


@pytest.mark.parametrize(("twilio", "field", "problem"), [
    ({"tools": [WEATHER]}, "twilio.tools", "needs a tool_webhook"),
    ({"tools": {"get_weather": WEATHER}, "tool_webhook": HOOK}, "twilio.tools", "must be a list"),
    ({"tool_timeout_s": 0}, "twilio.tool_timeout_s", "must be a number in (0, 60]"),
    ({"tool_timeout_s": "5s"}, "twilio.tool_timeout_s", "must be a number"),
    ({"tool_fallback": ""}, "twilio.tool_fallback", "must not be empty"),
    ({"greeting": "x" * 2001}, "twilio.greeting", "at most 2000 characters"),
    ({"instructions": 7}, "twilio.instructions", "must be a string"),
    ({"tool_webhook": "ftp://tools.example.com/"}, "twilio.tool_webhook", "http:// or https://"),
    ({"tool_webhook": "https://me:pw@tools.example.com/"}, "twilio.tool_webhook", "without user:password@"),
    ({"tool_webhook": "https://tools.example.com/a/%2e%2e/b"}, "twilio.tool_webhook", "'..' path segments"),
    ({"tool_webhook": "https://tools.example.com/a b"}, "twilio.tool_webhook", "spaces"),
    ({"allowed_tool_webhooks": ["https://tools.example.com"]}, "twilio.allowed_tool_webhooks", "end its path"),
    ({"allowed_tool_webhooks": ALLOWED}, "twilio.allowed_tool_webhooks", "must be a list"),
    ({"tool_hook": HOOK}, "twilio.tool_hook", "unknown field"),
    ({"tool_webhook_secret_env": "my secret"}, "twilio.tool_webhook_secret_env", "environment variable's name"),
])
def test_a_bad_field_is_a_config_error_naming_it(twilio: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(pipeline(**twilio))
    assert f"field '{field}': " in str(info.value) and problem in str(info.value), info.value


@pytest.mark.parametrize(("tool", "field"), [
    ({**WEATHER, "name": "get weather"}, "twilio.tools[0].name"),
    ({**WEATHER, "parameters": {"type": 5}}, "twilio.tools[0].parameters"),
    ({**WEATHER, "type": "mcp"}, "twilio.tools[0].type"),
    ({**WEATHER, "strict": True}, "twilio.tools[0].strict"),
])
def test_a_bad_tool_is_refused_by_the_sessions_parser_naming_it(tool: dict[str, Any], field: str) -> None:
    cfg = pipeline_from_dict(pipeline(tools=[tool], tool_webhook=HOOK))
    with pytest.raises(ConfigError) as info:
        twilio_settings(cfg)
    assert str(info.value).startswith(f"pipeline 'p': field '{field}': "), info.value


def test_the_webhook_secret_comes_from_the_environment_and_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = pipeline_from_dict(pipeline(tools=[WEATHER], tool_webhook=HOOK, tool_webhook_secret_env="HOOK_SECRET"))
    monkeypatch.delenv("HOOK_SECRET", raising=False)
    with pytest.raises(ConfigError, match="twilio.tool_webhook_secret_env': the environment variable HOOK_SECRET"):
        twilio_settings(cfg)
    monkeypatch.setenv("HOOK_SECRET", "s3cr3t-value")
    settings = twilio_settings(cfg)
    assert settings is not None and settings.tool_webhook_secret == "s3cr3t-value"
    webhook = settings.webhook_of(start())
    assert webhook is not None and webhook.secret == "s3cr3t-value"
    assert "s3cr3t" not in repr(settings) and "s3cr3t" not in repr(webhook)  # NOTE: settings and webhooks get logged


def test_settings_check_their_own_fields() -> None:
    tools = (Tool("get_weather"),)
    with pytest.raises(ValueError, match="field 'tools': needs a tool_webhook"):
        TwilioSettings(tools=tools)
    with pytest.raises(ValueError, match="field 'tool_timeout_s'"):
        TwilioSettings(tool_timeout_s=-1)
    with pytest.raises(ValueError, match="field 'params'"):
        TwilioSettings(params=(("tools", []),))
    with pytest.raises(ValueError, match="unique"):
        TwilioSettings(tools=tools * 2, tool_webhook=HOOK)


def test_a_call_gets_the_settings_tools_or_its_own_and_a_webhook_only_where_allowed() -> None:
    settings = TwilioSettings(tools=(Tool("get_weather"),), tool_webhook=HOOK, allowed_tool_webhooks=(ALLOWED,))
    params = dict(settings.session_config(start()).params)
    assert [t["name"] for t in params["tools"]] == ["get_weather"] and params["tool_choice"] == "auto"
    webhook = settings.webhook_of(start())
    assert webhook is not None and (webhook.url, webhook.timeout_s) == (HOOK, DEFAULT_TOOL_TIMEOUT_S)
    # A call's own tools replace the settings'; its own webhook must start with an allowed prefix.
    own = start(tools=json.dumps([{"type": "function", "name": "book_table"}]), tool_webhook=ALLOWED + "book")
    assert [t["name"] for t in dict(settings.session_config(own).params)["tools"]] == ["book_table"]
    assert settings.webhook_of(own) == type(webhook)(ALLOWED + "book", DEFAULT_TOOL_TIMEOUT_S, DEFAULT_TOOL_FALLBACK)
    for url in ("https://tools.example.com.evil.net/", "http://tools.example.com/", "http://169.254.169.254/"):
        with pytest.raises(ValueError, match="^tool_webhook: not allowed"):
            settings.webhook_of(start(tool_webhook=url))
    with pytest.raises(ValueError, match=r"^tool_webhook: must not have '\.' or '\.\.' path segments"):
        settings.webhook_of(start(tool_webhook=ALLOWED + "../admin"))
    # No webhook: a call may not have tools (nobody would answer), and without tools it needs none.
    bare = TwilioSettings()
    assert bare.webhook_of(start()) is None and "tools" not in dict(bare.session_config(start()).params)
    with pytest.raises(ValueError, match="^tools: needs a tool_webhook"):
        bare.webhook_of(start(tools=json.dumps([WEATHER])))
    with pytest.raises(ValueError, match="^tools: must be a JSON array"):
        bare.session_config(start(tools="[" * 100_000))


def test_check_config_runs_the_tools_through_the_sessions_parser(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    raw = yaml.safe_load(NUMERIC_CONFIG.read_text())
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({**raw, "twilio": {"tools": [WEATHER], "tool_webhook": HOOK}}))
    bad.write_text(yaml.safe_dump({**raw, "twilio": {"tools": [{**WEATHER, "parameters": {"type": 5}}],
                                                     "tool_webhook": HOOK}}))
    assert main(["check-config", str(good)]) == 0
    assert main(["check-config", str(bad)]) == 2
    assert "config error: pipeline 'test-numeric': field 'twilio.tools[0].parameters'" in capsys.readouterr().err


def test_serve_gives_the_twilio_section_to_the_endpoint(serve_process: Callable[..., ServerProcess],
                                                       tmp_path: Path) -> None:
    raw = yaml.safe_load(NUMERIC_CONFIG.read_text())
    config = tmp_path / "twilio.yaml"
    config.write_text(yaml.safe_dump({**raw, "twilio": {
        "tools": [WEATHER], "tool_webhook": HOOK, "allowed_tool_webhooks": ["http://127.0.0.1:9/tools/"]}}))
    server = serve_process(config=config)
    server.wait_healthy()
    # A webhook under the configured prefix is taken; any other closes the call with 1008.
    allowed = Phone(server.port, "ok")
    allowed.start(tool_webhook="http://127.0.0.1:9/tools/weather")
    refused = Phone(server.port, "no")
    refused.start(tool_webhook="http://127.0.0.1:9/admin/")
    assert refused.closed_with() == 1008
    allowed.stop()
    assert allowed.closed_with() == 1000
    # A bad section stops `serve` before it starts, naming the field.
    config.write_text(yaml.safe_dump({**raw, "twilio": {"tool_timeout_s": 0}}))
    bad = serve_process(config=config)
    assert bad.proc.wait(30) == 2
    assert "config error: pipeline 'test-numeric': field 'twilio.tool_timeout_s': must be a number" in bad.stderr
