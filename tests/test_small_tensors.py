"""Many small tensors: batched into shared regions on save, read in few reads on load.

The batched paths must give exactly the bytes of the one-at-a-time paths: mixed dtypes,
strided views, tensors that require grad, empty and 0-dim tensors, small runs longer than
one region and broken by large tensors, and data files that stay standard safetensors.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import safeckpt
from safeckpt.format.compact import TableBuilder
from safeckpt.format.manifest import decode_manifest
from safeckpt.protocol import batchread, datafile, reader
from safeckpt.storage import Storage

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8,
          torch.complex64, torch.float8_e4m3fn, torch.int8]


def many_small(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=g)
    state: dict = {}
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        t = (torch.randn(3 + i % 17, generator=g) * 10).to(dtype)
        state[f"t{i:05d}"] = t
    state["view"] = base[::3, 1::2]          # strided view
    state["grad"] = torch.randn(7, requires_grad=True)
    state["empty"] = torch.zeros(0, 4)
    state["scalar"] = torch.tensor(3.5)
    state["tied"] = state["t00001"]
    state["large"] = torch.randn((datafile.COALESCE_BELOW // 4) + 5, generator=g)  # breaks the small run
    state["after"] = torch.arange(11, dtype=torch.int32)
    return state


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else got[k],
                           v.detach().view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v.detach()), k


def test_small_runs_round_trip_over_several_regions(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(datafile, "COALESCE_BUFFER", 4096)  # many regions from a small state
    state = many_small(600)
    safeckpt.save(state, str(tmp_path / "c"))
    loaded = safeckpt.load_state(str(tmp_path / "c"))
    assert_equal(loaded, state)
    assert loaded["tied"] is loaded["t00001"]
    template = {k: torch.zeros_like(v.detach()) for k, v in state.items()}
    template["tied"] = template["t00001"]
    safeckpt.load(template, str(tmp_path / "c"))
    assert_equal(template, state)
    assert safeckpt.verify(str(tmp_path / "c")).ok
    (data,) = (tmp_path / "c").glob("data-*.safetensors")
    plain = load_file(str(data))  # still a standard safetensors file
    assert torch.equal(plain["after"], state["after"]) and torch.equal(plain["view"], state["view"])


def test_small_tensors_each_keep_their_own_checksum(tmp_path) -> None:
    """Corrupting one small tensor's bytes is reported for that tensor, not its neighbours."""
    state = many_small(50)
    safeckpt.save(state, str(tmp_path / "c"))
    path = next((tmp_path / "c").glob("manifest-*.json"))
    (chunk,) = decode_manifest(path.read_bytes(), str(path)).tensors["t00010"].chunks
    (data,) = (tmp_path / "c").glob("data-*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[chunk.start] ^= 0xFF
    data.write_bytes(bytes(raw))
    report = safeckpt.verify(str(tmp_path / "c"))
    assert not report.ok and len(report.problems) == 1 and "'t00010'" in report.problems[0]


def test_lazy_conj_and_neg_views_save_their_values(tmp_path) -> None:
    """A conjugate or negative view shares its base's bytes: its values must be resolved
    before they are stored (sync and async), or it loads as its base."""
    x = torch.tensor([1 + 2j, 3 - 4j])
    state = {"conj": x.conj(), "neg": x.conj().imag, "plain": x}
    safeckpt.save(state, str(tmp_path / "sync"))
    safeckpt.async_save(state, str(tmp_path / "async")).result()
    for folder in ("sync", "async"):
        loaded = safeckpt.load_state(str(tmp_path / folder))
        for k, v in state.items():
            assert torch.equal(loaded[k], v.resolve_conj().resolve_neg()), (folder, k)


def corrupt_byte(folder, name: str) -> None:
    """Flip the first byte of tensor ``name`` in its data file."""
    path = next(folder.glob("manifest-*.json"))
    (chunk,) = decode_manifest(path.read_bytes(), str(path)).tensors[name].chunks
    data = folder / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.start] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_batched_reads_over_many_runs_and_threads(tmp_path, monkeypatch) -> None:
    """Loads read small tensors in runs of adjacent bytes (``batchread``): with runs cut
    every few KiB, on several threads, every tensor (mixed dtypes, in place and fresh,
    tied, next to strided and large ones) gets exactly its bytes."""
    state = many_small(900)
    safeckpt.save(state, str(tmp_path / "c"))
    monkeypatch.setattr(reader, "COALESCE_MAX", 2048)
    monkeypatch.setattr(Storage, "merge_reads_below", 1024)  # runs of at most 2 KiB
    seen: list[int] = []
    real = batchread.BatchedReads._read_run
    monkeypatch.setattr(batchread.BatchedReads, "_read_run", lambda self, run, *a: (seen.append(len(run[3])),
                                                                                     real(self, run, *a)))
    loaded = safeckpt.load_state(str(tmp_path / "c"))
    assert_equal(loaded, state)
    assert loaded["tied"] is loaded["t00001"]
    assert len(seen) > 10 and sum(seen) >= 900, "the small tensors were not read in batches"
    template = {k: torch.full_like(v.detach(), 0) for k, v in state.items()}
    template["tied"] = template["t00001"]
    template["view"] = torch.zeros(22, 64).t()[:32, :22].t()  # a strided target: the general path
    safeckpt.load(template, str(tmp_path / "c"))
    assert_equal(template, state)


def test_batched_read_of_a_corrupt_tensor_names_it(tmp_path) -> None:
    state = many_small(300)
    safeckpt.save(state, str(tmp_path / "c"))
    corrupt_byte(tmp_path / "c", "t00123")
    with pytest.raises(safeckpt.CorruptCheckpointError, match="'t00123'.*fails its checksum"):
        safeckpt.load_state(str(tmp_path / "c"))
    template = {k: torch.zeros_like(v.detach()) for k, v in state.items()}
    with pytest.raises(safeckpt.CorruptCheckpointError, match="'t00123'.*fails its checksum"):
        safeckpt.load(template, str(tmp_path / "c"))
    unchecked = safeckpt.load_state(str(tmp_path / "c"), verify=False)  # verify=False reads it as it is
    assert not torch.equal(unchecked["t00123"], state["t00123"]) and torch.equal(unchecked["t00124"], state["t00124"])


def test_runs_cut_at_gaps_files_and_size(tmp_path) -> None:
    """``BatchedReads.runs``: adjacent bytes of one file form a run, cut at a gap, at a
    change of file, at a repeated range and every ``most`` bytes."""
    builder = TableBuilder()
    layout = [("a", 0, 10), ("a", 10, 20), ("a", 30, 40), ("b", 0, 10), ("b", 10, 20), ("a", 20, 30),
              ("a", 20, 30), ("b", 20, 30)]
    for k, (file, start, end) in enumerate(layout):
        builder.chunk(builder.tensor(f"t{k}", "uint8", [end - start]), file, start, end,
                      [f"xxh3_64:{k:016x}"], [0], [end - start])
    table = builder.build(["a", "b"], 1 << 24)
    batch = batchread.BatchedReads(table)
    for k in range(len(layout)):
        batch.add(None, table["t" + str(k)].only_chunk, torch.zeros(10, dtype=torch.uint8))  # type: ignore[arg-type]
    got = [(table.file_names[f], lo, hi, sorted(m)) for f, lo, hi, m in batch.runs(most=1000)]
    assert got == [("a", 0, 30, [0, 1, 5]), ("a", 20, 40, [2, 6]), ("b", 0, 30, [3, 4, 7])]
    assert [(lo, hi) for _, lo, hi, _ in batch.runs(most=15)] == [(0, 20), (20, 30), (20, 40), (0, 20), (20, 30)]
