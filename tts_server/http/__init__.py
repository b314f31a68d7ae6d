"""The OpenAI-compatible HTTP front door (aiohttp, in the gRPC server's event loop): request
conversion, the /v1/audio/speech handler, the server with auth, TLS and health (no torch here)."""
