"""Install llama.cpp's vocabulary GGUFs (the tokenizer families falcon, starcoder2, ...).

llama.cpp ships one small vocabulary-only GGUF per tokenizer family (``models/ggml-vocab-*.gguf``,
with the ids its original Hugging Face tokenizer gives on a test text beside each) inside the
``llama-cpp-python`` source distribution on PyPI. That package builds llama.cpp when installed,
so only its sdist is downloaded (``pip download``, from the package index, at install time),
checked against a pinned sha256, and the vocabulary files are copied out into
``<prefix>/share/capsule-vocab/llama.cpp`` (the folder the registry's ``share:llama.cpp``
families read). ``make`` runs this; nothing downloads at run time.

    python packaging/llama_cpp_vocabs.py [--prefix PREFIX]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# the vocabularies the registry's families name, with their test texts and expected ids
NAMES = ("falcon", "starcoder", "command-r", "mpt", "refact", "llama-spm", "phi-3", "gemma-4")
SUFFIXES = (".gguf", ".gguf.inp", ".gguf.out")
MAX_MEMBER = 64 << 20   # the largest (gemma-4) is 16 MB


def wanted() -> set[str]:
    return {f"ggml-vocab-{n}{s}" for n in NAMES for s in SUFFIXES}


def install(prefix: Path) -> Path:
    dest = prefix / "share" / "capsule-vocab" / "llama.cpp"
    names = wanted()
    if dest.is_dir() and names <= {p.name for p in dest.iterdir()}:
        return dest
    with tempfile.TemporaryDirectory(prefix="capsule-llama-cpp-sdist-") as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q",
                              "--disable-pip-version-check", "--no-deps", "--no-binary", ":all:",
                              SDIST, "-d", tmp], stderr=subprocess.PIPE, text=True)
        # (a machine's pip config may name index folders it lacks: pip warns, harmlessly)
        sys.stderr.writelines(line for line in got.stderr.splitlines(keepends=True)
                              if "is ignored: it is neither" not in line)
        if got.returncode:
            raise SystemExit(f"pip download {SDIST} failed (exit {got.returncode})")
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise SystemExit(f"pip download {SDIST} gave {sdists}, expected one sdist")
        digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
        if digest != SHA256:
            raise SystemExit(f"{sdists[0].name}: sha256 {digest}, expected {SHA256}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdists[0]) as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if name not in names or "/vendor/llama.cpp/models/" not in member.name:
                    continue
                if not member.isfile() or member.size > MAX_MEMBER:
                    raise SystemExit(f"{member.name}: not a regular file under {MAX_MEMBER} bytes")
                src = tar.extractfile(member)
                assert src is not None
                part = dest / f".{name}.part"
                with open(part, "wb") as out:
                    out.write(src.read())
                os.chmod(part, 0o644)
                os.replace(part, dest / name)
    missing = sorted(names - {p.name for p in dest.iterdir()})
    if missing:
        raise SystemExit(f"{SDIST} has no {', '.join(missing)}")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=Path, default=Path(sys.prefix),
                    help="the environment to install into (default: this Python's, %(default)s)")
    print(install(ap.parse_args().prefix))


if __name__ == "__main__":
    main()
