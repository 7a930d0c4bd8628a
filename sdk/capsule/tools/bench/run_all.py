"""`capsule bench` over several suites (every one by default): one folder with each suite's own
report, a combined results.json and report.md, and the PNG plots.

The machine (CPU, GPU, memory, disk) and the 1-min load average before and after every suite
are recorded; a suite that fails is recorded with its error and the next one runs (the exit
status says so). Progress: one line per suite as it starts and ends, and the suites' own bars.
Suites clean their temporary folders up themselves (``tempfile.TemporaryDirectory``), Ctrl-C
included; what was measured before a Ctrl-C is still written.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from . import SECTIONED, SUITES, BenchOptions, run_suite
from .plots import PLOTS, draw_plots
from .report import format_table, machine_info

ORDER = ("decode", "capsules", "tokenize", "tokenize-diff", "tokenize-bpe", "tokenize-tails", "memory", "control", "fleet",
         "reliability", "peers")
# run only when named: peers builds llama.cpp from source on its first run (tens of minutes)
OPT_IN = frozenset({"peers"})
# --quick over several suites must end in ~3 minutes on a 2-core CPU: the memory suite then runs
# these sections only (its accuracy and deviation sections alone take a minute), and the
# reliability campaign this many store SIGKILLs (its other sizes scale with it) unless --steps
QUICK_SECTIONS = {"memory": ("ttft", "decode")}
QUICK_STEPS = {"reliability": 20}
assert set(ORDER) == set(SUITES), "a bench suite missing from run_all.ORDER"


@dataclass(frozen=True)
class AllRun:
    out_dir: Path
    json_path: Path
    md_path: Path
    failed: tuple[str, ...]


def parse_suites(text: str | None) -> list[str]:
    """"a,b" -> ["a", "b"] (in the order given); None or "" -> every suite but the OPT_IN ones;
    ValueError naming the unknown ones and the choices."""
    if not text:
        return [n for n in ORDER if n not in OPT_IN]
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SUITES]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"--suite takes distinct names from: {', '.join(ORDER)} (got {text!r})")
    return names


def default_all_dir() -> Path:
    return Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_suites(names: Sequence[str], opts: BenchOptions, out_dir: str | Path | None = None) -> AllRun:
    out = Path(out_dir) if out_dir is not None else default_all_dir()
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    doc: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
                           "options": {"model": opts.model, "device": opts.device, "quick": opts.quick,
                                       "steps": opts.steps},
                           "disk_free_gb": round(shutil.disk_usage(out).free / 1e9, 1), "suites": {}}
    results: dict[str, Any] = {}
    failed: list[str] = []
    try:
        for i, name in enumerate(names, 1):
            # --only names sections of the sectioned suites; the others run whole
            only = (opts.only or (QUICK_SECTIONS.get(name, ()) if opts.quick else ())) if name in SECTIONED else ()
            steps = opts.steps or (QUICK_STEPS.get(name) if opts.quick else None)
            suite_opts = replace(opts, only=only, steps=steps)
            print(f"[{i}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
            entry: dict[str, Any] = {"load_before": _load()}
            t0 = time.perf_counter()
            try:
                run = run_suite(name, suite_opts, out / name)
                entry.update(results=dict(run.result.results), settings=dict(run.result.settings),
                             tables={k: list(v) for k, v in run.result.tables.items()})
                results[name] = run.result.results
            except Exception as exc:   # noqa: BLE001 - one suite's failure is reported, the rest run
                failed.append(name)
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc()[-4000:]
            entry.update(seconds=round(time.perf_counter() - t0, 1), load_after=_load())
            doc["suites"][name] = entry
            print(f"[{i}/{len(names)}] {name} {'FAILED: ' + entry['error'] if 'error' in entry else 'done'} "
                  f"in {entry['seconds']} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        doc["interrupted"] = True
        print("interrupted: writing what was measured", file=sys.stderr, flush=True)
    doc["seconds"] = round(time.perf_counter() - t_all, 1)
    doc["plots"] = draw_plots(results, out)
    json_path = out / "results.json"
    json_path.write_text(json.dumps(doc, indent=1, allow_nan=False, default=str) + "\n")
    md_path = out / "report.md"
    md_path.write_text(_markdown(doc))
    return AllRun(out, json_path, md_path, tuple(failed))


def _markdown(doc: dict[str, Any]) -> str:
    md = [f"# capsule bench, {doc['created']}", "",
          f"{len(doc['suites'])} suites in {doc['seconds']} s"
          f"{' (interrupted)' if doc.get('interrupted') else ''}; options: "
          + ", ".join(f"{k} {v}" for k, v in doc["options"].items()), "", "## Machine", ""]
    md += [f"- {k}: {v}" for k, v in doc["machine"].items() if k != "argv"]
    md += [f"- disk free: {doc['disk_free_gb']} GB", "", "## Suites", "",
           format_table([{"suite": n, "seconds": e["seconds"], "load before": e["load_before"],
                          "load after": e["load_after"], "status": "FAILED" if "error" in e else "ok"}
                         for n, e in doc["suites"].items()], markdown=True), "", "## Plots", ""]
    for name, status in doc["plots"].items():
        md.append(f"![{name}]({name})" if status == "ok" else f"- {name}: not drawn ({status})")
    for name, entry in doc["suites"].items():
        md += ["", f"## {name}", ""]
        if "error" in entry:
            md += [f"FAILED: {entry['error']}"]
            continue
        for title, rows in entry["tables"].items():
            md += [f"### {title}", "", format_table(rows, markdown=True), ""]
    return "\n".join(md) + "\n"


__all__ = ["AllRun", "ORDER", "PLOTS", "parse_suites", "run_suites"]
