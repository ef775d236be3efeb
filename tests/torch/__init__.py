"""Tests of the torch helpers (``pagedkv.torch``): KV tensors, block tables, kernels, engine."""
