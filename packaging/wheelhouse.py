#!/usr/bin/env python3
"""Build wheelhouse/: the wheels a lent GPU machine needs to run the project (`make wheelhouse`).

That machine has no network and no project dependencies beyond its image's packages
(packaging/gpu_image_packages.txt). This downloads, for its Python (3.12, x86-64 manylinux),
every dependency in pyproject.toml that the image lacks, and theirs, one version each: the
version installed in the Python running this script when it has one (what the tests ran
with), else the newest that pyproject.toml allows. packaging/gpu_check.sh installs them there
with `pip install --no-index --no-deps --target`. Never torch, onnxruntime, TensorRT, CUDA or
nvidia packages: the image's own must be the ones used. Fails, naming the sizes, when the
wheels and the working tree that travels with them pass the lent machine's 64 MiB.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import zipfile
from pathlib import Path

if sys.version_info < (3, 11):
    sys.exit("wheelhouse.py needs Python 3.11+ (tomllib reads pyproject.toml): run it with PYTHON=python3.11 or newer")
import tomllib  # noqa: E402

try:
    from packaging.requirements import Requirement
except ImportError:   # pip vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "packaging" / "gpu_image_packages.txt"
LIMIT_MIB = 64            # what one device call carries: the working tree and the carried paths
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|onnxruntime.*|tensorrt.*|pycuda|cupy.*|nvidia-.*|cuda-.*)$")
# carried although the image has a version: a requirement the image's version may not meet
ALWAYS_CARRY = {"click": "sqlite-utils 4 asks for click>=8.3.1; the image's version is not known here"}
MARKER_ENV = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.3",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = IMAGE_LIST.read_text(encoding="utf-8").splitlines()
    return {norm(ln.strip()) for ln in lines if ln.strip() and not ln.startswith("#")}


def wanted(req: Requirement, image: set[str]) -> bool:
    if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
        return False
    return norm(req.name) in ALWAYS_CARRY or norm(req.name) not in image


def pin(req: Requirement) -> str:
    """name==<installed version> when this Python has it and the spec allows it, else the spec."""
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        return f"{req.name}{req.specifier}"
    return f"{req.name}=={have}" if req.specifier.contains(have, prereleases=True) else f"{req.name}{req.specifier}"


def download(specs: list[str], dest: Path) -> None:
    argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
            *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *specs]
    proc = subprocess.run(argv, capture_output=True, text=True)
    noise = "is ignored: it is neither a file nor a directory"   # a pip.conf's absent local index
    for line in (proc.stdout + proc.stderr).splitlines():
        if noise not in line:
            print(line, file=sys.stderr)
    if proc.returncode != 0:
        sys.exit(f"wheelhouse: pip download failed for {' '.join(specs)} (network to PyPI? a wheel for "
                 f"Python {PYTHON_VERSION} on x86-64 Linux?)")


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", errors="replace").splitlines()
    return [Requirement(ln.split(":", 1)[1].strip()) for ln in lines if ln.startswith("Requires-Dist:")]


def wheel_name(wheel: Path) -> str:
    return norm(wheel.name.split("-")[0])


def tree_bytes() -> int:
    """Bytes of the working tree that a device call sends (tracked and untracked-not-ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout
    return sum((REPO / p).stat().st_size for p in out.decode().split("\0") if p and (REPO / p).is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=REPO / "wheelhouse")
    a = ap.parse_args(argv)
    image = image_packages()
    deps = [Requirement(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    a.dest.mkdir(exist_ok=True)
    for old in a.dest.glob("*.whl"):      # one version of each: two would stop the whole install
        old.unlink()
    todo, seen = [r for r in deps if wanted(r, image)], set()
    while todo:
        fresh = []
        for r in todo:
            if norm(r.name) not in seen:
                seen.add(norm(r.name))
                fresh.append(r)
        if not fresh:
            break
        bad = [r.name for r in fresh if NEVER.match(norm(r.name))]
        if bad:
            sys.exit(f"wheelhouse: {', '.join(bad)} would be carried; the GPU image's own must be used "
                     f"(add it to {IMAGE_LIST.name} if the image has it)")
        before = set(a.dest.glob("*.whl"))
        download([pin(r) for r in fresh], a.dest)
        todo = [q for w in sorted(set(a.dest.glob("*.whl")) - before) for q in requires(w) if wanted(q, image)]
    wheels = sorted(a.dest.glob("*.whl"))
    size, tree = sum(w.stat().st_size for w in wheels), tree_bytes()
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{size / 2**20:7.2f} MiB  in {len(wheels)} wheels; the working tree adds {tree / 2**20:.2f} MiB")
    if size + tree > LIMIT_MIB * 2**20:
        sys.exit(f"wheelhouse: {(size + tree) / 2**20:.1f} MiB with the working tree, over the {LIMIT_MIB} MiB "
                 "a device call carries: drop the largest wheels above (or carry them in separate calls)")
    for w in wheels:
        if NEVER.match(wheel_name(w)):
            sys.exit(f"wheelhouse: {w.name} must not be carried (the image's own is used)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
