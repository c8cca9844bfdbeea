"""Qwen3-Omni talker: MoE codec decoder (codebook 0), code predictor (MTP), prefill builder. Import submodules."""
