"""Benchmark reports: the machine a run was measured on, results.json and a results.md table.

A number without its machine, versions and settings cannot be compared, so every report
records them beside the results.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parents[4]  # sdk/capsule/tools/bench/report.py -> repository root


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("model name", "Model", "Hardware")):  # x86, then aarch64 boards
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _git_commit() -> str | None:
    """HEAD of the checkout this package runs from, with '+dirty' if it has local edits."""
    if not (REPO_ROOT / ".git").exists():
        return None  # an installed wheel: no checkout to ask
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, timeout=5,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               timeout=5, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine_info() -> dict[str, Any]:
    """Platform, CPU, memory, library versions, GPU and git commit of this run."""
    import numpy
    import torch

    from ..._version import __version__
    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cores = os.cpu_count()
    cuda = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable_cores,
        "torch_threads": torch.get_num_threads(),
        "ram_gb": _ram_gb(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "capsule": __version__,
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        "cuda_runtime": torch.version.cuda if cuda else None,
        "git_commit": _git_commit(),
        "argv": sys.argv,
    }


def default_out_dir(suite: str) -> Path:
    return Path("bench-results") / f"{suite}-{time.strftime('%Y%m%d-%H%M%S')}"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "-" if value is None else str(value)


def format_table(rows: Sequence[Mapping[str, Any]], *, markdown: bool) -> str:
    """Rows with the same keys as a Markdown table, or as aligned plain text for a terminal."""
    if not rows:
        return "(no rows)"
    head = list(rows[0])
    body = [[_cell(r.get(k)) for k in head] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in body])


def write_report(out_dir: Path, *, suite: str, settings: Mapping[str, Any], results: Mapping[str, Any],
                 tables: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[Path, Path]:
    """Write results.json (everything) and results.md (machine, settings, tables); return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    payload = {"suite": suite, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
               "settings": dict(settings), "results": dict(results), "tables": {k: list(v) for k, v in tables.items()}}
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    md = [f"# capsule bench: {suite}", "", f"Created {payload['created']}.", "", "## Machine", ""]
    md += [f"- {k}: {_cell(v)}" for k, v in machine.items() if k != "argv"]
    md += ["", "## Settings", ""] + [f"- {k}: {_cell(v)}" for k, v in settings.items()]
    for title, rows in tables.items():
        md += ["", f"## {title}", "", format_table(rows, markdown=True)]
    md_path = out_dir / "results.md"
    md_path.write_text("\n".join(md) + "\n")
    return json_path, md_path
