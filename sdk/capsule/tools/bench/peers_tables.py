"""The peers suite's settings and tables, from the numbers ``peers.run`` gathered."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from . import BenchOptions, decode_linears, peers_env

LITE = "capsule lite (no torch), dequantized fp32 via onnxruntime"
LITE_F32C = "capsule lite (no torch), dequantized fp32 via the C step"
LITE_INT4 = "capsule lite (no torch), int4 via the C step"
# linears -> (result key, row name) of each torch-free restore of that model (lite_restore.RUNTIMES)
LITES = {"dequantized": (("capsule_lite_restore", LITE), ("capsule_lite_restore_f32c", LITE_F32C)),
         "int4": (("capsule_lite_restore_int4", LITE_INT4),)}
NAMES = {"dequantized": "dequantized fp32", "int4": "int4 (the Q4_1 codes)", "F32": "F32 copy", "Q4_1": "Q4_1"}
PAIRS = (("dequantized", "F32"), ("int4", "Q4_1"))      # capsule's linears vs llama.cpp's weights


def settings(opts: BenchOptions, contexts: tuple[int, ...], steps: int, reps: int, restore_reps: int,
             gguf: Path) -> dict[str, Any]:
    return {"model": opts.model, "gguf": gguf.name, "contexts": list(contexts), "decode_steps": steps,
            "reps": reps, "restore_reps": restore_reps, "threads": list(decode_linears.THREADS),
            "peer": f"llama-cpp-python {peers_env.VERSION} (CMAKE_ARGS {peers_env.CMAKE_ARGS}; CFLAGS and "
                    f"CXXFLAGS {peers_env.compiler_flags() or '-'})",
            "f32": "llama.cpp's F32 GGUF: every tensor of the same GGUF dequantized by gguf.quants, as "
                   "capsule's loader does (bit-identical weights)",
            "kv_cache": "llama.cpp: its default F16 K/V cache; capsule's batch-1 rows: its default fp32 pool "
                        "(the batch-4 targets also with a bf16 pool, runtime.kv_dtype)",
            "timing": "decode: p50 of every step of every rep, cells interleaved rep by rep; restore: "
                      "medians, each run a fresh process timed from spawn", "quick": opts.quick}


def _ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def _decode_rows(res: dict[str, Any], contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    ours = {(r["linears"], r["threads"]): r for r in res["capsule_decode"].get("rows", [])
            if r.get("attention", decode_linears.ATTENTION[0]) == decode_linears.ATTENTION[0]
            and r.get("kv", decode_linears.KV_DTYPES[0]) == decode_linears.KV_DTYPES[0]}
    peer = res.get("llama_decode", {})
    rows = []
    for lin, w in PAIRS:
        for t in decode_linears.THREADS:
            cap, cells = ours.get((lin, t)), peer.get(f"{w}/{t}")
            if cap is None:
                continue
            theirs = {c: _ms([dt for cell in cells for dt in cell[str(c)]["steps_s"]]) if cells else None
                      for c in contexts}
            for c in contexts:
                mine = cap[f"b1_ms_ctx{c}"]
                rows.append({"weights": f"{NAMES[lin]} / {NAMES[w]}", "threads": t, "context": c,
                             "capsule_ms": mine, "llama_cpp_ms": theirs[c],
                             "capsule_vs_llama_cpp": mine / theirs[c] if mine and theirs[c] else None})
    return rows


def _greedy_rows(res: dict[str, Any], contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for lin, w in PAIRS:
        for t in decode_linears.THREADS:
            mine = res["capsule_decode"].get("greedy", {}).get(f"{lin}/{t}")
            cells = res.get("llama_decode", {}).get(f"{w}/{t}")
            if not mine or not cells:
                continue
            theirs = cells[0][str(contexts[0])]["greedy"]
            rows.append({"weights": f"{NAMES[lin]} / {NAMES[w]}", "threads": t, "context": contexts[0],
                         "tokens": min(len(mine), len(theirs)),
                         "equal_leading_tokens": decode_linears.lead(mine, theirs)})
    return rows


def _restore_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for lin, w in PAIRS:
        c = res["capsule_restore"].get(lin)
        if c is not None:
            rows.append({"who": f"capsule, {NAMES[lin]}", "interpreter_ms": c["restore_interpreter_s"] * 1e3,
                         "imports_ms": c["restore_import_s"] * 1e3, "open_or_load_ms": c["restore_open_s"] * 1e3,
                         "of_which_state_ms": c["restore_in_open_s"] * 1e3,
                         "first_token_ms": c["restore_first_token_s"] * 1e3,
                         "spawn_to_token_ms": c["restore_process_s"] * 1e3, "state_bytes": c["restore_bytes"]})
        for key, who in LITES[lin]:
            lite = res.get(key)
            if lite is not None:
                rows.append({"who": who, "interpreter_ms": lite["interpreter_s"] * 1e3,
                             "imports_ms": lite["import_s"] * 1e3, "open_or_load_ms": lite["open_s"] * 1e3,
                             "of_which_state_ms": None, "first_token_ms": lite["first_token_s"] * 1e3,
                             "spawn_to_token_ms": lite["process_s"] * 1e3, "state_bytes": lite["state_bytes"]})
        p = res.get("llama_restore", {}).get(w)
        if p is not None:
            rows.append({"who": f"llama.cpp, {NAMES[w]}", "interpreter_ms": p["interpreter_s"] * 1e3,
                         "imports_ms": p["import_s"] * 1e3,
                         "open_or_load_ms": (p["model_load_s"] + p["state_load_s"]) * 1e3,
                         "of_which_state_ms": p["state_load_s"] * 1e3, "first_token_ms": p["first_token_s"] * 1e3,
                         "spawn_to_token_ms": p["process_s"] * 1e3, "state_bytes": p["state_bytes"]})
    return rows


def _targets(decode: list[dict[str, Any]], restore: list[dict[str, Any]], res: dict[str, Any],
             contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each target's figure, bound and whether it holds."""
    out = []
    for r in decode:
        if r["llama_cpp_ms"] is not None:
            out.append({"target": f"decode {r['weights']}, {r['threads']} thread(s), ctx {r['context']}: "
                                  f"capsule <= llama.cpp", "capsule": r["capsule_ms"], "bound": r["llama_cpp_ms"],
                        "met": r["capsule_ms"] <= r["llama_cpp_ms"]})
    for r in res["capsule_decode"].get("rows", []):
        ratio = r.get(f"b{decode_linears.BATCH}_vs_b1")
        if ratio is not None:
            att, kv = r.get("attention", decode_linears.ATTENTION[0]), r.get("kv", decode_linears.KV_DTYPES[0])
            out.append({"target": f"batch {decode_linears.BATCH} per token <= 0.4x batch 1 at "
                                  f"{contexts[-1]} ({r['linears']}, {att} attention, {kv} K/V, "
                                  f"{r['threads']} thread(s))",
                        "capsule": ratio, "bound": 0.4, "met": ratio <= 0.4})
    by = {r["who"]: r for r in restore}
    for lin, w in PAIRS:
        for name in (f"capsule, {NAMES[lin]}", *(who for _, who in LITES[lin])):
            mine, theirs = by.get(name), by.get(f"llama.cpp, {NAMES[w]}")
            if mine and theirs:
                out.append({"target": f"restore -> first token from spawn, {name.removeprefix('capsule, ')} vs "
                                      f"{NAMES[w]}", "capsule": mine["spawn_to_token_ms"],
                            "bound": theirs["spawn_to_token_ms"],
                            "met": mine["spawn_to_token_ms"] <= theirs["spawn_to_token_ms"]})
    return out


def tables(res: dict[str, Any], contexts: tuple[int, ...]) -> dict[str, list[dict[str, Any]]]:
    decode, restore = _decode_rows(res, contexts), _restore_rows(res)
    out: dict[str, list[dict[str, Any]]] = {
        "decode ms/token, batch 1 (p50)": decode,
        "greedy ids, capsule vs llama.cpp (same prompt ids)": _greedy_rows(res, contexts),
        "restore -> first token, fresh process, one thread": restore,
        "targets (issue 19)": _targets(decode, restore, res, contexts)}
    if res["peer"]["why"]:
        out["llama.cpp unavailable"] = [{"why": res["peer"]["why"]}]
    return out
