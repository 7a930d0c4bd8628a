"""Feasibility probe for issue 19's torch-free restore: how fast can a fresh process reach the
first token after a restore if it never imports torch? (A measurement, not a product path.)

`prep` (imports torch, once): loads SmolLM2-135M dequantized, prefills a ~2,000-token prompt
through the ONNX Runtime LLM engine (`runtime.llm_engines=["onnxruntime"]`), and writes into a
folder what a restore would have: the decode step's ONNX graph (the engine's own `build_step`),
the pool's live K/V blocks (raw bytes, as a capsule's pages hold them), the step's input buffers,
and, as the reference, the hidden state and greedy token the torch-side engine computes for the
next step. `child` (no torch): imports numpy + onnxruntime, maps the fp32 weights from the
loader's safetensors cache, reads the K/V into a pool, builds the ORT session, runs the step,
and computes the logits and the greedy token in numpy; it prints each phase's time, whether
the hidden state is bit-identical to the engine's, and that torch was never imported.

    .venv/bin/python bench/torchfree_first_token.py            # prep, then 3 fresh children

What it leaves out (what a real torch-free restore must add): reading the capsule through the
store (torch-free already) and checking its binding, the tokenizer's state, the sampler (only
greedy here), and a numpy LM head that matches torch's bit for bit (it does not: another
summation order; this probe compares the argmax only).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(os.environ.get("PROBE_DIR", "/tmp/capsule-torchfree-probe"))
CONTEXT = 2000


def prep() -> None:
    import tempfile

    import numpy as np
    import torch

    from capsule import Session
    from capsule.llm.onnx_step import build_step
    from capsule.llm.step_io import StepBuffers, bucket_shape
    from capsule.paths import cache_dir

    torch.set_num_threads(1)
    HERE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        s = Session.open(Path(tmp) / "s", model="smollm2-135m", device="cpu",
                         runtime={"threads": 1, "llm_engines": ["onnxruntime"], "kv_pool_mb": 128})
        words = "the robot moves the red block to the left shelf and then checks the gripper ".split()
        s.append(" ".join(words[j % len(words)] for j in range(int(CONTEXT * 0.85))), stream="a")
        s.generate(1, stream="a")
        runner, model, pool = s.engine.runner, s.engine.runner.model, s.engine.pool
        table = s.engine.streams["a"].table
        ids = s.tokens("a")
        p = table.num_cached            # the next step feeds ids[p] at position p
        pos = table.position(p)
        table.ensure_capacity(p + 1)
        blocks = list(table.blocks)
        args = (torch.tensor([[ids[p]]]), torch.tensor([[pos]]), torch.tensor(table.slots_at([pos])),
                torch.tensor([blocks]))
        shape = bucket_shape(args[0], args[3], pool.tensor)
        blob, weights = build_step(model, shape)
        (HERE / "step.onnx").write_bytes(blob)
        hidden = runner.step(*args, pool.tensor, slot_valid=pool.slot_valid)     # writes ids[p]'s K/V
        logits = model.lm_head(hidden[:, -1])
        # the step's input buffers as the engine bound them, and the pool as it was before the step
        bufs = StepBuffers.allocate(shape, model.cfg, torch.device("cpu"), rows=False)
        bufs.load(*args, pool.slot_valid)                                        # what the engine binds
        for name, t in bufs.named().items():
            if name != "hidden":
                np.save(HERE / f"{name}.npy", t.numpy())
        np.save(HERE / "hidden_ref.npy", hidden.numpy())
        live = sorted(set(blocks))
        raw = pool.tensor.view(pool.tensor.shape[0], -1).view(torch.uint8).numpy()
        slot = int(args[2][0])
        # undo the step's own K/V write: the restore starts from the capsule, before the step
        # (the step attends its own new key from the graph, not from the pool)
        bs = pool.block_size
        before_pool = torch.from_numpy(raw.copy()).view(torch.float32).view(pool.tensor.shape)
        before_pool[slot // bs, :, :, slot % bs] = 0
        with open(HERE / "kv_blocks.bin", "wb") as f:
            for b in live:
                f.write(before_pool[b].contiguous().view(torch.uint8).numpy().tobytes())
        st = next((cache_dir() / "gguf").glob("*-f32.safetensors"))
        # graph inputs that are not checkpoint tensors (the RoPE tables: torch's cos / sin, which
        # numpy would round differently) travel as arrays
        with open(st, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            in_file = set(json.loads(f.read(n)))
        np.savez(HERE / "extra.npz", **{k: t.numpy() for k, t in weights.items() if k not in in_file})
        meta = {"pool_shape": list(pool.tensor.shape), "live_blocks": live, "weights": list(weights),
                "safetensors": str(st), "head": "model.embed_tokens.weight" if model.cfg.tie_embeddings
                else "lm_head.weight", "argmax_ref": int(logits.argmax(-1)[0]), "tokens": len(ids),
                "shape": str(shape)}
        (HERE / "meta.json").write_text(json.dumps(meta))
        s.close()
    print(f"prep: {len(ids)} tokens, {len(live)} live blocks, step shape {shape}")


def child(t_start: float) -> None:
    t0 = time.perf_counter()
    import numpy as np
    import onnxruntime as ort
    t_imp = time.perf_counter()
    meta = json.loads((HERE / "meta.json").read_text())
    # the fp32 weights: safetensors header + one map of the file
    st = Path(meta["safetensors"])
    with open(st, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    mm = np.memmap(st, dtype=np.uint8, mode="r")
    def tensor(name: str) -> np.ndarray:
        h = header[name]
        a, b = h["data_offsets"]
        return mm[8 + n + a:8 + n + b].view(np.float32).reshape(h["shape"])
    extra = np.load(HERE / "extra.npz")
    weights = {w: extra[w] if w in extra.files else tensor(w) for w in meta["weights"]}
    t_w = time.perf_counter()
    pool = np.zeros(meta["pool_shape"], dtype=np.float32)
    rows = pool.reshape(pool.shape[0], -1).view(np.uint8)
    data = np.fromfile(HERE / "kv_blocks.bin", dtype=np.uint8).reshape(len(meta["live_blocks"]), -1)
    rows[meta["live_blocks"]] = data
    t_kv = time.perf_counter()
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    sess = ort.InferenceSession(str(HERE / "step.onnx"), so, providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    inputs = {k: np.load(HERE / f"{k}.npy") for k in
              ("input_ids", "positions", "slot_mapping", "block_tables", "attn_bias")}
    hidden = np.zeros(np.load(HERE / "hidden_ref.npy").shape, dtype=np.float32)
    for k, v in {**inputs, **weights}.items():
        v = np.ascontiguousarray(v)
        io.bind_input(k, "cpu", 0, v.dtype, list(v.shape), v.ctypes.data)
    io.bind_input("kv_pool", "cpu", 0, np.float32, list(pool.shape), pool.ctypes.data)
    io.bind_output("kv_pool_out", "cpu", 0, np.float32, list(pool.shape), pool.ctypes.data)
    io.bind_output("hidden", "cpu", 0, np.float32, list(hidden.shape), hidden.ctypes.data)
    t_sess = time.perf_counter()
    sess.run_with_iobinding(io)
    logits = hidden[:, -1] @ tensor(meta["head"]).T
    token = int(logits.argmax(-1)[0])
    t_tok = time.perf_counter()
    same = bool(np.array_equal(hidden, np.load(HERE / "hidden_ref.npy")))
    print(json.dumps({"interpreter_ms": round((t0 - t_start) * 1e3, 1),
                      "import_numpy_ort_ms": round((t_imp - t0) * 1e3, 1),
                      "map_weights_ms": round((t_w - t_imp) * 1e3, 1),
                      "read_kv_ms": round((t_kv - t_w) * 1e3, 1),
                      "ort_session_ms": round((t_sess - t_kv) * 1e3, 1),
                      "first_token_ms": round((t_tok - t_sess) * 1e3, 1),
                      "spawn_to_token_ms": round((t_tok - t_start) * 1e3, 1),
                      "hidden_bit_identical": same, "argmax_equal": token == meta["argmax_ref"],
                      "torch_imported": "torch" in sys.modules}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(float(sys.argv[2]))
        return
    prep()
    for _ in range(3):   # perf_counter is CLOCK_MONOTONIC: one clock for parent and child
        out = subprocess.run([sys.executable, __file__, "child", repr(time.perf_counter())],
                             capture_output=True, text=True, check=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
