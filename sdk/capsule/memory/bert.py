"""A small BERT encoder in plain torch: ``BertModel``'s forward (post-LN, exact-erf GELU, SDPA
with a key mask) for sentence embedders such as all-MiniLM-L6-v2. Weights come memory-mapped
from a safetensors file; "bert."-prefixed and old gamma/beta names are accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError, UnsupportedArchitecture
from ..llm.safetensors_mmap import read_safetensors


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_positions: int
    type_vocab_size: int
    eps: float

    @staticmethod
    def from_json(cfg: dict, where: Path) -> BertConfig:
        if cfg.get("model_type", "bert") != "bert":
            raise UnsupportedArchitecture(f"{where}: model_type {cfg.get('model_type')!r}; only 'bert'")
        if cfg.get("hidden_act", "gelu") != "gelu":   # exact erf GELU only, as MiniLM uses
            raise UnsupportedArchitecture(f"{where}: hidden_act {cfg['hidden_act']!r}; only 'gelu'")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedArchitecture(f"{where}: only absolute position embeddings")
        try:
            c = BertConfig(int(cfg["vocab_size"]), int(cfg["hidden_size"]),
                            int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]),
                            int(cfg["intermediate_size"]), int(cfg["max_position_embeddings"]),
                            int(cfg.get("type_vocab_size", 2)), float(cfg.get("layer_norm_eps", 1e-12)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{where}: config.json lacks or mangles {exc}") from None
        if c.dim % c.n_heads:
            raise ModelLoadError(f"{where}: hidden_size {c.dim} not divisible by {c.n_heads} heads")
        return c


class Bert:
    """Inference-only BERT encoder over a dict of fp32 tensors (all on one device)."""

    def __init__(self, cfg: BertConfig, w: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, w

    @staticmethod
    def from_safetensors(cfg: BertConfig, path: Path, device: torch.device) -> Bert:
        raw = {}
        for k, t in read_safetensors(path).items():
            k = k.removeprefix("bert.")   # BertForMaskedLM & co. prefix the encoder
            k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            raw[k] = t

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = raw.get(name)
            if t is None:
                raise ModelLoadError(f"{path}: tensor {name!r} is missing")
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, want {shape}")
            # fp32 mmap views stay views on CPU: untouched embedding rows are never read
            return t.to(device=device, dtype=torch.float32)

        D, Fd = cfg.dim, cfg.ffn_dim
        w = {"word": get("embeddings.word_embeddings.weight", (cfg.vocab_size, D)),
             "pos": get("embeddings.position_embeddings.weight", (cfg.max_positions, D)),
             "type": get("embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, D)),
             "ln_w": get("embeddings.LayerNorm.weight", (D,)), "ln_b": get("embeddings.LayerNorm.bias", (D,))}
        for i in range(cfg.n_layers):
            p = f"encoder.layer.{i}."
            a = p + "attention.self."
            # one fused QKV projection: a single GEMM instead of three
            w[f"{i}.qkv_w"] = torch.cat([get(a + n + ".weight", (D, D)) for n in ("query", "key", "value")])
            w[f"{i}.qkv_b"] = torch.cat([get(a + n + ".bias", (D,)) for n in ("query", "key", "value")])
            for ours, theirs, shape in (("o", "attention.output.dense", (D, D)),
                                        ("up", "intermediate.dense", (Fd, D)), ("down", "output.dense", (D, Fd))):
                w[f"{i}.{ours}_w"] = get(p + theirs + ".weight", shape)
                w[f"{i}.{ours}_b"] = get(p + theirs + ".bias", (shape[0],))
            for ours, theirs in (("ln1", "attention.output.LayerNorm"), ("ln2", "output.LayerNorm")):
                w[f"{i}.{ours}_w"] = get(p + theirs + ".weight", (D,))
                w[f"{i}.{ours}_b"] = get(p + theirs + ".bias", (D,))
        return Bert(cfg, w)

    def to(self, device: torch.device) -> Bert:
        return Bert(self.cfg, {k: t.to(device) for k, t in self.w.items()})

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids (B, T) int64, mask (B, T) bool (True = real token) -> hidden states (B, T, D)."""
        c, w = self.cfg, self.w
        B, T = ids.shape
        H, hd = c.n_heads, c.dim // c.n_heads
        x = w["word"][ids] + w["pos"][:T] + w["type"][0]              # (B, T, D); single-segment input
        x = F.layer_norm(x, (c.dim,), w["ln_w"], w["ln_b"], c.eps)
        attn_mask = mask[:, None, None, :]                            # (B, 1, 1, T): keys only
        for i in range(c.n_layers):
            qkv = F.linear(x, w[f"{i}.qkv_w"], w[f"{i}.qkv_b"])       # (B, T, 3D)
            q, k, v = qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, T, hd)
            y = y.transpose(1, 2).reshape(B, T, c.dim)                # (B, T, D)
            x = F.layer_norm(x + F.linear(y, w[f"{i}.o_w"], w[f"{i}.o_b"]), (c.dim,),
                             w[f"{i}.ln1_w"], w[f"{i}.ln1_b"], c.eps)  # post-LN
            h = F.gelu(F.linear(x, w[f"{i}.up_w"], w[f"{i}.up_b"]))  # (B, T, F); exact erf GELU
            x = F.layer_norm(x + F.linear(h, w[f"{i}.down_w"], w[f"{i}.down_b"]), (c.dim,),
                             w[f"{i}.ln2_w"], w[f"{i}.ln2_b"], c.eps)
        return x
