"""Decoder configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 family."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import UnsupportedArchitecture

# model_type -> whether q/k/v carry a bias by construction (Qwen2 always does; Llama and
# Qwen3 only with attention_bias)
_ARCHITECTURES = {"llama": False, "qwen2": True, "qwen3": False}
_ARCH_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# model_types whose attention RMS-normalizes each head of q and k before RoPE
_QK_NORM = ("qwen3",)
_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (rotate-half convention)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise UnsupportedArchitecture(
                f"rope type {self.rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)} "
                "(YaRN and dynamic NTK change with position and cannot be cached pre-RoPE)")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be > 0, got {self.theta}, {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder. Validates itself on construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False  # Llama's and Qwen3's attention_bias also biases o_proj; Qwen2 never does
    tie_embeddings: bool = False
    max_position: int = 32768
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    architecture: str = "llama"
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.architecture not in _ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(sorted(_ARCHITECTURES))}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per element byte."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Digest of the shape and numerics (not the weights)."""
        d = self.to_dict()
        if not d["qk_norm"]:
            del d["qk_norm"]  # left out when off: models from before the field keep their digest
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x and 5.x layouts)."""
        arch = _model_type(cfg)
        sliding = [t for t in cfg.get("layer_types") or () if t != "full_attention"]
        if cfg.get("use_sliding_window") or sliding:
            raise UnsupportedArchitecture("sliding-window attention is not supported; "
                                          "use a checkpoint with use_sliding_window=false"
                                          + (f" (layer_types lists {sliding[0]!r})" if sliding else ""))
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitecture(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if cfg.get("mlp_bias"):
            raise UnsupportedArchitecture("mlp_bias=true is not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                qkv_bias=_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False)),
                o_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position=int(cfg.get("max_position_embeddings", 32768)),
                rope=_rope_from_hf(cfg),
                architecture=arch,
                qk_norm=arch in _QK_NORM,
            )
        except KeyError as exc:
            raise UnsupportedArchitecture(f"config.json lacks required key {exc.args[0]!r}") from None


def _model_type(cfg: Mapping[str, Any]) -> str:
    for cls_name in cfg.get("architectures") or ():
        if cls_name in _ARCH_CLASSES:
            return _ARCH_CLASSES[cls_name]
    model_type = cfg.get("model_type")
    if model_type in _ARCHITECTURES:
        return model_type
    found = cfg.get("architectures") or model_type
    raise UnsupportedArchitecture(
        f"architecture {found!r} is not supported; supported: "
        f"{', '.join(sorted(_ARCH_CLASSES))} (model_type {', '.join(sorted(_ARCHITECTURES))})")


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    # transformers 5 folds theta and scaling into rope_parameters; 4.x keeps rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type != "llama3":
        return RopeConfig(theta=theta, rope_type=str(rope_type))  # raises with the supported list
    return RopeConfig(
        theta=theta, rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
