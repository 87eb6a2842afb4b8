#!/usr/bin/env python
"""How long the ``safeckpt`` command takes to answer, each call a fresh process as from
a shell: ``ls``, ``show`` and ``verify`` of a run root of 10 checkpoints (a small model
and its AdamW state each), against ``safeckpt --help`` (the interpreter, click and rich:
the floor). Issue 28's target: ``ls`` on a 10-checkpoint root in under 0.5 s (it took
2-3 s when decoding a manifest imported torch). Also whether each command imported torch.

Standalone: ``python benchmarks/cli_bench.py [--repeat N] [--src PATH]`` (``--src``: another
checkout's ``src``, to compare before and after a change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
N_CHECKPOINTS = 10
LS_TARGET_S = 0.5
_PROBE = ("import sys, runpy\nsys.argv = ['safeckpt'] + sys.argv[1:]\n"
          "try:\n    runpy.run_module('safeckpt', run_name='__main__')\n"
          "finally:\n    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)")


def make_root(root: Path) -> None:
    import safeckpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10))
    optim = torch.optim.AdamW(model.parameters())
    with safeckpt.CheckpointManager(root) as mgr:
        for step in range(N_CHECKPOINTS):
            model(torch.randn(8, 256)).sum().backward()
            optim.step()
            mgr.save(step * 100, {"model": model, "optim": optim, "step": step * 100}, metrics={"loss": 1 / (step + 1)})


def time_command(args: list[str], repeat: int, src: Path = SRC) -> dict:
    """Wall and CPU seconds (user + system: what a busy machine does not inflate) of
    ``safeckpt ARGS`` in a fresh interpreter, and whether it imported torch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    times, cpu, torch_imported = [], [], None
    for _ in range(repeat):
        started = time.perf_counter()
        with subprocess.Popen([sys.executable, "-c", _PROBE, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL) as p:
            err = p.stderr.read() if p.stderr else ""
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
        times.append(time.perf_counter() - started)
        cpu.append(usage.ru_utime + usage.ru_stime)
        if p.returncode not in (0, 1):
            raise RuntimeError(f"safeckpt {' '.join(args)} failed: {err[-2000:]}")
        torch_imported = "torch imported: True" in err
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs_s": times,
            "cpu_s": statistics.median(cpu), "torch_imported": torch_imported}


def run_cli(repeat: int, workdir: Path, src: Path = SRC) -> dict:
    root = Path(tempfile.mkdtemp(prefix="cli-", dir=workdir)) / "run"
    make_root(root)
    one = root / f"step-{(N_CHECKPOINTS - 1) * 100:09d}"
    commands = {"safeckpt --help": ["--help"], f"safeckpt ls (root of {N_CHECKPOINTS})": ["ls", str(root)],
                "safeckpt show (one checkpoint)": ["show", str(one)],
                f"safeckpt verify (root of {N_CHECKPOINTS})": ["verify", str(root)]}
    out = {}
    for name, args in commands.items():
        print(f"  [cli] {name}", file=sys.stderr, flush=True)
        out[name] = time_command(args, repeat, src)
    out["_bytes"] = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return out


def cli_table(res: dict) -> str:
    lines = [f"### the command line: a fresh process per call, run root of {N_CHECKPOINTS} checkpoints "
             f"({res.get('_bytes', 0) / 1e6:.1f} MB)", "",
             "| command | median s | min–max s | CPU s (median) | imports torch |", "|---|---:|---:|---:|---|"]
    for name, r in res.items():
        if not name.startswith("_"):
            lines.append(f"| {name} | {r['median_s']:.2f} | {r['min_s']:.2f}–{r['max_s']:.2f} | {r['cpu_s']:.2f} | "
                         f"{'yes' if r['torch_imported'] else 'no'} |")
    return "\n".join(lines + [""])


def ls_seconds(res: dict, key: str = "median_s") -> float | None:
    """``safeckpt ls`` on the root: the target's measure (the median; ``min_s``, the best run)."""
    return next((r[key] for name, r in res.items() if name.startswith("safeckpt ls")), None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--src", type=Path, default=SRC, help="the safeckpt source to time (default: this checkout's)")
    p.add_argument("--json", type=Path, default=HERE / "results" / "cli_bench.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="safeckpt-cli-bench-") as tmp:
        res = run_cli(args.repeat, Path(tmp), args.src.resolve())
    print(cli_table(res))
    seconds = ls_seconds(res)
    print(f"ls target (< {LS_TARGET_S} s): {'met' if seconds is not None and seconds < LS_TARGET_S else 'missed'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
