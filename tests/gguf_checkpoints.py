"""Small GGUF files written from random transformers checkpoints, the way convert_hf_to_gguf.py
writes them (GGUF tensor names, llama's q/k row permutation, some tensors quantized), and the two
sides of a parity check: transformers loading the file, our decoder's logits."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from capsule.llm import BlockTable, KVPool
from hf_checkpoints import make_checkpoint

# gguf.quants can dequantize these but not quantize them: their blocks are written at random
# (the scale fields set so values stay small); (byte offset, count) of each block's fp16 scales
K_QUANT_SCALES = {"Q4_K": ((0, 2),), "Q5_K": ((0, 2),), "Q6_K": ((208, 1),)}
K_QUANT_SCALE = {"Q4_K": 3e-4, "Q5_K": 1.5e-4, "Q6_K": 2e-5}

# HF suffix (after model.layers.N.) -> GGUF suffix (after blk.N.)
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in TOP_NAMES:
        return TOP_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    base, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[base]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(shape: tuple[int, ...], qname: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes for a tensor of HF `shape`, in GGUFReader's byte shape."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qname]]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block, size), dtype=np.uint8)
    for start, count in K_QUANT_SCALES[qname]:
        scales = (rng.uniform(0.5, 1.0, (len(blocks), count)) * K_QUANT_SCALE[qname]).astype(np.float16)
        blocks[:, start:start + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def write_gguf(path: Path, weights: dict[str, torch.Tensor], cfg: dict, arch: str, *,
               qtypes: dict[str, str] | None = None, default_qtype: str = "F32",
               extra: dict[str, object] | None = None, drop: tuple[str, ...] = (),
               extra_tensors: dict[str, np.ndarray] | None = None, seed: int = 0,
               meta: dict[str, object] | None = None) -> Path:
    """Write HF `weights` (a state dict) with the HF config dict `cfg` as a GGUF of `arch`.

    qtypes: GGUF tensor name -> quantization type name (e.g. "Q8_0"); 2-D tensors not named get
    default_qtype, 1-D ones F32. extra: more metadata (key without the arch prefix -> value).
    drop: HF tensor names to leave out (a tied lm_head, say). extra_tensors: more F32 tensors
    by GGUF name. K-quant tensors get random blocks (seeded), not the checkpoint's values.
    meta: metadata under full keys (e.g. a tokenizer's tokenizer.ggml.*)."""
    import gguf
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    if meta:
        from gguf_meta import add_meta
        add_meta(writer, meta)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    for hf, t in weights.items():
        if hf in drop or (hf == "lm_head.weight" and cfg.get("tie_word_embeddings")):
            continue
        name = gguf_name(hf)
        arr = t.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            arr = permute(arr, heads)
        elif arch == "llama" and ".attn_k." in name:
            arr = permute(arr, kv)
        qname = (qtypes or {}).get(name, default_qtype if arr.ndim == 2 else "F32")
        qtype = gguf.GGMLQuantizationType[qname]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif qname in K_QUANT_SCALES:
            writer.add_tensor(name, random_blocks(arr.shape, qname, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    for name, arr in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A checkpoint folder's state dict and config (rope_theta at the top, as GGUF keeps it)."""
    from safetensors.torch import load_file
    cfg = json.loads((folder / "config.json").read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return load_file(folder / "model.safetensors"), cfg


def checkpoint_gguf(kind: str, folder: Path, **kw) -> tuple[Path, Path]:
    """make_checkpoint(kind) in folder/hf, written as folder/model.gguf; returns (gguf, hf folder)."""
    hf = make_checkpoint(kind, folder / "hf")
    weights, cfg = hf_state(hf)
    arch = "qwen2" if kind == "qwen2" else "llama"
    return write_gguf(folder / "model.gguf", weights, cfg, arch, **kw), hf


def random_checkpoint(arch: str, folder: Path, seed: int = 0, **shape) -> Path:
    """A random transformers "llama" or "qwen3" model of the given shape saved to `folder`, with
    random norms (as make_checkpoint does, so a wrong wiring cannot hide behind ones)."""
    transformers = __import__("transformers")
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, **shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def int4_session_gguf(folder: Path, max_positions: int) -> Path:
    """A small random llama GGUF a Session can run int4 (its vocabulary holds r50k_base's ids):
    every layer Q4_1, the embeddings and the output matrix Q8_0 (the C head)."""
    hf = random_checkpoint("llama", folder / "hf", vocab_size=50304, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=max_positions)
    weights, cfg = hf_state(hf)
    return write_gguf(folder / "m.gguf", weights, cfg, "llama", default_qtype="Q4_1",
                      qtypes={"token_embd.weight": "Q8_0", "output.weight": "Q8_0"})


def reference(path: Path):
    """transformers' own GGUF loader on the same file (dequantized to fp32)."""
    transformers = __import__("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Our decoder's logits (T, V) for one full prefill of ids (1, T)."""
    T = ids.shape[1]
    pool = KVPool(model.cfg, pool_bytes=8 << 20, block_size=16, dtype=torch.float32, device="cpu")
    table = BlockTable(pool)
    table.ensure_capacity(T)
    model.prepare_rope(T)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(T).view(1, -1), torch.tensor(table.slots(0, T)),
                       torch.tensor([table.blocks]), pool.tensor)
        return model.lm_head(hidden[0])
