"""Tensor kernels in plain torch: the same code runs on CPU tensors and, unchanged, on CUDA.

- ``bpe``: batched byte-level BPE merges over pre-token pieces (exact parallel merge rounds).
- ``rope``: rotate pre-RoPE keys to their serving positions and scatter K/V into the paged cache.

Planned (each arrives with its issue): page digests for delta checkpoints.
"""
