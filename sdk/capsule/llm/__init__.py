"""Decoder runtime: Llama/Qwen2 decoder, paged KV pool, graph runner, sampler, loader (HF, GGUF)."""
from .catalog import model_names, resolve_named
from .config import ModelConfig, RopeConfig
from .gguf_file import read_metadata
from .kv_pool import BlockTable, KVPool
from .loader import ModelInfo, load_model
from .model import Decoder
from .runner import DecodeRow, GraphRunner
from .sampler import SamplingParams, make_generator, sample_rows

__all__ = ["ModelConfig", "RopeConfig", "BlockTable", "KVPool", "ModelInfo", "load_model", "Decoder",
           "DecodeRow", "GraphRunner", "SamplingParams", "make_generator", "sample_rows", "model_names",
           "resolve_named", "read_metadata"]
