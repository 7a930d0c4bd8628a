"""The README's Python blocks run as written (issue 16): each one alone, in a fresh process, in an
empty folder (the stores they name are created there)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from capsule.tools.s3_server import LoopbackS3

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory):
    """For a block naming s3://: the AWS variables of a real S3 server on loopback, as a user's
    environment would hold their endpoint's, with the bucket the README names."""
    server = LoopbackS3(tmp_path_factory.mktemp("weed"))
    server.start()
    try:
        server.make_bucket("fleet")
        yield {**os.environ, **server.env()}
    finally:
        server.stop()


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs_as_written(index, tmp_path, request):
    script = tmp_path / f"block{index}.py"
    script.write_text(BLOCKS[index])
    env = request.getfixturevalue("s3_env") if "s3://" in BLOCKS[index] else None
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, f"README block {index}:\n{BLOCKS[index]}\n{res.stderr[-3000:]}"
