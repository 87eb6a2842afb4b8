#!/usr/bin/env python
"""Where a safeckpt operation spends its time: cProfile of one op on a benchmark state.

    python benchmarks/profile_ops.py save-small          # safeckpt.save of 20,000 small tensors
    python benchmarks/profile_ops.py load-small          # safeckpt.load (in place) of them
    python benchmarks/profile_ops.py async-small         # async_save: the caller's part AND the
                                                         # background thread's part, profiled apart
    python benchmarks/profile_ops.py save-large --size-mib 1024

States as in the suite (``large``: 50 fp32 tensors of --size-mib in total, ``small``:
--n-small optimizer-like tensors). The op runs once untimed (warm-up; for async this
allocates the staging buffers), then --repeat times under the profiler. Prints the top
functions by own time and by cumulative time; also written to
benchmarks/results/profile-OP.txt. For the GIL question (which thread holds it), run the
same op under ``py-spy record --gil`` as well: ``--spin`` keeps a CPU-bound loop busy on
the main thread while an async save runs, as in the suite.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (HERE, default_dir, empty_like_state, make_large_state, make_small_state,  # noqa: E402
                    remove)


def stats_text(prof: cProfile.Profile, title: str, top: int) -> str:
    out = io.StringIO()
    out.write(f"===== {title}\n")
    for key in ("tottime", "cumulative"):
        out.write(f"--- sorted by {key}\n")
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(top)
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=[f"{o}-{s}" for o in ("save", "load", "async") for s in ("small", "large")])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--n-small", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--spin", action="store_true", help="async: spin a Python loop on the main thread meanwhile")
    p.add_argument("--gil", action="store_true",
                   help="async: instead of cProfile, sample with py-spy (--gil --threads) which thread holds "
                        "the GIL while the main thread spins (needs py-spy: pip install py-spy)")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--_no-profile", dest="no_profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gil:
        return gil_share(args)
    import safeckpt
    import safeckpt.run.asyncsave as asyncsave

    kind, which = args.op.split("-")
    state = make_small_state(args.n_small, 8) if which == "small" else make_large_state(args.size_mib, 50)
    base = (args.dir or default_dir()).resolve()
    work = Path(tempfile.mkdtemp(prefix=".safeckpt-bench-", dir=base))
    texts = []
    try:
        if kind in ("save", "load"):
            safeckpt.save(state, str(work / "warm"))
            dest = empty_like_state(state)
            if kind == "load":
                safeckpt.load(dest, str(work / "warm"))
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            for r in range(args.repeat):
                if kind == "save":
                    path = work / f"p{r}"
                    prof.enable()
                    safeckpt.save(state, str(path))
                    prof.disable()
                    remove(path)
                else:
                    prof.enable()
                    safeckpt.load(dest, str(work / "warm"))
                    prof.disable()
            texts.append(stats_text(prof, f"{args.op}: {args.repeat} run(s), {time.perf_counter() - t0:.2f} s wall",
                                    args.top))
        else:
            bg = cProfile.Profile()
            real_run = asyncsave.AsyncSaver._run

            def profiled_run(self, *a, **kw):  # the background thread, under its own profiler
                if getattr(self, "_profile", False) and not args.no_profile:
                    bg.enable()
                    try:
                        return real_run(self, *a, **kw)
                    finally:
                        bg.disable()
                return real_run(self, *a, **kw)

            asyncsave.AsyncSaver._run = profiled_run
            safeckpt.async_save(state, str(work / "warm")).result()  # allocates the staging buffers
            asyncsave._default._profile = True
            fg = cProfile.Profile()
            blocked, total = [], []
            for r in range(args.repeat):
                t0 = time.perf_counter()
                if not args.no_profile:
                    fg.enable()
                fut = safeckpt.async_save(state, str(work / f"p{r}"))
                fg.disable()
                blocked.append(time.perf_counter() - t0)
                n = 0
                while not fut.done():
                    if args.spin:
                        x = 0
                        for i in range(2000):
                            x += i * i
                        n += 1
                    else:
                        time.sleep(0.001)
                fut.result()
                total.append(time.perf_counter() - t0)
                remove(work / f"p{r}")
            if args.no_profile:
                asyncsave._default.close()
                print(f"blocked {blocked}, commit after {total}")
                return 0
            texts.append(stats_text(fg, f"{args.op}: the caller's part (blocked {sum(blocked) / len(blocked):.3f} s "
                                        f"per save)", args.top))
            texts.append(stats_text(bg, f"{args.op}: the background thread (save done after "
                                        f"{sum(total) / len(total):.3f} s per save)", args.top))
            asyncsave._default.close()
    finally:
        remove(work)
        os.sync()
    text = "\n".join(texts)
    print(text)
    out = HERE / "results" / f"profile-{args.op}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"(written to {out})", file=sys.stderr)
    return 0


def gil_share(args: argparse.Namespace) -> int:
    """Run this op (async, spinning) under ``py-spy record --gil --threads`` and count, per
    thread, the samples in which it held the GIL."""
    import collections
    import re
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        print("py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    if not args.op.startswith("async"):
        print("--gil is for the async ops", file=sys.stderr)
        return 2
    raw = HERE / "results" / f"gil-{args.op}.txt"
    raw.parent.mkdir(parents=True, exist_ok=True)
    cmd = [spy, "record", "--gil", "--threads", "--nonblocking", "-r", "200", "--format", "raw", "-o", str(raw), "--",
           sys.executable, str(Path(__file__).resolve()), args.op, "--spin", "--repeat", str(max(3, args.repeat)),
           "--size-mib", str(args.size_mib), "--n-small", str(args.n_small), "--_no-profile"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    per_thread: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        name = re.sub(r"_\d+$", "", stack.split(";")[0].split(": ", 1)[-1])
        per_thread[name] += int(n)
    total = sum(per_thread.values()) or 1
    text = [f"===== {args.op}: share of GIL-holding samples per thread (py-spy --gil, main thread spinning; "
            "includes building the state: the unnamed thread at first)"]
    text += [f"{n:7d}  {n / total:6.1%}  {name}" for name, n in per_thread.most_common()]
    print("\n".join(text))
    (HERE / "results" / f"profile-{args.op}-gil.txt").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
