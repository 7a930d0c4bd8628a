"""GGUF model files: the chat template, a label, and the ModelConfig the metadata implies.

The header itself is read by the bounded reader in ``capsule.gguf_header`` (re-exported here).
"""
from __future__ import annotations

from ..errors import ModelLoadError, UnsupportedArchitecture
from ..gguf_header import SUPPORTED_TYPES, GGUFHeader, TensorInfo, read_header, read_metadata
from .config import ModelConfig, RopeConfig

__all__ = ["SUPPORTED_TYPES", "GGUFHeader", "TensorInfo", "read_header", "read_metadata",
           "chat_template", "usable_template", "label", "gguf_config"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
MAX_TEMPLATE_BYTES = 1 << 20   # real chat templates are a few KB
MAX_LAYERS = 4096


def chat_template(header: GGUFHeader) -> str | None:
    return usable_template(header.metadata.get("tokenizer.chat_template"))


def usable_template(tpl: object) -> str | None:
    """A chat template as found in a model's files, when it is one: a non-blank str within
    MAX_TEMPLATE_BYTES (a file is input: anything else only means no template)."""
    return tpl if isinstance(tpl, str) and tpl.strip() and len(tpl) <= MAX_TEMPLATE_BYTES else None


def label(header: GGUFHeader) -> str:
    """A short human name for mismatch messages: 'SmolLM2-135M-Instruct.Q4_1.gguf (llama, Q4_1)'."""
    matrices = [t.type_name for t in header.tensors if len(t.dims) == 2]
    quant = max(set(matrices), key=matrices.count) if matrices else "?"   # what most weights use
    return f"{header.path.name} ({header.metadata.get('general.architecture', '?')}, {quant})"


def gguf_config(header: GGUFHeader) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata and tensor list imply (UnsupportedArchitecture for
    another architecture or a setting the decoder lacks; ModelLoadError for missing keys)."""
    md, where = header.metadata, header.path.name
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(f"{where}: GGUF architecture {arch!r} is not supported; supported: "
                                      f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(key: str, default: object = None, kind: type = int) -> object:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{where}: GGUF metadata lacks {arch}.{key}")
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if isinstance(value, bool) or not ok:
            raise UnsupportedArchitecture(f"{where}: {arch}.{key} is {value!r}, expected one {kind.__name__}")
        return value

    names = {t.name: t for t in header.tensors}
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    factor = md.get(f"{arch}.rope.scaling.factor", 1.0)
    if scaling != "none" or factor not in (0, 1) or "rope_freqs.weight" in names:
        raise UnsupportedArchitecture(f"{where}: rope scaling ({scaling!r}, factor {factor!r}"
                                      f"{', a rope_freqs tensor' if 'rope_freqs.weight' in names else ''}) "
                                      "is not supported in GGUF files; use one without rope scaling")
    if "token_embd.weight" not in names or len(names["token_embd.weight"].dims) != 2:
        raise ModelLoadError(f"{where}: GGUF file lacks a 2-D token_embd.weight tensor")
    vocab = names["token_embd.weight"].shape[0]
    if get("vocab_size", vocab) != vocab:
        raise ModelLoadError(f"{where}: {arch}.vocab_size is {md[f'{arch}.vocab_size']} but token_embd.weight "
                             f"has {vocab} rows")
    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    if not 0 < layers <= MAX_LAYERS or heads <= 0:
        raise ModelLoadError(f"{where}: {layers} layers / {heads} heads are out of range")
    rope_dim = get("rope.dimension_count", 0)
    head_dim = get("attention.key_length", 0) or (rope_dim if arch == "llama" else 0) or hidden // heads
    if rope_dim not in (0, head_dim) or get("attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitecture(f"{where}: partial rotary ({rope_dim} of {head_dim} dims) or a value "
                                      "width other than the key width is not supported")
    llama_bias = arch == "llama" and "blk.0.attn_q.bias" in names   # llama.cpp's optional biases
    extra = {"qk_norm": True} if arch == "qwen3" else {}   # Qwen3 normalizes q and k per head
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length"),
            num_layers=layers, num_heads=heads, num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", kind=float)),
            qkv_bias=arch == "qwen2" or llama_bias,
            o_bias=arch == "llama" and "blk.0.attn_output.bias" in names,
            tie_embeddings="output.weight" not in names,
            max_position=get("context_length", 32768),
            rope=RopeConfig(theta=float(get("rope.freq_base", 10000.0, kind=float))),
            architecture=arch, **extra)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
