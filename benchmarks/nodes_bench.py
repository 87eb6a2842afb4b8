#!/usr/bin/env python
"""The local tier on several nodes, measured: 2 simulated nodes x 2 gloo ranks.

Every rank holds a row shard of one large matrix (``--mib`` in all). The same state is
saved ``--saves`` times by a manager writing straight to the durable root and by one
with a node-local folder per simulated node (``SAFECKPT_NODE_ID``), with and without
the peer replica; the durable root is a local folder and the moto S3 test server
(started here). Per save, the slowest rank's time blocked in ``save()`` and until the
checkpoint is committed in the durable root (``save()`` + ``wait()``); medians. Both
"disks" of one machine are the same disk, so the local tier's gain here is the durable
root's cost taken off the training loop, not an NVMe's speed.

Standalone: ``python benchmarks/nodes_bench.py [--mib 64] [--saves 3]``; ``run_all.py``
runs it as its ``nodes`` section (``run_nodes``, ``nodes_table``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORLD, PER_NODE = 4, 2
MODES = {"straight": {}, "node-local": {"local": True},
         "node-local + peer": {"local": True, "local_replicas": 1}}
ROOTS = ("local folder", "S3")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import safeckpt
    from safeckpt.protocol.shards import Shard

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    node = f"node{rank // PER_NODE}"
    os.environ["SAFECKPT_NODE_ID"] = node
    rows = args.mib * (1 << 20) // 4 // 1024
    mine = rows // WORLD
    state = {"w": Shard(torch.randn(mine, 1024), (mine * WORLD, 1024), (rank * mine, 0))}
    roots = json.loads(args.roots)
    out: dict = {}
    for where, (url, options) in roots.items():
        for name, mode in MODES.items():
            tag = f"{where}-{name}".replace(" ", "-").replace("+", "")
            kw = {"local_replicas": mode.get("local_replicas", 0)}
            if mode.get("local"):
                kw["local"] = f"{args.workdir}/{tag}-{node}"
            mgr = safeckpt.CheckpointManager(f"{url}/{tag}", keep_last=1, keep_local=1, storage_options=options,
                                             **kw)
            blocked, durable = [], []
            for step in range(args.saves):
                state["w"].local_tensor.add_(1)
                dist.barrier()
                t0 = time.perf_counter()
                mgr.save(step, state)
                t1 = time.perf_counter()
                mgr.wait()
                t2 = time.perf_counter()
                times: list = [None] * WORLD
                dist.all_gather_object(times, (t1 - t0, t2 - t0))
                blocked.append(max(t[0] for t in times))
                durable.append(max(t[1] for t in times))
            mgr.close()
            dist.barrier()
            if rank == 0:  # room for the next mode (1 GiB per copy)
                if not safeckpt.verify(f"{url}/{tag}/step-{args.saves - 1:09d}", storage_options=options).ok:
                    raise RuntimeError(f"{where}, {name}: the durable copy does not verify")
                _remove(url, tag, options)
            if mode.get("local") and rank % PER_NODE == 0:
                shutil.rmtree(kw["local"], ignore_errors=True)
            dist.barrier()
            out.setdefault(where, {})[name] = {"blocked_s": statistics.median(blocked),
                                               "durable_s": statistics.median(durable)}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()


def _remove(url: str, tag: str, options: dict) -> None:
    if url.startswith("s3://"):
        import s3fs
        s3fs.S3FileSystem(skip_instance_cache=True, **options).rm(f"{url}/{tag}", recursive=True)
    else:
        shutil.rmtree(f"{url}/{tag}", ignore_errors=True)


def run_nodes(mib: int, saves: int, workdir: Path) -> dict:
    """Every mode on both durable roots; ``{root: {mode: {blocked_s, durable_s}}}``."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        return {"error": f"skipped: {e} (pip install 'safeckpt[dev]')"}
    from s3_bench import BUCKET, MotoServer

    work = Path(tempfile.mkdtemp(prefix="nodes-", dir=workdir))
    try:
        with MotoServer(work / "moto.log") as srv:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = work / "result.json"
            roots = {"local folder": (str(work / "durable"), {}), "S3": (f"s3://{BUCKET}/nodes", srv.options)}
            cmd = [sys.executable, __file__, "--worker", "--mib", str(mib), "--saves", str(saves),
                   "--roots", json.dumps(roots), "--workdir", str(work), "--out", str(out)]
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
                   "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
            t0 = time.monotonic()
            procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in range(WORLD)]
            codes = [p.wait(timeout=1800) for p in procs]
            if any(codes):
                return {"error": f"a rank failed (exit codes {codes})"}
            return {"mib": mib, "saves": saves, "seconds": time.monotonic() - t0, "roots": json.loads(out.read_text())}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def nodes_table(res: dict) -> str:
    if "error" in res:
        return f"### several nodes: {res['error']}\n"
    lines = [f"### several nodes ({WORLD // PER_NODE} simulated nodes x {PER_NODE} gloo ranks, {res['mib']} MiB, "
             f"median of {res['saves']} saves, slowest rank)", "",
             "| durable root | mode | training blocked | × straight | durable after | × straight |",
             "|---|---|---:|---:|---:|---:|"]
    for where, modes in res["roots"].items():
        straight = modes["straight"]
        for name, r in modes.items():
            lines.append(f"| {where} | {name} | {r['blocked_s']:.3f} s | {r['blocked_s'] / straight['blocked_s']:.2f} "
                         f"| {r['durable_s']:.3f} s | {r['durable_s'] / straight['durable_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--roots"), p.add_argument("--workdir"), p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    res = run_nodes(args.mib, args.saves, Path(tempfile.gettempdir()))
    print(nodes_table(res))
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
