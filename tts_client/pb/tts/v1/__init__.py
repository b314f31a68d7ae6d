"""Generated gRPC stubs; do not edit (scripts/gen_protos.py)."""
