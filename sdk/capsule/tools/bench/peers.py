"""`capsule bench --suite peers`: capsule against llama.cpp on the same weights, in one run (issue 19).

Decode at batch 1 (contexts 512 and 2,048; one and two threads): capsule's dequantized fp32
layers vs llama.cpp on an F32 copy of the same GGUF (``peers_f32``: dequantized by the function
capsule's loader uses), and capsule's int4 layers vs llama.cpp on the quantized GGUF itself; the
same prompt ids go to both, and the greedy ids are compared. The reps interleave: llama.cpp's
rep r runs right after capsule's rep r, so drift in the machine's load falls on both alike. Then
restore -> first token in a fresh process at 2,048 tokens, one thread: capsule's restore from its
store vs llama.cpp's state file.

llama.cpp comes from ``llama-cpp-python`` in a venv of its own (``peers_env``), built from source
on first use and cached. When it cannot be had, the suite says why and still reports capsule's
figures. The model defaults to smollm2-135m (a builtin model has no GGUF for llama.cpp).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError
from ...llm.catalog import resolve_named
from ...session import Session
from . import BenchOptions, SuiteResult, decode_linears, peers_env
from .capsules_restore import measure_restore, transcripts
from .lite_restore import measure_lite
from .decode import robot_prompt
from .peers_f32 import write_f32_copy
from .peers_tables import settings, tables
from .timing import progress

MODEL = "smollm2-135m"
CHILD = Path(__file__).with_name("peers_llama_child.py")
PEER_WEIGHTS = (("F32", "dequantized"), ("Q4_1", "int4"))   # llama.cpp file -> capsule's linears
RESTORE_TOKENS, RESTORE_REPS, QUICK_RESTORE_REPS = 2048, 3, 1
CHILD_TIMEOUT_S = 1800


def _gguf(model: str) -> Path:
    path = resolve_named(model)
    if path is None and model.endswith(".gguf") and Path(model).is_file():
        path = Path(model)
    if path is None:
        raise ModelLoadError(f"the peers suite compares against llama.cpp on a GGUF: give --model "
                             f"{MODEL} or a .gguf file, not {model!r}")
    return path


def _peer(env: peers_env.PeerEnv, *args: str) -> dict[str, Any]:
    spawn = time.time()
    # -I: no script directory on sys.path (this package's bench/tokenize.py would shadow the stdlib's)
    proc = subprocess.run([str(env.python), "-I", str(CHILD), *args], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp child {args[0]} {_ended(proc.returncode)}:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "t_start" in out:
        out["interpreter_s"] = max(0.0, out.pop("t_start") - spawn)
    return out


def _ended(rc: int) -> str:
    """How a child ended: "exited 1", "was killed by SIGILL" (a negative code is its signal)."""
    if rc >= 0:
        return f"exited {rc}"
    try:
        return f"was killed by {signal.Signals(-rc).name}"
    except ValueError:
        return f"was killed by signal {-rc}"


# what a failing llama.cpp child raises (a crash, a hang, no result printed): the suite reports
# capsule's figures without the peer instead of losing them
PEER_FAILURES = (RuntimeError, subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError)


def _left_out(exc: BaseException) -> str:
    """Why the peer's figures are missing from this run."""
    return f"llama.cpp failed during the run, so its figures are left out: {exc}"[:2000]


def _job(work: Path, name: str, job: dict[str, Any]) -> str:
    path = work / f"{name}.json"
    path.write_text(json.dumps(job))
    return str(path)


def _prompts(model: str, contexts: tuple[int, ...], work: Path) -> tuple[Any, dict[int, list[int]], list[int]]:
    """The model's tokenizer, the ids a Session gives each decode prompt (capsule's timed streams
    hold these; llama.cpp is fed them) and the restore transcript's ids."""
    with Session.open(work / "prompts", model=model, device="cpu") as s:
        tok = s.tokenizer
        texts = {c: robot_prompt(tok, c, 7) for c in contexts}
        texts[0] = transcripts(tok, [RESTORE_TOKENS])[RESTORE_TOKENS]
        ids = {}
        for n, text in texts.items():
            s.append(text, stream=f"p{n}")
            ids[n] = list(s.tokens(f"p{n}"))
    restore = ids.pop(0)
    return tok, ids, restore


def _llama_decode_rep(env: peers_env.PeerEnv, files: dict[str, Path], ids: dict[int, list[int]],
                      steps: int, r: int, work: Path, got: dict[str, list[dict[str, Any]]],
                      show: bool) -> None:
    """llama.cpp's rep r of every decode cell (weights x threads) into got["F32/1"], ..."""
    n_ctx = max(len(v) for v in ids.values()) + steps + 16
    cells = [(w, t) for w, _ in PEER_WEIGHTS for t in decode_linears.THREADS if t <= (os.cpu_count() or 1)]
    bar = progress(len(cells), f"llama.cpp decode cells, rep {r + 1}", show, unit="cell")
    for w, t in cells:
        job = {"model": str(files[w]), "threads": t, "n_ctx": n_ctx, "steps": steps + 1,
               "warmup_ids": ids[min(ids)][:64], "prompts": {str(n): v for n, v in ids.items()}}
        got.setdefault(f"{w}/{t}", []).append(_peer(env, "decode", _job(work, f"decode-{w}-{t}-{r}", job)))
        bar.update(1)
    bar.close()


def _llama_restore(env: peers_env.PeerEnv, files: dict[str, Path], ids: list[int], reps: int,
                   work: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for w, path in files.items():
        job = {"model": str(path), "threads": 1, "n_ctx": len(ids) + 64, "ids": ids,
               "state": str(work / f"state-{w}.bin")}
        jp = _job(work, f"restore-{w}", job)
        saved = _peer(env, "save", jp)
        runs = [_peer(env, "restore", jp) for _ in range(reps)]
        for r in runs:   # spawn -> first token, as capsule's restore_process_s
            r["process_s"] = r["interpreter_s"] + r["total_from_start_s"]
        row = {k: statistics.median(r[k] for r in runs) for k in
               ("interpreter_s", "import_s", "model_load_s", "state_load_s", "first_token_s", "process_s")}
        row.update(save_s=saved["save_s"], state_bytes=Path(job["state"]).stat().st_size,
                   token_as_uninterrupted=all(r["token"] == saved["token"] for r in runs))
        out[w] = row
    return out


def run(opts: BenchOptions) -> SuiteResult:
    model = MODEL if opts.model.startswith("builtin:") else opts.model
    src = _gguf(model)
    opts = replace(opts, model=model)
    show = opts.progress
    load0 = os.getloadavg()[0]
    contexts = decode_linears.QUICK_CONTEXTS if opts.quick else decode_linears.CONTEXTS
    steps = min(opts.steps or decode_linears.STEPS, decode_linears.QUICK_STEPS if opts.quick else decode_linears.STEPS)
    reps = decode_linears.QUICK_REPS if opts.quick else decode_linears.REPS
    env = peers_env.ensure(show)
    restore_reps = QUICK_RESTORE_REPS if opts.quick else RESTORE_REPS
    with tempfile.TemporaryDirectory(prefix="capsule-bench-peers-") as tmp:
        work = Path(tmp)
        tok, ids, restore_ids = _prompts(model, contexts, work)
        files: dict[str, Path] = {}
        if env.python is not None:
            f32 = peers_env.cache_dir() / f"{src.stem}-{src.stat().st_size}.F32.gguf"
            files = {"F32": write_f32_copy(src, f32), "Q4_1": src}
        llama: dict[str, list[dict[str, Any]]] = {}
        why = env.why         # a peer that fails mid-run: the reason; the suite goes on without it

        def peer_rep(r: int) -> None:   # llama.cpp's rep r right after capsule's rep r
            nonlocal why
            if files and not why:
                try:
                    _llama_decode_rep(env, files, ids, steps, r, work, llama, show)
                except PEER_FAILURES as exc:
                    why = _left_out(exc)

        ours = decode_linears.measure(opts, robot_prompt, show=show, after_rep=peer_rep)
        results: dict[str, Any] = {"capsule_decode": ours, "peer": {"python": str(env.python),
                                                                     "version": peers_env.VERSION,
                                                                     "built_s": env.built_s}}
        if files and not why:
            results["llama_decode"] = llama
        results["capsule_restore"] = {}
        for _, lin in PEER_WEIGHTS:
            (work / lin).mkdir()
            rows, _ = measure_restore(tok, [RESTORE_TOKENS], restore_reps, work / lin, model, "cpu",
                                      {"threads": 1, "linears": lin}, show)
            results["capsule_restore"][lin] = rows[0]
        # the same transcript restored by a process that never imports torch (capsule.lite):
        # onnxruntime graphs over the dequantized weights, the dense fp32 C step, the int4 C step
        transcript = (work / "dequantized" / f"transcript-{RESTORE_TOKENS}.txt").read_text(encoding="utf-8")
        results["capsule_lite_restore"] = measure_lite(transcript, model, restore_reps, work)
        results["capsule_lite_restore_f32c"] = measure_lite(transcript, model, restore_reps, work, "dequantized-c")
        results["capsule_lite_restore_int4"] = measure_lite(transcript, model, restore_reps, work, "int4")
        if files and not why:
            try:
                results["llama_restore"] = _llama_restore(env, files, restore_ids, restore_reps, work)
            except PEER_FAILURES as exc:
                why = _left_out(exc)
        results["peer"]["why"] = why
    results["load_average_1m"] = {"start": load0, "end": os.getloadavg()[0]}
    return SuiteResult(settings=settings(opts, contexts, steps, reps, restore_reps, src),
                       results=results, tables=tables(results, contexts))
