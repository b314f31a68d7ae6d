"""Generated gRPC stubs (tts.v1); do not edit: regenerate with `make protos`."""
