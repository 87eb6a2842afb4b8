#!/usr/bin/env python
"""The local tier on several nodes, measured: 2 simulated nodes x 2 gloo ranks.

Every rank holds a row shard of one large matrix (``--mib`` in all). The same state is
saved ``--saves`` times by a manager writing straight to the durable root (the moto S3
test server, started here) and by one with a node-local folder per simulated node
(``SAFECKPT_NODE_ID``), with and without the peer replica. Per save, the slowest rank's
time blocked in ``save()`` and until the checkpoint is committed in the bucket
(``save()`` + ``wait()``); medians. Both "disks" of one machine are the same disk, so
the local tier's gain here is the object store's latency, not an NVMe's speed.

Standalone: ``python benchmarks/nodes_bench.py [--mib 64] [--saves 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORLD, PER_NODE = 4, 2
MODES = {"straight to S3": {}, "node-local + S3": {"local": True},
         "node-local + peer + S3": {"local": True, "local_replicas": 1}}


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
    options = json.loads(args.options)
    out = {}
    for name, mode in MODES.items():
        tag = name.replace(" ", "-").replace("+", "")
        kw = {"local_replicas": mode.get("local_replicas", 0)}
        if mode.get("local"):
            kw["local"] = f"{args.workdir}/{tag}-{node}"
        mgr = safeckpt.CheckpointManager(f"{args.root}/{tag}", keep_last=2, storage_options=options, **kw)
        blocked, durable = [], []
        for step in range(args.saves):
            state["w"].local_tensor.add_(1)
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(step, state)
            t1 = time.perf_counter()
            mgr.wait()
            t2 = time.perf_counter()
            times = [None] * WORLD
            dist.all_gather_object(times, (t1 - t0, t2 - t0))
            blocked.append(max(t[0] for t in times))
            durable.append(max(t[1] for t in times))
        mgr.close()
        out[name] = {"blocked_s": statistics.median(blocked), "durable_s": statistics.median(durable)}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--root"), p.add_argument("--options"), p.add_argument("--workdir"), p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    from s3_bench import BUCKET, MotoServer
    with tempfile.TemporaryDirectory() as tmp, MotoServer(Path(tmp) / "moto.log") as srv:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--mib", str(args.mib), "--saves", str(args.saves),
               "--root", f"s3://{BUCKET}/nodes", "--options", json.dumps(srv.options), "--workdir", tmp,
               "--out", str(out)]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
               "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in range(WORLD)]
        if any(p.wait(timeout=900) for p in procs):
            return 1
        res = json.loads(out.read_text())
    straight = res["straight to S3"]
    print(f"| mode ({WORLD // PER_NODE} nodes x {PER_NODE} ranks, {args.mib} MiB, moto S3) | training blocked "
          "| x straight | committed in the bucket after | x straight |\n|---|---:|---:|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['blocked_s']:.3f} s | {r['blocked_s'] / straight['blocked_s']:.2f} | "
              f"{r['durable_s']:.3f} s | {r['durable_s'] / straight['durable_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
