"""Peak memory of saving (and loading in place) a big state, measured in a fresh process.

    python memory_probe.py PATH N_TENSORS TOTAL_MIB

Prints one JSON line: ru_maxrss (KiB) after allocating and touching the tensors, after
``safeckpt.save``, after ``safeckpt.load`` into the same (zeroed) tensors and after
``safeckpt.load_state`` (whose result adds the state's size once), plus whether the
loaded values are right. ru_maxrss is the process's peak resident set: page
cache of the written file does not count, only memory the process itself touched.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

import safeckpt


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    path, n, total_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    per = (total_mib << 20) // n // 4
    state = {"model": {f"t{i:04d}": torch.full((per,), float(i)) for i in range(n)}}  # touched
    # warm up the code paths (imports, first-call allocations) on a tiny save
    safeckpt.save({"w": torch.ones(1000)}, path + "-warmup")
    base = peak_kib()
    safeckpt.save(state, path)
    after_save = peak_kib()
    for t in state["model"].values():
        t.zero_()
    safeckpt.load(state, path)
    after_load = peak_kib()
    ok = all(bool((t == float(i)).all()) for i, t in enumerate(state["model"].values()))
    fresh = safeckpt.load_state(path)
    after_load_state = peak_kib()
    ok = ok and all(bool((t == float(i)).all()) for i, t in enumerate(fresh["model"].values()))
    print(json.dumps({"base_kib": base, "after_save_kib": after_save, "after_load_kib": after_load,
                      "after_load_state_kib": after_load_state, "tensor_bytes": per * 4 * n, "values_ok": ok}))


if __name__ == "__main__":
    main()
