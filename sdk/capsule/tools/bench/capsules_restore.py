"""Part 1 of `capsule bench --suite capsules`: restore-to-first-token in a fresh process vs cold start.

Each measurement is its own child process (sys.executable -c), so nothing is warm that a
process after a power cut would not have: the child times Session.open -> first generated
token and prints one JSON line; the interpreter's start (spawn -> the child's first statement)
and the imports are reported beside it, and ``*_process_s`` adds them up (spawn -> first
token). The first cold run of each context also checkpoints its state (untimed) into the store the restore runs open, so the
transcript is prefilled once per rep and never just for setup.
"""
from __future__ import annotations

import importlib
import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .child_env import timed_child_env
from .timing import progress

SOURCE_MODULES = ("textwrap", "json.decoder", "difflib", "argparse")  # varied, deterministic per Python
CHILD_TIMEOUT_S = 600

CHILD = r"""
import time
T_START = time.time()
import json, sys
from capsule import Session
from capsule.state.checkpointer import Checkpointer
mode, store, text_path, model, device = sys.argv[1:6]
runtime = json.loads(sys.argv[6])
text = open(text_path, encoding="utf-8").read() if mode != "restore" else ""
restore_s = []
inner = Checkpointer.restore_newest
def timed(self, load_host):  # the restore's own share of open(), for the read-throughput figure
    t = time.perf_counter()
    out = inner(self, load_host)
    restore_s.append(time.perf_counter() - t)
    return out
Checkpointer.restore_newest = timed
T_IMPORTED = time.time()
t0 = time.perf_counter()
s = Session.open(store, model=model, device=device, runtime=runtime, restore=mode == "restore")
t1 = time.perf_counter()
if mode != "restore":
    s.append(text)
t2 = time.perf_counter()
s.generate(1)
t3 = time.perf_counter()
out = {"open_s": t1 - t0, "append_s": t2 - t1, "first_token_s": t3 - t2, "total_s": t3 - t0,
       "restore_s": restore_s[0] if restore_s else None, "restored_epoch": s.restored_epoch,
       "tokens": len(s.tokens()), "t_start": T_START, "import_s": T_IMPORTED - T_START}
if mode == "cold+save":
    s.checkpoint()
    info = s.epochs()[-1]
    out["epoch_bytes"], out["epoch_pages"] = info.bytes_written, info.n_pages
s.close()
print(json.dumps(out))
"""


def source_text() -> str:
    """Python source of a few stdlib modules: code, prose and numbers, identical on every run."""
    parts = []
    for name in SOURCE_MODULES:
        parts.append(f"# ---- {name} ----\n{inspect.getsource(importlib.import_module(name))}")
    return "\n".join(parts)


def transcripts(tokenizer: Any, contexts: Sequence[int]) -> dict[int, str]:
    """Prefixes of source_text() trimmed to n tokens each (decoded from the first n ids)."""
    ids = tokenizer.encode(source_text())
    if len(ids) < max(contexts):
        raise ValueError(f"the source text has {len(ids)} tokens, fewer than {max(contexts)}")
    return {n: tokenizer.decode(ids[:n]) for n in contexts}


def _child(mode: str, store: Path, text_path: Path, model: str, device: str,
           runtime: dict[str, Any]) -> dict[str, Any]:
    argv = [sys.executable, "-c", CHILD, mode, str(store), str(text_path), model, device, json.dumps(runtime)]
    spawn = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=timed_child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"bench child ({mode}, {store.name}) exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["interpreter_s"] = max(0.0, out.pop("t_start") - spawn)
    out["process_s"] = out["interpreter_s"] + out["import_s"] + out["total_s"]
    return out


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure_restore(tokenizer: Any, contexts: Sequence[int], reps: int, work: Path, model: str,
                    device: str, runtime: dict[str, Any], show: bool) -> tuple[list[dict[str, Any]], dict[int, Path]]:
    """One row per context (medians over reps) and the restore store of each context."""
    texts = transcripts(tokenizer, contexts)
    rows, stores = [], {}
    bar = progress(len(contexts) * reps * 2, "restore vs cold (fresh processes)", show, unit="process")
    for n in contexts:
        text_path = work / f"transcript-{n}.txt"
        text_path.write_text(texts[n], encoding="utf-8")
        store = work / f"restore-{n}"
        cold, warm = [], []
        for r in range(reps):  # interleaved, so drift in machine load hits both paths alike
            # r == 0: this cold run also leaves the capsule the restore runs open, and the
            # bytecode cache (child_env): its imports may be slower, the medians take that
            if r == 0:
                cold.append(_child("cold+save", store, text_path, model, device, runtime))
            else:
                cold.append(_child("cold", work / f"cold-{n}-{r}", text_path, model, device, runtime))
            bar.update(1)
            warm.append(_child("restore", store, text_path, model, device, runtime))
            if warm[-1]["restored_epoch"] is None:
                raise RuntimeError(f"the restore child did not restore the {n}-token store")
            bar.update(1)
        stores[n] = store
        rows.append(_row(n, cold, warm, store))
    bar.close()
    return rows, stores


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _row(n: int, cold: list[dict[str, Any]], warm: list[dict[str, Any]], store: Path) -> dict[str, Any]:
    cold_s, restore_s = _med(cold, "total_s"), _med(warm, "total_s")
    return {"context_tokens": cold[0]["tokens"] - 1,  # the transcript; the child added one generated token
            "target_tokens": n,
            "cold_s": cold_s, "restore_s": restore_s, "ratio": cold_s / restore_s,
            # best runs: the least disturbed by other load on a shared machine
            "cold_min_s": min(r["total_s"] for r in cold), "restore_min_s": min(r["total_s"] for r in warm),
            "ratio_of_min": min(r["total_s"] for r in cold) / min(r["total_s"] for r in warm),
            "cold_open_s": _med(cold, "open_s"), "cold_tokenize_s": _med(cold, "append_s"),
            "cold_prefill_first_token_s": _med(cold, "first_token_s"),
            "restore_open_s": _med(warm, "open_s"), "restore_in_open_s": _med(warm, "restore_s"),
            "restore_first_token_s": _med(warm, "first_token_s"),
            # from spawning the process: interpreter start + imports + open/restore + first token
            "restore_interpreter_s": _med(warm, "interpreter_s"), "restore_import_s": _med(warm, "import_s"),
            "restore_process_s": _med(warm, "process_s"), "cold_process_s": _med(cold, "process_s"),
            "restore_bytes": cold[0]["epoch_bytes"], "restore_pages": cold[0]["epoch_pages"],
            "store_disk_bytes": _dir_bytes(store),
            "cold_runs_s": [r["total_s"] for r in cold], "restore_runs_s": [r["total_s"] for r in warm]}
