"""Audio front end (16 kHz log-mel) and the Whisper-style audio encoder of the Qwen3-Omni thinker."""
