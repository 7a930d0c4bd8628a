"""`capsule bench` suites: a registry of name -> suite function, and the common options.

A suite takes BenchOptions and returns a SuiteResult; `run_suite` writes its report.
New suites (capsules, tokenize, memory, control, fleet) plug in by adding one entry to SUITES.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from .report import default_out_dir, write_report


@dataclass(frozen=True)
class BenchOptions:
    """What the command line passes to every suite. steps=None lets the suite pick its default;
    only: section names to run, for a suite with sections (SECTIONED); () runs them all."""

    model: str = "builtin:small"
    device: str = "auto"
    quick: bool = False
    steps: int | None = None
    progress: bool = True
    only: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty str (a checkpoint folder or builtin:<preset>), "
                             f"got {self.model!r}")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise ValueError(f"steps must be an int >= 1 (or None for the suite's default), got {self.steps!r}")
        if not isinstance(self.only, tuple) or not all(isinstance(x, str) and x for x in self.only):
            raise ValueError(f"only must be a tuple of section names, e.g. ('accuracy',), got {self.only!r}")


@dataclass(frozen=True)
class SuiteResult:
    """settings: what was measured and how; results: the numbers; tables: title -> rows to print."""

    settings: Mapping[str, Any]
    results: Mapping[str, Any]
    tables: Mapping[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class SuiteRun:
    result: SuiteResult
    json_path: Path
    md_path: Path


Suite = Callable[[BenchOptions], SuiteResult]


def _lazy(module: str) -> Suite:
    """The suite in bench/<module>.py, imported on first run: the registry is listed (e.g. on a
    typo) without loading any suite."""
    def run(opts: BenchOptions) -> SuiteResult:
        return importlib.import_module(f"{__name__}.{module}").run(opts)
    return run


SUITES: Mapping[str, Suite] = MappingProxyType({
    "decode": _lazy("decode"), "capsules": _lazy("capsules"), "tokenize": _lazy("tokenize"),
    "tokenize-diff": _lazy("tokenize_diff"), "tokenize-bpe": _lazy("tokenize_bpe"),
    "tokenize-tails": _lazy("tokenize_tails"),
    "memory": _lazy("memory"), "control": _lazy("control"), "fleet": _lazy("fleet"),
    "reliability": _lazy("reliability"), "peers": _lazy("peers")})


SECTIONED = frozenset({"memory"})   # suites whose run honours BenchOptions.only


def run_suite(name: str, opts: BenchOptions, out_dir: str | Path | None = None) -> SuiteRun:
    """Run one suite and write results.json / results.md into out_dir (default bench-results/<suite>-<time>/)."""
    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; available: {', '.join(sorted(SUITES))}")
    if opts.only and name not in SECTIONED:
        raise ValueError(f"suite {name!r} has no sections to choose from; --only works with: "
                         f"{', '.join(sorted(SECTIONED))}")
    result = SUITES[name](opts)
    out = Path(out_dir) if out_dir is not None else default_out_dir(name)
    settings = {"suite": name, **dict(result.settings)}
    json_path, md_path = write_report(out, suite=name, settings=settings, results=result.results,
                                      tables=result.tables)
    return SuiteRun(result, json_path, md_path)


__all__ = ["BenchOptions", "SECTIONED", "SuiteResult", "SuiteRun", "SUITES", "run_suite"]
