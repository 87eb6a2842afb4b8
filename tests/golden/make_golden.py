"""Make the golden checkpoints of tests/test_golden.py: one per format version.

Run once per format version, with the safeckpt that writes that version, and commit what
it writes; never regenerate an existing version (the point is that checkpoints written by
released code keep loading). ``v1`` was made by the code of commit 8990613 (format 1:
``safeckpt.save``), ``v2`` by the same code (format 2: an incremental
``CheckpointManager`` run of two steps whose second step shares chunks with the first).
``v3`` (format 3, tensor tables) holds both: ``v3/plain`` the ``safeckpt.save`` of
``golden_state()`` and ``v3/run`` the incremental run, made by the code that introduced
format 3 (branch v3). ``v4`` (format 4: a ``torch.distributed.checkpoint`` save through
``safeckpt.dcp.Writer`` with DCP's ZStandard stream transform; the only saves written as
format 4) was made by the code that introduced format 4 (``make_transformed``). It writes
the folder of the version it writes, and never over one.

    PYTHONPATH=src python tests/golden/make_golden.py tests/golden

The expected values are not stored: ``golden_state`` and ``incremental_states`` build them
deterministically (no random numbers), and the test compares what loads against them.
"""

from __future__ import annotations

import collections
import math
import sys
from pathlib import Path

import torch

import safeckpt
from safeckpt.format.manifest import WRITE_VERSION

CHUNK_SIZE = 64  # the incremental run's chunks: tiny, so the files stay a few KB


def golden_state() -> dict:
    """Several dtypes, a strided view, tied weights, a rank-local value and plain values."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8
    weight = torch.linspace(-1, 1, 12, dtype=torch.float32).reshape(3, 4)
    return {
        "model": collections.OrderedDict([
            ("weight", weight),
            ("bias", torch.tensor([0.5, -0.25, 2.0], dtype=torch.float64)),
            ("head", weight),  # tied to model.weight: the same tensor
            ("half", torch.arange(6, dtype=torch.float16) - 2.5),
            ("bf16", torch.arange(5, dtype=torch.bfloat16) * 0.75),
            ("ids", torch.arange(-3, 4, dtype=torch.int64) * (1 << 40)),
            ("mask", torch.tensor([True, False, True, True])),
            ("bytes", torch.arange(250, 256, dtype=torch.uint8)),
            ("scalar", torch.tensor(7, dtype=torch.int32)),
            ("empty", torch.zeros(0, 3)),
        ]),
        "view": base[1:, ::2],  # a non-contiguous view of a larger tensor
        "transposed": base.t(),
        "rng": safeckpt.RankLocal(torch.arange(8, dtype=torch.uint8)),
        "step": 42,
        "lr": 3e-4,
        "name": "golden",
        "flags": (True, None, "x"),
        "history": [1.5, float("inf"), -0.0, {"epoch": 3, 7: "seven"}],
        "big": 1 << 70,
        "nan": float("nan"),
    }


def expected_loaded(state: dict) -> dict:
    """What ``load_state`` returns for ``golden_state()``: rank-local values by rank."""
    out = dict(state)
    out["rng"] = [state["rng"].value]
    return out


def incremental_states() -> list[tuple[int, dict]]:
    """Two steps; only ``moving`` and ``step`` change, so step 2 shares ``frozen``'s chunks."""
    frozen = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    states = []
    for step in (1, 2):
        states.append((step, {
            "frozen": frozen,
            "moving": torch.full((4, 8), float(step), dtype=torch.float32),
            "zeros": torch.zeros(32, dtype=torch.int16),
            "step": step,
        }))
    return states


def make_plain(path: Path) -> None:
    safeckpt.save(golden_state(), str(path), metadata={"made_by": "tests/golden/make_golden.py"})


def make_run(root: Path) -> None:
    with safeckpt.CheckpointManager(str(root), incremental=True, chunk_size=CHUNK_SIZE) as mgr:
        for step, state in incremental_states():
            mgr.save(step, state, metrics={"loss": 1.0 / step})


def transformed_state() -> dict:
    """What the format-4 checkpoint holds: tensors DCP compresses, and plain values."""
    return {"weight": torch.arange(64, dtype=torch.float32).reshape(8, 8) / 4,
            "zeros": torch.zeros(256, dtype=torch.int16), "step": 7}


def make_transformed(path: Path) -> None:
    """Format 4: DCP's save of ``transformed_state()`` with ZStandard (needs zstandard)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    import safeckpt.dcp

    dcp.save(transformed_state(), storage_writer=safeckpt.dcp.Writer(str(path), _extensions=[ZStandard()]),
             no_dist=True)


def make(out: Path) -> None:
    """Write the golden checkpoints of the format version this code writes (``v1`` and
    ``v2`` came from the code of their time), never over existing ones."""
    if not (out / "v4").exists():
        make_transformed(out / "v4")
    folder = out / f"v{WRITE_VERSION}"
    if folder.exists():
        raise SystemExit(f"{folder} exists: golden checkpoints are never regenerated")
    make_plain(folder / "plain")
    make_run(folder / "run")


if __name__ == "__main__":
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
