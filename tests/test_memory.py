"""Saving streams tensor memory to disk: no copy of the state, no big buffers.

Each case runs in a fresh process (tests/helpers/memory_probe.py) so the peak resident
set (ru_maxrss) is this save's alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import safeckpt
from safeckpt.protocol.reader import COALESCE_MAX, READ_THREADS

PROBE = Path(__file__).parent / "helpers" / "memory_probe.py"
LIMIT_MIB = 256
# small tensors are read in coalesced requests: up to READ_THREADS x COALESCE_MAX bytes
# (4 x 16 MiB) may be in flight by design, plus slack; a copy of the state shows as +256 MiB
SMALL_LIMIT_MIB = (READ_THREADS * COALESCE_MAX >> 20) + 32


def _fs_type(path: Path) -> str:
    r = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return r.stdout.strip()


@pytest.fixture
def disk_dir(tmp_path):
    """A folder on a real disk (not tmpfs), removed afterwards: the test writes 1 GiB."""
    where = tmp_path
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        where = Path(tempfile.mkdtemp(prefix="safeckpt-mem-", dir=Path(__file__).resolve().parent.parent))
    try:
        yield where
    finally:
        shutil.rmtree(where / "ckpt", ignore_errors=True)
        shutil.rmtree(where / "ckpt-warmup", ignore_errors=True)
        if where != tmp_path:
            shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("n_tensors, total_mib, limit_mib", [(50, 1024, LIMIT_MIB), (1024, 256, SMALL_LIMIT_MIB)],
                         ids=["1GiB-in-50-tensors", "256MiB-in-1024-small-tensors"])
def test_saving_needs_little_extra_memory(disk_dir, n_tensors, total_mib, limit_mib):
    """1 GiB in 50 tensors: under 256 MiB extra to save, to load in place, and for
    ``load_state`` beyond its result. Small tensors are coalesced into write buffers and
    read in batched runs, which must stay small too (a copy of the state would show as
    +256 MiB)."""
    env = dict(os.environ)
    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    r = subprocess.run([sys.executable, str(PROBE), str(disk_dir / "ckpt"), str(n_tensors), str(total_mib)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tensor_bytes"] >= (total_mib << 20) - (1 << 20)
    assert out["values_ok"], "the loaded values differ from the saved ones"
    save_extra = (out["after_save_kib"] - out["base_kib"]) / 1024
    load_extra = (out["after_load_kib"] - out["base_kib"]) / 1024
    # load_state's result is new memory of the state's size: what counts is the peak beyond it
    fresh_extra = (out["after_load_state_kib"] - out["base_kib"]) / 1024 - out["tensor_bytes"] / 2**20
    print(f"{total_mib} MiB in {n_tensors} tensors: save +{save_extra:.0f} MiB, load in place +{load_extra:.0f} MiB, "
          f"load_state +{fresh_extra:.0f} MiB beyond its result")
    assert save_extra < limit_mib, f"saving {total_mib} MiB raised the peak by {save_extra:.0f} MiB"
    assert load_extra < limit_mib, f"loading {total_mib} MiB in place raised the peak by {load_extra:.0f} MiB"
    assert fresh_extra < limit_mib, f"load_state of {total_mib} MiB raised the peak by {fresh_extra:.0f} MiB beyond its result"
