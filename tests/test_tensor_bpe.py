"""Tensor BPE (edge_kernels.bpe, tokenize.tensor_bpe): exact vs sequential BPE and the references."""
from __future__ import annotations

import random

import pytest
import torch

from capsule.tokenize import load_reference, run_differential
from capsule.tokenize.differential import HAZARD, MULTILINGUAL, _texts
from capsule.tokenize.tensor_bpe import TensorBpe
from edge_kernels.bpe import merge_pieces, table_from_merges, table_from_ranks
from tokenizer_facts import tensor_bpe_families

CHARS = [chr(0x61 + i) for i in range(256)]   # a stand-in "byte alphabet" for toy vocabularies


def sequential_merges(piece: bytes, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """tokenizers' Word::merge_all, written plainly: lowest rank first, leftmost on ties."""
    rank = {}
    for i, (a, b) in enumerate(merges):
        rank[(a, b)] = i
    parts = [CHARS[b] for b in piece]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = rank.get((parts[i], parts[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return [vocab[p] for p in parts]
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def sequential_ranks(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's _byte_pair_merge, written plainly: rank of the concatenated bytes."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return [ranks[p] for p in parts]
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def toy_vocab(rng: random.Random, n_bytes: int, n_merges: int):
    vocab = {CHARS[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    tokens = [CHARS[b] for b in range(n_bytes)]
    while len(merges) < n_merges:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if (a, b) in merges or len(a + b) > 6:
            continue
        merges.append((a, b))
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            tokens.append(a + b)
    rng.shuffle(merges)   # ranks unrelated to training order: merges that create lower pairs
    return vocab, merges


def test_round_stops_after_a_merge_that_creates_a_lower_pair():
    # 'abab': (a,b) ranks 1 at two places; merging the first makes (ab,a) rank 0, which the
    # sequential loop takes next: [aba, b]. Merging both occurrences at once would give [ab, ab].
    vocab = {CHARS[b]: b for b in range(256)}
    vocab.update({"ab": 256, "aba": 257})
    table = table_from_merges(vocab, [("ab", "a"), ("a", "b")], CHARS)
    assert merge_pieces([bytes([0, 1, 0, 1])], table) == [[257, 1]]
    assert sequential_merges(bytes([0, 1, 0, 1]), vocab, [("ab", "a"), ("a", "b")]) == [257, 1]


@pytest.mark.parametrize("seed", range(6))
def test_random_merge_tables_match_sequential_bpe(seed):
    rng = random.Random(seed)
    vocab, merges = toy_vocab(rng, 4, 60)
    table = table_from_merges(vocab, merges, CHARS)
    pieces = [bytes(rng.randrange(4) for _ in range(rng.randint(1, 40))) for _ in range(400)]
    pieces += [bytes([0, 0, 0, 0, 0, 0, 0]), bytes([0, 1] * 9), bytes([1]) * 33]
    got = merge_pieces(pieces, table)
    assert got == [sequential_merges(p, vocab, merges) for p in pieces]


def random_ranks(rng: random.Random) -> dict[bytes, int]:
    """The 256 bytes plus 80 random strings over 3 bytes, ranked in random order."""
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < 256 + 80:
        ranks.setdefault(bytes(rng.randrange(3) for _ in range(rng.randint(2, 5))), len(ranks))
    shuffled = list(ranks)[256:]
    rng.shuffle(shuffled)
    return {**{bytes([b]): b for b in range(256)}, **{t: 256 + i for i, t in enumerate(shuffled)}}


@pytest.mark.parametrize("seed", range(6))
def test_random_rank_tables_match_sequential_bpe(seed):
    rng = random.Random(100 + seed)
    ranks = random_ranks(rng)
    table = table_from_ranks(ranks)
    pieces = [bytes(rng.randrange(3) for _ in range(rng.randint(1, 30))) for _ in range(400)]
    assert merge_pieces(pieces, table) == [sequential_ranks(p, ranks) for p in pieces]


def test_kernel_rejects_empty_pieces_and_passes_single_bytes():
    table = table_from_ranks({bytes([b]): b for b in range(256)})
    assert merge_pieces([b"a", b"xyz"], table) == [[97], [120, 121, 122]]
    assert merge_pieces([], table) == []
    with pytest.raises(ValueError, match="non-empty"):
        merge_pieces([b""], table)


@pytest.mark.parametrize("family", tensor_bpe_families())
def test_tensor_bpe_equals_reference_on_corpus_slice(family):
    ref = load_reference(family)
    bpe = TensorBpe(ref)
    gen = _texts(7, 2000)
    texts = [next(gen)[1] for _ in range(60)]
    texts += [MULTILINGUAL, "".join(HAZARD), "", "x" + " " * 40 + "y", "9" * 500, "today\n \n",
              "<|im_start|>user<|im_end|>", "<｜end▁of▁sentence｜>", "Cafe\u0301 \u00a0\u3000 👩\u200d👧"]
    assert bpe.encode_batch(texts) == [ref.encode(t) for t in texts]
    assert bpe.encode("hello world") == ref.encode("hello world")


def test_tensor_bpe_bad_input():
    bpe = TensorBpe(load_reference("cl100k_base"))
    with pytest.raises(TypeError, match="str"):
        bpe.encode(b"bytes")   # type: ignore[arg-type]


def test_differential_campaign_checks_the_kernel():
    out = run_differential(["deepseek-v4"], n_checks=300, seed=3, bpe=True)
    fam = out["families"]["deepseek-v4"]
    assert fam["bpe_checks"] >= 3 and fam["bpe_divergences"] == 0 and fam["divergences"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("family", tensor_bpe_families())
def test_tensor_bpe_on_cuda_equals_reference(family):
    ref = load_reference(family)
    bpe = TensorBpe(ref, device="cuda")
    gen = _texts(11, 3000)
    texts = [next(gen)[1] for _ in range(100)] + [MULTILINGUAL]
    assert bpe.encode_batch(texts) == [ref.encode(t) for t in texts]
    assert bpe.table.keys.device.type == "cuda"
    torch.cuda.synchronize()
