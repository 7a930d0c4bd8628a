"""Run the GPU check's steps in order, each alone in a child process with its own timeout.

A step that crashes, hangs (its whole process group is killed at its limit) or writes no
result is recorded as ok=false with the error and its output's tail, and the next step runs.
Writes DIR/gpu_check.json ({"steps": {name: {"ok": ..., figures}}, "device", "total_s", ...}),
DIR/gpu_check.md and DIR/gpu_check.log (every step's output): three files, as few as a lent
machine's $OUT takes back. Exit status 0 when every step is ok, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ... import safejson
from ..bench.report import REPO_ROOT
from . import STEPS, Step, step_named
from .report import markdown

Command = Callable[[Step, Path], list[str]]   # (step, result file) -> argv of its child
KILL_GRACE_S = 5.0
RESULT_MAX_BYTES = 8 << 20


def step_command(device: str, quick: bool) -> Command:
    def argv(step: Step, result: Path) -> list[str]:
        return [sys.executable, "-m", f"{__package__}.step", step.name, "--device", device,
                "--result", str(result), "--budget", str(step.timeout_s), *(["--quick"] if quick else [])]
    return argv


def child_env() -> dict[str, str]:
    """This environment, with capsule, devices and edge_kernels importable from where this
    process imports them (a checkout run as packaging/gpu_check.py, not installed)."""
    import devices

    sdk = Path(__file__).resolve().parents[3]      # sdk/capsule/tools/gpu_check/runner.py -> sdk
    roots = [str(sdk), str(Path(devices.__file__).resolve().parents[1])]
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(roots + old)), "PYTHONUNBUFFERED": "1"}


def _kill_group(proc: subprocess.Popen) -> None:
    """End the step's process group: the step if it still runs (TERM, then KILL after a grace)
    and anything it left behind (a pytest or bench child)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return                                   # the step and all it started are gone
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _result(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(the step's result, or None and why there is none)."""
    if not path.is_file():
        return None, "without writing a result"
    try:
        doc = safejson.loads(path.read_bytes(), what=f"its result {path.name}", max_bytes=RESULT_MAX_BYTES)
    except (OSError, ValueError) as exc:
        return None, f"and its result is unreadable ({exc})"
    if not (isinstance(doc, dict) and isinstance(doc.get("ok"), bool)):
        return None, 'and its result is not an object with "ok": true|false'
    return doc, ""


def run_step(step: Step, argv: list[str], result: Path, env: dict[str, str], cwd: Path) -> tuple[dict, str]:
    """(the step's record, its output). The record starts with ok and ends with seconds, timeout_s."""
    result.unlink(missing_ok=True)
    out_path = result.with_suffix(".out")
    t0 = time.perf_counter()
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=step.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
        _kill_group(proc)
    seconds = time.perf_counter() - t0
    output = out_path.read_text(encoding="utf-8", errors="replace")
    out_path.unlink(missing_ok=True)
    doc, why = (None, "") if timed_out else _result(result)
    if timed_out:
        doc = {"ok": False, "error": f"timed out after {step.timeout_s} s, its own limit (the step was "
                                     "killed; the next step runs)"}
    elif doc is None:
        how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exited {rc}"
        doc = {"ok": False, "error": f"the step's process {how} {why}"}
    elif rc != 0 and doc["ok"]:
        doc = {**doc, "ok": False, "error": f"the step's process exited {rc} after reporting ok"}
    if not doc["ok"] and "output_tail" not in doc:
        doc["output_tail"] = output[-3000:]
    result.unlink(missing_ok=True)
    return {**doc, "seconds": round(seconds, 2), "timeout_s": step.timeout_s}, output


def run_steps(steps: Sequence[Step], command: Command, out_dir: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None, echo: bool = True) -> dict[str, dict]:
    """Every step in order (none stops the next); appends each one's output to gpu_check.log."""
    env = env if env is not None else child_env()
    cwd = cwd if cwd is not None else (REPO_ROOT if (REPO_ROOT / "pyproject.toml").is_file() else Path.cwd())
    results: dict[str, dict] = {}
    with open(out_dir / "gpu_check.log", "w", encoding="utf-8") as log:
        for step in steps:
            if echo:
                print(f"== {step.name}: {step.what} (limit {step.timeout_s} s)", flush=True)
            rec, output = run_step(step, command(step, out_dir / f".{step.name}.json"), out_dir / f".{step.name}.json",
                                   env, cwd)
            results[step.name] = rec
            log.write(f"===== {step.name}: {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']} s\n{output}\n")
            log.flush()
            if echo:
                print(f"   {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']:.1f} s"
                      + ("" if rec["ok"] else f": {rec.get('error', '')[:300]}"), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json / .md / .log")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    ap.add_argument("--only", default="", help="comma-separated step names to run (default: all, in order)")
    a = ap.parse_args(argv)
    steps = [step_named(n) for n in a.only.split(",") if n] if a.only else list(STEPS)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_steps(steps, step_command(a.device, a.quick), a.out)
    doc = {"device": a.device, "quick": a.quick, "total_s": round(time.perf_counter() - t0, 2),
           "timeout_sum_s": sum(s.timeout_s for s in steps), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "python": sys.executable, "steps": results}
    (a.out / "gpu_check.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    md = markdown(doc, {s.name: s.what for s in steps})
    (a.out / "gpu_check.md").write_text(md, encoding="utf-8")
    print(md, flush=True)
    return 0 if all(r["ok"] for r in results.values()) else 1
