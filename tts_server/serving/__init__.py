"""Serving: the engine thread (loop, watchdog), the scheduling policy, streams and chunk emission."""
