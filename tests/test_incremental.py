"""Incremental checkpoints: chunks identified by their content, written once per run.

``CheckpointManager(root, incremental=True, chunk_size=...)`` cuts every tensor into
row-major runs of at most ``chunk_size`` bytes, and a chunk that the run's newest
committed checkpoint already holds is referenced (``../step-.../data-...``) instead of
written again. Everything here runs on real files under ``tmp_path`` (no mocks):

- the tiling (``split_box``) and what each save writes (LoRA-like states, a partly
  changed embedding table, duplicates within a save, every dtype);
- reachability: retention retires folders whose data later checkpoints share, garbage
  collection removes them once nothing references them, out-of-order deletes, other
  runs and non-incremental continuations never break what is committed;
- failures: a full disk, a shared file deleted by hand or while a save runs, a flipped
  byte in shared data;
- the command line (ls, verify, export, gc), async saves, and 2 real gloo ranks.

Small chunks (4-64 KiB) keep every tensor small and the module fast.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import safeckpt
from safeckpt.run import garbage
from safeckpt.format.folder import read_committed
from safeckpt.protocol.incremental import split_box
from safeckpt.format.names import RETIRED, step_folder, step_of
from safeckpt.format.manifest import is_shared
from safeckpt.storage import LocalStorage
from safeckpt.storage import open as open_storage
from safeckpt.testing import FaultyStorage

pytestmark = pytest.mark.timeout(180)

CHUNK = 64 << 10
SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
HEADER_SLACK = 16 << 10  # a data file's safetensors header and alignment, for a few dozen chunks


def header_slack(chunks: int) -> int:
    """Room for the safetensors header of a data file holding ``chunks`` chunks."""
    return 4096 + 128 * chunks


# --------------------------------------------------------------------------- helpers


def exact(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs, -0.0 and float8 included)."""
    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
        return False
    return torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                       want.contiguous().reshape(-1).view(torch.uint8))


def differences(got, want, key: str = "") -> list[str]:
    if isinstance(want, torch.Tensor):
        if not exact(got, want):
            what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return [f"{key}: expected {want.dtype} {tuple(want.shape)} exactly, got {what} (or other bytes)"]
        return []
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{key}: keys {sorted(got) if isinstance(got, dict) else got!r} != {sorted(want)}"]
        return [p for k in want for p in differences(got[k], want[k], f"{key}.{k}" if key else str(k))]
    return [] if got == want else [f"{key}: {got!r} != {want!r}"]


def blank(state):
    """A load target shaped like ``state`` holding other values (zeros, -1)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, int):
        return -1
    return None


def assert_loads(path: str, want: dict) -> None:
    """Every way of reading one checkpoint by its path gives ``want`` exactly."""
    target = blank(want)
    safeckpt.load(target, path)
    assert not differences(target, want), (path, differences(target, want))
    got = safeckpt.load_state(path)
    assert not differences(got, want), (path, differences(got, want))
    report = safeckpt.verify(path)
    assert report.ok, report.problems
    m = manifest(path)
    assert report.bytes_checked == m.total_bytes + m.shared_files_bytes


def manifest(path: str):
    return read_committed(open_storage(path))


def files_under(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def digests_under(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None)


def own_files(path: str) -> dict[str, int]:
    return {n: f.size for n, f in manifest(path).files.items() if not is_shared(n)}


def check_reachability(root: Path, mgr: safeckpt.CheckpointManager, collected: bool = True) -> None:
    """Every step folder on disk is committed, or retired (marker, no manifest) holding
    the data files committed checkpoints still reference; nothing referenced is missing,
    and once garbage was ``collected`` nothing unreferenced stays either."""
    committed = {s: manifest(mgr.path(s)) for s in mgr.steps()}
    referenced: dict[str, set[str]] = {}
    for m in committed.values():
        for name in m.files:
            if is_shared(name):
                _, folder, file = name.split("/", 2)
                referenced.setdefault(folder, set()).add(file)
    for folder in step_dirs(root):
        names = set(os.listdir(root / folder))
        step = int(folder[5:])
        if step in committed:
            assert RETIRED not in names, f"{folder} is committed and marked retired: {names}"
            continue
        assert garbage.RETIRED in names, f"{folder} is neither committed nor retired: {names}"
        assert mgr._read(step).state == "retired"
        data = {n for n in names if n.startswith("data-")}
        assert data >= referenced.get(folder, set()) and (data == referenced.get(folder, set()) or not collected), (
            f"retired {folder} holds {sorted(data)}, committed checkpoints reference "
            f"{sorted(referenced.get(folder, set()))}")
        assert names == data | {garbage.RETIRED}, names
    for folder, needed in referenced.items():
        for file in needed:
            assert (root / folder / file).is_file(), f"{folder}/{file} is referenced and missing"


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def only_data_file(folder: Path) -> Path:
    files = [p for p in folder.iterdir() if p.name.startswith("data-")]
    assert len(files) == 1, files
    return files[0]


# --------------------------------------------------------------------------- states

_FROZEN: dict[int, dict] = {}


def frozen(n: int = 4, dim: int = 768) -> dict:
    """Base weights that never change (the same objects every call: cheap)."""
    if dim not in _FROZEN:
        g = torch.Generator().manual_seed(dim)
        _FROZEN[dim] = {f"layer{i}.weight": torch.randn(dim, dim, generator=g) for i in range(n)}
    return _FROZEN[dim]


def lora_state(step: int, dim: int = 768, rank: int = 32) -> dict:
    """~90% frozen base weights (4 x dim^2 fp32), ~10% trainable adapters that change
    at every step, and the step."""
    g = torch.Generator().manual_seed(10_000 + step)
    base = frozen(4, dim)
    lora = {}
    for i in range(4):
        lora[f"layer{i}.A"] = torch.randn(dim, rank, generator=g)
        lora[f"layer{i}.B"] = torch.randn(rank, dim, generator=g)
    return {"base": base, "lora": lora, "step": step}


def nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    return 0


def layered_state(step: int) -> dict:
    """Three speeds: ``frozen`` never changes, ``slow`` changes every 2nd step, ``fast``
    at every step (each spans several 4 KiB chunks)."""
    g = torch.Generator().manual_seed(5)
    return {"frozen": torch.randn(64, 64, generator=g),                          # 16 KiB
            "slow": torch.arange(2048, dtype=torch.float32).reshape(32, 64) + 1000 * (step // 2),  # 8 KiB
            "fast": torch.arange(2048, dtype=torch.float64) * step,               # 16 KiB
            "step": step}


# --------------------------------------------------------------------------- 1. tiling


def _is_contiguous_run(shape: tuple, offsets: tuple, box: tuple) -> bool:
    """A box is one row-major run iff every dimension after its first non-1 extent is
    taken whole from offset 0."""
    j = next((d for d, s in enumerate(box) if s != 1), len(box))
    return all(box[d] == shape[d] and offsets[d] == 0 for d in range(j + 1, len(box)))


def _linear(offsets: tuple, shape: tuple) -> int:
    index = 0
    for o, s in zip(offsets, shape):
        index = index * s + o
    return index


def _check_tiling(shape: tuple, itemsize: int, limit: int) -> None:
    boxes = split_box(shape, itemsize, limit)
    numel = 1
    for d in shape:
        numel *= d
    where = f"split_box({shape}, {itemsize}, {limit}) = {boxes[:6]}{'...' if len(boxes) > 6 else ''}"
    assert boxes, where
    if numel == 0:
        assert boxes == [((0,) * len(shape), tuple(shape))], where
        return
    position = 0
    for offsets, box in boxes:
        assert len(offsets) == len(box) == len(shape), where
        assert all(o >= 0 and b >= 1 and o + b <= s for o, b, s in zip(offsets, box, shape)), where
        assert _is_contiguous_run(shape, offsets, box), f"{where}: {offsets}+{box} is not contiguous"
        n = 1
        for b in box:
            n *= b
        assert n * itemsize <= limit or n == 1, f"{where}: {offsets}+{box} has {n * itemsize} bytes"
        # row-major order, back to back: disjoint and, with the total below, covering
        assert _linear(offsets, shape) == position, f"{where}: {offsets} starts at element " \
            f"{_linear(offsets, shape)}, the previous box ended at {position}"
        position += n
    assert position == numel, where
    if 0 < numel <= 20_000 and len(boxes) <= 500:  # on values: each box is the next run of the flat tensor
        t = torch.arange(numel).reshape(shape)
        flat = t.reshape(-1)
        pos = 0
        for offsets, box in boxes:
            sub = t[tuple(slice(o, o + b) for o, b in zip(offsets, box))].reshape(-1)
            assert torch.equal(sub, flat[pos:pos + sub.numel()]), where
            pos += sub.numel()
    # not needlessly fine: where a whole row (the last dimension) fits, no box cuts one
    if len(shape) >= 1 and shape[-1] * itemsize <= limit:
        assert all(box[-1] == shape[-1] for _, box in boxes), where


def test_split_box_tiles_every_shape_exactly():
    shapes = [(), (0,), (1,), (7,), (1000,), (0, 7), (7, 0), (7, 0, 3), (3, 5), (5, 1, 1), (1, 1, 9),
              (2, 3, 4, 5), (64, 1000), (3, 7, 11), (2, 1, 300), (1, 4096), (4096, 1), (10, 10, 10, 10)]
    rng = random.Random(1)
    shapes += [tuple(rng.randint(0 if rng.random() < 0.05 else 1, 12) for _ in range(rng.randint(1, 4)))
               for _ in range(50)]
    checked = 0
    for shape in shapes:
        for itemsize in (1, 2, 4, 8, 16):
            numel = 1
            for d in shape:
                numel *= d
            total = numel * itemsize
            limits = {itemsize, itemsize + 1, 2 * itemsize, 3 * itemsize - 1, 64, 1000, 4096,
                      max(itemsize, total // 3), max(itemsize, total - 1), total, total + 1}
            row = (shape[-1] if shape else 1) * itemsize
            limits |= {max(itemsize, row - 1), max(itemsize, row), row + 1, 2 * row + 1}  # around one row
            for limit in sorted(limits):
                if limit >= itemsize and total // limit <= 1000:  # at most a few thousand boxes
                    _check_tiling(shape, itemsize, limit)
                    checked += 1
    assert checked > 1500
    # a few exact answers
    assert split_box((10,), 4, 16) == [((0,), (4,)), ((4,), (4,)), ((8,), (2,))]
    assert split_box((2, 3, 5), 4, 50) == [((0, 0, 0), (1, 2, 5)), ((0, 2, 0), (1, 1, 5)),
                                            ((1, 0, 0), (1, 2, 5)), ((1, 2, 0), (1, 1, 5))]
    assert split_box((4, 4), 4, 64) == [((0, 0), (4, 4))]
    assert split_box((), 16, 1) == [((), ())]  # a scalar is one element, larger or not


def test_split_box_elements_larger_than_the_limit(tmp_path):
    assert split_box((3,), 8, 4) == [((0,), (1,)), ((1,), (1,)), ((2,), (1,))]
    assert split_box((2, 2), 16, 8) == [((0, 0), (1, 1)), ((0, 1), (1, 1)), ((1, 0), (1, 1)), ((1, 1), (1, 1))]
    with pytest.raises(ValueError, match="chunk_size must be an int of at least 64"):
        safeckpt.CheckpointManager(tmp_path / "run", incremental=True, chunk_size=4)
    with safeckpt.CheckpointManager(tmp_path / "run", incremental=True, chunk_size=64) as mgr:
        state = {"x": torch.arange(5, dtype=torch.float64), "z": torch.randn(9, dtype=torch.complex128)}
        mgr.save(1, state)
        got = safeckpt.load_state(mgr.path(1))
        assert exact(got["x"], state["x"]) and exact(got["z"], state["z"])


# --------------------------------------------------------------------------- 2. LoRA


def test_lora_saves_write_only_the_trainable_part(tmp_path):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=2, incremental=True, chunk_size=CHUNK)
    frozen_bytes = nbytes(frozen())
    trainable = nbytes(lora_state(1)["lora"])
    assert 0.05 < trainable / (trainable + frozen_bytes) < 0.15  # a LoRA-like split
    infos = {}
    for step in range(1, 6):
        infos[step] = info = mgr.save(step, lora_state(step))
        assert info.step == step
        if step == 1:
            full = info.bytes
            assert frozen_bytes + trainable <= full < frozen_bytes + trainable + header_slack(200)
            assert info.shared_bytes == 0
            first_file = only_data_file(root / step_folder(1))
        else:
            # the adapters are written again (all of them changed), nothing else is
            assert trainable <= info.bytes < trainable + HEADER_SLACK, (step, info.bytes)
            assert info.bytes < 0.15 * full
            # ... and the base weights are read from step 1's data file, by name
            assert info.shared_bytes == first_file.stat().st_size
            assert f"../{step_folder(1)}/{first_file.name}" in info.files
        # retention by reachability
        assert mgr.steps() == ([1] if step == 1 else [step - 1, step])
        expect_dirs = {step_folder(s) for s in mgr.steps()} | ({step_folder(1)} if step >= 3 else set())
        assert set(step_dirs(root)) == expect_dirs, (step, step_dirs(root))
        if step >= 3:
            assert sorted(os.listdir(root / step_folder(1))) == sorted([first_file.name, garbage.RETIRED])
            assert mgr._read(1).state == "retired"
        check_reachability(root, mgr)
        # bounded: the base once, the adapters of the kept steps, manifests and a lease
        on_disk = files_under(root)
        data = sum(size for name, size in on_disk.items() if name.split("/")[-1].startswith("data-"))
        kept = sum(sum(own_files(mgr.path(s)).values()) for s in mgr.steps())
        assert data == kept + (first_file.stat().st_size if step >= 3 else 0)
        assert sum(on_disk.values()) < full + 2 * (trainable + HEADER_SLACK) + (64 << 10)

    # the manifest: format 2, chunks of at most chunk_size, base chunks in step 1's file
    m = manifest(mgr.path(5))
    assert m.version == 3 and m.block_size == CHUNK
    assert m.total_bytes == infos[5].bytes
    assert m.shared_bytes() == frozen_bytes  # every base chunk once, read from step 1
    for name, entry in m.tensors.items():
        for c in entry.chunks:
            assert c.end - c.start <= CHUNK
            if name.startswith("base."):
                assert c.file == f"../{step_folder(1)}/{first_file.name}", (name, c.file)
            else:
                assert not is_shared(c.file), (name, c.file)
    for step in mgr.steps():
        assert_loads(mgr.path(step), lora_state(step))
    mgr.close()

    # a resumed job restores the newest, adopts its run and keeps sharing
    resumed = safeckpt.CheckpointManager(root, keep_last=2, incremental=True, chunk_size=CHUNK)
    target = blank(lora_state(5))
    assert resumed.restore(target) == 5
    assert not differences(target, lora_state(5))
    target = blank(lora_state(4))
    assert resumed.restore(target, step=4) == 4
    assert not differences(target, lora_state(4))
    info = resumed.save(6, lora_state(6))
    assert trainable <= info.bytes < trainable + HEADER_SLACK
    assert resumed.steps() == [5, 6]
    assert set(step_dirs(root)) == {step_folder(1), step_folder(5), step_folder(6)}
    check_reachability(root, resumed)
    assert_loads(resumed.path(6), lora_state(6))
    resumed.close()


# --------------------------------------------------------------------------- 3. a partly changed table


def test_changed_rows_rewrite_only_their_chunks(tmp_path):
    rows, cols = 32768, 128  # float32: 16 MiB, 512 bytes a row, 128 rows a chunk
    per_chunk = CHUNK // (cols * 4)
    table = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    mgr = safeckpt.CheckpointManager(tmp_path / "run", incremental=True, chunk_size=CHUNK)
    first = mgr.save(1, {"emb": table})
    assert rows * cols * 4 <= first.bytes < rows * cols * 4 + header_slack(rows // per_chunk)
    changed = [3, 4, 77 * per_chunk - 1, 77 * per_chunk, rows - 1]  # 5 rows in 4 chunks
    touched = sorted({r // per_chunk for r in changed})
    assert touched == [0, 76, 77, 255]
    table2 = table.clone()
    table2[changed] += 1.0
    info = mgr.save(2, {"emb": table2})
    assert len(touched) * CHUNK <= info.bytes < len(touched) * CHUNK + 4096, info.bytes
    m = manifest(mgr.path(2))
    own = sorted(c.offsets[0] // per_chunk for c in m.tensors["emb"].chunks if not is_shared(c.file))
    assert own == touched
    assert len(m.tensors["emb"].chunks) == rows // per_chunk
    assert m.shared_bytes() == (rows // per_chunk - len(touched)) * CHUNK
    # a save with nothing changed writes no data at all and still loads
    same = mgr.save(3, {"emb": table2})
    assert same.bytes == 0 and not own_files(mgr.path(3))
    assert all(is_shared(n) for n in same.files) and len(same.files) == 2  # step 1's and step 2's files
    for step, want in ((1, table), (2, table2), (3, table2)):
        assert_loads(mgr.path(step), {"emb": want})
    mgr.close()


# --------------------------------------------------------------------------- 4. duplicates in one save


def test_identical_content_in_one_save_is_stored_once(tmp_path):
    g = torch.Generator().manual_seed(4)
    a = torch.randn(256, 256, generator=g)  # 256 KiB: 4 chunks
    state = {"a": a, "b": a.clone(), "flat": a.clone().reshape(-1), "zeros": torch.zeros(1 << 18),
             "other": torch.randn(100, generator=g)}
    mgr = safeckpt.CheckpointManager(tmp_path / "run", incremental=True, chunk_size=CHUNK)
    info = mgr.save(1, state)
    # a's 4 chunks once (b and flat are the same bytes), one zero chunk for 16, and "other"
    expected = 4 * CHUNK + CHUNK + 400
    assert expected <= info.bytes < expected + 4096, info.bytes
    m = manifest(mgr.path(1))

    def spans(name):
        return [(c.file, c.start, c.end) for c in m.tensors[name].chunks]
    assert spans("a") == spans("b") == spans("flat")
    assert len(set(spans("zeros"))) == 1 and len(spans("zeros")) == 16
    assert_loads(mgr.path(1), state)
    # loading by path fills distinct targets; nothing in them is tied
    target = blank(state)
    safeckpt.load(target, mgr.path(1))
    target["a"].add_(1)
    assert exact(target["b"], a) and exact(target["flat"], a.reshape(-1))
    # the same state again: nothing new to write
    again = mgr.save(2, {k: v.clone() for k, v in state.items()})
    assert again.bytes == 0
    assert_loads(mgr.path(2), state)
    mgr.close()


def test_load_state_keeps_equal_but_distinct_tensors_apart(tmp_path):
    state = {"bias1": torch.zeros(100), "bias2": torch.zeros(100)}
    state["tied"] = state["bias1"]  # a real tie: it may come back as one tensor
    for incremental in (False, True):
        with safeckpt.CheckpointManager(tmp_path / str(incremental), incremental=incremental,
                                        chunk_size=CHUNK) as mgr:
            mgr.save(1, state)
            got = safeckpt.load_state(mgr.path(1))
        assert got["bias1"] is got["tied"]
        got["bias1"].add_(1)
        assert exact(got["bias2"], torch.zeros(100)), f"incremental={incremental}: bias2 moved with bias1"
        assert got["bias1"] is not got["bias2"]


# --------------------------------------------------------------------------- 5. dtypes


def dtype_state(version: int) -> dict:
    g = torch.Generator().manual_seed(8)
    s = {
        "bf16": torch.randn(64, 33, generator=g).bfloat16(),
        "f16": torch.randn(500, generator=g).half(),
        "f64": torch.randn(10, 30, generator=g, dtype=torch.float64),
        "i64": torch.randint(-2 ** 62, 2 ** 62, (300,), generator=g),
        "i8": torch.randint(-128, 127, (3000,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (17, 19), generator=g, dtype=torch.uint8),
        "bool": torch.rand(40, 41, generator=g) > 0.5,
        "c64": torch.randn(100, 7, dtype=torch.complex64, generator=g),
        "c128": torch.randn(20, 9, dtype=torch.complex128, generator=g),
        "empty": torch.empty(0, 5),
        "empty3": torch.empty(3, 0, 2, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "iscalar": torch.tensor(7, dtype=torch.int8),
        "bscalar": torch.tensor(True),
        "nan": torch.tensor([float("nan"), -0.0, float("inf"), 1.0]).repeat(100),
        "transposed": torch.arange(2000.).reshape(40, 50).t(),  # not contiguous
        "sliced": torch.arange(3000, dtype=torch.int32).reshape(60, 50)[10:30, 5:45],
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            s[name] = torch.randn(50, 50, generator=g).to(getattr(torch, name))
    if hasattr(torch, "uint16"):
        s["u16"] = torch.arange(1000, dtype=torch.int32).to(torch.uint16)
    if version >= 2:  # a few values change; the rest stays
        s["i64"][5] += 1
        s["bool"][0, 0] = ~s["bool"][0, 0]
        s["scalar"] = torch.tensor(-2.25)
        s["bf16"][63, 32] = 7.0
    if version >= 3 and "float8_e4m3fn" in s:
        s["float8_e4m3fn"] = (s["float8_e4m3fn"].float() * 2).to(torch.float8_e4m3fn)
    return s


def test_every_dtype_round_trips_through_incremental_saves(tmp_path):
    chunk = 1024
    mgr = safeckpt.CheckpointManager(tmp_path / "run", incremental=True, chunk_size=chunk)
    first = mgr.save(1, dtype_state(1))
    assert first.bytes >= nbytes(dtype_state(1))
    second = mgr.save(2, dtype_state(2))
    # i64, bool, bf16: one chunk each at most; the scalar: 4 bytes
    assert 0 < second.bytes < 3 * chunk + 4 + 4096, second.bytes
    third = mgr.save(3, dtype_state(3))
    if hasattr(torch, "float8_e4m3fn"):
        assert 2500 <= third.bytes < 2500 + 4096
    else:
        assert third.bytes == 0
    for step in (1, 2, 3):
        want = dtype_state(step)
        assert_loads(mgr.path(step), want)
        m = manifest(mgr.path(step))
        for name, t in want.items():
            e = m.tensors[name]
            assert e.dtype == str(t.dtype).removeprefix("torch.") and e.shape == list(t.shape), name
            assert all(c.end - c.start <= chunk for c in e.chunks), name
    # step 2 wrote exactly the chunks holding a changed value, and shares every other one
    m2 = manifest(mgr.path(2))
    own = {name: [c.offsets for c in e.chunks if not is_shared(c.file)] for name, e in m2.tensors.items()}
    assert {k: v for k, v in own.items() if v} == {
        "i64": [[0]],          # 128 int64 a chunk: element 5
        "bool": [[0, 0]],      # 24 rows of 41 bools a chunk: [0, 0]
        "scalar": [[]],
        "bf16": [[60, 0]],     # 15 rows of 33 bf16 a chunk: row 63 is in the chunk from row 60
    }, own
    assert sum(c.end - c.start for e in m2.tensors.values() for c in e.chunks if not is_shared(c.file)) \
        == 1024 + 24 * 41 + 4 + 4 * 33 * 2
    mgr.close()


# --------------------------------------------------------------------------- 6. retention and gc


def test_keep_last_1_keeps_exactly_what_is_reachable(tmp_path):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=1, incremental=True, chunk_size=4096)
    sizes = {}
    for step in range(1, 9):
        info = mgr.save(step, layered_state(step))
        sizes[step] = info.bytes
        assert mgr.steps() == [step]
        check_reachability(root, mgr)
        # step 1 holds the frozen tensor for good; the slow tensor lives in the folder of
        # the even step that last changed it, which is retired while the odd one after it is kept
        expect = {step_folder(step), step_folder(1)}
        if step % 2 == 1 and step > 1:
            expect.add(step_folder(step - 1))
        assert set(step_dirs(root)) == expect, (step, step_dirs(root))
        before = digests_under(root)
        assert mgr.gc(dry_run=True) == [] and mgr.gc() == [] and mgr.gc(min_age_s=0) == []
        assert digests_under(root) == before
        assert_loads(mgr.path(step), layered_state(step))
    slow, fast = 32 * 64 * 4, 2048 * 8
    assert all(fast <= sizes[s] < fast + 4096 for s in (3, 5, 7))  # slow unchanged at odd steps
    assert all(fast + slow <= sizes[s] < fast + slow + 4096 for s in (2, 4, 6, 8))
    mgr.close()


@pytest.mark.parametrize("order", [(3, 1, 5, 2, 4), (1, 2, 3, 4, 5), (6, 2, 4, 1, 5), (5, 4, 3, 2, 1)])
def test_out_of_order_deletes_never_break_the_rest(tmp_path, order):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, incremental=True, chunk_size=4096)
    for step in range(1, 7):
        mgr.save(step, layered_state(step))
    remaining = set(range(1, 7))
    for step in order:
        mgr.delete(step)
        remaining.discard(step)
        assert mgr.steps() == sorted(remaining)
        for s in remaining:
            assert_loads(mgr.path(s), layered_state(s))
        check_reachability(root, mgr, collected=False)  # delete() leaves collection to gc
        removed = mgr.gc()
        assert not any(r.startswith(step_folder(s) + "/") for s in remaining for r in removed), removed
        for s in remaining:
            assert_loads(mgr.path(s), layered_state(s))
        check_reachability(root, mgr)
    # the last one left owns or references everything it needs; nothing else remains
    last = sorted(remaining)
    referenced = {n.split("/")[1] for s in last for n in manifest(mgr.path(s)).files if is_shared(n)}
    assert set(step_dirs(root)) == {step_folder(s) for s in last} | referenced
    mgr.close()


# --------------------------------------------------------------------------- 7. injected faults


def test_a_full_disk_during_an_incremental_save_loses_nothing(tmp_path):
    root = tmp_path / "run"
    storage = FaultyStorage(LocalStorage(str(root)))
    mgr = safeckpt.CheckpointManager(storage, keep_last=2, incremental=True, chunk_size=CHUNK)
    for step in (1, 2):
        mgr.save(step, lora_state(step, dim=256))
    before = digests_under(root)
    full = sum(own_files(mgr.path(1)).values())
    shared = f"{step_folder(1)}/{only_data_file(root / step_folder(1)).name}"
    assert shared in before

    fault = storage.inject("write_file", errno.ENOSPC, path="data-")
    with pytest.raises(safeckpt.StorageError) as caught:
        mgr.save(3, lora_state(3, dim=256))
    assert caught.value.errno == errno.ENOSPC
    assert "disk is full" in str(caught.value) and step_folder(3) in str(caught.value)
    assert isinstance(caught.value, safeckpt.CheckpointError) and isinstance(caught.value, OSError)
    assert digests_under(root) == before  # the shared data, the manifests, everything untouched
    assert not (root / step_folder(3)).exists()
    assert mgr.steps() == [1, 2]
    for step in (1, 2):
        assert_loads(mgr.path(step), lora_state(step, dim=256))
    storage.faults.remove(fault)

    # the data file written whole, then the storage reports the error (a timed-out write)
    storage.inject("write_file", errno.ENOSPC, path="data-", effect="after", times=1)
    with pytest.raises(safeckpt.StorageError, match="disk is full"):
        mgr.save(3, lora_state(3, dim=256))
    assert digests_under(root) == before and mgr.steps() == [1, 2]

    # an I/O error on the data file's fsync: the data may not be durable, so no commit
    storage.inject("fsync", errno.EIO, path="data-", times=1)
    with pytest.raises(safeckpt.StorageError, match="I/O error"):
        mgr.save(3, lora_state(3, dim=256))
    assert digests_under(root) == before and mgr.steps() == [1, 2]
    mgr.close()

    # a disk that fills up part-way through the data file, in a resumed job
    full_disk = FaultyStorage(LocalStorage(str(root)), enospc_after_bytes=10_000)
    mgr = safeckpt.CheckpointManager(full_disk, keep_last=2, incremental=True, chunk_size=CHUNK)
    assert mgr.restore(blank(lora_state(0, dim=256))) == 2
    with pytest.raises(safeckpt.StorageError, match="disk is full"):
        mgr.save(3, lora_state(3, dim=256))
    lease = {n for n in digests_under(root) if n.startswith("safeckpt-writer")}
    assert {n: d for n, d in digests_under(root).items() if n not in lease} == \
        {n: d for n, d in before.items() if not n.startswith("safeckpt-writer")}
    assert mgr.steps() == [1, 2]
    mgr.close()

    mgr = safeckpt.CheckpointManager(root, keep_last=2, incremental=True, chunk_size=CHUNK)
    assert mgr.restore(blank(lora_state(0, dim=256))) == 2
    # the next save works, and still shares with step 2 (and through it, step 1)
    info = mgr.save(3, lora_state(3, dim=256))
    assert info.bytes < 0.25 * full and info.shared_bytes == full
    assert mgr.steps() == [2, 3]
    for step in (2, 3):
        assert_loads(mgr.path(step), lora_state(step, dim=256))
    check_reachability(root, mgr)
    mgr.close()


def test_a_shared_file_deleted_by_hand(tmp_path):
    """Checkpoints that need the file fail to load, naming it; the manager no longer
    lists them; the next save shares nothing with them, writes every chunk and loads.
    The automatic gc after each save keeps the broken checkpoints (a well-formed
    manifest whose files seem missing may be a stale listing); an explicit gc removes
    them (docs/format.md section 4)."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=3, incremental=True, chunk_size=4096)
    for step in (1, 2, 3):
        mgr.save(step, layered_state(step))
    gone = only_data_file(root / step_folder(1))
    gone.unlink()
    for step in (1, 2, 3):
        with pytest.raises(safeckpt.CorruptCheckpointError) as caught:
            safeckpt.load(blank(layered_state(step)), mgr.path(step))
        assert gone.name in str(caught.value) and "missing" in str(caught.value)
        report = safeckpt.verify(mgr.path(step))
        assert not report.ok and gone.name in " ".join(report.problems)
    assert mgr.steps() == []
    with pytest.raises(safeckpt.CorruptCheckpointError, match="could be restored"):
        safeckpt.CheckpointManager(root).restore(blank(layered_state(0)))
    info = mgr.save(4, layered_state(4))
    assert info.shared_bytes == 0 and all(not is_shared(n) for n in info.files)
    assert info.bytes >= nbytes(layered_state(4))
    assert mgr.steps() == [4]
    assert_loads(mgr.path(4), layered_state(4))
    info = mgr.save(5, layered_state(5))  # and sharing starts again from there
    assert 0 < info.bytes < 2048 * 8 + 4096 and info.shared_bytes > 0
    assert_loads(mgr.path(5), layered_state(5))
    for step in (1, 2, 3):  # evidence kept by the automatic gc
        assert any(n.startswith("manifest-") for n in os.listdir(root / step_folder(step)))
    removed = mgr.gc()
    assert {r.split("/")[0] for r in removed} == {step_folder(s) for s in (1, 2, 3)}, removed
    check_reachability(root, mgr)
    mgr.close()


class _DeletesWhileSaving(LocalStorage):
    """A local disk where another process deletes ``victim`` just as a data file is
    being written (a gc elsewhere, or a person cleaning up)."""

    victim: ClassVar[list] = []

    def child(self, name):
        return _DeletesWhileSaving(self._full(name), fs=self.fs)

    def parent(self):
        return _DeletesWhileSaving(os.path.dirname(self.path), fs=self.fs)

    def write_file(self, name, parts):
        if name.startswith("data-") and self.victim:
            os.unlink(self.victim.pop())
        return super().write_file(name, parts)


def test_a_shared_file_deleted_during_the_save_aborts_it(tmp_path):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(_DeletesWhileSaving(str(root)), incremental=True, chunk_size=4096)
    for step in (1, 2):
        mgr.save(step, layered_state(step))
    victim = only_data_file(root / step_folder(1))
    _DeletesWhileSaving.victim.append(str(victim))
    with pytest.raises(safeckpt.SaveAbortedError) as caught:
        mgr.save(3, layered_state(3))
    message = str(caught.value)
    assert victim.name in message and "missing" in message and "Save again" in message
    assert not (root / step_folder(3)).exists()  # nothing committed, its data file removed
    assert not _DeletesWhileSaving.victim
    info = mgr.save(3, layered_state(3))  # the retry writes what it cannot share
    assert info.shared_bytes == 0 and info.bytes >= nbytes(layered_state(3))
    assert_loads(mgr.path(3), layered_state(3))
    mgr.close()


# --------------------------------------------------------------------------- 8. tampering


def test_a_flipped_byte_in_shared_data(tmp_path):
    """Every checkpoint that reads the damaged chunk fails to load (and to verify) with a
    CorruptCheckpointError naming the file (in the folder that holds it) and the tensor;
    the others load. restore() falls back past the damaged ones to the newest checkpoint
    that does not read the chunk; when all of them read it, it raises a
    CorruptCheckpointError listing every step it tried."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, incremental=True, chunk_size=4096)
    for step in (2, 3, 4, 5):
        mgr.save(step, layered_state(step))
    # "slow" changes at steps 2 and 4: step 3 reads step 2's copy, step 5 reads step 4's
    m3 = manifest(mgr.path(3))
    slow = m3.tensors["slow"].chunks[0]
    assert slow.file.startswith(f"../{step_folder(2)}/")
    flip_byte(root / step_folder(2) / slow.file.split("/")[-1], slow.start + 100)
    for step in (2, 3):
        with pytest.raises(safeckpt.CorruptCheckpointError) as caught:
            safeckpt.load(blank(layered_state(step)), mgr.path(step))
        assert step_folder(2) in str(caught.value) and "'slow'" in str(caught.value)
        with pytest.raises(safeckpt.CorruptCheckpointError):
            safeckpt.load_state(mgr.path(step))
        report = safeckpt.verify(mgr.path(step))
        assert not report.ok and any(step_folder(2) in p and "slow" in p for p in report.problems)
    for step in (4, 5):  # they do not read that chunk
        assert_loads(mgr.path(step), layered_state(step))
    # restore: the newest loads, nothing to fall back from
    target = blank(layered_state(0))
    assert safeckpt.CheckpointManager(root).restore(target) == 5
    assert not differences(target, layered_state(5))

    # the frozen tensor lives in step 2's file and every checkpoint reads it
    frozen_chunk = manifest(mgr.path(5)).tensors["frozen"].chunks[1]
    assert frozen_chunk.file.startswith(f"../{step_folder(2)}/")
    flip_byte(root / step_folder(2) / frozen_chunk.file.split("/")[-1], frozen_chunk.start + 7)
    for step in (2, 3, 4, 5):
        with pytest.raises(safeckpt.CorruptCheckpointError) as caught:
            safeckpt.load(blank(layered_state(step)), mgr.path(step))
        assert step_folder(2) in str(caught.value)
    # restore falls back through every one of them, then raises naming each
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(safeckpt.CorruptCheckpointError) as caught:
            safeckpt.CheckpointManager(root).restore(blank(layered_state(0)))
    message = str(caught.value)
    assert "could be restored" in message, message
    assert all(re.search(rf"\bstep {s}\b", message) for s in (2, 3, 4, 5)) and "'frozen'" in message, message
    mgr.close()


def test_shared_data_that_rotted_spreads_until_a_full_save(tmp_path):
    """Shared data is one copy: a save reuses chunks by the hashes its base recorded, so
    rot in them reaches later checkpoints too (and is detected when they load). With
    ``full_every=N`` every N-th save writes everything, and the run is sound again."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=5, incremental=True, chunk_size=4096, full_every=3)
    for step in (1, 2):
        mgr.save(step, layered_state(step))
    chunk = manifest(mgr.path(2)).tensors["frozen"].chunks[0]
    flip_byte(root / step_folder(1) / chunk.file.split("/")[-1], chunk.start + 3)
    assert not safeckpt.verify(mgr.path(2)).ok
    mgr.save(3, layered_state(3))  # the 3rd save of this manager: a full one
    assert not any(is_shared(f) for f in manifest(mgr.path(3)).files)
    assert_loads(mgr.path(3), layered_state(3))
    mgr.save(4, layered_state(4))  # shares again, with the sound full save
    assert any(is_shared(f) for f in manifest(mgr.path(4)).files)
    assert_loads(mgr.path(4), layered_state(4))
    with pytest.raises(safeckpt.CorruptCheckpointError, match=chunk.file.split("/")[-1]):
        safeckpt.load_state(mgr.path(2))


def test_overwriting_a_shared_checkpoint_keeps_later_ones_loadable(tmp_path):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, incremental=True, chunk_size=4096)
    for step in (1, 2):
        mgr.save(step, layered_state(step))
    safeckpt.save(layered_state(11), mgr.path(1), overwrite=True)
    assert_loads(mgr.path(2), layered_state(2))
    assert_loads(mgr.path(1), layered_state(11))
    assert mgr.steps() == [1, 2]


# --------------------------------------------------------------------------- 9. and 10. other managers


def test_a_non_incremental_continuation_keeps_shared_data(tmp_path):
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, keep_last=3, incremental=True, chunk_size=CHUNK) as inc:
        for step in (1, 2, 3):
            inc.save(step, lora_state(step, dim=256))
    first = only_data_file(root / step_folder(1))
    plain = safeckpt.CheckpointManager(root, keep_last=2)  # incremental=False
    target = blank(lora_state(0, dim=256))
    assert plain.restore(target) == 3
    assert not differences(target, lora_state(3, dim=256))
    info = plain.save(4, lora_state(4, dim=256))
    assert info.shared_bytes == 0 and info.bytes >= nbytes(lora_state(4, dim=256))
    assert manifest(plain.path(4)).version == 3
    # retention deleted 1 and 2; 1 holds the base step 3 still reads
    assert plain.steps() == [3, 4]
    assert set(step_dirs(root)) == {step_folder(1), step_folder(3), step_folder(4)}
    assert sorted(os.listdir(root / step_folder(1))) == sorted([first.name, garbage.RETIRED])
    check_reachability(root, plain)
    for step in (3, 4):
        assert_loads(plain.path(step), lora_state(step, dim=256))
    plain.save(5, lora_state(5, dim=256))
    assert plain.steps() == [4, 5]
    assert set(step_dirs(root)) == {step_folder(4), step_folder(5)}  # nothing references step 1 now
    for step in (4, 5):
        assert_loads(plain.path(step), lora_state(step, dim=256))
    plain.close()


def test_a_new_run_neither_shares_with_nor_deletes_another_run(tmp_path):
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, keep_last=2, incremental=True, chunk_size=CHUNK) as a:
        for step in (1, 2, 3, 4):
            a.save(step, lora_state(step, dim=256))
        a_steps = a.steps()
    assert a_steps == [3, 4]
    a_files = {n: d for n, d in digests_under(root).items() if not n.startswith("safeckpt-writer")}
    full = nbytes(lora_state(0, dim=256))
    b = safeckpt.CheckpointManager(root, keep_last=1, incremental=True, chunk_size=CHUNK)  # no restore
    with pytest.warns(UserWarning, match="another run"):
        first = b.save(10, lora_state(10, dim=256))  # the same base weights as run a
    assert first.shared_bytes == 0 and not any(is_shared(n) for n in first.files)
    assert full <= first.bytes < full + header_slack(40)
    for step in (11, 12):
        info = b.save(step, lora_state(step, dim=256))
        assert info.bytes < 0.3 * first.bytes
        assert all(n.startswith(f"../{step_folder(10)}/") for n in info.files if is_shared(n))
    assert b.gc() == []
    after = digests_under(root)
    assert {n: after.get(n) for n in a_files} == a_files  # run a: untouched, file by file
    assert b.steps() == [3, 4, 12]
    assert set(step_dirs(root)) == {step_folder(s) for s in (1, 3, 4, 10, 12)}
    for step in (3, 4, 12):
        assert_loads(b.path(step), lora_state(step, dim=256))
    b.close()


# --------------------------------------------------------------------------- 11. the command line


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *sys.path]), "COLUMNS": "200"}
ENV.pop("SAFECKPT_STORAGE_OPTIONS", None)
ENV.pop("SAFECKPT_DEBUG", None)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "safeckpt", *map(str, args)], check=False, capture_output=True,
                          text=True, env=ENV, timeout=120, stdin=subprocess.DEVNULL)


def _in_process(capsys, *args) -> subprocess.CompletedProcess:
    """The same command line run in this process (``safeckpt.cli.main``): no interpreter
    start, so the module stays fast; one command still runs as a real subprocess."""
    from safeckpt.cli import main

    argv = [str(a) for a in args]
    capsys.readouterr()
    shown = warnings.showwarning
    try:
        code = main(argv)
    finally:
        warnings.showwarning = shown
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["safeckpt", *argv], code, out, err)


def _ok(p: subprocess.CompletedProcess, code: int = 0) -> str:
    assert p.returncode == code, f"{p.args}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p.stdout


def test_cli_on_an_incremental_run(tmp_path, capsys):
    root = tmp_path / "run"
    states = {}
    with safeckpt.CheckpointManager(root, keep_last=2, incremental=True, chunk_size=CHUNK) as mgr:
        for step in (1, 2, 3, 4):
            states[step] = lora_state(step, dim=256)
            states[step]["lora"]["copy"] = states[step]["lora"]["layer0.A"].clone()  # stored once
            mgr.save(step, states[step])
    assert step_dirs(root) == [step_folder(1), step_folder(3), step_folder(4)]
    # copies: one to tamper with, one where nothing references step 1 any more, one for default gc
    tampered, orphaned, young = tmp_path / "tampered", tmp_path / "orphaned", tmp_path / "young"
    for copy in (tampered, orphaned, young):
        shutil.copytree(root, copy)
    chunk = manifest(str(tampered / step_folder(4))).tensors["base.layer2.weight"].chunks[0]
    flip_byte(tampered / step_folder(1) / chunk.file.split("/")[-1], chunk.start + 1)
    for copy in (orphaned, young):
        with safeckpt.CheckpointManager(copy) as m:
            m.delete(3)
            m.delete(4)
        assert step_dirs(copy) == [step_folder(1)]
    out = tmp_path / "export" / "model.safetensors"
    before = digests_under(root)
    with ThreadPoolExecutor(1) as pool:
        ls_future = pool.submit(_cli, "ls", root)  # python -m safeckpt, while the rest runs here
        ls_json, verify, verify_bad, export = (
            _in_process(capsys, *args) for args in
            [("ls", root, "--json"), ("verify", root), ("verify", tampered),
             ("export", root / step_folder(4), out)])
        ls = ls_future.result()
    gc_root, gc_orphaned, gc_young = (
        _in_process(capsys, *args) for args in
        [("gc", root, "--min-age", "0"), ("gc", orphaned, "--min-age", "0"), ("gc", young)])

    text = _ok(ls)
    header = next(line for line in text.splitlines() if "step" in line and "status" in line)
    assert "owns" in header and "shares" in header
    row1 = next(line for line in text.splitlines() if line.strip().startswith("1 "))
    assert "retired (data still shared)" in row1
    for step in (3, 4):
        row = next(line for line in text.splitlines() if line.strip().startswith(f"{step} "))
        assert "committed" in row and "1.0 MB" in row and " KB" in row  # shares the base, owns the adapters
    assert "3 checkpoint folder(s)" in text and "2 committed" in text and "1 retired" in text

    rows = {r["step"]: r for r in json.loads(_ok(ls_json))}
    assert sorted(rows) == [1, 3, 4] and rows[1]["status"] == "retired"
    for step in (3, 4):
        m = manifest(str(root / step_folder(step)))
        assert rows[step]["status"] == "committed"
        assert rows[step]["bytes"] == m.total_bytes and rows[step]["shared_bytes"] == m.shared_bytes()
        assert rows[step]["shared_bytes"] == nbytes(frozen(4, 256)) and rows[step]["bytes"] < rows[step]["shared_bytes"]

    text = _ok(verify)
    lines = text.splitlines()
    assert any(line.startswith("committed ") and line.rstrip().endswith(")") and step_folder(4) in line for line in lines)
    assert any(line.startswith("committed ") and step_folder(3) in line for line in lines)
    assert any(line.startswith("retired") and step_folder(1) in line for line in lines)
    assert text.rstrip().endswith(": 2 committed, 1 retired")

    text = _ok(verify_bad, code=1)
    for step in (3, 4):
        assert any(line.startswith("CORRUPT") and step_folder(step) in line for line in text.splitlines())
    assert "base.layer2.weight" in text and step_folder(1) in text and "0 committed, 2 corrupt" in text

    _ok(export)
    from safetensors.torch import load_file
    exported = load_file(str(out))
    want = {f"{k}.{n}": t for k in ("base", "lora") for n, t in states[4][k].items()}
    assert sorted(exported) == sorted(want)
    for name, t in want.items():
        assert exact(exported[name], t), name

    assert "nothing to remove" in _ok(gc_root)
    assert digests_under(root) == before
    text = _ok(gc_orphaned)
    assert "removed 2 file(s)" in text and garbage.RETIRED in text
    assert step_dirs(orphaned) == []
    assert "nothing to remove" in _ok(gc_young)  # a young save is spared by default (--min-age 3600)
    assert step_dirs(young) == [step_folder(1)]


# --------------------------------------------------------------------------- 12. async


def test_async_incremental_saves(tmp_path):
    root = tmp_path / "run"
    trainable = nbytes(lora_state(1, dim=512)["lora"])
    mgr = safeckpt.CheckpointManager(root, keep_last=2, incremental=True, chunk_size=CHUNK, async_save=True)
    futures = {}
    for step in range(1, 5):
        state = lora_state(step, dim=512)
        futures[step] = mgr.save(step, state)
        assert isinstance(futures[step], safeckpt.SaveFuture)
        for t in state["lora"].values():  # training goes on: the save has its own snapshot
            t.add_(1000)
    infos = {step: f.result(timeout=60) for step, f in futures.items()}
    mgr.wait()
    full = infos[1].bytes
    assert full >= nbytes(lora_state(1, dim=512))
    for step in (2, 3, 4):
        assert trainable <= infos[step].bytes < trainable + HEADER_SLACK
        assert infos[step].bytes < 0.15 * full and infos[step].shared_bytes > 0
    assert mgr.steps() == [3, 4]
    check_reachability(root, mgr)
    for step in (3, 4):
        assert_loads(mgr.path(step), lora_state(step, dim=512))
    target = blank(lora_state(0, dim=512))
    assert mgr.restore(target) == 4 and not differences(target, lora_state(4, dim=512))
    mgr.close()
    resumed = safeckpt.CheckpointManager(root, keep_last=2, incremental=True, chunk_size=CHUNK, async_save=True)
    assert resumed.restore(blank(lora_state(0, dim=512))) == 4
    info = resumed.save(5, lora_state(5, dim=512)).result(timeout=60)
    assert trainable <= info.bytes < trainable + HEADER_SLACK
    resumed.close()
    assert_loads(str(root / step_folder(5)), lora_state(5, dim=512))


# --------------------------------------------------------------------------- many ranks


def test_two_gloo_ranks_save_incrementally(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import incr_dist_worker as iw

    server = iw.IncrForkServer(SRC)
    try:
        env = {"SAFECKPT_TIMEOUT": "30", "DIST_WORKER_STEP_TIMEOUT": "60"}
        saved = server.launch(2, ["incr_save2"], tmp_path, tmp_path / "launch-save", timeout=120, env=env)
        res = saved.results("incr_save2")
        loaded = server.launch(2, ["incr_load2"], tmp_path, tmp_path / "launch-load", timeout=120, env=env)
        loads2 = loaded.results("incr_load2")
    finally:
        server.close()
    row = iw.EMB_SHAPE[1] * 4
    full = iw.EMB_SHAPE[0] * row + 4 * iw.FROZEN_SHAPE[0] * iw.FROZEN_SHAPE[1]
    saves = res[0]["saves"]
    assert res[1]["saves"] == saves  # every rank got the same summary
    assert full <= saves["1"]["bytes"] < full + 8192
    for step in (2, 3):  # only the touched embedding chunks, spread over the ranks that hold them
        n = iw.touched_chunks(step)
        assert n * iw.CHUNK <= saves[str(step)]["bytes"] < n * iw.CHUNK + 2048, saves[str(step)]
        assert saves[str(step)]["shared_bytes"] > 0
    own3 = [f for f in saves["3"]["files"] if not is_shared(f)]
    assert sorted(f.split("-")[-1] for f in own3) == ["r00000.safetensors", "r00001.safetensors"]
    assert [s["steps"] for s in saves.values()] == [[1], [1, 2], [2, 3]]
    for r, data in enumerate(res):
        for step, problems in data["loads"].items():
            assert problems == [], (r, step, problems)
        assert data["restored"] == 3 and data["restored_problems"] == [], (r, data)
    for r, data in enumerate(loads2):
        assert sorted(data) == ["2", "3"] and all(p == [] for p in data.values()), (r, data)
    root = tmp_path / "incr2"
    assert step_dirs(root) == [step_folder(1), step_folder(2), step_folder(3)]
    assert garbage.RETIRED in os.listdir(root / step_folder(1))
    # one process (1 rank) reads every kept checkpoint whole
    for step in (2, 3):
        got = safeckpt.load_state(str(root / step_folder(step)))
        assert exact(got["emb"], iw.emb_full(step)) and exact(got["frozen"], iw.frozen_full())
        assert got["step"] == step
        assert safeckpt.verify(str(root / step_folder(step))).ok
