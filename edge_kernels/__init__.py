"""Tensor kernels: plain torch (the same code on CPU and CUDA) unless marked Triton.

- ``bpe``: batched byte-level BPE merges over pre-token pieces (exact parallel merge rounds).
- ``rope``: rotate pre-RoPE keys to their serving positions and scatter K/V into the paged cache.
- ``paged_decode`` (Triton, imported lazily): T=1 paged attention whose work follows each row's
  live length inside a captured graph; on CPU only under TRITON_INTERPRET=1.

Planned (each arrives with its issue): page digests for delta checkpoints.
"""
