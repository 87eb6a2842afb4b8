#!/usr/bin/env python
"""Save/load on the S3 test server: moto in server mode, started here on 127.0.0.1.

moto keeps objects in its own (Python) process, so its GB/s is the test server's, not
AWS's: compare the tools with each other and with the server's own limit, never with
the local disk. Per repeat:
* ``s3fs put`` / ``s3fs get``: one object of the same bytes uploaded from and downloaded
  to a local file through s3fs (the server's limit as s3fs reaches it);
* ``safeckpt.save``/``safeckpt.load`` (in place) straight to/from ``s3://``;
* the common workaround: ``torch.save`` to a local file, then upload it with s3fs
  (and back: download with s3fs, then ``torch.load``).

Standalone: ``python benchmarks/s3_bench.py [--quick]``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (bench_parser, MiB, check_equal, empty_like_state, flatten,  # noqa: E402
                    free_port, make_large_state, run_and_report, state_nbytes, summary, write_fsync, raw_src_buffer)

KEY, SECRET = "bench", "bench-secret"
BUCKET = "safeckpt-bench"


class MotoServer:
    """``python -m moto.server -H 127.0.0.1 -p PORT`` for the duration of a with-block."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET}

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options)

    def __enter__(self) -> "MotoServer":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited with {self.proc.returncode}: {self.log.read_text()[-1500:]}")
            try:
                self.fs().call_s3("create_bucket", Bucket=BUCKET)
                return self
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"moto did not start in 60 s: {last!r}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def run_s3(size_mib: int, n_large: int, repeat: int, workdir: Path, verify: bool = True) -> dict:
    """Times of each op on moto (see the module docstring)."""
    try:
        import s3fs  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        return {"error": f"skipped: {e} (pip install 'safeckpt[dev]')"}
    import safeckpt

    state = make_large_state(size_mib, n_large, seed=5)
    nbytes = state_nbytes(state)
    dest = empty_like_state(state)
    src = raw_src_buffer()
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    with MotoServer(workdir / "moto.log") as srv:
        fs = srv.fs()
        opts = srv.options
        local_raw = workdir / "s3-raw.bin"
        write_fsync(local_raw, nbytes, src)

        def op(name: str, fn) -> None:
            if name in errors:
                return
            try:
                t0 = time.perf_counter()
                fn()
                times.setdefault(name, []).append(time.perf_counter() - t0)
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()

        for r in range(repeat):
            pt_local = workdir / f"s3-{r}.pt"
            pt_back = workdir / f"s3-{r}-back.pt"
            url = f"s3://{BUCKET}/sk-{r}"
            op("s3fs put (raw bytes)", lambda: fs.put_file(str(local_raw), f"{BUCKET}/raw-{r}"))
            op("s3fs get (raw bytes)", lambda: fs.get_file(f"{BUCKET}/raw-{r}", str(workdir / "s3-raw-back.bin")))
            (workdir / "s3-raw-back.bin").unlink(missing_ok=True)
            op("safeckpt.save", lambda: safeckpt.save(state, url, storage_options=opts))
            for t in flatten(dest).values():
                t.zero_()
            op("safeckpt.load (in place)", lambda: safeckpt.load(dest, url, storage_options=opts))
            if verify and "safeckpt.load (in place)" not in errors:
                check_equal(state, dest)

            def torch_up() -> None:
                torch.save(state, pt_local)
                fs.put_file(str(pt_local), f"{BUCKET}/pt-{r}.pt")

            got: dict = {}

            def torch_down() -> None:
                fs.get_file(f"{BUCKET}/pt-{r}.pt", str(pt_back))
                got["v"] = torch.load(pt_back, weights_only=True)

            op("torch.save + s3fs put", torch_up)
            op("s3fs get + torch.load", torch_down)
            if verify and "v" in got:
                check_equal(state, got["v"])
            got.clear()
            for p in (pt_local, pt_back):
                p.unlink(missing_ok=True)
            try:
                for key in fs.find(f"{BUCKET}/"):
                    fs.rm_file(key)
            except Exception:  # noqa: BLE001 - moto memory only
                pass
            print(f"  [s3 r{r + 1}/{repeat}] done", file=sys.stderr, flush=True)
        local_raw.unlink(missing_ok=True)
    return {"bytes": nbytes, "n_tensors": len(flatten(state)), "ops": {k: summary(v) for k, v in times.items()},
            "errors": errors, "server": "moto (server mode, in memory, 127.0.0.1)"}


S3_ROWS = [("save", "s3fs put (raw bytes)", "safeckpt.save", "torch.save + s3fs put"),
           ("load", "s3fs get (raw bytes)", "safeckpt.load (in place)", "s3fs get + torch.load")]


def s3_table(res: dict) -> str:
    if "error" in res:
        return f"### S3 (moto)\n\n{res['error']}\n"
    ops, nbytes = res["ops"], res["bytes"]
    lines = [f"### S3 test server ({res['server']}): {res['n_tensors']} tensors, {nbytes / MiB:,.0f} MiB", "",
             "| op | median s | min–max s | GB/s | × s3fs raw | safeckpt / peer (time) |",
             "|---|---:|---:|---:|---:|---:|"]
    for _, raw, mine, peer in S3_ROWS:
        for name in (raw, mine, peer):
            if name not in ops:
                lines.append(f"| {name} | ERROR: {res['errors'].get(name, 'not run')[:200]} | | | | |")
                continue
            s = ops[name]
            ratio = f"{ops[raw]['median_s'] / s['median_s']:.2f}" if raw in ops else "–"
            vs = f"{s['median_s'] / ops[peer]['median_s']:.2f}" if name == mine and peer in ops else ""
            lines.append(f"| {name} | {s['median_s']:.3f} | {s['min_s']:.3f}–{s['max_s']:.3f} | "
                         f"{nbytes / s['median_s'] / 1e9:.2f} | {ratio} | {vs} |")
    lines += ["", "× s3fs raw = throughput / throughput of s3fs moving one object of the same bytes; the peer "
              "of safeckpt.save is torch.save to a local file + upload, of safeckpt.load download + torch.load.", ""]
    return "\n".join(lines)


def main() -> int:
    p = bench_parser(__doc__, "s3.json", size_mib=256, count=("--n-large", 50))
    args = p.parse_args()
    if args.quick:
        args.size_mib, args.repeat = 8, 1
    return run_and_report(args, lambda workdir: run_s3(args.size_mib, args.n_large, args.repeat, workdir), s3_table)


if __name__ == "__main__":
    sys.exit(main())
