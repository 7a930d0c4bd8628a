"""`capsule bench --suite peers` without llama.cpp: the cached peer venv, the refusal to build when
told not to, the tables and targets from known numbers, and a model llama.cpp cannot read."""
from __future__ import annotations

import os
import stat

import pytest

from capsule.errors import ModelLoadError
from capsule.tools.bench import BenchOptions, peers_env
from capsule.tools.bench.peers import run
from capsule.tools.bench.peers_tables import tables


def test_no_build_when_forbidden_and_the_cached_venv_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_PEERS_CACHE", str(tmp_path))
    monkeypatch.setenv("CAPSULE_PEERS_BUILD", "0")
    env = peers_env.ensure(show=False)
    assert env.python is None and "CAPSULE_PEERS_BUILD=0" in env.why
    assert not (tmp_path / f"llama-cpp-python-{peers_env.VERSION}").exists()   # nothing half-built
    fake = tmp_path / f"llama-cpp-python-{peers_env.VERSION}" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!/bin/sh\necho {peers_env.VERSION}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert peers_env.ensure(show=False).python is None             # no record of its build flags
    stamp = fake.parent.parent / peers_env.STAMP
    stamp.write_text(peers_env.build_flags().replace("AMX_INT8=OFF", "AMX_INT8=ON"))
    assert peers_env.ensure(show=False).python is None             # built with other flags: not reused
    stamp.write_text(peers_env.build_flags())
    env = peers_env.ensure(show=False)
    assert env.python == fake and env.why == "" and env.built_s == 0.0
    fake.write_text("#!/bin/sh\necho 0.0.1\n")                  # another version: not reused
    assert peers_env.ensure(show=False).python is None


def test_on_x86_llama_cpp_is_built_without_amx_even_for_the_native_cpu(monkeypatch):
    # -march=native ignores GGML_AMX_*=OFF; only an explicit -mno-amx-* keeps tilezero out
    monkeypatch.setattr(peers_env.platform, "machine", lambda: "x86_64")
    assert set(peers_env.compiler_flags().split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}
    assert "-mno-amx-int8" in peers_env.build_flags()
    monkeypatch.setattr(peers_env.platform, "machine", lambda: "aarch64")   # gcc there has no such flag
    assert peers_env.compiler_flags() == ""


def test_a_peer_that_crashes_mid_run_is_left_out_with_the_reason(tmp_path):
    from capsule.tools.bench.peers import PEER_FAILURES, _left_out, _peer
    crash = tmp_path / "python"
    crash.write_text("#!/bin/sh\nkill -ILL $$\n")                # as llama.cpp's AMX path did here
    crash.chmod(crash.stat().st_mode | stat.S_IXUSR)
    env = peers_env.PeerEnv(crash)
    with pytest.raises(RuntimeError, match="decode was killed by SIGILL") as crashed:
        _peer(env, "decode", str(tmp_path / "job.json"))
    assert isinstance(crashed.value, PEER_FAILURES)                # the suite goes on without the peer
    why = _left_out(crashed.value)
    assert why.startswith("llama.cpp failed during the run") and "SIGILL" in why
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\nexit 0\n")                     # ran, printed no result
    silent.chmod(silent.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(PEER_FAILURES) as quiet:
        _peer(peers_env.PeerEnv(silent), "restore", "x")
    assert "llama.cpp failed" in _left_out(quiet.value)


def _results(peer: bool) -> dict:
    def cap(lin, t, b512, b2048, ratio):
        return {"linears": lin, "threads": t, "b1_ms_ctx512": b512, "b1_ms_ctx2048": b2048, "b4_vs_b1": ratio}
    res = {"capsule_decode": {"rows": [cap("dequantized", 1, 50.0, 70.0, 0.6), cap("dequantized", 2, 45.0, 60.0, 0.5),
                                       cap("int4", 1, 20.0, 40.0, 0.35), cap("int4", 2, 15.0, 30.0, 0.3),
                                       # a bf16 pool: a batch-4 target, not a llama.cpp comparison
                                       {**cap("dequantized", 1, 49.0, 69.0, 0.38), "kv": "bfloat16"}],
                              "greedy": {"dequantized/1": [5, 6, 7, 8], "int4/1": [5, 6, 9, 9]}},
           "capsule_restore": {lin: {"restore_interpreter_s": 0.02, "restore_import_s": 1.2, "restore_open_s": 0.03,
                                     "restore_in_open_s": 0.01, "restore_first_token_s": 0.03,
                                     "restore_process_s": 1.28, "restore_bytes": 10} for lin in ("dequantized", "int4")},
           "capsule_lite_restore": {"interpreter_s": 0.05, "import_s": 0.2, "open_s": 0.1, "first_token_s": 0.1,
                                    "process_s": 0.40, "state_bytes": 10},
           "capsule_lite_restore_f32c": {"interpreter_s": 0.05, "import_s": 0.15, "open_s": 0.05,
                                         "first_token_s": 0.05, "process_s": 0.30, "state_bytes": 10},
           "capsule_lite_restore_int4": {"interpreter_s": 0.05, "import_s": 0.2, "open_s": 0.1,
                                         "first_token_s": 0.05, "process_s": 0.45, "state_bytes": 10},
           "peer": {"why": "" if peer else "no compiler"}}
    if peer:
        def cells(ms512, ms2048):
            return [{"512": {"steps_s": [ms512 / 1e3] * 3, "greedy": [5, 6, 7, 9]},
                     "2048": {"steps_s": [ms2048 / 1e3] * 3, "greedy": [1]}}]
        res["llama_decode"] = {"F32/1": cells(60.0, 70.0), "F32/2": cells(40.0, 50.0),
                               "Q4_1/1": cells(30.0, 45.0), "Q4_1/2": cells(20.0, 25.0)}
        res["llama_restore"] = {w: {"interpreter_s": 0.02, "import_s": 0.1, "model_load_s": 0.2, "state_load_s": 0.05,
                                    "first_token_s": 0.05, "process_s": 0.42, "state_bytes": 9} for w in ("F32", "Q4_1")}
    return res


def test_tables_compare_cell_by_cell_and_say_which_targets_hold():
    t = tables(_results(peer=True), (512, 2048))
    decode = {(r["weights"].split()[0], r["threads"], r["context"]): r for r in t["decode ms/token, batch 1 (p50)"]}
    assert decode[("dequantized", 1, 512)]["llama_cpp_ms"] == pytest.approx(60.0)
    assert decode[("dequantized", 1, 512)]["capsule_vs_llama_cpp"] == pytest.approx(50 / 60)
    assert decode[("int4", 2, 2048)]["capsule_vs_llama_cpp"] == pytest.approx(30 / 25)
    greedy = {r["weights"].split()[0]: r for r in t["greedy ids, capsule vs llama.cpp (same prompt ids)"]}
    assert greedy["dequantized"]["equal_leading_tokens"] == 3 and greedy["int4"]["equal_leading_tokens"] == 2
    targets = {r["target"]: r["met"] for r in t["targets (issue 19)"]}
    assert targets["decode dequantized fp32 / F32 copy, 1 thread(s), ctx 512: capsule <= llama.cpp"] is True
    assert targets["decode dequantized fp32 / F32 copy, 2 thread(s), ctx 512: capsule <= llama.cpp"] is False
    assert targets["batch 4 per token <= 0.4x batch 1 at 2048 (int4, auto attention, float32 K/V, 1 thread(s))"] is True
    assert targets["batch 4 per token <= 0.4x batch 1 at 2048 (dequantized, auto attention, float32 K/V, "
                   "1 thread(s))"] is False
    assert targets["batch 4 per token <= 0.4x batch 1 at 2048 (dequantized, auto attention, bfloat16 K/V, "
                   "1 thread(s))"] is True
    assert len([k for k in targets if k.startswith("batch")]) == 5
    restore = [v for k, v in targets.items() if k.startswith("restore")]
    # vs 420 ms from spawn: 1,280 ms, lite 400 ms, fp32 C lite 300; int4 1,280, int4 lite 450
    assert restore == [False, True, True, False, False]
    lite = [k for k in targets if k.startswith("restore") and "lite" in k]
    assert lite == ["restore -> first token from spawn, capsule lite (no torch), dequantized fp32 via onnxruntime "
                    "vs F32 copy", "restore -> first token from spawn, capsule lite (no torch), dequantized fp32 via "
                    "the C step vs F32 copy", "restore -> first token from spawn, capsule lite (no torch), int4 via "
                    "the C step vs Q4_1"]
    assert "llama.cpp unavailable" not in t


def test_without_the_peer_the_tables_keep_capsules_figures_and_say_why():
    t = tables(_results(peer=False), (512, 2048))
    assert t["llama.cpp unavailable"] == [{"why": "no compiler"}]
    assert all(r["llama_cpp_ms"] is None and r["capsule_ms"] for r in t["decode ms/token, batch 1 (p50)"])
    assert [r["who"] for r in t["restore -> first token, fresh process, one thread"]] == [
        "capsule, dequantized fp32", "capsule lite (no torch), dequantized fp32 via onnxruntime",
        "capsule lite (no torch), dequantized fp32 via the C step",
        "capsule, int4 (the Q4_1 codes)", "capsule lite (no torch), int4 via the C step"]
    assert not any(r["target"].startswith(("decode", "restore")) for r in t["targets (issue 19)"])


def test_a_model_llama_cpp_cannot_read_is_refused_before_any_work(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF"):
        run(BenchOptions(model=str(tmp_path), device="cpu", progress=False))
    assert os.listdir(tmp_path) == []


def test_llama_cpps_f32_copy_holds_the_weights_capsule_runs(tmp_path):
    """The F32 GGUF given to llama.cpp: every tensor F32, metadata kept, and loaded by capsule it is
    bit for bit the model capsule dequantizes from the quantized file (llama layout, permuted q/k)."""
    import gguf
    import torch
    from gguf_checkpoints import checkpoint_gguf

    from capsule.llm import load_model
    from capsule.tools.bench.peers_f32 import write_f32_copy
    src, _ = checkpoint_gguf("llama", tmp_path, default_qtype="Q4_1",
                             qtypes={"blk.0.attn_q.weight": "Q4_0", "token_embd.weight": "Q8_0"})
    dst = write_f32_copy(src, tmp_path / "copy.F32.gguf")
    reader = gguf.GGUFReader(dst)
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    assert reader.fields["tokenizer.chat_template"].contents() == "{{ messages[0]['content'] }}"
    want, got = load_model(src)[0].state_dict(), load_model(dst)[0].state_dict()
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    q = want["w.model/layers/0/self_attn/q_proj/weight"]
    assert q.abs().max() > 0 and not torch.equal(q, q.round())                 # real weights, not zeros
    stamp = dst.stat().st_mtime_ns
    assert write_f32_copy(src, dst) == dst and dst.stat().st_mtime_ns == stamp    # reused, not rewritten
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
