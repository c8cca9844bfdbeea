"""Qwen3-Omni thinker: MoE text decoder with interleaved M-RoPE and audio placeholder merge."""
