"""What a decoder checkpoint holds, by Hugging Face name: every tensor's shape (expected_shapes)
and one layer's tensors resolved once (LayerWeights), apart from the model that runs them."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .config import ModelConfig
from .linears import DenseLinears


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must provide, by Hugging Face name."""
    D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D),
                                          "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q_out, D), p + "self_attn.k_proj.weight": (kv_out, D),
            p + "self_attn.v_proj.weight": (kv_out, D), p + "self_attn.o_proj.weight": (D, q_out),
            p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
            p + "mlp.down_proj.weight": (D, I),
        })
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (D,)
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


class LayerWeights(NamedTuple):
    """One layer's checkpoint tensors, resolved once (the step loop does no name lookups)."""

    in_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None

    def dense(self) -> DenseLinears:
        return DenseLinears(self.q, self.k, self.v, self.o, self.gate, self.up, self.down,
                            self.q_bias, self.k_bias, self.v_bias, self.o_bias)

    @classmethod
    def of(cls, get: Callable[[str], torch.Tensor], cfg: ModelConfig, p: str) -> "LayerWeights":
        """Layer `p` ("model.layers.{i}.") of a checkpoint whose tensors `get` returns by name."""
        bias = cfg.qkv_bias
        return cls(
            get(p + "input_layernorm.weight"), get(p + "self_attn.q_proj.weight"),
            get(p + "self_attn.k_proj.weight"), get(p + "self_attn.v_proj.weight"),
            get(p + "self_attn.q_proj.bias") if bias else None,
            get(p + "self_attn.k_proj.bias") if bias else None,
            get(p + "self_attn.v_proj.bias") if bias else None,
            get(p + "self_attn.o_proj.weight"),
            get(p + "self_attn.o_proj.bias") if cfg.o_bias else None,
            get(p + "post_attention_layernorm.weight"),
            get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight"),
            get(p + "mlp.down_proj.weight"),
            get(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            get(p + "self_attn.k_norm.weight") if cfg.qk_norm else None)
