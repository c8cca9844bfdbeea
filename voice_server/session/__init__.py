"""The session layer: WebSocket protocols between callers (browsers, telephony) and the engine."""
