"""The writer children of the SIGKILL trials (forked by the zygote in reliability_kills).

A child writes its ledger (see reliability_ledger) line by line with unbuffered writes, which
survive its SIGKILL. "W store-open-start / store-open-end <s>" lines say when, in seconds since
the child started, its Store.open ran: the parent aims later first-life kills into that window
(the very first open, which creates the store).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time

from . import reliability_harness as H


def child_main(req: dict) -> None:
    t0 = time.monotonic()
    out = os.open(req["ack"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def say(text: str) -> None:
        os.write(out, (text + "\n").encode())

    trace_store_open(say, t0)
    if req["kind"] == "store":
        store_child(req, say)
    else:
        session_child(req, say)


def trace_store_open(say, t0: float) -> None:
    """In this child only: wrap Store.open so W lines tell when it ran (Session.open calls it too)."""
    from ...store import Store
    real = Store.open.__func__

    def traced(cls, *args, **kw):
        say(f"W store-open-start {time.monotonic() - t0:.5f}")
        st = real(cls, *args, **kw)
        say(f"W store-open-end {time.monotonic() - t0:.5f}")
        return st
    Store.open = classmethod(traced)


OPS = (("write", 34), ("group", 16), ("add_fact", 10), ("set_kv", 6), ("forget", 5), ("retain", 11),
       ("compact", 12), ("reopen", 3), ("discard", 3))


def store_child(req: dict, say) -> None:
    from ...store import Store
    rng = random.Random(req["seed"])
    key = H.SIGN_KEY if req.get("signed") else None
    say("@ open-create" if req.get("fresh") else "@ open")
    st = Store.open(req["path"], segment_bytes=H.SEGMENT_BYTES, sign_key=key)
    say("@ opened")
    facts = [tuple(f) for f in req["facts"]]       # [id, seq, next variant] of acknowledged facts
    seq = req["seq"]
    names, weights = zip(*OPS)
    while True:
        op = rng.choices(names, weights)[0]
        e = (st.latest_epoch() or 0) + 1
        if op == "write":
            say("@ write")
            info = st.write_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e))
            assert info.id == e, (info.id, e)
            say(f"E {e}")
        elif op == "group":
            n = rng.randint(2, 4)
            for k in range(n):
                say("@ stage")
                assert st.stage_epoch(H.pages_for(e + k), H.manifest(e + k), name=H.epoch_name(e + k)) == e + k
            say("@ sync")
            for info in st.sync():
                say(f"E {info.id}")
        elif op == "discard":                   # staged then dropped: never acknowledged
            say("@ stage")
            st.stage_epoch(H.pages_for(e), H.manifest(e), name=H.epoch_name(e))
            say("@ discard")
            st.discard_staged()
        elif op == "add_fact" and len(facts) < H.MAX_LIVE_FACTS:
            say("@ add_fact")
            fid = H.add_fact(st, seq)
            say(f"F {fid} {seq}")
            facts.append((fid, seq, 2))
            seq += 1
        elif op == "set_kv" and facts:
            j = rng.randrange(len(facts))
            fid, s, w = facts[j]
            say(f"k {fid} {w}")
            say("@ set_fact_kv")
            H.set_fact_kv(st, fid, s, w)
            say(f"K {fid} {w}")
            facts[j] = (fid, s, w + 1)
        elif op == "forget" and len(facts) > 3:
            fid = facts.pop(rng.randrange(len(facts)))[0]
            say(f"f {fid}")
            say("@ forget_fact")
            H.facts(st).forget_fact(fid)
            say(f"G {fid}")
        elif op == "retain":
            infos = st.epochs()
            drop = [i.id for i in infos[:-H.KEEP] if i.name is None]
            if drop:
                say(f"R {max(drop)}")
            say("@ retain")
            st.retain(H.KEEP)
            say("@ retained")
        elif op == "compact":
            say("@ compact")
            st.compact()
            say("@ compacted")
        elif op == "reopen":
            say("@ close")
            st.close()
            say("@ open")
            st = Store.open(req["path"], segment_bytes=H.SEGMENT_BYTES, sign_key=key)
            say("@ opened")


def obs(step: int):
    import numpy as np
    return {"observation.state": np.sin(np.arange(14, dtype=np.float32) * 0.37 + step * 0.11).astype(np.float32)}


def session_digest(s) -> str:
    h = hashlib.sha256()
    for region in s.registry:
        if region.role in ("output", "kv"):
            # outputs are not saved by design (a step recomputes them); the KV pool's unused blocks
            # hold warm-up scratch: KV is checked by the continuation instead (check_session)
            continue
        h.update(region.name.encode())
        h.update(region.tensor.detach().cpu().contiguous().view(-1).numpy().tobytes())
    h.update(json.dumps(s.state, sort_keys=True).encode())
    if s.tokenizer is not None:
        h.update(json.dumps(s.tokens()).encode())
    return h.hexdigest()[:32]


SESSION_RT = {"kv_pool_mb": 4, "max_context": 512}


def open_session(path: str, model: str | None, signed: bool):
    from ...session import Session
    key = H.SIGN_KEY if signed else None
    if model is None:
        return Session.open(path, model=None, policy="builtin:gru", device="cpu", sign_key=key)
    return Session.open(path, model=model, device="cpu", runtime=SESSION_RT, sign_key=key)


def session_step(s, step: int) -> None:
    if s.tokenizer is not None:
        s.generate(1)
    else:
        s.act(obs(step))
    s.state = {"step": step}


def session_child(req: dict, say) -> None:
    say("@ open-create" if req.get("fresh") else "@ open")
    s = open_session(req["path"], req.get("model"), req.get("signed", False))
    say("@ opened")
    wait = req["wait"]
    step = s.state.get("step", -1) + 1 if s.restored_epoch is not None else 0
    if s.tokenizer is not None and s.restored_epoch is None:
        s.append("robot log: joint1=0.1 joint2=0.2 gripper=open\n")
    while True:
        session_step(s, step)
        say(f"P {step} {session_digest(s)}")
        say("@ checkpoint")
        epoch = s.checkpoint(wait=wait)
        if wait:
            say(f"A {epoch}")
        elif step % 3 == 2:
            say("@ flush")
            s.flush()
            say(f"A {epoch}")
        step += 1


