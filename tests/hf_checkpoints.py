"""Small random Llama / Qwen2 / Qwen3 checkpoints written by transformers itself, for parity tests."""
from __future__ import annotations

from pathlib import Path

import torch

CHECKPOINT_KINDS = ("llama", "llama3-scaled", "qwen2", "llama-tied", "qwen3")


def make_checkpoint(kind: str, folder: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a random transformers model of `kind` to `folder` and return the folder."""
    transformers = __import__("transformers")
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
    elif kind == "llama-tied":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True)
    elif kind == "llama3-scaled":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
    elif kind == "qwen3":  # head_dim 32 != hidden / heads (16), as real Qwen3 models have
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {CHECKPOINT_KINDS}")
    torch.manual_seed(seed)
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}.get(kind, transformers.LlamaForCausalLM)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random norms and biases so a wrong wiring cannot hide behind ones/zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def load_reference(folder: Path):
    transformers = __import__("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
