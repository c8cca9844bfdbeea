"""The vision tower of the Qwen3-Omni thinker (a SigLIP2-style ViT with 2D rotary and DeepStack mergers).

`config` (VisionEncoderConfig) is torch-free so configs can be read without importing torch; the index
tensors a batch's `grid_thw` implies are in `grid`, the modules in `encoder` (VisionEncoder).
"""
