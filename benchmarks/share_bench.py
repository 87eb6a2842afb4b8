#!/usr/bin/env python
"""Loads of a replicated state (DDP: every rank holds every tensor) on 1, 2 and 4 ranks
(gloo, real processes), from a local folder and from the S3 test server (moto, started
here): the bytes all ranks together read from storage, and the time, side by side:

* ``safeckpt.load, shared``: ``share_reads="job"`` -- each saved byte read from storage
  once by one of the ranks, checked there and sent to the others (``protocol/exchange``);
* ``safeckpt.load, not shared``: ``share_reads="off"``, every rank reads every byte (the
  path before sharing; also what ``"auto"`` does on one node's local files, whose page
  cache already reads them once);
* ``dcp.load``: torch.distributed.checkpoint's ``FileSystemReader`` (``FsspecReader``
  on S3) of the same state saved by ``dcp.save``.

Bytes are what the storage layer was asked for (a counting storage under safeckpt, a
counting stream under DCP's readers), summed over the ranks. Loads are timed from a
barrier to a barrier after one untimed round of every load (the first load of a process
also creates its S3 client, imports and threads), the page cache dropped before local
loads when permitted, and checked against the saved state (the untimed round).

Standalone: ``python benchmarks/share_bench.py [--quick] [--ranks 1,2,4] [--size-mib 256]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MiB, bench_parser, check_equal, drop_page_cache, empty_like_state,  # noqa: E402
                    flatten, launch_ranks, make_large_state, parse_or_work, run_and_report, state_nbytes,
                    summary)

OPS = ["safeckpt.load, shared", "safeckpt.load, not shared", "dcp.load"]
MODES = {"safeckpt.load, shared": "job", "safeckpt.load, not shared": "off"}


class Counter:
    """Bytes read through the wrappers below, in this process."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.n += n


def counting_storage(inner, counter: Counter):
    from safeckpt.storage import StorageWrapper

    class Counted(StorageWrapper):
        def read_into(self, name: str, offset: int, out: memoryview) -> None:
            self.inner.read_into(name, offset, out)
            counter.add(len(out))
    return Counted(inner)


class CountedStream:
    """A file object whose reads are counted (DCP's readers read through it)."""

    def __init__(self, inner, counter: Counter) -> None:
        self._inner, self._counter = inner, counter

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        self._counter.add(len(data))
        return data

    def readinto(self, buf) -> int:
        n = self._inner.readinto(buf)
        self._counter.add(n or 0)
        return n

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def counted_reader(reader, counter: Counter):
    """DCP's reader with every stream it opens counted."""
    make = reader.fs.create_stream

    @contextlib.contextmanager
    def create_stream(path, mode):
        with make(path, mode) as stream:
            yield CountedStream(stream, counter)
    reader.fs.create_stream = create_stream
    return reader


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    import safeckpt
    import torch.distributed.checkpoint as dcp
    from safeckpt.storage import open as open_storage

    s3 = json.loads(args.s3) if args.s3 else None
    opts = {k: s3[k] for k in ("endpoint_url", "key", "secret")} if s3 else {}
    base = f"s3://{s3['bucket']}/share-{world}" if s3 else str(Path(args.dir))
    state = make_large_state(args.size_mib, args.n_large, seed=7)
    dest = empty_like_state(state)
    sk, dc = f"{base}/sk", f"{base}/dcp"
    safeckpt.save(state, sk, storage_options=opts)
    if s3:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        dcp.save(state, storage_writer=FsspecWriter(dc, **opts))
        reader = lambda: FsspecReader(dc, **opts)  # noqa: E731
    else:
        dcp.save(state, checkpoint_id=dc)
        reader = lambda: dcp.FileSystemReader(dc)  # noqa: E731

    def load(op: str, counter: Counter) -> None:
        if op in MODES:
            storage = counting_storage(open_storage(sk, **opts), counter)
            safeckpt.load(dest, storage, share_reads=MODES[op])
        else:
            dcp.load(dest, storage_reader=counted_reader(reader(), counter))

    out: dict = {op: {"times": [], "bytes": [], "errors": []} for op in OPS}
    for r in range(args.repeat + 1):  # round 0 warms up (imports, S3 clients, thread pools): not timed
        for op in OPS:
            for t in flatten(dest).values():
                t.zero_()
            if rank == 0 and not s3:
                drop_page_cache()
            counter = Counter()
            dist.barrier()
            t0 = time.perf_counter()
            error = None
            try:
                load(op, counter)
            except Exception as e:  # noqa: BLE001 - every rank still reaches the barrier
                error = f"rank {rank}: {type(e).__name__}: {e}"
            dist.barrier()
            seconds = time.perf_counter() - t0
            if error is None and not r:
                try:
                    check_equal(state, dest)
                except AssertionError as e:
                    error = f"rank {rank}: {e}"
            got = [None] * world
            dist.all_gather_object(got, (counter.n, error))
            rec = out[op]
            rec["errors"] += [e for _, e in got if e]
            if r:
                rec["times"].append(seconds)
                rec["bytes"].append(sum(n for n, _ in got))
    if rank == 0:
        res = {"world": world, "state_bytes": state_nbytes(state), "tensors": len(flatten(state)),
               "where": "S3 test server (moto)" if s3 else "local folder", "ops": {}}
        for op, rec in out.items():
            res["ops"][op] = {**summary(rec["times"]), "bytes": min(rec["bytes"]), "errors": rec["errors"]}
        Path(args.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def run_share(worlds: list[int], size_mib: int, n_large: int, repeat: int, workdir: Path, s3_mib: int | None,
              timeout: float = 1200) -> dict:
    """Every world size on the local folder, then on the S3 test server (``s3_mib``; None: not)."""
    script = Path(__file__).resolve()
    common = ["--n-large", str(n_large), "--repeat", str(repeat)]
    res: dict = {"local": {}, "s3": {}}
    for w in worlds:
        print(f"  [share] local, {w} rank(s)", file=sys.stderr, flush=True)
        res["local"][str(w)] = launch_ranks(script, w, ["--size-mib", str(size_mib), *common],
                                            workdir / f"share-{w}", timeout)
    if s3_mib:
        try:
            import moto.server  # noqa: F401
            import s3fs  # noqa: F401
        except ImportError as e:
            res["s3"] = {"error": f"skipped: {e}"}
            return res
        from s3_bench import BUCKET, MotoServer

        with MotoServer(workdir / "moto.log") as srv:
            spec = json.dumps({**srv.options, "bucket": BUCKET})
            for w in worlds:
                print(f"  [share] S3, {w} rank(s)", file=sys.stderr, flush=True)
                res["s3"][str(w)] = launch_ranks(script, w, ["--size-mib", str(s3_mib), "--s3", spec, *common],
                                                 workdir / f"share-s3-{w}", timeout)
    return res


def share_table(res: dict) -> str:
    lines = ["### replicated loads on N ranks: bytes read from storage and time", "",
             "| storage | ranks | MiB | load | bytes read (all ranks) | × checkpoint | median s | min–max s | "
             "× not shared (time) | × dcp.load (time) |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for where, worlds in res.items():
        if "error" in worlds:
            lines.append(f"| {where} | | | {worlds['error']} | | | | | | |")
            continue
        for w, r in worlds.items():
            if "error" in r:
                lines.append(f"| {where} | {w} | | ERROR: {r['error'][:200]} | | | | | | |")
                continue
            ops, nbytes = r["ops"], r["state_bytes"]
            for op in OPS:
                s = ops.get(op)
                if s is None or s["errors"] or "median_s" not in s:
                    lines.append(f"| {where} | {w} | | {op}: ERROR {(s or {}).get('errors', ['not run'])[:1]} "
                                 "| | | | | | |")
                    continue
                ratios = [_ratio(s, ops.get(peer)) for peer in ("safeckpt.load, not shared", "dcp.load")]
                lines.append(
                    f"| {r['where']} | {w} | {nbytes / MiB:,.0f} | {op} | {s['bytes'] / MiB:,.0f} MiB | "
                    f"{s['bytes'] / nbytes:.2f} | {s['median_s']:.2f} | {s['min_s']:.2f}–{s['max_s']:.2f} | "
                    f"{ratios[0]} | {ratios[1]} |")
    lines += ["", "× checkpoint = bytes all ranks read from storage ÷ the state's bytes (headers and "
              "metadata make it a little over 1); time ratios below 1 are faster.", ""]
    return "\n".join(lines)


def _ratio(mine: dict, peer: dict | None) -> str:
    return f"{mine['median_s'] / peer['median_s']:.2f}" if peer and "median_s" in peer else ""


def share_figures(res: dict) -> dict:
    """The targets' inputs: bytes read ÷ checkpoint of the shared load on the most ranks,
    and on S3 its time ÷ the load without sharing."""
    out: dict = {}
    for where, worlds in res.items():
        runs = {int(w): r for w, r in worlds.items() if isinstance(r, dict) and "ops" in r}
        if not runs:
            continue
        w = max(runs)
        ops = runs[w]["ops"]
        shared, off = ops.get("safeckpt.load, shared", {}), ops.get("safeckpt.load, not shared", {})
        if "median_s" in shared:
            out[where] = {"ranks": w, "bytes_x": shared["bytes"] / runs[w]["state_bytes"],
                          "time_x": shared["median_s"] / off["median_s"] if "median_s" in off else None,
                          "time_x_best": shared["min_s"] / off["min_s"] if "min_s" in off else None}
    return out


def main() -> int:
    p = bench_parser(__doc__, "share.json", size_mib=256, count=("--n-large", 50))
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--s3-mib", type=int, default=128, help="state size on the S3 test server (0: skip S3)")
    p.add_argument("--s3", default=None, help=argparse.SUPPRESS)  # the worker's server spec
    args = parse_or_work(p, worker)
    if args is None:
        return 0
    if args.quick:
        args.size_mib, args.s3_mib, args.repeat, args.ranks = 16, 8, 1, "2"
    worlds = [int(x) for x in args.ranks.split(",")]
    return run_and_report(args, lambda workdir: run_share(worlds, args.size_mib, args.n_large, args.repeat, workdir,
                                                          args.s3_mib or None), share_table)


if __name__ == "__main__":
    sys.exit(main())
