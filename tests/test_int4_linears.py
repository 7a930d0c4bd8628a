"""runtime.linears='int4': a GGUF's Q4_0 / Q4_1 weights kept 4-bit (capsule.llm.int4_linear).

The codes and scales read from the blocks are gguf's own dequantization exactly; the products
are those weights' up to the activations' rounding: int16 in the package's C kernel
(Q4KernelMatrix, ~1e-5), bf16 in torch's (Int4Matrix, the fallback, ~1e-2); the logits' head is
Q8_0 kept as Q8_0, else fp16. A model loads int4 only where it can, its logits stay near the
dequantized model's (and differ: the int4 path ran); a Session continues bit-exactly across a
restore, and a capsule is bound to the settings and kernels it was taken with."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from capsule import CapsuleMismatch, Session
from capsule.errors import ModelLoadError
from capsule.llm import load_model
from capsule.llm.int4_linear import (Int4Linears, Int4Matrix, Q4KernelMatrix, kernel_missing, q4_blocks,
                                     torch_kernel_missing)
from gguf_checkpoints import checkpoint_gguf, int4_session_gguf, logits

pytestmark = pytest.mark.skipif(kernel_missing() is not None, reason=str(kernel_missing()))
TOKENIZER = "r50k_base"          # max id 50256: the Session model's vocabulary must hold it


def _quantized(qname: str, shape: tuple[int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    import gguf
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, shape).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[qname]
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(shape)


@pytest.mark.parametrize("qname, type_id", [("Q4_0", 2), ("Q4_1", 3)])
def test_codes_and_scales_are_ggufs_dequantization_exactly(qname, type_id):
    raw, want = _quantized(qname, (48, 96))
    codes, d, m = q4_blocks(raw, type_id)
    assert codes.shape == (48, 96) and d.shape == m.shape == (48, 3)
    assert codes.min() >= 0 and codes.max() <= 15 and len(np.unique(codes)) > 8
    got = (codes.reshape(48, 3, 32) * d[..., None] + m[..., None]).reshape(48, 96)
    assert np.array_equal(got, want)


# each kind of matrix and how close its products must be: int16 activations / bf16 ones; a
# wrong nibble, scale or zero is off by O(1)
KINDS = [pytest.param(Q4KernelMatrix, 1e-4, id="c-int16"),
         pytest.param(Int4Matrix, 0.02, id="torch-bf16",
                      marks=pytest.mark.skipif(torch_kernel_missing() is not None, reason=str(torch_kernel_missing())))]


@pytest.mark.parametrize("mat_type, rel", KINDS)
@pytest.mark.parametrize("qname, type_id", [("Q4_0", 2), ("Q4_1", 3)])
def test_the_kernel_multiplies_by_those_weights(qname, type_id, mat_type, rel):
    raw, w = _quantized(qname, (64, 128), seed=1)
    mat = mat_type(*q4_blocks(raw, type_id))
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0))
    got = mat(x)
    want = x @ torch.from_numpy(w).t()
    assert got.shape == (2, 5, 64) and got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err < rel * want.abs().max().item()
    assert torch.equal(mat(x), got)                 # deterministic
    assert torch.equal(mat_type.from_tensors(mat.tensors())(x), got)   # what int4_cache keeps and maps


@pytest.mark.parametrize("mat_type, rel", KINDS)
def test_fused_matrix_outputs_are_the_parts_in_order(mat_type, rel):
    a, b = (q4_blocks(_quantized("Q4_1", (n, 64), seed=n)[0], 3) for n in (32, 16))
    x = torch.randn(3, 64)
    fused = mat_type.fused([a, b])(x)
    assert torch.equal(fused[:, :32], mat_type(*a)(x)) and torch.equal(fused[:, 32:], mat_type(*b)(x))


def test_a_matrix_the_kernel_cannot_pack_is_refused():
    codes, d, m = q4_blocks(_quantized("Q4_1", (24, 64))[0], 3)
    with pytest.raises(ValueError, match="N % 16"):
        Int4Matrix(codes, d, m)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_int4_logits_stay_near_the_dequantized_models(kind, tmp_path):
    # llama: q/k rows unpermuted like the dequantized weights; qwen2: the fused q|k|v bias
    path, _ = checkpoint_gguf(kind, tmp_path, default_qtype="Q4_1", qtypes={"blk.0.attn_q.weight": "Q4_0"})
    deq, _ = load_model(path)
    q4, info = load_model(path, linears="int4")
    assert info.linears == "int4 (2 of 2 layers)"
    assert all(isinstance(lin, Int4Linears) for lin in q4.linears) and q4.linears_kind == "int4"
    assert all(isinstance(m, Q4KernelMatrix) for lin in q4.linears for m in lin.matrices().values())
    h = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2))
    for lin_d, lin_q in zip(deq.linears, q4.linears):   # each projection: its rows, bias and order
        pairs = list(zip(lin_d.qkv(h), lin_q.qkv(h))) + [(lin_d.mlp(h), lin_q.mlp(h)), (lin_d.o(h), lin_q.o(h))]
        for want, got in pairs:
            assert (got - want).abs().max().item() < 5e-4 * want.abs().max().item()   # bf16: ~1e-2
    hn = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    want, got = deq.lm_head(hn), q4.lm_head(hn)       # fp16 head over lm_head.weight (untied here)
    assert got.dtype == torch.float32 and 0 < (got - want).abs().max().item() < 2e-3 * want.abs().max().item()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    want, got = logits(deq, ids), logits(q4, ids)
    dev = (got - want).abs().max().item()
    assert 0 < dev < 0.03 * want.abs().max().item(), dev
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.skipif(torch_kernel_missing() is not None, reason=str(torch_kernel_missing()))
def test_without_the_c_kernels_torchs_int4_runs_and_lands_much_further_off(tmp_path, monkeypatch):
    from edge_kernels import q4_linear_cpu
    path, _ = checkpoint_gguf("llama", tmp_path, default_qtype="Q4_1")
    deq, _ = load_model(path)
    c, _ = load_model(path, linears="int4")
    monkeypatch.setattr(q4_linear_cpu, "missing", lambda: "not built")   # a wheel built without them
    t, info = load_model(path, linears="int4")
    assert info.linears == "int4 (2 of 2 layers)"
    assert all(isinstance(m, Int4Matrix) for lin in t.linears for m in lin.matrices().values())
    assert [lin.activations for lin in c.linears + t.linears] == ["int16"] * 2 + ["bf16"] * 2
    monkeypatch.undo()                                # a CPU the C kernel has no SIMD path for
    monkeypatch.setattr(q4_linear_cpu, "fastest_path", lambda: "portable")
    assert all(isinstance(lin.qkv_m, Int4Matrix) for lin in load_model(path, linears="int4")[0].linears)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    want = logits(deq, ids)
    dev_c, dev_t = ((logits(m, ids) - want).abs().max().item() for m in (c, t))
    assert 0 < dev_c and 0 < dev_t < 0.03 * want.abs().max().item()
    assert dev_t > 5 * dev_c, (dev_c, dev_t)     # the rest is the fp16 head both share


def test_a_q8_0_head_stays_q8_0_and_multiplies_by_the_dequantized_weights(tmp_path, monkeypatch):
    from capsule.llm import q8_head
    from capsule.llm.int4_linear import HalfHead
    from capsule.llm.q8_head import Q8Head
    from edge_kernels import q8_linear_cpu
    path, _ = checkpoint_gguf("llama", tmp_path, default_qtype="Q4_1", qtypes={"output.weight": "Q8_0"})
    deq, _ = load_model(path)
    q4, _ = load_model(path, linears="int4")
    assert isinstance(q4.head, Q8Head) and q4.head.codes.dtype == torch.int8
    hn = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    want, got = deq.lm_head(hn), q4.lm_head(hn)        # the same Q8_0 weights, dequantized
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    half = HalfHead(deq.head_weight())(hn)             # what an fp16 copy would give: much further
    assert (half - want).abs().max().item() > 10 * (got - want).abs().max().item()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    assert (logits(q4, ids).argmax(-1) == logits(deq, ids).argmax(-1)).float().mean() > 0.9
    # no compiled kernel (a wheel built without one): the fp16 copy, from the cache entry too
    for module in (q8_head, q8_linear_cpu):
        monkeypatch.setattr(module, "missing", lambda: "not built")
    assert isinstance(load_model(path, linears="int4")[0].head, HalfHead)


def test_a_layer_with_another_type_stays_dense(tmp_path):
    path, _ = checkpoint_gguf("llama", tmp_path, default_qtype="Q4_1", qtypes={"blk.1.ffn_down.weight": "Q8_0"})
    model, info = load_model(path, linears="int4")
    assert info.linears == "int4 (1 of 2 layers)"
    assert isinstance(model.linears[0], Int4Linears) and not isinstance(model.linears[1], Int4Linears)


def test_int4_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ModelLoadError, match="no GGUF file"):
        load_model("builtin:tiny", linears="int4", vocab_size=512)
    f32, _ = checkpoint_gguf("llama", tmp_path / "f32")
    with pytest.raises(ModelLoadError, match="no layer .* Q4_0 or Q4_1"):
        load_model(f32, linears="int4")
    with pytest.raises(ModelLoadError, match="CPU only"):   # refused before anything touches CUDA
        load_model(f32, linears="int4", device="cuda")
    with pytest.raises(ValueError, match="linears must be one of"):
        load_model(f32, linears="int8")
    with pytest.raises(ValueError, match="runtime.linears"):
        Session.open(tmp_path / "s0", model=str(f32), tokenizer=TOKENIZER, device="cpu",
                     runtime={"linears": "int8"})
    with pytest.raises(ModelLoadError, match="torch engine"):
        Session.open(tmp_path / "s1", model=str(f32), tokenizer=TOKENIZER, device="cpu",
                     runtime={"linears": "int4", "llm_engines": ["onnxruntime", "torch"]})


@pytest.fixture(scope="module")
def session_gguf(tmp_path_factory):
    return int4_session_gguf(tmp_path_factory.mktemp("int4"), max_positions=512)


def _open(path, model, linears="int4"):
    return Session.open(path, model=str(model), tokenizer=TOKENIZER, device="cpu",
                        runtime={"linears": linears, "threads": 1})


def test_a_restored_int4_session_continues_bit_exactly(session_gguf, tmp_path):
    with _open(tmp_path / "s", session_gguf) as s:
        s.append("user: bring me the red cup from the kitchen\n")
        s.generate(6)
        epoch = s.checkpoint()
        s.generate(10)
        want = s.tokens()
    with _open(tmp_path / "s", session_gguf) as s:
        assert s.restored_epoch == epoch
        s.generate(10)
        assert s.tokens() == want


def test_a_q8_0_head_capsule_is_refused_where_the_head_would_be_fp16(session_gguf, tmp_path, monkeypatch):
    from capsule.llm import q8_head
    from edge_kernels import q8_linear_cpu
    with _open(tmp_path / "s", session_gguf) as s:      # the GGUF's output matrix is Q8_0
        assert isinstance(s.engine.runner.model.head, q8_head.Q8Head)
        s.append("hello robot")
        s.checkpoint()
    for module in (q8_head, q8_linear_cpu):             # a build without the kernel: fp16 head
        monkeypatch.setattr(module, "missing", lambda: "not built")
    with pytest.raises(CapsuleMismatch, match="lm_head"):
        _open(tmp_path / "s", session_gguf)


@pytest.mark.skipif(torch_kernel_missing() is not None, reason=str(torch_kernel_missing()))
@pytest.mark.parametrize("first", ["c", "torch"])
def test_a_capsule_is_refused_under_the_other_int4_kernel(session_gguf, tmp_path, monkeypatch, first):
    # int16 vs bf16 activations: other K/V, other logits. The lm_head stays Q8_0 in both (only
    # the Q4 kernel is switched off), so the mismatch is the activations' alone
    from edge_kernels import q4_linear_cpu

    def kernels(on: bool) -> None:
        monkeypatch.setattr(q4_linear_cpu, "missing", (lambda: None) if on else (lambda: "not built"))
    kernels(first == "c")
    with _open(tmp_path / "s", session_gguf) as s:
        s.append("hello robot")
        s.checkpoint()
    kernels(first != "c")
    with pytest.raises(CapsuleMismatch, match="int4_activations"):
        _open(tmp_path / "s", session_gguf)
    kernels(first == "c")
    with _open(tmp_path / "s", session_gguf) as s:       # its own kernel continues it
        assert s.restored_epoch is not None


def test_an_int4_capsule_is_refused_by_a_dequantized_session(session_gguf, tmp_path):
    with _open(tmp_path / "s", session_gguf) as s:
        s.append("hello robot")
        s.checkpoint()
    with pytest.raises(CapsuleMismatch, match="linears"):
        _open(tmp_path / "s", session_gguf, "dequantized")


def test_the_decode_suites_weights_table(session_gguf):
    from capsule.tools.bench import BenchOptions
    from capsule.tools.bench.decode import robot_prompt
    from capsule.tools.bench.decode_linears import measure
    reps_done = []   # the peers suite runs llama.cpp's rep r here, after every cell's rep r
    m = measure(BenchOptions(model=str(session_gguf), device="cpu", quick=True, steps=3), robot_prompt, TOKENIZER,
                show=False, after_rep=lambda r: reps_done.append((r, len(reps_done))))
    assert reps_done == [(r, r) for r in range(m["reps"])]
    rows = {(r["linears"], r["attention"], r["kv"], r["threads"]): r for r in m["rows"]}
    assert len(rows) == len(m["rows"])                                  # no cell twice
    assert {lin for lin, _, _, _ in rows} == {"dequantized", "int4"} and {t for *_, t in rows} >= {1}
    # a bf16 pool under the default attention only, every weights kind and thread count
    assert {(a, kv) for _, a, kv, _ in rows} == {("auto", "float32"), ("torch", "float32"), ("auto", "bfloat16")}
    assert {(lin, t) for lin, _, kv, t in rows if kv == "bfloat16"} == {(lin, t) for lin, _, _, t in rows}
    assert {(a, r["kernel"]) for (_, a, _, _), r in rows.items()} == {("auto", "cpu"), ("torch", "torch")}
    assert {(a, r["step"]) for (_, a, _, _), r in rows.items()} == {("auto", "fused"), ("torch", "layers")}
    for r in rows.values():
        assert r["b1_ms_ctx512"] > 0 and r["b4_ms_per_token_ctx512"] > 0 and r["prefill_tokens"] >= 512
        assert 0 <= r["greedy_same_as_dequantized"] <= r["greedy_tokens"] == 5
        assert 0 <= r["greedy_same_as_fp32_kv"] <= 5 and (r["kv"] == "bfloat16" or r["greedy_same_as_fp32_kv"] == 5)
    assert rows[("dequantized", "auto", "float32", 1)]["greedy_same_as_dequantized"] == 5
    assert rows[("dequantized", "auto", "bfloat16", 1)]["greedy_same_as_dequantized"] == 5
    assert set(m["greedy"]) == {f"{lin}/{t}" for lin, *_, t in rows}   # the default attention's and pool's
    d = m["deviation"]
    assert d["prompt_tokens"] == 256 and 0 < d["max_abs_logit_dev"] and d["max_dev_over_max_logit"] < 0.05
    assert "skipped" in measure(BenchOptions(model="builtin:tiny", device="cpu", quick=True), robot_prompt, TOKENIZER, show=False)
