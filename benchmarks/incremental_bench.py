#!/usr/bin/env python
"""Incremental checkpoints and the local tier, measured.

incremental: a model whose parameters are 90% frozen (a base) and 10% trained (adapters
  that change every step) is saved ``saves`` times, each save to a new step folder, by
  ``CheckpointManager`` with full saves and with ``incremental=True``, and, for
  reference, by torch.save, safetensors and DCP (each fsync'd, as in save_load.py).
  Reported per tool: bytes written per save after the first, and median seconds per
  save. Then the cost of hashing when nothing can be shared: every tensor changes
  before every save; incremental vs full, median seconds per save.
tiered: the same state saved ``saves`` times by a manager writing straight to the S3 test
  server (moto, started here) and by one with ``local=`` a folder on this disk: how long
  ``save()`` blocks the training loop, and how long until the checkpoint is committed
  in the bucket (``save()`` + ``wait()``); also tiered + ``async_save``.

Standalone: ``python benchmarks/incremental_bench.py [--quick]``; ``run_all.py`` runs it
as its "incremental" and "tiered" sections.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Ctx, MiB, bench_parser, default_dir, disk_usage, flatten,  # noqa: E402
                    fsync_tree, make_large_state, make_tools, remove, setup_dcp, state_nbytes)
from safeckpt.protocol.incremental import CHUNK_SIZE, digest_pieces  # noqa: E402

FROZEN_SHARE = 0.9


def make_adapter_state(total_mib: int, n: int) -> dict:
    """90% frozen base weights, 10% adapters (the part training changes)."""
    return {"base": make_large_state(max(1, int(total_mib * FROZEN_SHARE)), n, seed=11),
            "adapters": make_large_state(max(1, int(total_mib * (1 - FROZEN_SHARE))), max(1, n // 4), seed=12)}


def train_step(state: dict, everything: bool = False) -> None:
    """Change the adapters (or, with ``everything``, every tensor) in place."""
    for t in flatten(state["adapters"] if not everything else state).values():
        t.add_(1.0)


def _peer(tool: Any, ctx: Ctx) -> Callable[[Path], int]:
    def save(path: Path) -> int:
        tool.save(ctx, path)
        if tool.self_fsync != "yes" and not tool.self_fsync.startswith("yes"):
            fsync_tree(path)
        return disk_usage(path)
    return save


def _manager(root: Path, **options: Any) -> Callable[[int, dict], Any]:
    import safeckpt

    mgr = safeckpt.CheckpointManager(root, **options)
    return lambda step, state: mgr.save(step, state)


def run_incremental(total_mib: int, n: int, saves: int, workdir: Path) -> dict:
    """Bytes written and seconds per save of each tool (see the module docstring)."""
    setup_dcp()
    state = make_adapter_state(total_mib, n)
    out: dict = {"state_bytes": state_nbytes(state), "saves": saves, "frozen_share": FROZEN_SHARE, "tools": {}}
    ctx = Ctx(state, {}, None, state_nbytes(state))  # type: ignore[arg-type]
    peers = {t.name: _peer(t, ctx) for t in make_tools(None)
             if t.name in ("torch.save", "safetensors.save_file", "dcp.save") and not t.skip}
    modes: dict[str, Callable[[Path], Callable[[int, dict], Any]]] = {
        "safeckpt full saves": lambda root: _manager(root, keep_last=2),
        "safeckpt incremental": lambda root: _manager(root, keep_last=2, incremental=True),
    }
    names = list(modes) + list(peers)
    roots = {name: workdir / f"inc-{name.replace(' ', '-')}" for name in names}
    savers = {name: modes[name](roots[name]) for name in modes}
    times: dict[str, list[float]] = {name: [] for name in names}
    written: dict[str, list[int]] = {name: [] for name in names}
    for step in range(saves):  # the tools take turns, so drift in the disk's speed hits all alike
        train_step(state)
        for name in names:
            roots[name].mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            nbytes = savers[name](step, state).bytes if name in savers else peers[name](roots[name] / f"step-{step}")
            times[name].append(time.perf_counter() - t0)
            written[name].append(nbytes)
            if name in peers and step:
                remove(roots[name] / f"step-{step - 1}")  # the peers keep one, safeckpt keep_last=2
    for name in names:
        out["tools"][name] = {"first_bytes": written[name][0],
                              "later_bytes": statistics.median(written[name][1:] or written[name]),
                              "total_bytes": sum(written[name]),
                              "median_s": statistics.median(times[name][1:] or times[name]),
                              "first_s": times[name][0]}
        shutil.rmtree(roots[name], ignore_errors=True)
        print(f"  [incremental] {name}: {out['tools'][name]['median_s']:.3f} s/save", file=sys.stderr, flush=True)
    out["nothing_shared"] = _hash_overhead(state, saves, workdir)
    return out


def _hash_overhead(state: dict, saves: int, workdir: Path) -> dict:
    """Every tensor changes before every save: incremental pays hashing, shares nothing.
    The two modes alternate so that drift in the disk's speed hits both alike."""
    roots = {m: workdir / f"nothing-shared-{m}" for m in ("full", "incremental")}
    savers = {"full": _manager(roots["full"]), "incremental": _manager(roots["incremental"], incremental=True)}
    times: dict[str, list[float]] = {m: [] for m in savers}
    for step in range(max(saves, 4)):
        for mode, saver in savers.items():
            train_step(state, everything=True)
            t0 = time.perf_counter()
            saver(step, state)
            times[mode].append(time.perf_counter() - t0)
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    full, inc = statistics.median(times["full"][1:]), statistics.median(times["incremental"][1:])
    # the disk's speed drifts more than hashing costs: also time the hashing alone
    pieces = [(name, t, (0,) * t.dim()) for name, t in flatten(state).items()]
    hashing = min(_timed(lambda: digest_pieces(pieces, CHUNK_SIZE)) for _ in range(3))
    return {"full_s": full, "incremental_s": inc, "overhead": inc / full - 1, "hash_s": hashing,
            "hash_share": hashing / full}


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_tiered(total_mib: int, n: int, saves: int, workdir: Path) -> dict:
    """Blocked time and time to durability: straight to S3 vs local tier + replication."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        return {"error": f"skipped: {e} (pip install 'safeckpt[dev]')"}
    state = make_large_state(total_mib, n, seed=13)
    out: dict = {"state_bytes": state_nbytes(state), "saves": saves, "modes": {}}
    try:
        _tiered_modes(state, saves, workdir, out["modes"])
    except Exception as e:  # reported in the results; run_all counts it as an error
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _tiered_modes(state: dict, saves: int, workdir: Path, out: dict) -> None:
    import safeckpt
    from s3_bench import BUCKET, MotoServer

    with MotoServer(workdir / "moto-tiered.log") as srv:
        modes = {
            "straight to S3": {},
            "local tier + S3": {"local": str(workdir / "tier-local")},
            "local tier + S3, async": {"local": str(workdir / "tier-local-async"), "async_save": True},
        }
        for name, options in modes.items():
            root = f"s3://{BUCKET}/{name.replace(' ', '-').replace(',', '')}"
            mgr = safeckpt.CheckpointManager(root, keep_last=2, storage_options=srv.options, **options)
            blocked, durable = [], []
            for step in range(saves):
                train_step({"adapters": state})
                t0 = time.perf_counter()
                mgr.save(step, state)
                blocked.append(time.perf_counter() - t0)
                mgr.wait()
                durable.append(time.perf_counter() - t0)
            mgr.close()
            if not safeckpt.verify(f"{root}/step-{saves - 1:09d}", storage_options=srv.options).ok:
                raise RuntimeError(f"{name}: the durable copy does not verify")
            out[name] = {"blocked_s": statistics.median(blocked), "durable_s": statistics.median(durable)}
            print(f"  [tiered] {name}: blocked {statistics.median(blocked):.3f} s, durable after "
                  f"{statistics.median(durable):.3f} s", file=sys.stderr, flush=True)


def incremental_table(res: dict) -> str:
    tools = res["tools"]
    full = tools.get("safeckpt full saves", {})
    lines = [f"### incremental saves: {res['state_bytes'] / MiB:,.0f} MiB state, {res['frozen_share']:.0%} frozen, "
             f"{res['saves']} saves", "",
             "| tool | bytes written per save (after the first) | × full save | s per save | × full save |",
             "|---|---:|---:|---:|---:|"]
    for name, r in tools.items():
        lines.append(f"| {name} | {r['later_bytes'] / MiB:,.1f} MiB | {r['later_bytes'] / full['later_bytes']:.2f} | "
                     f"{r['median_s']:.3f} | {r['median_s'] / full['median_s']:.2f} |")
    h = res["nothing_shared"]
    lines += ["", f"Nothing shared (every tensor changes): full {h['full_s']:.3f} s, incremental "
              f"{h['incremental_s']:.3f} s per save ({h['overhead']:+.1%}); hashing alone takes "
              f"{h['hash_s']:.3f} s = **{h['hash_share']:.1%}** of a full save.", ""]
    return "\n".join(lines)


def tiered_table(res: dict) -> str:
    if res.get("error"):
        return f"### local tier + S3: {res['error']}\n"
    direct = res["modes"]["straight to S3"]
    lines = [f"### local tier vs straight to S3 (moto test server): {res['state_bytes'] / MiB:,.0f} MiB, "
             f"{res['saves']} saves", "",
             "| mode | training blocked (s) | × straight | committed in the bucket after (s) | × straight |",
             "|---|---:|---:|---:|---:|"]
    for name, r in res["modes"].items():
        lines.append(f"| {name} | {r['blocked_s']:.3f} | {r['blocked_s'] / direct['blocked_s']:.2f} | "
                     f"{r['durable_s']:.3f} | {r['durable_s'] / direct['durable_s']:.2f} |")
    return "\n".join(lines + [""])


def main() -> int:
    p = bench_parser(__doc__, "incremental.json", size_mib=512, count=("--n", 40))
    p.add_argument("--saves", type=int, default=10)
    args = p.parse_args()
    size, saves = (16, 3) if args.quick else (args.size_mib, args.saves)
    workdir = (args.dir or default_dir()).resolve() / ".safeckpt-incremental-bench"
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        res = {"incremental": run_incremental(size, args.n, saves, workdir),
               "tiered": run_tiered(max(8, size // 4), args.n, saves, workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(incremental_table(res["incremental"]))
    print(tiered_table(res["tiered"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
