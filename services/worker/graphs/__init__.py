"""CUDA graphs of the decode, verify and draft passes (``cuda_graph``)."""
