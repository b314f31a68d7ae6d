"""The gRPC layer: validation and conversion, the servicer, the server (no torch here)."""
