"""Decode engines behind one step contract (contract.py): the PyTorch reference, the CUDA megakernel."""
