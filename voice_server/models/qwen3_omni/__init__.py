"""Qwen3-Omni (thinker + talker/MTP + code2wav). Import submodules directly; nothing heavy is loaded here."""
