"""Decoder.set_decode_attention("triton"): the paged decode kernel inside the model's forward
gives the torch path's hidden states, on a full block table (as graph decode passes it), with a
memory region's holes and rows of different lengths. CPU runs the kernel under Triton's
interpreter (set per test, as tests/test_paged_decode_kernel.py does); the cuda test compares
greedy continuations through captured graphs."""
from __future__ import annotations

import pytest
import torch

from capsule.session import Session
from paged_cases import decode_rows

RT = {"kv_pool_mb": 16, "max_context": 1024}
FACTS = ["The red cup is fragile.", "The charger is in bay 2.", "Alice likes green tea."]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_triton_decode_attention_equals_torch(tmp_path, interpret):
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT,
                      memory={"embedder": None}) as s:
        for f in FACTS:
            s.remember(f)
        s.append("system: you are a robot.\n", stream="a", system=True)
        s.append("user: where is the charger?\nassistant:", stream="a")
        s.generate(3, stream="a", memory_k=2)                 # a region with holes before its facts
        s.append("user: " + "tell me a long story about bays. " * 6, stream="b")
        s.generate(2, stream="b")
        assert s.engine.streams["a"].table.skip[1] > s.engine.streams["a"].table.skip[0]
        m, pool = s.engine.runner.model, s.engine.pool
        ids, pos, slots, tables = decode_rows(s, ["a", "b"])
        assert pos[0, 0] != pos[1, 0] and tables.shape[1] > 2
        out = {}
        for kind in ("torch", "triton"):
            m.set_decode_attention(kind)
            with torch.inference_mode():
                out[kind] = m(ids, pos, slots, tables, pool.tensor, slot_valid=pool.slot_valid)
        m.set_decode_attention("torch")
    assert out["torch"].shape == (2, 1, m.cfg.hidden_size)
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-4, atol=1e-5)


def test_decode_attention_kind_is_checked(tmp_path, interpret):
    from capsule.llm.model import DECODE_ATTENTION
    from devices.profile import DECODE_ATTENTION as PROFILE_CHOICES
    assert DECODE_ATTENTION is PROFILE_CHOICES                # one list of choices, not two
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT) as s:
        m = s.engine.runner.model
        assert m.decode_attention == "cpu"                    # "auto" on a CPU fp32 model: the C kernel
        with pytest.raises(ValueError, match="decode attention must be one of"):
            m.set_decode_attention("flash")
    with Session.open(tmp_path / "t", device="cpu", model="builtin:tiny",
                      runtime={**RT, "decode_attention": "triton"}) as s:
        assert s.engine.runner.model.decode_attention == "triton"
        s.append("user: hello robot\nassistant:")
        assert len(s.tokens()) > 0 and isinstance(s.generate(2), str)
    with pytest.raises(ValueError, match="runtime.decode_attention"):
        Session.open(tmp_path / "u", device="cpu", model="builtin:tiny",
                     runtime={**RT, "decode_attention": "flash"})


@pytest.mark.cuda
def test_triton_decode_attention_in_graphs_matches_torch(tmp_path):
    got = {}
    for kind in ("torch", "triton"):
        with Session.open(tmp_path / kind, device="cuda", model="builtin:tiny",
                          runtime={**RT, "decode_attention": kind}, memory={"embedder": None}) as s:
            assert s.engine.runner.uses_graphs and s.engine.runner.model.decode_attention == kind
            for f in FACTS:
                s.remember(f)
            s.append("system: you are a robot.\n", system=True)
            s.append("user: where is the charger?\nassistant:")
            got[kind] = s.generate(24, memory_k=2)
    assert got["triton"] == got["torch"]


def test_a_capsule_is_bound_to_its_decode_attention(tmp_path, interpret):
    from capsule.errors import CapsuleMismatch
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT) as s:
        s.append("user: hello robot\nassistant:")
        s.generate(2)
        s.checkpoint()
    with pytest.raises(CapsuleMismatch):
        Session.open(tmp_path / "s", device="cpu", model="builtin:tiny",
                     runtime={**RT, "decode_attention": "triton"})
    with Session.open(tmp_path / "s", device="cpu", model="builtin:tiny", runtime=RT) as s:
        assert s.text().startswith("user: hello robot")          # the default restores it
