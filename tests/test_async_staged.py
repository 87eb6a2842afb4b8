"""Async saves of one process, handed to the writer process (``async_mode`` "process")
or staged on the caller for a background thread ("thread"): the background thread of
the saving process runs almost no Python, and what a save commits is exactly what a
synchronous save of the same state commits: views, tied weights, mixed dtypes,
conj/neg views, pieces that span several checksum blocks; errors reach the future as
typed errors and leave the previous checkpoint."""

from __future__ import annotations

import errno
import sys
import threading
import time

import pytest
import torch

import safeckpt
from safeckpt.protocol.checkpoint import save_request
from safeckpt.run import asyncsave, writer
from safeckpt.format.checksum import BLOCK_SIZE, checksum
from safeckpt.format.folder import read_committed
from safeckpt.protocol.datafile import COALESCE_BELOW, WrittenPiece
from safeckpt.format.compact import from_entries
from safeckpt.format.manifest import Chunk, TensorEntry
from safeckpt.protocol.staged import Placeholders
from safeckpt.storage import open as open_storage
from safeckpt.storage.local import LocalStorage
from safeckpt.testing import FaultyStorage


@pytest.fixture(autouse=True)
def _no_error_left_behind():
    yield
    if asyncsave._default is not None:
        asyncsave._default.wait()


def _mixed_state() -> dict:
    """Small and large pieces interleaved (regions between large buffers), views of one
    base, a tied weight, strided/conj/neg views, many dtypes, 0-d and empty tensors, and
    one piece spanning more than one 16 MiB checksum block."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 64, generator=g)
    emb = torch.randn(300, 1024, generator=g)  # 1.2 MB: a large piece
    z = torch.randn(40, generator=g, dtype=torch.complex64)
    return {
        "model": {
            "emb": emb, "head": emb,  # tied
            "row": base[3], "cols": base[:, 5], "t": base.t(), "blk": base[8:16, 8:40],
            "big": torch.randn(BLOCK_SIZE // 4 + 1000, generator=g),  # two blocks
            "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
            "f16": torch.randn(7, generator=g).to(torch.float16),
            "f64": torch.randn(5, generator=g, dtype=torch.float64),
            "i8": torch.randint(-100, 100, (11,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
            "i64": torch.randint(0, 1 << 40, (9,), generator=g),
            "mask": torch.rand(17, generator=g) > 0.5,
            "conj": z.conj(), "neg": torch.randn(6, generator=g)._neg_view(),
            "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
            "wide_t": torch.randn(600, 512, generator=g).t(),  # a large strided view
        },
        "optim": {"state": {i: {"m": torch.full((50 + i,), float(i))} for i in range(40)}, "lr": 0.1},
        "step": 12,
    }


def _values(state: dict) -> dict:
    """Every tensor of a loaded state as a plain tensor (conj/neg views resolved)."""
    out = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, torch.Tensor):
            out[prefix] = node.resolve_conj().resolve_neg().clone()
    walk("", state)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_staged_save_commits_what_a_sync_save_commits(tmp_path, async_mode):
    state = _mixed_state()
    expect = _values(state)
    fut = safeckpt.async_save(state, tmp_path / "async")
    for t in _values_in_place(state):  # the training goes on: the snapshot must not see it
        t.add_(1)
    info = fut.result(timeout=120)
    safeckpt.save(_mixed_state(), tmp_path / "sync")

    got = safeckpt.load_state(tmp_path / "async")
    _assert_same(_values(got), expect)
    assert got["step"] == 12 and got["optim"]["lr"] == 0.1
    assert safeckpt.verify(tmp_path / "async").ok
    a = read_committed(open_storage(tmp_path / "async"))
    s = read_committed(open_storage(tmp_path / "sync"))
    assert a.tensors.keys() == s.tensors.keys()
    for name, entry in a.tensors.items():  # the same bytes and the same checksums, block by block
        assert [(c.end - c.start, c.checksums, c.offsets, c.shape) for c in entry.chunks] == \
               [(c.end - c.start, c.checksums, c.offsets, c.shape) for c in s.tensors[name].chunks], name
    assert len(a.tensors["model.big"].chunks[0].checksums) == 2
    assert a.tensors["model.head"].chunks == a.tensors["model.emb"].chunks  # tied: stored once
    assert info.bytes == a.total_bytes


def _values_in_place(state: dict) -> list[torch.Tensor]:
    """The state's tensors that can be changed in place (not lazy conj/neg views)."""
    out: list[torch.Tensor] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, torch.Tensor) and not (node.is_conj() or node.is_neg()) and node.dtype != torch.bool:
            out.append(node)
    walk(state)
    seen: set[int] = set()
    return [t for t in out if not (t.data_ptr() in seen or seen.add(t.data_ptr()))]  # one add_ per storage


def test_staging_packs_small_pieces_into_regions_and_reuses_them(tmp_path, monkeypatch):
    monkeypatch.setenv(writer.ENV, "thread")
    state = {"small": [torch.full((100 + i,), float(i)) for i in range(500)],
             "large": torch.arange(COALESCE_BELOW // 4 * 3, dtype=torch.float32)}
    safeckpt.async_save(state, tmp_path / "a").result(timeout=60)
    pool = asyncsave._default.pool
    regions = [k for k in pool.buffers if k.startswith("region:")]
    assert len(regions) == 1, pool.buffers.keys()  # 500 small tensors: one buffer, one write
    assert pool.nbytes == sum(t.nbytes for t in state["small"]) + state["large"].nbytes
    first = {k: b.data_ptr() for k, b in pool.buffers.items()}
    for t in state["small"]:
        t.mul_(-1)
    safeckpt.async_save(state, tmp_path / "b").result(timeout=60)
    assert {k: b.data_ptr() for k, b in pool.buffers.items()} == first
    got = safeckpt.load_state(tmp_path / "b")
    assert all(torch.equal(a, b) for a, b in zip(got["small"], state["small"]))
    assert safeckpt.load_state(tmp_path / "a")["small"][3][0].item() == 3.0


def test_background_thread_runs_no_python_per_tensor(tmp_path, async_mode):
    """Count the Python calls made on the saving process's threads of a save after
    ``submit`` returned: a constant (per region and per large piece, for a save on a
    thread), never per tensor."""
    calls = {"n": 0}
    ours = {"safeckpt-async-save", "safeckpt-hash", "safeckpt-writer-answers"}

    def profile(frame, event, arg):
        if event == "call" and threading.current_thread().name.split("_")[0] in ours:
            calls["n"] += 1

    def counted(n_small: int) -> int:
        state = {"opt": {f"p{i}": torch.full((64,), float(i)) for i in range(n_small)},
                 "w": torch.zeros(1 << 19)}
        saver = asyncsave.AsyncSaver()  # its thread (and the writer's reader) start below, profiled
        try:
            saver.submit(state, save_request(tmp_path / f"warm{n_small}")).result(timeout=60)
            calls["n"] = 0
            saver.submit(state, save_request(tmp_path / f"n{n_small}")).result(timeout=60)
            return calls["n"]
        finally:
            saver.close()

    writer.stop()
    threading.setprofile(profile)
    try:
        few, many = counted(100), counted(4000)
    finally:
        threading.setprofile(None)
    assert many - few < 200, f"{few} Python calls for 100 tensors, {many} for 4,000: work per tensor"
    assert few > 0, "nothing was counted: the profile missed the save's threads"


def test_large_data_is_hashed_with_the_gil_released():
    """While one thread checksums a large buffer, the main thread keeps running Python."""
    data = memoryview(bytearray(256 << 20))
    span: dict[str, float] = {}

    def hash_it() -> None:
        span["start"] = time.perf_counter()
        for _ in range(2):  # long enough that a busy machine schedules the main thread meanwhile
            checksum(data)
        span["end"] = time.perf_counter()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # holding the GIL, the hashing thread would keep it throughout
    inside = 0
    try:
        worker = threading.Thread(target=hash_it)
        worker.start()
        while worker.is_alive():
            inside += "start" in span and "end" not in span
        worker.join()
    finally:
        sys.setswitchinterval(old)
    assert inside, f"the main thread did not run while {len(data) >> 20} MiB were hashed"


def test_gil_released_and_one_shot_checksums_agree():
    import xxhash

    for n in (0, 1, (64 << 10) - 1, 64 << 10, (1 << 20) + 3):
        data = bytes((i * 7) % 251 for i in range(n))
        assert checksum(data) == f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}", n
        assert checksum(data, "xxh3_128") == f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}", n


def _table_with(pieces: list[WrittenPiece], extra: "dict[str, list[str]] | None" = None):
    """The tensor table of a manifest whose tensors are ``pieces`` (one chunk each) and
    ``extra`` (a name -> block checksums, a chunk of one block each)."""
    file = "data-x-r00000.safetensors"
    tensors = {p.name: TensorEntry("float32", [(p.end - p.start) // 4],
                                   [Chunk(file, p.start, p.end, p.checksums, [0], [(p.end - p.start) // 4])])
               for p in pieces}
    tensors.update({name: TensorEntry("float32", [2], [Chunk(file, 0, 8, sums, [0], [2])])
                    for name, sums in (extra or {}).items()})
    return from_entries(tensors, [file], BLOCK_SIZE)


def test_placeholders_are_patched_in_the_table_or_it_is_built_again():
    pieces = [WrittenPiece("a", 8, 8 + 2 * BLOCK_SIZE + 4), WrittenPiece("b", 8 + 2 * BLOCK_SIZE + 4, 8 + 3 * BLOCK_SIZE)]
    for collide in (False, True):
        mine = [WrittenPiece(p.name, p.start, p.end) for p in pieces]
        holes = Placeholders(mine)
        # a small piece whose real checksum equals a stand-in: patching by position is off
        table = _table_with(mine, {"small": [holes._text(1) if collide else checksum(b"small")]})
        holes.locate(table)
        assert (holes.at is None) == collide
        with pytest.raises(RuntimeError):
            holes.patch(table)  # never a manifest with a placeholder in it
        for n, (piece, k) in enumerate(holes.slots):
            piece.checksums[k] = checksum(f"block {n}".encode())
        assert holes.patch(table) is not collide
        if not collide:
            assert [c.checksums for name in ("a", "b") for c in table[name].chunks] == \
                   [[checksum(f"block {n}".encode()) for n in range(3)], [checksum(b"block 3")]]
            assert table["small"].chunks[0].checksums == [checksum(b"small")]


def test_a_large_piece_and_many_small_ones_commit_with_their_real_checksums(tmp_path, async_mode):
    state = {"big": torch.randn(3 * BLOCK_SIZE // 4 + 5), **{f"t{i}": torch.randn(16) for i in range(300)}}
    safeckpt.async_save(state, tmp_path / "c").result()
    report = safeckpt.verify(tmp_path / "c")
    assert report.ok, report.problems
    m = read_committed(open_storage(tmp_path / "c"))
    assert all(":" in s and s.partition(":")[2] != "" for c in m.tensors["big"].chunks for s in c.checksums)
    out = safeckpt.load_state(tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_failed_manifest_write_reaches_the_future_and_keeps_the_previous_checkpoint(tmp_path):
    storage = FaultyStorage(LocalStorage(tmp_path / "ckpt"))
    old = _mixed_state()
    safeckpt.save(old, storage)
    storage.inject("write_file", errno.EIO, path="manifest-")
    new = _mixed_state()
    new["step"] = 13
    fut = safeckpt.async_save(new, storage, overwrite=True)
    with pytest.raises(safeckpt.StorageError) as err:
        fut.result(timeout=120)
    assert err.value.errno == errno.EIO
    storage.faults.clear()
    got = safeckpt.load_state(tmp_path / "ckpt")
    assert got["step"] == 12
    _assert_same(_values(got), _values(old))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("data-")) == \
           sorted(read_committed(open_storage(tmp_path / "ckpt")).files), "the failed save's data file was left"


def test_a_failed_manifest_write_in_either_mode_keeps_the_previous_checkpoint(tmp_path, async_mode):
    """The same as above through the faults of ``async_mode`` (the writer process's own)."""
    path = tmp_path / "ckpt@eio"
    old = _mixed_state()
    _save_outside_the_faults(old, path)
    new = _mixed_state()
    new["step"] = 13
    fut = safeckpt.async_save(new, path, overwrite=True)
    with pytest.raises(safeckpt.StorageError) as err:
        fut.result(timeout=120)
    assert err.value.errno == errno.EIO, err.value
    got = safeckpt.load_state(path)
    assert got["step"] == 12
    _assert_same(_values(got), _values(old))
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(("data-", "manifest-"))) == \
           sorted([*read_committed(open_storage(path)).files, "manifest-000001.json"])


def _save_outside_the_faults(state: dict, path) -> None:
    """Save ``state`` at ``path`` without the faults its name asks for (saved elsewhere, moved)."""
    elsewhere = path.parent / "plain"
    safeckpt.save(state, elsewhere)
    elsewhere.rename(path)


def test_a_refused_save_fails_its_future_and_writes_nothing(tmp_path, async_mode):
    safeckpt.save({"w": torch.ones(3)}, tmp_path / "c")
    before = sorted(p.name for p in (tmp_path / "c").iterdir())
    fut = safeckpt.async_save({"w": torch.zeros(3)}, tmp_path / "c")
    with pytest.raises(safeckpt.CheckpointExistsError):
        fut.result(timeout=60)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == before


def test_a_bad_state_raises_from_async_save_itself(tmp_path, async_mode):
    with pytest.raises(safeckpt.UnsafeObjectError):
        safeckpt.async_save({"q": torch.ones(4).to_sparse()}, tmp_path / "q")
    assert not (tmp_path / "q").exists() or not any((tmp_path / "q").iterdir())


def test_regions_of_the_same_size_each_keep_their_own_bytes(tmp_path, monkeypatch):
    """Every region of a staged save has a buffer of its own, even when two regions are
    the same size (they once shared one: the last region's bytes were written for all)."""
    from safeckpt.protocol import staging
    monkeypatch.setenv(writer.ENV, "thread")
    monkeypatch.setattr(staging, "STAGED_REGION", 4096)  # regions of exactly four 1 KiB pieces
    state = {f"t{i:03d}": torch.full((256,), float(i)) for i in range(40)}
    safeckpt.async_save(state, tmp_path / "c").result(timeout=60)
    regions = [k for k in asyncsave._default.pool.buffers if k.startswith("region:")]
    assert len(regions) == 10
    got = safeckpt.load_state(tmp_path / "c")
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert safeckpt.verify(tmp_path / "c").ok
