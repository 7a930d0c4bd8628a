"""The object store seam: a few calls on keys under one prefix, and their S3 implementation (boto3).

Endpoint, credentials and region come from the standard AWS variables (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION) or the AWS config files, as for
any boto3 program. boto3 is imported only here, and only when a bucket is opened.

Threading: an S3Bucket may be used from several threads (boto3 clients are thread-safe).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from .errors import RemoteCorrupt, RemoteUnavailable

_MISSING = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict"}


class ObjectStore(Protocol):
    """Keys are relative to the replica's prefix ("epochs/...", "packs/...")."""

    where: str   # "s3://bucket/prefix", for messages

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Store data under key; if_absent: only when no object has that key (write-once). False:
        the key existed (nothing written). RemoteUnavailable on any other failure."""

    def get(self, key: str, *, max_bytes: int, start: int = 0, length: int | None = None) -> bytes | None:
        """The object's bytes (or `length` of them from `start`); None when absent. An object (or
        range) larger than max_bytes is refused unread (RemoteCorrupt)."""

    def keys(self, under: str, start_after: str = "") -> Iterator[tuple[str, int]]:
        """(key, size) of every object whose key starts with `under`, in key order."""

    def delete(self, key: str) -> None:
        """Remove the object (absent: nothing to do)."""


@dataclass(frozen=True)
class Location:
    bucket: str
    prefix: str    # "" or "robot-7" (no leading or trailing slash)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel


def parse_url(url: str) -> Location:
    """s3://bucket[/prefix] -> Location; ValueError naming what is wrong."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"a replica is named s3://bucket/prefix, got {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not all(c.isalnum() or c in "-." for c in bucket) or not 3 <= len(bucket) <= 63:
        raise ValueError(f"{url!r}: the bucket name must be 3..63 letters, digits, '-' or '.'")
    if len(prefix) > 512 or "//" in prefix or any(part in (".", "..") for part in prefix.split("/")):
        raise ValueError(f"{url!r}: the prefix must be at most 512 characters, without '//', '.' or '..' parts")
    return Location(bucket, prefix)


class S3Bucket:
    """ObjectStore over boto3. Timeouts are short and retries few: a replicator retries on its own."""

    def __init__(self, url: str, *, client: Any = None, connect_timeout: float = 5.0,
                 read_timeout: float = 30.0, attempts: int = 2):
        self.loc = parse_url(url)
        self.where = self.loc.url
        self._client = client if client is not None else _client(connect_timeout, read_timeout, attempts)

    # -- ObjectStore -----------------------------------------------------------------------------
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self._client.put_object(Bucket=self.loc.bucket, Key=self.loc.key(key), Body=data, **extra)
        except Exception as exc:  # noqa: BLE001 - botocore's exceptions are mapped below
            if if_absent and _code(exc) in _EXISTS:
                return False
            raise self._failed("writing", key, exc) from None
        return True

    def get(self, key: str, *, max_bytes: int, start: int = 0, length: int | None = None) -> bytes | None:
        if length is not None and length > max_bytes:
            raise RemoteCorrupt(self._name(key), f"{length} bytes asked for; at most {max_bytes} are read")
        extra = {}
        if start or length is not None:
            extra["Range"] = f"bytes={start}-" + ("" if length is None else str(start + length - 1))
        try:
            got = self._client.get_object(Bucket=self.loc.bucket, Key=self.loc.key(key), **extra)
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in _MISSING:
                return None
            raise self._failed("reading", key, exc) from None
        body = got["Body"]
        try:
            size = int(got.get("ContentLength", -1))
            if size > max_bytes:
                raise RemoteCorrupt(self._name(key), f"{size} bytes; at most {max_bytes} are read")
            data = body.read(max_bytes + 1)
        except RemoteCorrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a connection cut mid-body
            raise self._failed("reading", key, exc) from None
        finally:
            body.close()
        if len(data) > max_bytes:
            raise RemoteCorrupt(self._name(key), f"more than {max_bytes} bytes; refused")
        if length is not None and len(data) != length:
            raise RemoteCorrupt(self._name(key), f"{len(data)} bytes where {length} were asked for (truncated)")
        return data

    def keys(self, under: str, start_after: str = "") -> Iterator[tuple[str, int]]:
        cut = len(self.loc.key(""))
        args = {"Bucket": self.loc.bucket, "Prefix": self.loc.key(under)}
        if start_after:
            args["StartAfter"] = self.loc.key(start_after)
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(**args):
                for obj in page.get("Contents", ()):
                    yield obj["Key"][cut:], int(obj["Size"])
        except Exception as exc:  # noqa: BLE001
            if _code(exc) == "NoSuchBucket":
                raise RemoteUnavailable(f"{self.where}: no bucket {self.loc.bucket!r} at "
                                        f"{_endpoint(self._client)}; create it first") from None
            raise self._failed("listing", under, exc) from None

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.loc.bucket, Key=self.loc.key(key))
        except Exception as exc:  # noqa: BLE001
            if _code(exc) not in _MISSING:
                raise self._failed("deleting", key, exc) from None

    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (tests, first set-up)."""
        try:
            self._client.head_bucket(Bucket=self.loc.bucket)
        except Exception as exc:  # noqa: BLE001
            if _code(exc) not in _MISSING | {"NoSuchBucket"}:
                raise self._failed("checking the bucket of", "", exc) from None
            try:
                self._client.create_bucket(Bucket=self.loc.bucket)
            except Exception as exc2:  # noqa: BLE001
                if _code(exc2) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                    raise self._failed("creating the bucket of", "", exc2) from None

    # -- messages ------------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return f"{self.where}/{key}" if key else self.where

    def _failed(self, doing: str, key: str, exc: Exception) -> RemoteUnavailable:
        code = _code(exc)
        hint = ""
        if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            hint = ": set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or an AWS config profile)"
        elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            hint = ": check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy"
        elif code == "NoSuchBucket":
            hint = f": no bucket {self.loc.bucket!r}; create it first"
        return RemoteUnavailable(f"{doing} {self._name(key)} at {_endpoint(self._client)} failed: "
                                 f"{type(exc).__name__}{f' {code}' if code else ''}: {exc}{hint}")


def _client(connect_timeout: float, read_timeout: float, attempts: int) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise RemoteUnavailable(f"replication needs boto3 ({exc}): pip install 'exec-capsules[fleet]'") from None
    # credentials as boto3 finds them (variables, config files, an instance role on a base station on
    # EC2: its metadata probe is bounded, 1 s by default; AWS_EC2_METADATA_DISABLED=true skips it)
    style = "path" if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3") else "auto"
    config = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                    retries={"max_attempts": attempts, "mode": "standard"}, s3={"addressing_style": style},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", config=config)


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        code = str(err.get("Code", "") or "")
        status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "") or "")
        return code or status
    return ""


def _endpoint(client: Any) -> str:
    return str(getattr(getattr(client, "meta", None), "endpoint_url", "?"))
