"""GPU-check step `pytest_cuda`: ``pytest -m cuda`` over the test files that mark CUDA tests.

Only those files are collected (a file of CPU tests importing a package the GPU image lacks
cannot stop the run), and a collection error in one is counted, not fatal. pytest runs in a
child with a limit under the step's own, so a run cut short still reports the tests it got
through. Without a GPU every test is skipped (conftest.py): the counts say so.
ok: nothing failed or errored, and pytest finished.
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from typing import Any

from ..bench.report import REPO_ROOT

OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)
COLLECT_ERROR = re.compile(r"^ERROR (\S+)( - .*)?$", re.M)
MARGIN_S = 8.0   # between pytest's limit and the step's: time to parse and report


def cuda_test_files() -> list[str]:
    tests = REPO_ROOT / "tests"
    if not tests.is_dir():
        raise FileNotFoundError(f"no tests folder at {tests}: run the check from a checkout of the repository")
    return [str(p.relative_to(REPO_ROOT)) for p in sorted(tests.glob("test_*.py"))
            if "mark.cuda" in p.read_text(encoding="utf-8")]


def run(device: str, quick: bool, budget_s: float) -> dict[str, Any]:
    files = cuda_test_files()
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfE", "-p", "no:cacheprovider",
            "--continue-on-collection-errors", *files]
    limit = max(5.0, budget_s - MARGIN_S)
    try:
        proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=limit)
        out, rc, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as exc:
        parts = (exc.stdout, exc.stderr)
        out = "".join(p.decode(errors="replace") if isinstance(p, bytes) else (p or "") for p in parts)
        rc, timed_out = None, True
    seen = dict(OUTCOME.findall(out))          # a test id once: its final outcome
    counts = Counter(seen.values())
    failed = sorted(t for t, o in seen.items() if o in ("FAILED", "ERROR"))
    summary = next((ln.strip("= ") for ln in reversed(out.splitlines()) if re.search(r" in [\d.]+s", ln)), None)
    collect_errors = sorted({m for m, _ in COLLECT_ERROR.findall(out) if "::" not in m})
    result: dict[str, Any] = {
        "files": files, "passed": counts["PASSED"], "failed": counts["FAILED"], "skipped": counts["SKIPPED"],
        "errors": counts["ERROR"] + len(collect_errors), "xfailed": counts["XFAIL"], "xpassed": counts["XPASS"],
        "returncode": rc, "timed_out": timed_out, "summary": summary,
        "failed_tests": failed[:30], "collection_errors": collect_errors}
    problems = []
    if timed_out:
        problems.append(f"pytest ran past {limit:.0f} s (the counts are the tests it finished)")
    if failed or collect_errors or rc not in (0, 5, None):
        problems.append(f"{len(failed)} failed or errored, {len(collect_errors)} files not collected, exit {rc}")
    if problems:
        result["error"] = "; ".join(problems)
        result["output_tail"] = out[-4000:]
    result["ok"] = not problems
    return result
