"""Qwen3's config.json reading (q_norm / k_norm per head, explicit head_dim, no sliding window).

Logit parity with transformers runs in test_llm_parity.py (kind "qwen3" of hf_checkpoints), and
pre-RoPE fact capture after k_norm in test_memory_encode.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from capsule.errors import UnsupportedArchitecture
from capsule.llm.config import ModelConfig
from capsule.llm.model import expected_shapes

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "attention_bias": False,
         "use_sliding_window": False, "sliding_window": None,
         "layer_types": ["full_attention", "full_attention"],
         "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}


def test_qwen3_has_qk_norm_explicit_head_dim_and_no_bias():
    cfg = ModelConfig.from_hf(QWEN3)
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim) == ("qwen3", True, 32)
    assert not cfg.qkv_bias and not cfg.o_bias
    shapes = expected_shapes(cfg)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (32,)
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)   # not hidden / heads
    assert "model.layers.0.self_attn.q_proj.bias" not in shapes


def test_qwen3_by_model_type_alone_and_attention_bias_biases_all_four():
    cfg = ModelConfig.from_hf({**QWEN3, "architectures": None, "attention_bias": True})
    assert cfg.architecture == "qwen3" and cfg.qkv_bias and cfg.o_bias
    assert "model.layers.0.self_attn.o_proj.bias" in expected_shapes(cfg)


@pytest.mark.parametrize("change", [{"use_sliding_window": True, "sliding_window": 64},
                                    {"layer_types": ["full_attention", "sliding_attention"]}])
def test_sliding_window_is_refused(change):
    with pytest.raises(UnsupportedArchitecture, match="sliding-window"):
        ModelConfig.from_hf({**QWEN3, **change})


def test_llama_and_qwen2_have_no_qk_norm_and_keep_their_fingerprint():
    qwen2 = ModelConfig.from_hf({**QWEN3, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert not qwen2.qk_norm and "model.layers.0.self_attn.q_norm.weight" not in expected_shapes(qwen2)
    # the digest a model had before qk_norm existed: capsules bound to it still restore
    before = {k: v for k, v in dataclasses.asdict(qwen2).items() if k != "qk_norm"}
    assert qwen2.fingerprint() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    qwen3 = ModelConfig.from_hf(QWEN3)
    assert qwen3.fingerprint() != dataclasses.replace(qwen3, qk_norm=False).fingerprint()
