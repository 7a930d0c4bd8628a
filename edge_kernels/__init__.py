"""Tensor kernels: plain torch (the same code on CPU and CUDA) unless marked Triton.

- ``bpe``: batched byte-level BPE merges over pre-token pieces (exact parallel merge rounds).
- ``regex_split``: GPT-family regex pre-tokenization of UTF-8 bytes (match lengths, then the
  match chain by pointer doubling).
- ``bpe_fused`` (Triton, imported lazily): the same merges, one launch per length bucket, every
  round of a row in registers (no host sync per round); on CPU only under TRITON_INTERPRET=1.
- ``rope``: rotate pre-RoPE keys to their serving positions and scatter K/V into the paged cache.
- ``paged_decode`` (Triton, imported lazily): T=1 paged attention whose work follows each row's
  live length inside a captured graph; on CPU only under TRITON_INTERPRET=1.
- ``triton_mode``: where a Triton kernel may run (CUDA, or the interpreter on CPU).

Planned (each arrives with its issue): page digests for delta checkpoints.
"""
