"""Plain PyTorch Qwen3-TTS decode math (the oracle), prompt building and model loading."""
