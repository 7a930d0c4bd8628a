"""A Llama / Qwen2 / Qwen3-architecture decoder over the paged KV pool.

Weights keep their Hugging Face names, so a checkpoint's state dict is used as is.
The model holds no cache of its own: K/V live in the pool passed to `forward`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from devices.profile import DECODE_ATTENTION, DECODE_STEP
from edge_kernels.decode_step_cpu import DecodeStep
from edge_kernels.f32_linear_cpu import F32Matrix
from edge_kernels.paged_decode import paged_decode_attention
from edge_kernels.paged_decode_cpu import DecodePlan, kernel_threads

from ..errors import ModelLoadError
from .config import ModelConfig
from .layer_weights import LayerWeights, expected_shapes
from .linears import LayerLinears
from .paged_attention import attention_mask, paged_attention, write_kv
from .fused_step import fused_decode_step, fused_step_unsupported
from .rope import apply_rope, rope_tables


# decode (T == 1) attention, DECODE_ATTENTION: "torch" gathers every block of the table
# (paged_attention); "triton" reads only each row's live slots (edge_kernels.paged_decode);
# "cpu" does the same in C on a CPU fp32 or bf16 pool (edge_kernels.paged_decode_cpu), what
# runtime.decode_attention "auto" picks on CPU, and rotates q and k and writes the new K/V in
# the same call. "triton" stays opt-in until a GPU run has checked it (packaging/gpu_check.py).
# A DecodeKernel: (q, k, v pre-RoPE, k_cache, v_cache) -> attention (B, 1, H, hd), the new
# K/V written into the step's slots.
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_FUSED_RMS_NORM = hasattr(F, "rms_norm")   # torch >= 2.4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalize in fp32 and cast back, as transformers' LlamaRMSNorm does. On CPU fp32, torch's
    # own F.rms_norm is the same operators in one call (bit-identical: tests/test_rms_norm.py),
    # ~6 fewer per norm, 61 norms a step; elsewhere (bf16 / fp16 round differently, CUDA has
    # its own kernel) the operators are spelled out
    if _FUSED_RMS_NORM and x.dtype == torch.float32 and weight.dtype == torch.float32 and not x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Decoder(nn.Module):
    """Decoder-only transformer. `forward` writes the new tokens' K/V into the pool, then attends."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        want = expected_shapes(cfg)
        missing = [n for n in want if n not in weights]
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
        for name, shape in want.items():
            if tuple(weights[name].shape) != shape:
                raise ModelLoadError(f"tensor {name} has shape {tuple(weights[name].shape)}, "
                                     f"config.json implies {shape}")
        # flat parameter dict keyed by HF name ('.' is not allowed in module names)
        self.w = nn.ParameterDict({n.replace(".", "/"): nn.Parameter(weights[n], requires_grad=False)
                                   for n in want})
        # per-layer tensors resolved once: the step loop does no name lookups
        self.layers = [LayerWeights.of(self.p, cfg, f"model.layers.{i}.") for i in range(cfg.num_layers)]
        # what forward multiplies by: dense views of those weights unless use_linears swaps them
        self.linears: list[LayerLinears] = [lw.dense() for lw in self.layers]
        self.linears_kind = "dequantized"
        self.head: Callable[[torch.Tensor], torch.Tensor] | None = None   # use_linears; None: dense
        self.fused_step: DecodeStep | None = None   # set_decode_step("fused"): decode in one C call
        self.fused_head: F32Matrix | None = None    # and, for dense weights, the logits in C
        self.scale = cfg.head_dim ** -0.5
        self.decode_attention = "torch"       # set_decode_attention; one of DECODE_ATTENTION
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def p(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "/")]

    @property
    def dtype(self) -> torch.dtype:
        return self.p("model.norm.weight").dtype

    @property
    def device(self) -> torch.device:
        return self.p("model.norm.weight").device

    def prepare_rope(self, n_positions: int) -> None:
        """Build cos/sin tables for positions < n_positions once (outside any captured graph)."""
        if self.rope_cos.shape[0] >= n_positions:
            return
        cos, sin = rope_tables(self.cfg.rope, self.cfg.head_dim, n_positions, self.device)
        self.rope_cos, self.rope_sin = cos, sin

    def set_decode_attention(self, kind: str) -> None:
        """Pick the decode attention (DECODE_ATTENTION); set before graphs are captured (a
        captured graph keeps the kernel it was captured with). "triton" needs Triton, and on
        CPU its interpreter (TRITON_INTERPRET=1): a test path, not a fast one."""
        if kind not in DECODE_ATTENTION:
            raise ValueError(f"decode attention must be one of {DECODE_ATTENTION}, got {kind!r}")
        self.decode_attention = kind

    def use_linears(self, linears: Sequence[LayerLinears], kind: str,
                    head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Multiply by `linears` (one per layer, e.g. int4_linear.int4_layers') from now on, and
        by `head` for the logits when given; `kind` names them (runtime.linears). Before any
        graph is captured."""
        if len(linears) != self.cfg.num_layers:
            raise ValueError(f"need one LayerLinears per layer ({self.cfg.num_layers}), got {len(linears)}")
        self.linears, self.linears_kind, self.head = list(linears), kind, head
        # int4 layers in the C kernel decode in one C call unless set_decode_step says otherwise
        # (what they did before the setting existed); dense layers keep the loop
        int4_fused = kind == "int4" and self.fused_step_unsupported() is None
        self.set_decode_step("fused" if int4_fused else "layers")

    def fused_step_unsupported(self) -> str | None:
        """Why this model's layers cannot decode in one C call (llm/fused_step.py), or None."""
        return fused_step_unsupported(self.cfg, self.linears, self.p("model.norm.weight"))

    def set_decode_step(self, kind: str) -> None:
        """DECODE_STEP: "fused" decodes one token a row in one C call (under decode attention
        "cpu"; ValueError where fused_step_unsupported says why not), "layers" through the loop
        over the layers. Before any graph is captured."""
        if kind not in DECODE_STEP:
            raise ValueError(f"decode step must be one of {DECODE_STEP}, got {kind!r}")
        self.fused_step = (fused_decode_step(self.cfg, self.layers, self.linears, self.p("model.norm.weight"))
                           if kind == "fused" else None)
        # a dense model's logits in the same C linear: the lite restore (capsule.lite) runs the
        # same calls over the same bytes, bit for bit. An int4 model keeps its head (a dense one
        # too: its capsules from before the setting continue with torch's logits)
        dense = self.fused_step is not None and self.head is None and self.linears_kind == "dequantized"
        self.fused_head = F32Matrix([self.head_weight()]) if dense else None

    @property
    def decode_step(self) -> str:
        """The decode step in effect: "fused" (set so, under decode attention "cpu") or "layers"."""
        return "fused" if self.fused_step is not None and self.decode_attention == "cpu" else "layers"

    def head_weight(self) -> torch.Tensor:
        """The (V, D) matrix the logits multiply by: the embeddings when tied."""
        return self.p("model.embed_tokens.weight") if self.cfg.tie_embeddings else self.p("lm_head.weight")

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(h)
        if self.fused_head is not None and self.decode_attention == "cpu":   # decode_step "fused"
            return self.fused_head(h, kernel_threads())
        return F.linear(h, self.head_weight())

    def _decode_kernel(self, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, kv_pool: torch.Tensor, slot_valid: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, plan: DecodePlan | None) -> DecodeKernel | None:
        """The step's decode attention, its rows set up once for every layer (see DecodeKernel;
        plan: _cpu_plan's, for "cpu"); None: the torch path (paged_attention)."""
        B, H, hd = positions.shape[0], self.cfg.num_heads, self.cfg.head_dim
        # seq_lens on the device, so a captured graph replays the Triton kernel unchanged
        seq_lens = positions[:, 0] + 1                                             # (B,)
        if self.decode_attention == "triton":
            lens32 = seq_lens.to(torch.int32)

            def triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> torch.Tensor:
                write_kv(k_cache, v_cache, slot_mapping, apply_rope(k, cos, sin), v)
                return paged_decode_attention(apply_rope(q, cos, sin).view(B, 1, H, hd), k_cache, v_cache,
                                              block_tables, lens32, self.scale, slot_valid)
            return triton
        if plan is not None:
            return lambda q, k, v, k_cache, v_cache: plan.layer(q, k, v, k_cache, v_cache,
                                                                self.scale).view(B, 1, H, hd)
        return None

    def _cpu_plan(self, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  kv_pool: torch.Tensor, slot_valid: torch.Tensor | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> DecodePlan:
        """The C decode attention's rows for this step (pool and dtype checked when the Session
        was built)."""
        return DecodePlan(block_tables, positions[:, 0] + 1, slot_valid, kv_pool.shape[0], kv_pool.shape[3],
                          slots=slot_mapping, rope=(cos, sin), threads=kernel_threads())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, kv_pool: torch.Tensor, *,
                slot_valid: torch.Tensor | None = None, block_pos: torch.Tensor | None = None,
                segments: Sequence[tuple[int, int, int]] | None = None,
                capture: list | None = None) -> torch.Tensor:
        """input_ids, positions: (B, T); slot_mapping: (B*T,); block_tables: (B, nb);
        kv_pool: (NB, L, 2, bs, KV, hd). Returns the final normed hidden states (B, T, D).

        slot_valid: the pool's (NB, bs) readable-slot mask (memory regions leave holes).
        block_pos: (B, nb) the index in the stream of each block of block_tables, when blocks
        are left out (eager prefill skips wholly empty memory-region blocks).
        segments: query segments for paged_attention (eager prefill across a memory region).

        capture: when a list, one (k_pre, v) per layer is appended, each (B*T, KV, hd): keys
        after k_proj (and k_norm, when the model has one) and before RoPE, i.e. exactly what
        RoPE rotates (memory facts are stored unrotated). Eager use only."""
        cfg = self.cfg
        B, T = input_ids.shape
        H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        flat_pos = positions.reshape(-1)
        cos, sin = self.rope_cos[flat_pos], self.rope_sin[flat_pos]           # (N, hd)
        key_valid = None if slot_valid is None else slot_valid[block_tables].view(B, -1)  # (B, S)
        key_pos = None
        if block_pos is not None:
            bs = kv_pool.shape[3]
            key_pos = (block_pos.unsqueeze(-1) * bs
                       + torch.arange(bs, device=block_pos.device)).view(B, -1)  # (B, S)
        # one query per row over a full table (graph decode): the kernel reads slots 0..position
        # of each row, minus the holes, with no mask; on the device, so a graph replays it as is
        one_query = T == 1 and block_pos is None and segments is None
        plan = (self._cpu_plan(positions, slot_mapping, block_tables, kv_pool, slot_valid, cos, sin)
                if one_query and self.decode_attention == "cpu" else None)
        if plan is not None and self.fused_step is not None and capture is None:   # one C call
            x = F.embedding(input_ids.view(B), self.p("model.embed_tokens.weight"))   # (B, D)
            return self.fused_step(x, plan, kv_pool, self.scale, kernel_threads()).view(B, 1, -1)
        kernel = (self._decode_kernel(positions, slot_mapping, block_tables, kv_pool, slot_valid, cos, sin, plan)
                  if one_query else None)
        # the same for every layer: built once per forward
        mask = None if kernel is not None else attention_mask(positions, block_tables.shape[1] * kv_pool.shape[3],
                                                  H // KV, self.dtype, key_valid, key_pos)  # (B, 1, T*G, S)
        x = F.embedding(input_ids, self.p("model.embed_tokens.weight"))       # (B, T, D)
        for i, (lw, lin) in enumerate(zip(self.layers, self.linears)):
            h = rms_norm(x, lw.in_norm, cfg.rms_norm_eps)
            q, k, v = lin.qkv(h)
            q = q.reshape(B * T, H, hd)                                        # (N, H, hd)
            k = k.reshape(B * T, KV, hd)                                       # (N, KV, hd)
            v = v.reshape(B * T, KV, hd)
            if lw.q_norm is not None:   # Qwen3: per head, over hd, before RoPE
                q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
            if capture is not None:
                capture.append((k, v))
            k_cache, v_cache = kv_pool[:, i, 0], kv_pool[:, i, 1]             # (NB, bs, KV, hd)
            if kernel is not None:   # decode: RoPE, the K/V write and attention in one call
                att = kernel(q, k, v, k_cache, v_cache)                          # (B, 1, H, hd)
            else:
                q = apply_rope(q, cos, sin)                                    # (N, H, hd)
                k = apply_rope(k, cos, sin)                                    # (N, KV, hd)
                write_kv(k_cache, v_cache, slot_mapping, k, v)
                att = paged_attention(q.view(B, T, H, hd), k_cache, v_cache, block_tables, positions,
                                      self.scale, mask=mask, segments=segments)  # (B, T, H, hd)
            x = x + lin.o(att.reshape(B, T, H * hd))
            x = x + lin.mlp(rms_norm(x, lw.post_norm, cfg.rms_norm_eps))
        return rms_norm(x, self.p("model.norm.weight"), cfg.rms_norm_eps)
