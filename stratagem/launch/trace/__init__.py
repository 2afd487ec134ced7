"""Traced fidelity: the harness's own training step of one rank, at full size, on fake tensors in a fake
process group (`run`), with a live-bytes counter that splits the peak into blocks (`fake`).
Import names from their modules (the package re-exports nothing): importing it imports no torch.
"""
