"""Tensor kernels with a torch reference and a CUDA variant where a GPU is present.

Planned here (each arrives with its issue): batched BPE merges (incremental tokenization),
RoPE rotate + scatter into the paged cache (memory facts), page digests (delta checkpoints).
"""
