"""What a restore kit holds for an all-int4 model decoding in the C step (llm/q4_step.py): the
tensors the lite restore's C calls take, by the names capsule.lite.int4_steps reads, and the
model's shape. The step, the Q8_0 head and the embedding lookup are the Session's own code over
the same bytes, so the lite tokens are the Session's (greedy), bit for bit."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import LiteUnsupported
from .q8_head import Q8Head

if TYPE_CHECKING:
    from .runner import GraphRunner

ENGINE = "int4-c"


def int4_kit_parts(runner: "GraphRunner") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensor name -> tensor, the kit's "model" entry) of the runner's model; LiteUnsupported
    where the lite restore could not give the Session's tokens (no one-call step, another head,
    a bf16 pool)."""
    model, pool = runner.model, runner.pool.tensor
    step = model.step
    if step is None or model.decode_attention != "cpu":
        raise LiteUnsupported("a restore kit for runtime.linears='int4' needs every layer int4 in the C kernel "
                              "(a GGUF whose layers are all Q4_0 / Q4_1, the package's C kernels built) and "
                              "decode_attention 'auto' or 'cpu'")
    if not isinstance(model.head, Q8Head):
        raise LiteUnsupported("a restore kit for runtime.linears='int4' needs the GGUF's output matrix in Q8_0 "
                              "(the C head); this model's logits multiply an fp16 copy")
    if pool.dtype != torch.float32:
        raise LiteUnsupported(f"a restore kit reads an fp32 K/V pool; this Session's is {pool.dtype}: "
                              "leave runtime.kv_dtype unset")
    cfg = model.cfg
    t: dict[str, torch.Tensor] = {"embed": model.p("model.embed_tokens.weight"),
                                  "final_norm": model.p("model.norm.weight"),
                                  "rope_cos": model.rope_cos, "rope_sin": model.rope_sin,
                                  "head.codes": model.head.codes, "head.scales": model.head.scales}
    qkv_bias = o_bias = False
    for i, (lw, lin) in enumerate(zip(model.layers, model.linears)):
        t[f"{i}.in_norm"], t[f"{i}.post_norm"] = lw.in_norm, lw.post_norm
        for name, m in lin.matrices().items():
            for part, tensor in m.tensors().items():
                t[f"{i}.{name}.{part}"] = tensor
        if lin.qkv_bias is not None:
            t[f"{i}.qkv.bias"], qkv_bias = lin.qkv_bias, True
        if lin.o_bias is not None:
            t[f"{i}.o.bias"], o_bias = lin.o_bias, True
    meta = {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "eps": cfg.rms_norm_eps, "scale": model.scale, "qkv_bias": qkv_bias, "o_bias": o_bias}
    return {n: v.detach().contiguous() for n, v in t.items()}, meta
