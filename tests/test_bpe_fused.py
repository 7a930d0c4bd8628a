"""The fused Triton BPE merges (edge_kernels.bpe_fused) equal sequential BPE and the references.

CPU tests run the kernel under Triton's interpreter (TRITON_INTERPRET=1, set per test as in
tests/test_paged_decode_kernel.py); triton is in the test extra (a missing one fails). The
interpreter pays per operation, so the batches are small; the cuda tests run the compiled kernel.
"""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from capsule.tokenize import load_reference
from capsule.tokenize.differential import HAZARD, MULTILINGUAL, _texts
from capsule.tokenize.tensor_bpe import TensorBpe
from edge_kernels import bpe_fused
from edge_kernels.bpe import (merge_pieces, merge_rows, pack_pieces, table_from_merges,
                              table_from_ranks, unpack)
from edge_kernels.bpe_fused import hash_table, merge_packed_fused, merge_rows_fused
from tokenizer_facts import tensor_bpe_families
from test_tensor_bpe import CHARS, random_ranks, sequential_merges, sequential_ranks, toy_vocab

assert importlib.util.find_spec("triton") is not None, \
    "triton is not installed: pip install -e '.[test]' (the test extra lists it)"


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def fused(pieces: list[bytes], table) -> list[list[int]]:
    return unpack(merge_packed_fused(pack_pieces(pieces, table), table, hash_table(table)),
                  len(pieces))


def test_round_stops_after_a_merge_that_creates_a_lower_pair(interpret):
    vocab = {CHARS[b]: b for b in range(256)}
    vocab.update({"ab": 256, "aba": 257})
    table = table_from_merges(vocab, [("ab", "a"), ("a", "b")], CHARS)
    assert fused([bytes([0, 1, 0, 1])], table) == [[257, 1]]


@pytest.mark.parametrize("seed", range(2))
def test_random_merge_tables_match_sequential_bpe(interpret, seed):
    rng = random.Random(seed)
    vocab, merges = toy_vocab(rng, 4, 60)
    table = table_from_merges(vocab, merges, CHARS)
    pieces = [bytes(rng.randrange(4) for _ in range(rng.randint(1, 24))) for _ in range(120)]
    pieces += [bytes([0] * 7), bytes([0, 1] * 9), bytes([1]) * 33, bytes([2, 3]) * 20]
    assert fused(pieces, table) == [sequential_merges(p, vocab, merges) for p in pieces]


@pytest.mark.parametrize("seed", range(2))
def test_random_rank_tables_match_sequential_bpe(interpret, seed):
    rng = random.Random(100 + seed)
    ranks = random_ranks(rng)
    table = table_from_ranks(ranks)
    pieces = [bytes(rng.randrange(3) for _ in range(rng.randint(1, 24))) for _ in range(120)]
    assert fused(pieces, table) == [sequential_ranks(p, ranks) for p in pieces]


def test_rows_of_a_tile_finish_at_different_rounds_and_padding_stays(interpret):
    # one bucket (5-8 bytes) where one row needs many rounds and others none: a finished row
    # must not change while the tile keeps going, and every row ends left-aligned, -1 padded
    rng = random.Random(7)
    vocab, merges = toy_vocab(rng, 2, 30)
    table = table_from_merges(vocab, merges, CHARS)
    rows = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0], [7, 8, 9, 10, 11, -1, -1, -1],
                         [1, 0, 1, 0, -1, -1, -1, -1], [5, -1, -1, -1, -1, -1, -1, -1]])
    assert torch.equal(merge_rows_fused(rows, table, hash_table(table)), merge_rows(rows, table))


def test_wide_rows_keep_the_torch_loop(interpret, monkeypatch):
    rng = random.Random(3)
    vocab, merges = toy_vocab(rng, 3, 40)
    table = table_from_merges(vocab, merges, CHARS)
    monkeypatch.setattr(bpe_fused, "MAX_WIDTH", 8)
    monkeypatch.setattr(bpe_fused, "_kernel", lambda: pytest.fail("kernel launched for wide rows"))
    pieces = [bytes(rng.randrange(3) for _ in range(rng.randint(9, 16))) for _ in range(20)]
    assert fused(pieces, table) == merge_pieces(pieces, table)


def test_hash_table_finds_every_pair_and_nothing_else():
    rng = random.Random(5)
    vocab, merges = toy_vocab(rng, 8, 300)
    table = table_from_merges(vocab, merges, CHARS)
    h = hash_table(table)
    assert h.keys.numel() > 4 * table.keys.numel() and int(h.keys[-1]) == -1   # empty tail slot
    assert int((h.keys >= 0).sum()) == table.keys.numel()
    # probing from each pair's home slot reaches its key within max_probe slots
    left, right = table.keys // table.stride, table.keys % table.stride
    home = bpe_fused._home(left, right, h.shift, h.mask)
    for k, r, m, at in zip(table.keys.tolist(), table.ranks.tolist(), table.merged.tolist(),
                           home.tolist()):
        window = h.keys[at:at + h.max_probe].tolist()
        assert k in window, (k, at)
        i = at + window.index(k)
        assert (int(h.values[i]) >> 32, int(h.values[i]) & 0xFFFFFFFF) == (r, m)
        assert -1 not in window[:window.index(k)]   # no empty slot before it: a probe gets there
    empty = hash_table(table_from_ranks({bytes([b]): b for b in range(256)}))
    assert int((empty.keys >= 0).sum()) == 0 and empty.max_probe == 0


def test_bad_inputs_are_refused(monkeypatch):
    table = table_from_ranks({bytes([b]): b for b in range(256)})
    h = hash_table(table)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        merge_rows_fused(torch.zeros(2, 4, dtype=torch.int64), table, h)
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        merge_rows_fused(torch.zeros(4, dtype=torch.int64), table, h)
    with pytest.raises(ValueError, match="kernel must be one of"):
        TensorBpe(load_reference("cl100k_base"), kernel="cuda")


def one_bucket(pieces: list[bytes], table, width: int) -> torch.Tensor:
    """All pieces as one (B, width) row tensor: one interpreted launch instead of one per bucket."""
    rows = torch.full((len(pieces), width), -1, dtype=torch.int64)
    for i, p in enumerate(pieces):
        rows[i, :len(p)] = table.byte_ids[torch.tensor(list(p))]
    return rows


@pytest.mark.parametrize("family", tensor_bpe_families())
def test_real_vocabularies_equal_the_torch_loop(interpret, family):
    # the torch loop equals each reference (tests/test_tensor_bpe.py); here the fused kernel
    # equals it on the family's real merge table, over the pieces of a corpus slice
    ref = load_reference(family)
    bpe = TensorBpe(ref)
    gen = _texts(7, 3000)
    text = "".join(next(gen)[1] for _ in range(6)) + MULTILINGUAL + "".join(HAZARD)
    # up to 16 bytes: the interpreter's time follows the rounds of the slowest row (long
    # pieces and runs are the random-table tests' part)
    pieces = sorted({p for p in bpe.pre_tokenize(text) if isinstance(p, bytes)
                     and 1 < len(p) <= 16 and p not in bpe.whole_pieces})
    assert len(pieces) > 100
    rows = one_bucket(pieces, bpe.table, 16)
    assert torch.equal(merge_rows_fused(rows, bpe.table, hash_table(bpe.table)),
                       merge_rows(rows, bpe.table))


def test_tensor_bpe_triton_kernel_equals_reference(interpret):
    ref = load_reference("cl100k_base")
    bpe = TensorBpe(ref, kernel="triton")
    texts = [MULTILINGUAL, "x" + " " * 40 + "y", "", "<|endoftext|>9999999 hello"]
    assert bpe.encode_batch(texts) == [ref.encode(t) for t in texts]


@pytest.mark.cuda
@pytest.mark.parametrize("family", tensor_bpe_families())
def test_fused_kernel_on_cuda_equals_reference_and_the_torch_loop(family):
    ref = load_reference(family)
    bpe = TensorBpe(ref, device="cuda", kernel="triton")
    gen = _texts(11, 3000)
    texts = [next(gen)[1] for _ in range(100)] + [MULTILINGUAL, " " * 3000 + "x", "9" * 5000]
    assert bpe.encode_batch(texts) == [ref.encode(t) for t in texts]
    pieces = [p for t in texts[:20] for p in bpe.pre_tokenize(t) if isinstance(p, bytes)]
    torch_loop = TensorBpe(ref, device="cuda")
    assert bpe.merge(pieces) == torch_loop.merge(pieces)
    torch.cuda.synchronize()
