"""What a restore kit holds for a model decoding in the one-call C step (llm/fused_step.py): the
tensors the lite restore's C calls take, by the names capsule.lite.c_steps reads, and the model's
shape. Engine "int4-c": every layer int4 in the C kernel, the Q8_0 head; "f32-c": every layer
dense fp32, the fp32 head in the same C linear. The step, the head and the embedding lookup are
the Session's own code over the same bytes, so the lite tokens are the Session's (greedy), bit
for bit."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from edge_kernels.decode_step_abi import f32_blocks

from ..errors import LiteUnsupported
from .fused_step import dense_projections, dense_qkv_bias
from .int4_linear import Int4Linears
from .linears import DenseLinears
from .q8_head import Q8Head

if TYPE_CHECKING:
    from .runner import GraphRunner


def c_kit_parts(runner: "GraphRunner") -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """(tensor name -> tensor, the kit's "model" entry, its engine: lite.kit.C_ENGINES) of the runner's model;
    LiteUnsupported where the lite restore could not give the Session's tokens (no one-call
    step, another head, a bf16 pool)."""
    model, pool = runner.model, runner.pool.tensor
    if model.fused_step is None or model.decode_step != "fused":
        raise LiteUnsupported("a restore kit without onnxruntime runs the one-call C decode step: every layer int4 "
                              "in the C kernel (a GGUF whose layers are all Q4_0 / Q4_1) or every layer dense fp32, "
                              "the package's C kernels built, decode_attention and decode_step 'auto' (or 'cpu' "
                              "and 'fused')")
    int4 = isinstance(model.linears[0], Int4Linears)
    if int4 and not isinstance(model.head, Q8Head):
        raise LiteUnsupported("a restore kit for runtime.linears='int4' needs the GGUF's output matrix in Q8_0 "
                              "(the C head); this model's logits multiply an fp16 copy")
    if pool.dtype != torch.float32:
        raise LiteUnsupported(f"a restore kit reads an fp32 K/V pool; this Session's is {pool.dtype}: "
                              "leave runtime.kv_dtype unset")
    cfg = model.cfg
    t: dict[str, torch.Tensor] = {"embed": model.p("model.embed_tokens.weight"),
                                  "final_norm": model.p("model.norm.weight"),
                                  "rope_cos": model.rope_cos, "rope_sin": model.rope_sin}
    if int4:
        t.update({"head.codes": model.head.codes, "head.scales": model.head.scales})
    else:
        t["head.weight"] = model.head_weight()
    blocks = f32_blocks(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    qkv_bias = o_bias = False
    for i, (lw, lin) in enumerate(zip(model.layers, model.linears)):
        t[f"{i}.in_norm"], t[f"{i}.post_norm"] = lw.in_norm, lw.post_norm
        if isinstance(lin, Int4Linears):
            for name, m in lin.matrices().items():
                for part, tensor in m.tensors().items():
                    t[f"{i}.{name}.{part}"] = tensor
            bias = lin.qkv_bias
        else:
            assert isinstance(lin, DenseLinears)   # the fused step takes no other layers
            projections = dense_projections(lin)
            for name in blocks:
                for p, _ in blocks[name]:
                    t[f"{i}.{p}"] = projections[p]
            bias = dense_qkv_bias(lin)
        if bias is not None:
            t[f"{i}.qkv.bias"], qkv_bias = bias, True
        if lin.o_bias is not None:
            t[f"{i}.o.bias"], o_bias = lin.o_bias, True
    meta = {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "eps": cfg.rms_norm_eps, "scale": model.scale, "qkv_bias": qkv_bias, "o_bias": o_bias}
    return {n: v.detach().contiguous() for n, v in t.items()}, meta, "int4-c" if int4 else "f32-c"
