"""Decode engines behind one contract: the PyTorch reference and the CUDA megakernel."""
