"""Per-connection voice sessions: protocol layers, turn detection and conversation state."""
