"""What a Session's capsules are bound to (state.binding.Binding): the model, the tokenizer and
every setting that changes numerics, so a capsule continues bit-exactly or is refused with a
CapsuleMismatch naming what differs; plus the labels a person recognises in that message."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

import devices

from .llm import ModelInfo
from .llm.int4_linear import Int4Linears
from .policy.actor import Actor
from .state.binding import Binding
from .state.regions import RegionRegistry

if TYPE_CHECKING:
    from .assembly import LLMParts


def binding_of(llm: LLMParts | None, profile: devices.DeviceProfile, registry: RegionRegistry,
               actor: Actor | None = None) -> Binding:
    rt = profile.runtime
    # settings that change numerics are bound too: graphs attend over every block, eager over
    # those in use; the prefill chunking changes reduction order
    layout = {"regions": registry.layout(), "block_size": rt.block_size, "buckets": list(rt.batch_buckets),
              "max_context": rt.max_context, "cuda_graphs": rt.cuda_graphs, "prefill_chunk": rt.prefill_chunk}
    if llm and rt.kv_cache_dtype != rt.dtype:
        # the pool's bytes are K/V in this dtype (the kv_pool region's dtype says so too; named
        # here only when it differs, so capsules from before kv_dtype existed keep their layout)
        layout["kv_dtype"] = rt.kv_cache_dtype
    if rt.threads is not None and profile.device == "cpu":
        # CPU kernels split their reductions by thread count (builtin:small's decode logits
        # differ bitwise at 1 vs 2 threads), so a capsule continues bit-exactly only at its count.
        # Unset, the count is torch's default (the machine's cores), unbound as before
        layout["threads"] = rt.threads
    if llm and llm.engine.runner.engine_name != "torch":
        # another engine sums in another order: a capsule continues bit-exactly only under the
        # engine it was taken with (a restore under another is a CapsuleMismatch naming both)
        layout["llm_engine"] = llm.engine.runner.engine_name
    if llm and llm.engine.runner.model.decode_attention != "torch":
        # the decode kernels sum in another order than SDPA: a capsule continues bit-exactly only
        # under the attention it was taken with (named only when not torch's; "auto" resolved)
        layout["decode_attention"] = llm.engine.runner.model.decode_attention
    if llm and llm.engine.runner.model.decode_step != _decode_step_before(llm):
        # the one-call C step sums in its own order (matmuls, norms, SwiGLU): a capsule continues
        # bit-exactly only under the step it was taken with. Named only where it is not what SDKs
        # before runtime.decode_step ran, so their capsules keep their binding
        layout["decode_step"] = llm.engine.runner.model.decode_step
    if llm and rt.linears != "dequantized":
        # int4 weights: other logits, other K/V (named only when not the default)
        layout["linears"] = rt.linears
        if _head_kind(llm) == "q8_0":   # other logits than the fp16 head (named only when Q8_0)
            layout["lm_head"] = "q8_0"
        if _int4_activations(llm) == "int16":   # the C kernel's, not torch's bf16 (named only then)
            layout["int4_activations"] = "int16"
    if actor is not None:   # a capsule's hidden state means nothing to other policy weights
        layout["policy"] = actor.runner.spec.digest
    model = "none"
    if llm:  # the weights and the config that says what they mean (rope, norms)
        cfg = llm.engine.runner.model.cfg.fingerprint()
        model = hashlib.sha256(f"{llm.info.weights_digest}:{cfg}".encode()).hexdigest()
    return Binding.of(model=model,
                      tokenizer=llm.tokenizer.fingerprint if llm else "none",
                      layout=layout, dtype=rt.dtype, device_class=profile.device,
                      labels=_labels(llm, profile, actor))


def _labels(llm: LLMParts | None, profile: devices.DeviceProfile, actor: Actor | None) -> dict:
    """What a person recognises in a mismatch message (informational: never compared)."""
    rt = profile.runtime
    layout: dict[str, Any] = {"max_context": rt.max_context, "block_size": rt.block_size,
                              "kv_pool_mb": rt.kv_pool_mb, "batch_buckets": list(rt.batch_buckets),
                              "prefill_chunk": rt.prefill_chunk, "cuda_graphs": rt.cuda_graphs,
                              "threads": rt.threads if rt.threads is not None
                              else f"default ({torch.get_num_threads()})"}
    if llm:
        layout["kv_blocks"] = llm.engine.pool.num_blocks
        layout["kv_dtype"] = rt.kv_cache_dtype
        layout["llm_engine"] = llm.engine.runner.engine_name
        layout["decode_attention"] = llm.engine.runner.model.decode_attention
        layout["decode_step"] = llm.engine.runner.model.decode_step
        layout["linears"] = llm.info.linears
        layout["lm_head"] = _head_kind(llm)
        layout["int4_activations"] = _int4_activations(llm) or "none (no int4 layer)"
    if actor is not None:
        spec = actor.runner.spec
        layout["policy"] = f"{spec.name} ({spec.digest[:12]})"
    return {"model": _model_label(llm.info) if llm else "none", "tokenizer": llm.tokenizer.name if llm else "none",
            "layout": layout}


def _head_kind(llm: LLMParts) -> str:
    """How the logits' weights are held: "dense" (the model's dtype), or the head's kind."""
    head = llm.engine.runner.model.head
    return "dense" if head is None else str(getattr(head, "kind", type(head).__name__))


def _decode_step_before(llm: LLMParts) -> str:
    """The decode step SDKs before runtime.decode_step ran: the C step for a model whose every
    layer is int4 in the C kernel, under decode attention "cpu"; the layer loop otherwise."""
    model = llm.engine.runner.model
    fused = (_int4_activations(llm) == "int16" and model.decode_attention == "cpu"
             and model.fused_step_unsupported() is None)
    return "fused" if fused else "layers"


def _int4_activations(llm: LLMParts) -> str | None:
    """How the int4 layers round activations ("int16", "bf16"), None without int4 layers."""
    for lin in llm.engine.runner.model.linears:
        if isinstance(lin, Int4Linears):
            return lin.activations
    return None


def _model_label(info: ModelInfo) -> str:
    """A GGUF's shows its quantization in a mismatch message: "SmolLM2-135M-Instruct.Q4_1.gguf
    (llama, Q4_1) at /path/to/it.gguf"; a folder's or a builtin's is its source."""
    gguf = info.source.lower().endswith(".gguf") and info.label
    return f"{info.label} at {info.source}" if gguf else info.source
