"""Code2Wav: the causal ConvNet vocoder of Qwen3-Omni (16 codebooks at 12.5 Hz -> 24 kHz PCM).

`config` (Code2WavConfig) is torch-free so configs can be read without importing torch; the model
is in `model` (Code2Wav) and the streaming state in `streaming` (Code2WavStreamState).
"""
