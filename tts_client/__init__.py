"""Client library, CLI and generated stubs for the Qwen3-TTS gRPC server (no torch needed)."""
