"""llama.cpp's side of `capsule bench --suite peers`, run by the peer venv's interpreter.

Imports only the standard library, numpy and ``llama_cpp`` (never capsule: this runs under
another interpreter). One mode per process; prints one JSON line.

  decode JOB.json        per context: prefill, then greedy steps timed one ``eval`` each
  save JOB.json          evaluate ids[:-1], write llama.cpp's state file, time it
  restore JOB.json       from process start: import, model load, state load, then ids[-1] -> token
"""
import time

T_START = time.time()
import ctypes  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


def _llama(job: dict):
    import llama_cpp
    return llama_cpp, llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=512,
                                      n_threads=job["threads"], n_threads_batch=job["threads"],
                                      logits_all=False, verbose=False)


def _next(llm) -> int:
    """Greedy id after the last eval: its logits read from the context (llama-cpp-python keeps no
    copy without logits_all)."""
    import llama_cpp
    import numpy as np
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def _decode(job: dict) -> dict:
    _, llm = _llama(job)
    llm.eval(job["warmup_ids"])                                # untimed: first-call allocations
    out = {}
    for ctx, ids in job["prompts"].items():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - t0
        greedy, steps = [_next(llm)], []
        for _ in range(job["steps"]):
            t0 = time.perf_counter()
            llm.eval([greedy[-1]])
            steps.append(time.perf_counter() - t0)
            greedy.append(_next(llm))
        out[ctx] = {"prefill_s": prefill, "prompt_tokens": len(ids), "steps_s": steps, "greedy": greedy}
    return out


def _save(job: dict) -> dict:
    llama_cpp, llm = _llama(job)
    ids = job["ids"]
    llm.eval(ids[:-1])
    t0 = time.perf_counter()
    arr = (llama_cpp.llama_token * (len(ids) - 1))(*ids[:-1])
    if not llama_cpp.llama_state_save_file(llm.ctx, job["state"].encode(), arr, len(ids) - 1):
        raise RuntimeError("llama_state_save_file failed")
    save_s = time.perf_counter() - t0
    llm.eval(ids[-1:])
    return {"save_s": save_s, "token": _next(llm)}


def _restore(job: dict) -> dict:
    t_import = time.time()
    import llama_cpp                      # timed: the import is part of a restore from spawn
    t_load = time.time()
    _, llm = _llama(job)
    t_state = time.time()
    ids = job["ids"]
    cap = len(ids) + 16
    got, n = (llama_cpp.llama_token * cap)(), ctypes.c_size_t(0)
    if not llama_cpp.llama_state_load_file(llm.ctx, job["state"].encode(), got, cap, ctypes.byref(n)):
        raise RuntimeError("llama_state_load_file failed")
    if list(got[:n.value]) != ids[:-1]:
        raise RuntimeError("the state file holds other tokens than the job's")
    llm.input_ids[:n.value] = ids[:-1]
    llm.n_tokens = n.value
    t_token = time.time()
    llm.eval(ids[-1:])
    token = _next(llm)
    t_end = time.time()
    return {"t_start": T_START, "interpreter_to_import_s": t_import - T_START, "import_s": t_load - t_import,
            "model_load_s": t_state - t_load, "state_load_s": t_token - t_state,
            "first_token_s": t_end - t_token, "total_from_start_s": t_end - T_START, "token": token}


if __name__ == "__main__":
    with open(sys.argv[2], encoding="utf-8") as fh:
        job = json.load(fh)
    print(json.dumps({"decode": _decode, "save": _save, "restore": _restore}[sys.argv[1]](job)))
