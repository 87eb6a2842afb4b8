"""Helpers shared by the benchmarks: states, disk and page-cache helpers, the peers'
save/load functions, timing, and the machine's busy share.

Used by ``save_load.py`` (single-process save/load), ``async_bench.py``,
``dist_bench.py``, ``s3_bench.py`` and ``run_all.py`` (the whole suite).
"""

from __future__ import annotations

import bisect
import functools
import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


MiB = 1 << 20
RAW_CHUNK = 64 * MiB
HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Run from a checkout without installing: fall back to the source tree (also for the
# subprocesses the benchmarks start, which inherit PYTHONPATH).
try:
    import importlib.util

    if importlib.util.find_spec("safeckpt") is None and (REPO / "src" / "safeckpt").is_dir():
        sys.path.insert(0, str(REPO / "src"))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
except (ImportError, ValueError):
    pass


# ----------------------------------------------------------------------------- states


def large_rows(total_mib: int, n: int, dtype: torch.dtype = torch.float32, multiple: int = 1) -> int:
    """Rows of each of the n 4096-column matrices of a large state of about total_mib."""
    rows = max(1, (total_mib * MiB) // (n * 4096 * dtype.itemsize))
    return max(multiple, rows // multiple * multiple)


def make_large_state(total_mib: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """~n matrices of 4096 columns (16 KiB rows in fp32) totalling about total_mib."""
    g = torch.Generator().manual_seed(seed)
    rows = large_rows(total_mib, n, dtype)
    return {"model": {f"w{i:03d}": torch.randn(rows, 4096, generator=g, dtype=dtype) for i in range(n)}}


def make_small_state(n: int, avg_kib: int, seed: int = 1) -> dict:
    """n optimizer-like fp32 tensors (exp_avg / exp_avg_sq pairs) of 1/4..7/4 x avg_kib."""
    g = torch.Generator().manual_seed(seed)
    base = avg_kib * 256 // 4  # numel of avg_kib/4 KiB
    state: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(n):
        numel = base * (1 + (i * 7919) % 7)  # deterministic spread, mean 4*base
        state.setdefault(f"p{i // 2:05d}", {})["exp_avg" if i % 2 == 0 else "exp_avg_sq"] = (
            torch.randn(numel, generator=g)
        )
    return {"optim": {"state": state}}


def make_transformer_state(d_model: int = 512, layers: int = 4, seed: int = 2) -> dict:
    """A real small transformer (``nn.TransformerEncoder``) and its AdamW state after one
    step, as a training loop saves them: ``{"model": ..., "optim": ..., "step": 1}``."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model, max(1, d_model // 64), 4 * d_model, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 16, d_model)).square().mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}


def flatten(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors -> {"a.b.c": tensor} (already-flat dicts pass through)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj
    return out


def state_nbytes(state: dict) -> int:
    return sum(t.nbytes for t in flatten(state).values())


def empty_like_state(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: empty_like_state(v) for k, v in obj.items()}
    return torch.zeros_like(obj) if isinstance(obj, torch.Tensor) else obj


def check_equal(expected: dict, got: Any) -> None:
    a, b = flatten(expected), flatten(got)
    if a.keys() != b.keys():
        missing, extra = sorted(a.keys() - b.keys())[:3], sorted(b.keys() - a.keys())[:3]
        raise AssertionError(f"keys differ: missing {missing}, unexpected {extra}")
    for k, t in a.items():
        if not torch.equal(t, b[k]):
            raise AssertionError(f"tensor {k!r} differs after load")


# ----------------------------------------------------------------------------- disk helpers


def fsync_tree(path: Path) -> None:
    """fsync every file under path (or path itself), then the folders, then the parent."""
    dirs = [path.parent]
    if path.is_dir():
        for root, _, files in os.walk(path):
            dirs.append(Path(root))
            for name in files:
                _fsync(Path(root, name), os.O_RDONLY)
    else:
        _fsync(path, os.O_RDONLY)
    for d in dirs:
        _fsync(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a checkpoint (file or folder) if it exists."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def disk_usage(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted (warm cache)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dirty_mib() -> float:
    """System-wide Dirty + Writeback pages: what a 'save' left unflushed."""
    try:
        vals = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":")
                vals[k] = int(v.split()[0])
        return (vals.get("Dirty", 0) + vals.get("Writeback", 0)) / 1024
    except OSError:
        return float("nan")


def filesystem_of(path: Path) -> dict:
    """Mount point, device and type of the filesystem holding path (longest /proc/mounts match)."""
    path_s = str(path.resolve())
    best = {"mount": "", "device": "?", "fstype": "?"}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                inside = path_s == mnt or path_s.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best["mount"]):
                    best = {"mount": mnt, "device": dev, "fstype": fstype}
    except OSError:
        pass
    st = os.statvfs(path)
    best["free_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 1)
    return best


class FileBackedDetector:
    """Tells whether a tensor's memory is a file mapping (lazy mmap load) via /proc/self/maps."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.rows: list[tuple[int, int, bool]] = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    name = parts[5].strip() if len(parts) > 5 else ""
                    file_backed = name.startswith("/") and not name.startswith("/dev/zero")
                    self.starts.append(lo)
                    self.rows.append((lo, hi, file_backed))
        except OSError:
            pass

    def __call__(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        i = bisect.bisect_right(self.starts, ptr) - 1
        return i >= 0 and self.rows[i][0] <= ptr < self.rows[i][1] and self.rows[i][2]


def touch_if_lazy(result: Any) -> bool:
    """Fault in every page of mmap-backed tensors; True if any were lazy."""
    tensors = [t for t in flatten(result).values() if t.numel()]
    is_file = FileBackedDetector()
    lazy = [t for t in tensors if is_file(t)]
    for t in lazy:
        t.reshape(-1).view(torch.uint8)[::4096].sum()
    return bool(lazy)


# ----------------------------------------------------------------------------- tools
# A writer saves `state` at `path` (a file or a folder it creates).  A loader reads
# `path` back and returns a new state, or fills ctx.dest in place and returns None.


@functools.lru_cache(maxsize=1)
def raw_src_buffer() -> memoryview:
    """RAW_CHUNK random bytes: what raw writes write (incompressible, made once)."""
    return memoryview(np.random.default_rng(0).integers(0, 256, RAW_CHUNK, dtype=np.uint8))


@dataclass
class Ctx:
    state: dict
    dest: dict  # preallocated, same structure: the target of in-place loads
    raw_buf: np.ndarray  # preallocated target of the raw read
    nbytes: int
    raw_src: memoryview = field(default_factory=raw_src_buffer)  # made outside the timing


def write_fsync(path: Path, nbytes: int, src: memoryview) -> None:
    """os.write nbytes from RAW_CHUNK-sized src buffers into a new file, then os.fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, src[: min(left, RAW_CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_into(path: Path, buf: np.ndarray | memoryview, nbytes: int) -> None:
    """Read nbytes of path into a preallocated buffer, RAW_CHUNK at a time."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < nbytes:
            n = f.readinto(view[off : off + RAW_CHUNK])
            if not n:
                raise EOFError(f"{path}: short read at {off}")
            off += n


def raw_write(ctx: Ctx, path: Path) -> None:
    """Physical limit: sequential os.write of 64 MiB buffers, then os.fsync."""
    write_fsync(path, ctx.nbytes, ctx.raw_src)


def raw_read(ctx: Ctx, path: Path) -> None:
    """Physical limit: read the same bytes into a preallocated buffer."""
    read_into(path, ctx.raw_buf, ctx.nbytes)


def safeckpt_save(ctx: Ctx, path: Path) -> None:
    import safeckpt

    safeckpt.save(ctx.state, str(path))


def safeckpt_load(ctx: Ctx, path: Path) -> None:
    import safeckpt

    safeckpt.load(ctx.dest, str(path))


def safeckpt_load_state(ctx: Ctx, path: Path) -> dict:
    import safeckpt

    return safeckpt.load_state(str(path))


def torch_save(ctx: Ctx, path: Path) -> None:
    torch.save(ctx.state, path)


def torch_load(ctx: Ctx, path: Path) -> dict:
    return torch.load(path, weights_only=True)


def torch_load_mmap(ctx: Ctx, path: Path) -> dict:
    return torch.load(path, weights_only=True, mmap=True)


def safetensors_save(ctx: Ctx, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(flatten(ctx.state), path)


def safetensors_load(ctx: Ctx, path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def dcp_save(ctx: Ctx, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(ctx.state, checkpoint_id=str(path))  # FileSystemWriter(sync_files=True)


def dcp_load(ctx: Ctx, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(ctx.dest, checkpoint_id=str(path))


@dataclass
class Loader:
    name: str
    fn: Callable[[Ctx, Path], Any]
    in_place: bool


@dataclass
class Tool:
    name: str  # also the save op's name
    save: Callable[[Ctx, Path], None]
    suffix: str  # file name suffix of what save writes ("" = folder)
    self_fsync: str
    loaders: list[Loader] = field(default_factory=list)
    skip: str | None = None  # reason the tool is unavailable


def setup_dcp() -> str:
    """dcp runs without a process group in recent torch; else init a gloo group of 1."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d:
        try:
            dcp.save({"x": torch.zeros(2)}, checkpoint_id=d)
            return "no process group"
        except Exception:
            store = dist.FileStore(os.path.join(d, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            return "gloo group of 1 (FileStore)"


def make_tools(only: set[str] | None) -> list[Tool]:
    try:
        import safeckpt  # noqa: F401

        missing = [f for f in ("save", "load", "load_state") if not hasattr(safeckpt, f)]
        sk_skip = f"safeckpt lacks {missing}" if missing else None
    except Exception as e:  # still being written
        sk_skip = f"import safeckpt failed: {e!r}"
    try:
        import safetensors  # noqa: F401

        st_skip = None
    except ImportError:
        st_skip = "safetensors not installed"
    tools = [
        Tool("raw write+fsync", raw_write, ".bin", "yes",
             [Loader("raw read", raw_read, True)]),
        Tool("safeckpt.save", safeckpt_save, "", "yes (by design)",
             [Loader("safeckpt.load (in place)", safeckpt_load, True),
              Loader("safeckpt.load_state", safeckpt_load_state, False)], sk_skip),
        Tool("torch.save", torch_save, ".pt", "no, harness does",
             [Loader("torch.load", torch_load, False),
              Loader("torch.load(mmap=True)", torch_load_mmap, False)]),
        Tool("safetensors.save_file", safetensors_save, ".safetensors", "no, harness does",
             [Loader("safetensors.load_file", safetensors_load, False)], st_skip),
        Tool("dcp.save", dcp_save, "", "yes (sync_files)",
             [Loader("dcp.load (in place)", dcp_load, True)]),
    ]
    if only:
        tools = [t for t in tools if t.name.split(".")[0].split(" ")[0] in only or t.name.startswith("raw")]
    return tools


# ----------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "runs_s": times}



def proc_status() -> dict[str, int]:
    """Vm*/Rss* lines of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k.startswith(("Vm", "Rss")) and v.strip().endswith("kB"):
                out[k] = int(v.split()[0]) * 1024
    return out


def fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def cpu_snapshot() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children, wall)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def other_cpu_share(start: tuple[float, float, float]) -> float:
    """Share of the machine's CPU time that other processes used since ``start``:
    a busy neighbour makes every timing here unreliable."""
    end = cpu_snapshot()
    wall = end[2] - start[2]
    other = (end[0] - start[0]) - (end[1] - start[1])
    return round(max(0.0, other) / (wall * (os.cpu_count() or 1)), 3) if wall > 0 else 0.0


def source_fingerprint() -> str:
    """sha256 (12 hex) of safeckpt's .py files, to tie results to a version of the code."""
    import hashlib

    try:
        import safeckpt
    except Exception:
        return "unavailable"
    h = hashlib.sha256()
    root = Path(safeckpt.__file__).parent
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return f"{h.hexdigest()[:12]} ({root})"


def default_dir() -> Path:
    """A folder on the filesystem of the current directory (not /tmp, often tmpfs)."""
    return Path.cwd()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "host": platform.node()}
    for mod in ("safeckpt", "safetensors", "moto", "s3fs"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            out[mod] = "unavailable"
    return out


def busy_note(share: float) -> str:
    """How the report flags a run on a machine others were using."""
    return " — **the machine was busy: timings are skewed**" if share > 0.15 else ""


def median_of(rec: dict | None) -> float | None:
    return rec.get("median_s") if rec else None


def freeze_heap() -> None:
    """Move every object alive now out of the cyclic GC's reach (``gc.freeze``): the
    benchmarks call ``gc.collect()`` before each timing, which otherwise rescans torch's
    hundreds of thousands of objects each time (a third of a second on a busy machine)."""
    import gc

    gc.collect()
    gc.freeze()


def preflight(base, need_bytes: float) -> bool:
    """Warn when the target is memory or the machine is busy; False when the disk lacks
    the room a run needs (the caller then exits with status 2)."""
    fs = filesystem_of(base)
    if fs["fstype"] in ("tmpfs", "ramfs"):
        print(f"WARNING: {base} is on {fs['fstype']}: results measure memory, not a disk", file=sys.stderr)
    if fs["free_gib"] * 2**30 < need_bytes:
        print(f"not enough free space in {base}: {fs['free_gib']} GiB free, ~{need_bytes / 2**30:.1f} GiB needed",
              file=sys.stderr)
        return False
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) / 2:
        print(f"WARNING: load average {load:.1f} on {os.cpu_count()} CPUs: other work will "
              "skew the timings", file=sys.stderr)
    return True


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The hidden options ``launch_ranks`` passes to each rank's process."""
    p.add_argument("--_worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)


def parse_or_work(p: argparse.ArgumentParser, worker: Callable[[argparse.Namespace], None]) -> argparse.Namespace | None:
    """The options of a script whose ranks ``launch_ranks`` starts: in a rank's process
    (``--_worker``) run ``worker`` and return None, else return the options."""
    add_worker_args(p)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return None
    return args


def launch_ranks(script: Path, world: int, args: list[str], workdir: Path, timeout: float) -> dict:
    """Run ``script --_worker`` as ``world`` real processes (rank, world, port, ``--dir``
    and ``--out`` added to ``args``) and return the JSON rank 0 wrote, or ``{"error": ...}``."""
    import json
    import subprocess
    port = free_port()
    out = workdir.with_suffix(".json")
    workdir.mkdir()
    env = dict(os.environ)
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several processes per node
    cmd = [sys.executable, str(script), "--_worker", "--world", str(world), "--port", str(port), *args,
           "--dir", str(workdir), "--out", str(out)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            try:
                _, se = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                return {"world": world, "error": f"timed out after {timeout:.0f}s"}
            logs.append(se)
        if any(p.returncode for p in procs) or not out.exists():
            tail = next((s for s in logs if s.strip()), "")[-1500:]
            return {"world": world, "error": f"rc {[p.returncode for p in procs]}: {tail}"}
        return json.loads(out.read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        remove(workdir)
        out.unlink(missing_ok=True)


def bench_parser(doc: str, json_name: str, size_mib: int = 1024, count: tuple[str, int] = ("--n-small", 20000)):
    """The options every benchmark script shares: --quick, sizes, --repeat, --dir, --json."""
    import argparse
    from pathlib import Path
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--size-mib", type=int, default=size_mib)
    p.add_argument(count[0], type=int, default=count[1])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=HERE / "results" / json_name)
    return p


def run_and_report(args, run: Callable[[Path], dict], table: Callable[[dict], str]) -> int:
    """A benchmark script's end: ``run(workdir)`` in a fresh folder under ``--dir``
    (removed after), its table printed and its result written to ``--json``."""
    import json
    import tempfile
    from pathlib import Path
    base = (Path(args.dir) if args.dir else default_dir()).resolve()
    workdir = Path(tempfile.mkdtemp(prefix=".safeckpt-bench-", dir=base))
    try:
        res = run(workdir)
    finally:
        remove(workdir)
    print(table(res))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    return 0
