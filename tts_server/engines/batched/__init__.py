"""Batched decode engine: B streams per step in CUDA graphs of batch-invariant Triton kernels."""
