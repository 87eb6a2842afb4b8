"""Format 3: the tensor table (compact.py) and the paths that read it.

Saves write format 3; what they write must load exactly like the per-tensor entries of
format 1 (mixed dtypes, views and tied weights inside small-tensor regions, boxes that
straddle chunks); a crafted table — an index out of range, a negative or overflowing
offset, a length that does not match, a shape that overflows, a truncated column — is a
``CorruptCheckpointError`` naming the manifest, never another exception.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import safeckpt
from safeckpt.format.compact import TensorTable, pack
from safeckpt.format.folder import read_committed
from safeckpt.format.manifest import decode_manifest, editable, encode_manifest, frame
from safeckpt.format.plan import overlap
from safeckpt.format.tensors import dtype_from_name
from safeckpt.storage import open as open_storage

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.complex64,
          torch.float8_e4m3fn, torch.int8, torch.float64]


def _manifest(ckpt: Path) -> Path:
    (path,) = sorted(ckpt.glob("manifest-*.json"))
    return path


def _body(ckpt: Path) -> dict:
    data = _manifest(ckpt).read_bytes()
    return json.loads(data[len(b'{"safeckpt":'):data.rindex(b',"checksum":')])


def _write_body(ckpt: Path, body: dict) -> Path:
    path = _manifest(ckpt)
    path.write_bytes(frame(json.dumps(body).encode()))
    return path


def _column(body: dict, name: str) -> np.ndarray:
    raw = body["tensors"]["columns"][name]
    return np.frombuffer(zlib.decompress(base64.b64decode(raw)), dtype="<i8").copy()


_COLUMNS = ["dtype", "ndim", "chunks", "tied", "shape", "file", "start", "length", "algorithm", "offsets", "box"]


def mixed_state() -> dict:
    """Small tensors of every kind in one region: dtypes, views, a tie, empty, 0-dim."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(16, 16, generator=g)
    state: dict = {f"t{i:03d}": (torch.randn(2 + i % 7, generator=g) * 9).to(DTYPES[i % len(DTYPES)])
                   for i in range(60)}
    state.update(view=base[2::3, 1::2], transposed=base.t(), tied=state["t004"], empty=torch.zeros(0, 5),
                 scalar=torch.tensor(-2, dtype=torch.int16), step=9)
    return state


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and got.shape == want.shape and torch.equal(
            got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
            want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
    return got == want


def test_a_save_writes_format_3_and_loads_back_exactly(tmp_path):
    state = mixed_state()
    safeckpt.save(state, tmp_path / "c")
    m = decode_manifest(_manifest(tmp_path / "c").read_bytes(), "m")
    assert m.version == 3 and isinstance(m.tensors, TensorTable)
    assert m.tensors["tied"].tied_to == "t004" and m.tensors["t004"].tied_to is None
    loaded = safeckpt.load_state(tmp_path / "c")
    assert all(same(loaded[k], v) for k, v in state.items()), [k for k, v in state.items() if not same(loaded[k], v)]
    assert loaded["tied"] is loaded["t004"]  # tied weights come back tied
    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    template["tied"] = template["t004"]
    safeckpt.load(template, tmp_path / "c")
    assert all(same(template[k], v) for k, v in state.items())
    assert safeckpt.verify(tmp_path / "c").ok


def test_format_3_decodes_to_the_entries_format_1_holds(tmp_path):
    """The same checkpoint re-encoded as format 1 gives equal tensors, chunk by chunk."""
    safeckpt.save(mixed_state(), tmp_path / "c")
    path = _manifest(tmp_path / "c")
    v3 = decode_manifest(path.read_bytes(), "m")
    v1 = decode_manifest(encode_manifest(dataclasses.replace(v3, version=1, tensors=editable(v3.tensors))), "m")
    assert v1.version == 1 and list(v1.tensors) == list(v3.tensors)
    for name, entry in v1.tensors.items():
        table = v3.tensors[name]
        assert (table.dtype, table.shape, table.chunks) == (entry.dtype, entry.shape, entry.chunks), name


def _sharded_run(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A 2-d tensor saved in many chunks (an incremental save cuts it into row runs)."""
    full = torch.arange(37 * 11, dtype=torch.float32).reshape(37, 11)
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, incremental=True, chunk_size=64) as mgr:
        mgr.save(1, {"w": full, "v": full[:, 3:5].clone().to(torch.int16)})
    return root / "step-000000001", full


@pytest.mark.parametrize("box", [((0, 0), (37, 11)), ((5, 3), (9, 4)), ((1, 0), (1, 11)), ((36, 10), (1, 1)),
                                 ((3, 7), (30, 4)), ((0, 0), (0, 11))])
def test_boxes_straddling_chunks_read_exactly_their_part(tmp_path, box):
    ckpt, full = _sharded_run(tmp_path)
    m = decode_manifest(_manifest(ckpt).read_bytes(), "m")
    entry = m.tensors["w"]
    assert len(entry.chunks) > 20  # really cut into many chunks
    meeting = entry.meeting(box)
    assert meeting == [c for c in entry.chunks if overlap(box, (tuple(c.offsets), tuple(c.shape)))]
    (o0, o1), (s0, s1) = box
    local = torch.zeros(s0, s1)
    safeckpt.load({"w": safeckpt.Shard(local, [37, 11], [o0, o1]), "v": torch.zeros(37, 2, dtype=torch.int16)},
                  ckpt, strict=False)
    assert torch.equal(local, full[o0:o0 + s0, o1:o1 + s1])


# --------------------------------------------------------------------------- crafted tables


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ck"
    safeckpt.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2), "h": torch.zeros(2, 2, dtype=torch.int8),
                   "step": 7}, path)
    return path


def _col(name: str, change: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        body["tensors"]["columns"][name] = pack(change(_column(body, name)))
    return mutate


def _at(i: int, value: int) -> Callable[[np.ndarray], np.ndarray]:
    def change(a: np.ndarray) -> np.ndarray:
        a[i] = value
        return a
    return change


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        body["tensors"][key] = value
    return mutate


def _overlapping(body: dict) -> None:
    """``w`` as two chunks of 6 elements each, the second overlapping the first: the
    volumes add up, the boxes do not tile (and are no grid)."""
    cols = {k: _column(body, k) for k in ("chunks", "file", "start", "length", "algorithm", "offsets", "box")}
    cols["chunks"][0] = 2
    start, length = int(cols["start"][0]), int(cols["length"][0])
    cols["start"] = np.insert(cols["start"], 1, start)
    cols["length"] = np.insert(cols["length"], 1, 24)
    cols["length"][0] = 24
    cols["file"] = np.insert(cols["file"], 1, cols["file"][0])
    cols["algorithm"] = np.insert(cols["algorithm"], 1, 0)
    cols["offsets"] = np.concatenate(([0, 0, 1, 1], cols["offsets"][2:]))  # rows 0-1 x cols 0-2 and 1-2 x 1-3
    cols["box"] = np.concatenate(([2, 3, 2, 3], cols["box"][2:]))
    digests = base64.b64decode(body["tensors"]["digests"])
    body["tensors"]["digests"] = base64.b64encode(digests[:8] + digests).decode()
    for k, v in cols.items():
        body["tensors"]["columns"][k] = pack(v)
    assert length == 48


def _bomb(body: dict) -> None:
    body["tensors"]["columns"]["file"] = base64.b64encode(zlib.compress(bytes(1 << 28), 9)).decode()


CRAFTED = {
    "file index out of range": _col("file", _at(0, 5)),
    "file index negative": _col("file", _at(1, -1)),
    "dtype index out of range": _col("dtype", _at(0, 9)),
    "algorithm index out of range": _col("algorithm", _at(0, 1)),
    "negative start": _col("start", _at(0, -8)),
    "start past the file": _col("start", _at(0, 1 << 40)),
    "overflowing start": _col("start", _at(0, 2**63 - 4)),
    "length mismatch": _col("length", _at(0, 44)),
    "overflowing length": _col("length", _at(0, 2**63 - 1)),
    "negative offset": _col("offsets", _at(0, -1)),
    "box outside the tensor": _col("offsets", _at(1, 2)),
    "box larger than the tensor": _col("box", _at(0, 4)),
    "overflowing box": _col("box", _at(0, 2**62)),
    "negative dimension": _col("shape", _at(0, -3)),
    "shape overflow": _col("shape", _at(0, 2**62)),
    "65 dimensions": _col("ndim", _at(0, 65)),
    "chunk count negative": _col("chunks", _at(0, -1)),
    "chunk count huge": _col("chunks", _at(0, 2**62)),
    "a tensor without its chunk": _col("chunks", _at(0, 0)),
    "tied to itself": _col("tied", _at(0, 0)),
    "tied out of range": _col("tied", _at(0, 3)),
    "truncated column": _col("start", lambda a: a[:-1]),
    "column too long": _col("box", lambda a: np.append(a, 1)),
    "column cut mid-value": lambda body: body["tensors"]["columns"].__setitem__(
        "start", base64.b64encode(zlib.compress(_column(body, "start").tobytes()[:-3])).decode()),
    "column not base64": lambda body: body["tensors"]["columns"].__setitem__("length", "!!"),
    "column not deflated": lambda body: body["tensors"]["columns"].__setitem__("length", "AAAA"),
    "column missing": lambda body: body["tensors"]["columns"].pop("offsets"),
    "column inflates to 256 MiB": _bomb,
    "digests truncated": lambda body: body["tensors"].__setitem__("digests", body["tensors"]["digests"][:-4]),
    "digests not base64": _set("digests", "$$$$"),
    "names duplicated": lambda body: body["tensors"]["names"].__setitem__(1, body["tensors"]["names"][0]),
    "names not strings": lambda body: body["tensors"]["names"].__setitem__(0, 3),
    "names missing one": lambda body: body["tensors"]["names"].pop(),
    "dtype unknown": _set("dtypes", ["float99", "int8"]),
    "algorithm unknown": _set("algorithms", ["md5"]),
    "columns not an object": _set("columns", [1]),
    "overlapping chunks": _overlapping,
    "tensors a list": lambda body: body.__setitem__("tensors", [1]),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_table_is_a_corrupt_checkpoint(ckpt, case):
    body = _body(ckpt)
    CRAFTED[case](body)
    manifest = _write_body(ckpt, body)
    for call in (lambda: safeckpt.load_state(ckpt), lambda: safeckpt.load_state(ckpt, verify=False),
                 lambda: safeckpt.load({"w": torch.zeros(3, 4)}, ckpt, strict=False)):
        with pytest.raises(safeckpt.CorruptCheckpointError) as info:
            call()
        assert manifest.name in str(info.value), info.value
    report = safeckpt.verify(ckpt)
    assert not report.ok and manifest.name in report.problems[0]


def test_a_torn_format_3_manifest_is_not_a_commit(tmp_path):
    """Cut anywhere, inside the table too, the manifest is invalid; the older one wins."""
    safeckpt.save({"a": torch.ones(3)}, tmp_path / "c")
    safeckpt.save({"a": torch.full((3,), 2.0)}, tmp_path / "c", overwrite=True)
    (path,) = sorted((tmp_path / "c").glob("manifest-*.json"))
    data = path.read_bytes()
    for cut in (len(data) // 3, data.index(b'"columns"') + 20, len(data) - 2):
        path.write_bytes(data[:cut])
        with pytest.raises(safeckpt.CorruptCheckpointError, match=path.name):
            safeckpt.load_state(tmp_path / "c")
    path.write_bytes(data)
    assert torch.equal(safeckpt.load_state(tmp_path / "c")["a"], torch.full((3,), 2.0))


# --------------------------------------------------------------------------- memory bombs (issue 24, item 8)


@functools.lru_cache(maxsize=None)
def _zeros(nbytes: int, tail: bytes = b"") -> str:
    """A packed column of ``nbytes`` zero bytes (deflated ~1000:1), made without holding
    them; ``tail``: bytes after the stream."""
    z, piece = zlib.compressobj(9), bytes(min(nbytes, 1 << 20))
    out = [z.compress(piece[:min(len(piece), nbytes - done)]) for done in range(0, nbytes, len(piece))]
    return base64.b64encode(b"".join(out) + z.flush() + tail).decode()


def _claim_chunks(n: int) -> Callable[[dict], None]:
    """The first tensor (1-d) claims ``n`` chunks: every chunk column holds ``n`` zeros
    (the issue's bomb)."""
    def mutate(body: dict) -> None:
        cols = body["tensors"]["columns"]
        cols["chunks"] = pack(np.concatenate(([n], _column(body, "chunks")[1:])))
        for k in ("file", "start", "length", "algorithm", "offsets", "box"):
            cols[k] = _zeros(8 * n)
    return mutate


def _claim_dims(tensors: int) -> Callable[[dict], None]:
    """``tensors`` tensors of 64 dimensions each and no chunks (zero elements): a shape
    column of 64 values per name, deflated to nothing."""
    def mutate(body: dict) -> None:
        t = body["tensors"]
        t["names"] = [f"{i:x}" for i in range(tensors)]
        t["columns"].update(dtype=_zeros(8 * tensors), ndim=pack(np.full(tensors, 64)), chunks=_zeros(8 * tensors),
                            tied=pack(np.full(tensors, -1)), shape=_zeros(512 * tensors),
                            **{k: pack([]) for k in ("file", "start", "length", "algorithm", "offsets", "box")})
        t["digests"] = ""
        body["tree"] = {}
    return mutate


def _claim_boxes(chunks: int) -> Callable[[dict], None]:
    """One tensor of 64 dimensions and zero elements in ``chunks`` empty chunks, each with
    its digest: 128 box values per 8 digest bytes."""
    def mutate(body: dict) -> None:
        t = body["tensors"]
        t["names"], t["dtypes"] = ["w"], ["float32"]
        t["columns"].update(dtype=pack([0]), ndim=pack([64]), chunks=pack([chunks]), tied=pack([-1]),
                            shape=pack(np.zeros(64)), file=_zeros(8 * chunks), start=_zeros(8 * chunks),
                            length=_zeros(8 * chunks), algorithm=_zeros(8 * chunks), offsets=_zeros(512 * chunks),
                            box=_zeros(512 * chunks))
        t["digests"] = base64.b64encode(np.random.default_rng(0).bytes(8 * chunks)).decode()
        body["tree"] = {"w": {"$tensor": "w"}}
    return mutate


def _bomb_in(column: str) -> Callable[[dict], None]:
    """A zlib stream of 32 MB (deflated to 32 KB) where a small column belongs."""
    return lambda body: body["tensors"]["columns"].__setitem__(column, _zeros(32_000_000))


def _tail(column: str) -> Callable[[dict], None]:
    """Bytes after a column's complete stream (which holds exactly its values)."""
    def mutate(body: dict) -> None:
        raw = zlib.compress(_column(body, column).tobytes())
        body["tensors"]["columns"][column] = base64.b64encode(raw + b"\x00" * 8).decode()
    return mutate


BOMBS = {
    "4 million chunks in a 255 KB manifest": _claim_chunks(4_000_000),
    "64 dimensions for each of 40,000 tensors": _claim_dims(40_000),
    "64-dimensional boxes for 20,000 chunks": _claim_boxes(20_000),
    **{f"a zlib bomb in column {c!r}": _bomb_in(c) for c in _COLUMNS},
    **{f"bytes after the stream of column {c!r}": _tail(c) for c in ("dtype", "start", "box")},
}


def _measured(call: Callable[[], Any]) -> tuple[Any, float, int]:
    """What ``call`` returns (or the CheckpointError it raises), its seconds and the peak
    of the memory it traced."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        try:
            out = call()
        except safeckpt.CheckpointError as exc:
            out = exc
    finally:
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, seconds, peak


@pytest.mark.parametrize("case", list(BOMBS))
def test_a_manifest_claiming_more_than_it_holds_is_refused_in_bounded_memory(tmp_path, case):
    """Every declared size (counts, column lengths, inflated sizes) is checked against
    the manifest's own length before anything is inflated: a 255 KB manifest claiming 4
    million chunks took 418 MB and 4.7 s before its CorruptCheckpointError, and any
    ``steps()``, ``restore()`` or ``ls`` of its root as much. Now every path refuses it
    with under 20 MB more and well under a second."""
    root = tmp_path / "run"
    ckpt = root / "step-000000001"
    safeckpt.save({"b": torch.ones(2), "w": torch.arange(12.0).reshape(3, 4), "step": 7}, ckpt)
    body = _body(ckpt)
    BOMBS[case](body)
    manifest = _write_body(ckpt, body)
    assert manifest.stat().st_size < 400_000
    mgr = safeckpt.CheckpointManager(root)
    calls = {"load_state": lambda: safeckpt.load_state(ckpt), "verify": lambda: safeckpt.verify(ckpt),
             "ls": lambda: safeckpt.list_checkpoints(root), "steps": mgr.steps}
    outcomes = {name: _measured(call) for name, call in calls.items()}
    mgr.close()
    for name, (_, seconds, peak) in outcomes.items():
        assert peak < 20 << 20, f"{name}: {peak / 2**20:.0f} MiB"
        assert seconds < 1.0, f"{name}: {seconds:.2f} s"
    refused, report, (row,), steps = (outcomes[k][0] for k in calls)
    assert isinstance(refused, safeckpt.CorruptCheckpointError) and manifest.name in str(refused), refused
    assert not report.ok and manifest.name in report.problems[0]
    assert row.state is safeckpt.CheckpointState.CORRUPT and manifest.name in row.problem
    assert steps == []


def test_a_table_that_deflates_too_far_is_written_uncompressed_and_loads(tmp_path):
    """What a reader accepts is bounded by the manifest's length, so a writer never
    writes a table past that bound: 3,000 empty tensors of 64 dimensions (their shapes
    and boxes deflate ~1000:1) are stored uncompressed and load back."""
    state = {f"t{i}": torch.zeros([0] + [1] * 63) for i in range(3000)}
    safeckpt.save(state, tmp_path / "c")
    got = safeckpt.load_state(tmp_path / "c")
    assert all(got[k].shape == v.shape for k, v in state.items())
    body = _body(tmp_path / "c")
    assert len(base64.b64decode(body["tensors"]["columns"]["box"])) > 8 * 64 * 3000  # stored, not deflated
    safeckpt.save({"w": torch.ones(4, 4), "b": torch.ones(4)}, tmp_path / "d")  # a usual table stays deflated
    body = _body(tmp_path / "d")
    assert len(base64.b64decode(body["tensors"]["columns"]["box"])) < 8 * 3


# --------------------------------------------------------------------------- fuzzing

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_VALUES = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**62, 2**63 - 1, -2**63, 1 << 40]))


def _fuzz_column(body: dict, data: st.DataObject) -> None:
    """A column's values (counts, offsets, lengths, dtype and file indices, shapes, ties)
    set out of range, the column cut or grown, its stream cut (its compressed length),
    followed by bytes, replaced by a zlib bomb or by something that is no column."""
    name = data.draw(st.sampled_from(_COLUMNS))
    column = _column(body, name)
    how = data.draw(st.sampled_from(["set", "set", "cut", "grow", "tail", "truncate", "bomb", "garble"]))
    raw = zlib.compress(column.tobytes())
    packed: Any = pack(column)
    if how == "set" and len(column):
        column[data.draw(st.integers(0, len(column) - 1))] = data.draw(_VALUES)
        packed = pack(column)
    elif how == "cut":
        packed = pack(column[:data.draw(st.integers(0, len(column)))])
    elif how == "grow":
        packed = pack(np.append(column, data.draw(_VALUES)))
    elif how == "tail":
        packed = base64.b64encode(raw + data.draw(st.binary(min_size=1, max_size=9))).decode()
    elif how == "truncate":
        packed = base64.b64encode(raw[:data.draw(st.integers(0, len(raw) - 1))]).decode()
    elif how == "bomb":
        packed = _zeros(32_000_000)
    elif how == "garble":
        packed = data.draw(st.sampled_from(["", "!!", "AAAA", "eJw=", 3, None, ["x"]]))
    body["tensors"]["columns"][name] = packed


def _fuzz_tie(body: dict, data: st.DataObject) -> None:
    """A tensor tied to any tensor (or untied): the tie column in range, values mismatched."""
    tied = _column(body, "tied")
    tied[data.draw(st.integers(0, len(tied) - 1))] = data.draw(st.integers(-1, len(tied) - 1))
    body["tensors"]["columns"]["tied"] = pack(tied)


def _fuzz_lists(body: dict, data: st.DataObject) -> None:
    """The names, dtypes and algorithms tables: an entry changed, dropped or added."""
    t = body["tensors"]
    key = data.draw(st.sampled_from(["names", "dtypes", "algorithms"]))
    values = {"names": st.sampled_from(["w", "tied", "x", "", 3]),
              "dtypes": st.sampled_from(["float32", "int16", "int32", "uint8", "bool", "float64", "float99", "half"]),
              "algorithms": st.sampled_from(["xxh3_64", "xxh3_128", "md5"])}[key]
    entries = list(t[key])
    how = data.draw(st.sampled_from(["set", "drop", "add"]))
    if how == "set" and entries:
        entries[data.draw(st.integers(0, len(entries) - 1))] = data.draw(values)
    elif how == "drop" and entries:
        entries.pop(data.draw(st.integers(0, len(entries) - 1)))
    else:
        entries.append(data.draw(values))
    t[key] = entries


def _fuzz_digests(body: dict, data: st.DataObject) -> None:
    """The block checksums: a digest byte flipped, the digests cut, grown or garbled; or
    the block size they are counted by changed."""
    digests = bytearray(base64.b64decode(body["tensors"]["digests"]))
    how = data.draw(st.sampled_from(["flip", "cut", "grow", "garble", "block"]))
    if how == "flip":
        digests[data.draw(st.integers(0, len(digests) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        del digests[data.draw(st.integers(0, len(digests) - 1)):]
    elif how == "grow":
        digests += data.draw(st.binary(min_size=1, max_size=40))
    elif how == "block":
        body["block_size"] = data.draw(st.sampled_from([1, 3, 8, 16, 64, 0, -1, 2**62]))
    if how == "garble":
        body["tensors"]["digests"] = data.draw(st.sampled_from(["$$", "", 7, None]))
    else:
        body["tensors"]["digests"] = base64.b64encode(bytes(digests)).decode()


_FUZZERS = [_fuzz_column, _fuzz_column, _fuzz_column, _fuzz_tie, _fuzz_lists, _fuzz_digests]


def _fuzz_state() -> dict:
    w = torch.arange(40.0).reshape(5, 8)
    return {"w": w, "tied": w, "h": torch.arange(6, dtype=torch.int16).reshape(2, 3), "b": torch.ones(5),
            "e": torch.zeros(0, 3), "s": torch.tensor(-2, dtype=torch.int8), "flags": torch.tensor([True, False])}


@pytest.fixture
def fuzz_ckpt(tmp_path) -> Path:
    """A format-3 checkpoint of every kind of entry: a tie, several dtypes, an empty and
    a 0-d tensor, and tensors cut into several chunks (an incremental save: xxh3_128
    digests, a block size of 64)."""
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, incremental=True, chunk_size=64) as mgr:
        mgr.save(1, _fuzz_state())
    ckpt = root / "step-000000001"
    assert len(decode_manifest(_manifest(ckpt).read_bytes(), "m").tensors["w"].chunks) == 3
    return ckpt


def _as_described(ckpt: Path, entry: Any) -> torch.Tensor:
    """The bytes of a tensor as its manifest entry describes it (shape + [itemsize],
    uint8): its chunks' bytes read from the files as they are and laid into their boxes,
    independently of the reader under test."""
    itemsize = dtype_from_name(entry.dtype, "test").itemsize
    out = torch.zeros(entry.shape + [itemsize], dtype=torch.uint8)
    for c in entry.chunks:
        raw = (ckpt / c.file).read_bytes()[c.start:c.end]
        if raw:
            box = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))
            out[box] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(c.shape + [itemsize])
    return out


def _same_bytes(got: torch.Tensor, entry: Any, want: torch.Tensor) -> bool:
    return str(got.dtype) == f"torch.{entry.dtype}" and list(got.shape) == entry.shape and \
        torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1))


def _fuzz(ckpt: Path, data: st.DataObject) -> None:
    """Craft 1 to 3 fields of the table out of range; then ``load_state`` returns every
    tensor exactly as the manifest's own chunks hold it, or raises a
    CorruptCheckpointError naming the manifest or a data file; ``verify`` says ok only
    when that load succeeded (never for a mismatched tie); each in bounded memory."""
    path = _manifest(ckpt)
    original = path.read_bytes()
    body = _body(ckpt)
    files = [f["name"] for f in body["files"]] + [path.name]
    try:
        for _ in range(data.draw(st.integers(1, 3))):
            try:
                data.draw(st.sampled_from(_FUZZERS))(body, data)
            except (TypeError, ValueError, binascii.Error, zlib.error, AttributeError):
                pass  # an earlier change garbled the field this one changes
        _write_body(ckpt, body)
        loaded, _, peak = _measured(lambda: safeckpt.load_state(ckpt))
        assert peak < 20 << 20, f"load_state: {peak / 2**20:.0f} MiB"
        if isinstance(loaded, BaseException):
            assert isinstance(loaded, safeckpt.CorruptCheckpointError), repr(loaded)
            assert any(f in str(loaded) for f in files), loaded
        else:
            m = read_committed(open_storage(ckpt))
            for name, entry in m.tensors.items():
                assert _same_bytes(loaded[name], entry, _as_described(ckpt, entry)), name
        report, _, peak = _measured(lambda: safeckpt.verify(ckpt))
        assert peak < 20 << 20, f"verify: {peak / 2**20:.0f} MiB"
        assert not report.ok or not isinstance(loaded, BaseException), (report, loaded)
    finally:
        path.write_bytes(original)


_FUZZ = dict(deadline=None, derandomize=True, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.timeout(120)
@settings(max_examples=60, **_FUZZ)
@given(data=st.data())
def test_fuzzed_tables_load_exactly_or_raise_a_corrupt_checkpoint_error(fuzz_ckpt, data):
    _fuzz(fuzz_ckpt, data)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(max_examples=2000, **_FUZZ)
@given(data=st.data())
def test_fuzzed_tables_many_more_examples(fuzz_ckpt, data):
    _fuzz(fuzz_ckpt, data)


def test_the_manifest_grows_by_bytes_per_piece(tmp_path):
    """2,000 more tensors cost the names plus a few bytes per piece, not a JSON entry each."""
    sizes = []
    for n in (1000, 3000):
        safeckpt.save({f"layer{i}.w": torch.ones(3) for i in range(n)}, tmp_path / str(n))
        sizes.append(_manifest(tmp_path / str(n)).stat().st_size)
    per_tensor = (sizes[1] - sizes[0]) / 2000
    names = len(json.dumps([f"layer{i}.w" for i in range(1000, 3000)])) / 2000
    tree = len(json.dumps({f"layer{i}.w": {"$tensor": f"layer{i}.w"} for i in range(1000, 3000)})) / 2000
    assert per_tensor - names - tree < 24, per_tensor  # digest (8 bytes, base64) and deflated columns


def test_table_queries_match_the_per_tensor_entries():
    """shared_bytes and chunks_in (ls, verify) over the table equal the per-entry answers
    (golden v3 incremental run: step 2 shares step 1's chunks)."""
    golden = Path(__file__).parent / "golden" / "v3" / "run" / "step-000000002"
    m = decode_manifest(_manifest(golden).read_bytes(), "m")
    entries = dataclasses.replace(m, tensors=editable(m.tensors))
    assert m.shared_bytes() == entries.shared_bytes() > 0
    for name in m.files:
        assert m.chunks_in(name) == entries.chunks_in(name) and m.chunks_in(name)


def test_the_builder_takes_chunks_one_by_one_or_as_columns_alike():
    """Rank 0 adds a large job's chunks as columns (``TableBuilder.add``); the table must
    be the one chunk-by-chunk calls build: tensor order, chunk order within a tensor,
    ties, 0-d and empty boxes, several blocks per chunk and two checksum algorithms."""
    from safeckpt.format.compact import Checksums, ChunkColumns, TableBuilder
    chunks = [  # tensor, file, start, end, checksums, offsets, shape
        ("w", "f1", 8, 24, ["xxh3_64:" + "11" * 8, "xxh3_64:" + "12" * 8], [2, 0], [2, 2]),
        ("s", "f0", 0, 4, ["xxh3_128:" + "21" * 16], [], []),
        ("w", "f0", 4, 20, ["xxh3_64:" + "31" * 8], [0, 0], [2, 2]),
        ("e", "f1", 24, 24, ["xxh3_64:" + "41" * 8], [0, 0], [0, 5]),
    ]
    shapes = {"w": ([4, 2], "float32"), "s": ([], "int32"), "e": ([0, 5], "float32")}

    def table(columns: bool) -> dict:
        b = TableBuilder()
        index = {n: b.tensor(n, shapes[n][1], shapes[n][0]) for n in ("w", "s", "e")}
        b.chunk(index["w"], "f0", 0, 0, ["xxh3_64:" + "00" * 8], [0, 0], [0, 2])  # one by one, then columns
        if columns:
            files = sorted({c[1] for c in chunks})
            b.add(ChunkColumns(files, np.asarray([files.index(c[1]) for c in chunks]),
                               np.asarray([index[c[0]] for c in chunks]), np.asarray([c[2] for c in chunks]),
                               np.asarray([c[3] for c in chunks]), Checksums.parse([c[4] for c in chunks]),
                               np.asarray([len(c[5]) for c in chunks]),
                               np.asarray([x for c in chunks for x in c[5]], dtype=np.int64),
                               np.asarray([x for c in chunks for x in c[6]], dtype=np.int64)))
        else:
            for name, *rest in chunks:
                b.chunk(index[name], *rest)
        b.alias("tied", "w")
        return b.build(["f0", "f1"], 8).encode()

    built = table(columns=True)
    assert built == table(columns=False)
    assert built["algorithms"] == ["xxh3_64", "xxh3_128"] and built["names"] == ["w", "s", "e", "tied"]
    with pytest.raises(ValueError, match="mixes checksum algorithms"):
        Checksums.parse([["xxh3_64:" + "00" * 8, "xxh3_128:" + "00" * 16]])
