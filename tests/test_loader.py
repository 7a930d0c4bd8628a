"""load_model: HF folders (single and sharded), builtin presets, and damaged inputs."""
from __future__ import annotations

import struct

import pytest
import torch

from capsule.errors import ModelLoadError, UnsupportedArchitecture
from capsule.llm import load_model
from capsule.llm.config import ModelConfig
from capsule.paths import cache_dir
from capsule.llm.safetensors_mmap import read_safetensors
from hf_checkpoints import load_reference, make_checkpoint


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "one")
    ref = load_reference(folder)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, info_a = load_model(folder)
    b, info_b = load_model(tmp_path / "sharded")
    for name, t in a.w.items():
        assert torch.equal(t, b.w[name]), name
    assert info_a.weights_digest != info_b.weights_digest  # digests are of the files as stored


def test_builtin_is_materialized_once_and_seeded(tmp_path):
    m1, i1 = load_model("builtin:tiny", vocab_size=300)
    files = sorted((cache_dir() / "builtin").glob("tiny-v300-*.safetensors"))
    stamp = [f.stat().st_mtime_ns for f in files]
    m2, i2 = load_model("builtin:tiny", vocab_size=300)
    assert [f.stat().st_mtime_ns for f in files] == stamp           # reused, not regenerated
    assert i1.weights_digest == i2.weights_digest and i1.untrained
    m3, i3 = load_model("builtin:tiny", vocab_size=300, seed=1)
    assert i3.weights_digest != i1.weights_digest
    name = "model/embed_tokens/weight"
    assert torch.equal(m1.w[name], m2.w[name]) and not torch.equal(m1.w[name], m3.w[name])
    assert m1.cfg.vocab_size == 300 and m1.cfg.tie_embeddings


def test_truncated_safetensors_is_refused(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "ckpt")
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="do not fit"):
        load_model(folder)
    f.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(ModelLoadError, match="header length"):
        read_safetensors(f)
    f.write_bytes(b"abc")
    with pytest.raises(ModelLoadError, match="not a safetensors"):
        read_safetensors(f)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = make_checkpoint("llama", tmp_path / "ckpt")
    w = load_file(folder / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_model(folder)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_position_dependent_rope_scaling_is_refused(rope):
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": rope}
    with pytest.raises(UnsupportedArchitecture, match="default, llama3"):
        ModelConfig.from_hf(cfg)


def test_transformers4_and_5_config_layouts_agree():
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    v4 = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": scaling})
    v5 = ModelConfig.from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert v4 == v5 and v4.rope.rope_type == "llama3" and v4.rope.theta == 5e5


def test_bad_config_values():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3,
                    num_kv_heads=2, head_dim=4)
    with pytest.raises(UnsupportedArchitecture, match="num_attention_heads"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10})
    with pytest.raises(UnsupportedArchitecture, match="sliding-window"):
        ModelConfig.from_hf({"model_type": "qwen2", "use_sliding_window": True})


def test_only_the_checkpoints_own_weight_files_are_read(tmp_path):
    import json
    import shutil
    folder = make_checkpoint("llama", tmp_path / "one")
    other = make_checkpoint("qwen2", tmp_path / "two", seed=3)
    want, _ = load_model(folder)
    # a stray file next to model.safetensors is not part of the checkpoint (as in transformers)
    shutil.copy(other / "model.safetensors", folder / "zz_other.safetensors")
    got, _ = load_model(folder)
    assert all(torch.equal(t, got.w[n]) for n, t in want.w.items())
    # without model.safetensors every file is read, and a tensor in two of them is refused
    (folder / "model.safetensors").rename(folder / "a.safetensors")
    with pytest.raises(ModelLoadError, match="more than one"):
        load_model(folder)
    # an index may only name files inside the folder
    (folder / "zz_other.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../two/model.safetensors"}}))
    with pytest.raises(ModelLoadError, match="outside the folder"):
        load_model(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "b.safetensors"}}))
    with pytest.raises(ModelLoadError, match="lacks weight files its index lists"):
        load_model(folder)
