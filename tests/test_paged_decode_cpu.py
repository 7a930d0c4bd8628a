"""The C paged decode kernel (edge_kernels.paged_decode_cpu) equals capsule.llm.paged_attention
(T=1) on its mask rules, reads nothing past a row's length, is batch- and thread-invariant, and
runs inside the Session as runtime.decode_attention="cpu" (bound into capsules).

The kernel is built by the package install (setup.py); a missing build fails these tests."""
from __future__ import annotations

import sys

import pytest
import torch

from capsule.errors import CapsuleMismatch, EngineUnavailable
from capsule.session import Session
from edge_kernels import cpu_library, paged_decode_cpu
from edge_kernels.paged_decode_cpu import paged_decode_attention_cpu

from paged_cases import BS, HD, H, NB, NBLK, paged_case, paged_reference

RT = {"kv_pool_mb": 16, "max_context": 1024}


def test_the_kernel_was_built_with_the_package():
    assert paged_decode_cpu.missing() is None, paged_decode_cpu.missing()


def _case(seed: int = 0, hd: int = HD, dtype: torch.dtype = torch.float32) -> dict:
    return paged_case(pool_dtype=dtype, seed=seed, hd=hd)


_reference = paged_reference


def _kernel(c: dict, holes: bool, **kw) -> torch.Tensor:
    return paged_decode_attention_cpu(c["q"], c["k"], c["v"], c["tables"], c["lens"],
                                      c["q"].shape[-1] ** -0.5, c["valid"] if holes else None, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])   # runtime.kv_dtype
@pytest.mark.parametrize("hd", [64, 128, 48, 256])    # the two unrolled sizes, the generic loop (to its cap)
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("threads", [1, 4])           # 4 > 3 rows: each row split between workers
def test_equals_the_torch_paged_attention(holes, hd, dtype, threads):
    c = _case(hd=hd, dtype=dtype)   # the torch path widens a bf16 pool to fp32 as the kernel does
    torch.testing.assert_close(_kernel(c, holes, threads=threads), _reference(c, holes), rtol=1e-5, atol=2e-6)
    # (B, 1, H, hd) in, the same shape out
    out4 = paged_decode_attention_cpu(c["q"].unsqueeze(1), c["k"], c["v"], c["tables"].long(),
                                      c["lens"].long(), hd ** -0.5)
    assert out4.shape == (3, 1, H, hd)


def test_reads_no_slot_past_the_length():
    c = _case()
    before = _kernel(c, True)
    # garbage in every slot after each row's last one, and in the holes: nothing changes
    for b, n in enumerate(c["lens"].tolist()):
        for s in range(n, NBLK * BS):
            c["pool"][c["tables"][b, s // BS], 1, :, s % BS] = float("nan")
    c["pool"][:, 1, 1][~c["valid"]] = float("inf")    # a hole's value bytes (never written)
    torch.testing.assert_close(_kernel(c, True), before, rtol=0, atol=0)
    # one slot more is read when the length is one more: the result moves
    c2 = _case()
    c2["lens"] = c2["lens"].clone()
    c2["lens"][1] += 1
    assert not torch.allclose(_kernel(c2, True)[1], before[1])


def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    c = _case(seed=3)
    full = _kernel(c, True, threads=1)
    for threads in (2, 3, 8):
        assert torch.equal(_kernel(c, True, threads=threads), full)
    for b in range(3):   # one row split between 2 or 3 workers: the same bits as a whole row
        alone = {**c, "q": c["q"][b:b + 1], "tables": c["tables"][b:b + 1], "lens": c["lens"][b:b + 1]}
        for threads in (1, 2, 3):
            assert torch.equal(_kernel(alone, True, threads=threads)[0], full[b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_does_not_depend_on_the_other_heads_of_its_group(dtype):
    # The kernel reads a kv head's values once for its G query heads where every head has four
    # readable slots, else head by head; a head's sum must run in one order either way. Head 0's
    # huge scores underflow most of its p to 0, which must not change heads 1 and 2 (same group).
    c = _case(dtype=dtype)
    spiky = c["q"].clone()
    spiky[:, 0] *= 300
    calm, loud = _kernel(c, False), _kernel({**c, "q": spiky}, False)
    assert not torch.equal(calm[:, 0], loud[:, 0])
    assert torch.equal(calm[:, 1:], loud[:, 1:])


def test_an_empty_batch_is_an_empty_result():
    c = _case(seed=4)
    empty = {**c, "q": c["q"][:0], "tables": c["tables"][:0], "lens": c["lens"][:0]}
    for threads in (1, 2):
        assert _kernel(empty, True, threads=threads).shape == (0, H, c["q"].shape[-1])


def test_bad_arguments_are_refused_before_the_kernel_reads():
    c = _case()
    bad_tables = c["tables"].clone()
    bad_tables[0, 0] = NB                              # one past the pool
    with pytest.raises(ValueError, match="ids outside the pool"):
        paged_decode_attention_cpu(c["q"], c["k"], c["v"], bad_tables, c["lens"], 0.1)
    for lens in ([0, 1, 1], [1, 1, NBLK * BS + 1]):
        with pytest.raises(ValueError, match="seq_lens must lie in"):
            paged_decode_attention_cpu(c["q"], c["k"], c["v"], c["tables"], torch.tensor(lens), 0.1)
    with pytest.raises(RuntimeError, match="fp32 or bf16 CPU pools"):
        paged_decode_attention_cpu(c["q"], c["k"].half(), c["v"].half(), c["tables"], c["lens"], 0.1)
    with pytest.raises(ValueError, match="q must be fp32"):
        paged_decode_attention_cpu(c["q"].double(), c["k"], c["v"], c["tables"], c["lens"], 0.1)
    with pytest.raises(ValueError, match="of k_cache's dtype"):
        paged_decode_attention_cpu(c["q"], c["k"], c["v"].bfloat16(), c["tables"], c["lens"], 0.1)
    odd = _case(hd=40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _kernel(odd, False)
    with pytest.raises(RuntimeError, match="up to 256"):      # its registers hold 16 chunks a slot
        _kernel(_case(hd=272), False)
    with pytest.raises(ValueError, match="one layout"):
        paged_decode_attention_cpu(c["q"], c["k"], c["v"].contiguous(), c["tables"], c["lens"], 0.1)
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_decode_attention_cpu(c["q"], c["k"], c["v"], c["tables"][:2], c["lens"], 0.1)


def test_the_kernel_itself_refuses_heads_it_cannot_hold():
    # the Python checks come first; the C entry refuses too rather than overrun its registers
    c = _case(hd=272)
    q, out = c["q"].contiguous(), torch.empty_like(c["q"])
    k, v = c["k"], c["v"]
    B, H, hd = q.shape
    tables, lens = c["tables"].long().contiguous(), c["lens"].long().contiguous()
    rc = cpu_library.library().capsule_paged_decode(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), False, k.stride(0), k.shape[2] * hd, hd,
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), None, B, H, k.shape[2], hd, BS, 0.1,
        out.data_ptr(), 1)
    assert rc == -1


@pytest.mark.parametrize("kv", [{}, {"kv_dtype": "bfloat16"}])
def test_the_session_decodes_with_it_and_binds_its_capsules(tmp_path, kv):
    texts, hidden = {}, {}
    rt = {**RT, **kv}
    for kind in ("torch", "cpu"):
        with Session.open(tmp_path / kind, device="cpu", model="builtin:tiny",
                          runtime={**rt, "decode_attention": kind}) as s:
            assert s.engine.runner.model.decode_attention == kind
            s.append("user: " + "tell me about the charging bay. " * 8 + "\nassistant:", stream="a")
            s.append("user: hello robot\nassistant:", stream="b")
            texts[kind] = (s.generate(12, stream="a"), s.generate(12, stream="b"))
            s.checkpoint()
    # random weights: near-ties are rare but possible, so the tokens are compared per stream
    # only as a sanity check of the wiring; the hidden states are held to fp32 rounding below
    assert all(len(t) > 0 for t in texts["cpu"])
    with pytest.raises(CapsuleMismatch):
        Session.open(tmp_path / "cpu", device="cpu", model="builtin:tiny",
                     runtime={**rt, "decode_attention": "torch"})
    with Session.open(tmp_path / "cpu", device="cpu", model="builtin:tiny",
                      runtime={**rt, "decode_attention": "cpu"}) as s:
        m, pool = s.engine.runner.model, s.engine.pool
        t = s.engine.streams["a"].table
        i = t.num_cached - 1
        p = t.position(i)
        args = (torch.tensor([[s.tokens("a")[i]]]), torch.tensor([[p]]),
                torch.tensor(t.slots_at([p])), torch.tensor([list(t.blocks[:p // pool.block_size + 1])]))
        for kind in ("torch", "cpu"):
            m.set_decode_attention(kind)
            with torch.inference_mode():
                hidden[kind] = m(*args, pool.tensor, slot_valid=pool.slot_valid)
        m.set_decode_attention("cpu")
    torch.testing.assert_close(hidden["cpu"], hidden["torch"], rtol=1e-4, atol=1e-5)


def test_a_pool_it_cannot_read_is_refused_at_open(tmp_path):
    with pytest.raises(EngineUnavailable, match="decode_attention='cpu' cannot run: .*fp32 or bf16"):
        Session.open(tmp_path / "s", device="cpu", model="builtin:tiny",
                     runtime={**RT, "decode_attention": "cpu", "kv_dtype": "float16"})
    with pytest.raises(EngineUnavailable, match="computes in fp32, the model in torch.bfloat16"):
        Session.open(tmp_path / "t", device="cpu", model="builtin:tiny",
                     runtime={**RT, "decode_attention": "cpu", "dtype": "bfloat16", "kv_dtype": "float32"})


def test_auto_picks_the_kernel_where_it_runs_and_torch_elsewhere(tmp_path):
    from devices.profile import RuntimeDefaults
    assert RuntimeDefaults.__dataclass_fields__["decode_attention"].default == "auto"
    with Session.open(tmp_path / "a", device="cpu", model="builtin:tiny", runtime=RT) as s:
        assert s.engine.runner.model.decode_attention == "cpu"
    with Session.open(tmp_path / "b", device="cpu", model="builtin:tiny",
                      runtime={**RT, "kv_dtype": "float16"}) as s:   # a pool the kernel cannot read
        assert s.engine.runner.model.decode_attention == "torch"
        s.append("user: hello robot\nassistant:")
        assert isinstance(s.generate(2), str)


def test_auto_continues_a_capsule_under_the_attention_it_was_taken_with(tmp_path, caplog):
    """A capsule taken under torch's attention (an SDK from before the kernel, or "torch" asked
    for) restores into a default ("auto") Session, which goes on under torch's attention: the
    continuation equals the uninterrupted one token for token. An explicit "cpu" still refuses."""
    path = tmp_path / "s"
    rt = {**RT, "decode_attention": "torch"}
    with Session.open(path, device="cpu", model="builtin:tiny", runtime=rt) as s:
        s.append("user: " + "where is the charger? " * 6 + "\nassistant:")
        s.generate(4)
        s.checkpoint()
        at_checkpoint = s.tokens()
        s.generate(16)
        uninterrupted = s.tokens()
    caplog.set_level("INFO", logger="capsule")
    with Session.open(path, device="cpu", model="builtin:tiny", runtime=RT) as s:   # auto
        assert s.engine.runner.model.decode_attention == "torch"
        assert s.tokens() == at_checkpoint
        s.generate(16)
        assert s.tokens() == uninterrupted
        s.checkpoint()                                   # new capsules name torch's attention too
    assert "taken under decode attention 'torch'" in caplog.text
    with pytest.raises(CapsuleMismatch, match="capsule decode_attention=torch.* != session decode_attention=cpu"):
        Session.open(path, device="cpu", model="builtin:tiny", runtime={**RT, "decode_attention": "cpu"})
    # a fresh start under auto picks the kernel again
    with Session.open(tmp_path / "fresh", device="cpu", model="builtin:tiny", runtime=RT) as s:
        assert s.engine.runner.model.decode_attention == "cpu"
    with Session.open(path, device="cpu", model="builtin:tiny", runtime=RT, restore=False) as s:
        assert s.engine.runner.model.decode_attention == "cpu" and s.restored_epoch is None


def test_auto_does_not_hide_another_mismatch(tmp_path):
    path = tmp_path / "s"
    with Session.open(path, device="cpu", model="builtin:tiny", runtime={**RT, "decode_attention": "torch"}) as s:
        s.append("user: hello robot\nassistant:")
        s.generate(2)
        s.checkpoint()
    # another max_context: no attention makes it match, and the first refusal is what is raised
    with pytest.raises(CapsuleMismatch, match="max_context"):
        Session.open(path, device="cpu", model="builtin:tiny", runtime={**RT, "max_context": 512})


def test_the_doctor_checks_the_kernel(monkeypatch, tmp_path):
    from capsule.tools.doctor import FAILED, MISSING, OK, probe_decode_kernel
    check = probe_decode_kernel(tmp_path)
    assert check.status == OK and "max |diff|" in check.reason, check
    if sys.platform == "linux" and torch.backends.openmp.is_available():   # where the team is found
        assert f"{torch.get_num_threads()} workers on torch's OpenMP team" in check.reason, check
    monkeypatch.setattr(paged_decode_cpu, "missing", lambda: "no C compiler at install")
    check = probe_decode_kernel(tmp_path)
    assert check.status == MISSING and "no C compiler at install" in check.reason
    monkeypatch.undo()
    # a kernel that reads one slot too few is caught
    real = paged_decode_cpu.paged_decode_attention_cpu
    monkeypatch.setattr(paged_decode_cpu, "paged_decode_attention_cpu",
                        lambda q, k, v, t, lens, *a, **kw: real(q, k, v, t, lens - 1, *a, **kw))
    assert probe_decode_kernel(tmp_path).status == FAILED
