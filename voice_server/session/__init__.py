"""The session layer: WebSocket endpoints, turn detection and conversation state (numpy only, no torch).

- ``turn_config``: ``TurnDetectionConfig``, the validated OpenAI ``server_vad`` settings of a session;
- ``vad``: ``TurnDetector``, streaming speech start/stop detection on a session's input audio (webrtcvad);
- ``realtime``: the OpenAI Realtime protocol (client event parsing, session config, server event builders);
- ``twilio``: the Twilio Media Streams protocol (messages, outbound audio, what the caller has heard).
"""

from __future__ import annotations

from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.vad import SpeechStarted, SpeechStopped, TurnDetector, TurnEvent

__all__ = ["SpeechStarted", "SpeechStopped", "TurnDetectionConfig", "TurnDetector", "TurnEvent"]
