"""Test-only helpers shipped with the server: fault injection (`--inject-fault`)."""
