"""Part 4 of `capsule bench --suite fleet`: a second machine continues from the replica.

A source Session (the bench model) holds a transcript, takes a capsule and replicates it, then
generates CONTINUE more tokens (not checkpointed): the tokens a restored copy must produce too.
Each measurement is a fresh child process, as in capsules_restore: it imports first (untimed,
boto3 included, reported apart with the interpreter's start), then
  pull: pull(url, new folder) + Session.open (model load + restore) + generate(1);
  cold: Session.open(new folder) + append(the same transcript) + generate(1) (prefill),
and prints one JSON line. The two alternate, rep by rep.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...fleet import Replication
from ...session import Session
from .capsules_restore import transcripts
from .fleet_throughput import wait_remote
from .timing import progress

CONTINUE = 8                    # tokens compared after the restore
CHILD_TIMEOUT_S = 600

CHILD = r"""
import json, sys, time
boot = time.time()
t = time.perf_counter()
import boto3
from capsule import Session
from capsule.fleet import pull
a = json.loads(sys.argv[1])
imports_s = time.perf_counter() - t
t0 = time.perf_counter()
pulled = pull(a["url"], a["dest"], sign_key=bytes.fromhex(a["key"])) if a["mode"] == "pull" else None
t1 = time.perf_counter()
s = Session.open(a["dest"], model=a["model"], device=a["device"], runtime=a["runtime"], restore=a["mode"] == "pull")
t2 = time.perf_counter()
if a["mode"] == "cold":
    s.append(open(a["text"], encoding="utf-8").read())
t3 = time.perf_counter()
s.generate(1)
t4 = time.perf_counter()
s.generate(a["m"] - 1 if a["mode"] == "pull" else a["m"])   # both end on the source's next m tokens
out = {"boot": boot, "imports_s": imports_s, "pull_s": t1 - t0, "open_s": t2 - t1, "append_s": t3 - t2,
       "first_token_s": t4 - t3, "total_s": t4 - t0, "restored_epoch": s.restored_epoch,
       "pulled_epoch": pulled.epoch if pulled else None, "pulled_bytes": pulled.page_bytes if pulled else None,
       "tokens": s.tokens()[-a["m"]:], "n_tokens": len(s.tokens())}
s.close()
print(json.dumps(out))
"""


def source(path: Path, model: str, device: str, runtime: dict[str, Any], context: int,
           replicate: Replication) -> dict[str, Any]:
    """The replicated source: transcript + 1 token, a capsule on the remote, then CONTINUE tokens."""
    with Session.open(path, model=model, device=device, runtime=runtime, replicate=replicate) as s:
        text = transcripts(s.tokenizer, [context])[context]
        s.append(text)
        s.generate(1)
        epoch = s.checkpoint()
        t0 = time.perf_counter()
        if not wait_remote(s, 120):
            raise RuntimeError(f"the source capsule did not reach {replicate.url}: {s.replication}")
        upload_s = time.perf_counter() - t0
        n = len(s.tokens())
        s.generate(CONTINUE)
        want = s.tokens()[-CONTINUE:]
        written = s.epochs()[-1].bytes_written
    return {"text": text, "epoch": epoch, "tokens": n - 1, "want": want, "epoch_bytes": written,
            "upload_wait_s": upload_s}


def _child(args: dict[str, Any]) -> dict[str, Any]:
    spawned = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"bench child ({args['mode']}) exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(process_s=wall, interpreter_start_s=out.pop("boot") - spawned)
    return out


def second_machine(work: Path, url: str, sign_key: bytes, model: str, device: str, runtime: dict[str, Any],
                   context: int, reps: int, show: bool) -> dict[str, Any]:
    src = source(work / "source", model, device, runtime, context, Replication(url, sign_key=sign_key))
    text_path = work / "transcript.txt"
    text_path.write_text(src["text"], encoding="utf-8")
    base = {"url": url, "key": sign_key.hex(), "model": model, "device": device, "runtime": runtime,
            "m": CONTINUE, "text": str(text_path)}
    pulls, colds = [], []
    bar = progress(2 * reps, "pull vs cold start (fresh processes)", show, unit="process")
    for r in range(reps):
        pulls.append(_child({**base, "mode": "pull", "dest": str(work / f"pulled-{r}")}))
        bar.update(1)
        colds.append(_child({**base, "mode": "cold", "dest": str(work / f"cold-{r}")}))
        bar.update(1)
    bar.close()

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(x[key] for x in runs)
    pull_total, cold_total = med(pulls, "total_s"), med(colds, "total_s")
    return {"context_tokens": src["tokens"], "reps": reps, "source_epoch": src["epoch"],
            "epoch_bytes": src["epoch_bytes"], "source_upload_wait_s": src["upload_wait_s"],
            "pulled_bytes": pulls[0]["pulled_bytes"],
            "continuation_equal": all(p["tokens"] == src["want"] for p in pulls),
            "pulled_newest": all(p["pulled_epoch"] == src["epoch"] and p["restored_epoch"] == 1 for p in pulls),
            "cold_continuation_equal": all(c["tokens"] == src["want"] for c in colds),
            "pull_path_s": pull_total, "cold_s": cold_total, "cold_over_pull": cold_total / pull_total,
            "pull_s": med(pulls, "pull_s"), "pull_open_restore_s": med(pulls, "open_s"),
            "pull_first_token_s": med(pulls, "first_token_s"), "cold_open_s": med(colds, "open_s"),
            "cold_append_s": med(colds, "append_s"), "cold_prefill_first_token_s": med(colds, "first_token_s"),
            "pull_mb_s": pulls[0]["pulled_bytes"] / med(pulls, "pull_s") / 1e6,
            "interpreter_start_s": med(pulls + colds, "interpreter_start_s"),
            "imports_s": med(pulls + colds, "imports_s"),
            "pull_runs_s": [p["total_s"] for p in pulls], "cold_runs_s": [c["total_s"] for c in colds]}
