"""Exports are complete or absent; imports check every integrity check their source
offers and stream (issue 17, item 10).

Exports: a failed export (a corrupt source) leaves no file behind and a rerun is not
blocked; a sharded export's index comes last; an export in progress shows no partial
file under a final name; leftovers of an interrupted export do not block a rerun.
Imports from torch.distributed.checkpoint: byte flips in a ``.distcp`` file are
detected (the zip CRC-32s inside are checked), a damaged one is one line and exit 2
on the command line, NumPy values come in natively, and the import streams tensor by
tensor (bounded anonymous memory, measured in a fresh process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import safeckpt
from safeckpt.cli import main as cli_main
from safeckpt.interop.export import export_checkpoint
from safeckpt.interop.imports import import_checkpoint, read_dcp

st = pytest.importorskip("safetensors.torch")


def _checkpoint(path: Path) -> dict:
    state = {"a": torch.arange(64.0), "b": torch.ones(8, 8), "c": torch.full((32,), 3.0)}
    safeckpt.save(state, path)
    return state


def _flip_tensor(ckpt: Path, name: str) -> None:
    """Flip one byte in the middle of a tensor's data (verification catches it on read)."""
    (data,) = ckpt.glob("data-*.safetensors")
    header = json.loads(data.read_bytes()[8:8 + int.from_bytes(data.read_bytes()[:8], "little")])
    start, end = header[name]["data_offsets"]
    base = 8 + int.from_bytes(data.read_bytes()[:8], "little")
    raw = bytearray(data.read_bytes())
    raw[base + (start + end) // 2] ^= 0x40
    data.write_bytes(bytes(raw))


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_failed_export_leaves_nothing_and_a_rerun_is_not_blocked(tmp_path, capsys):
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    state = _checkpoint(ckpt)
    (data,) = ckpt.glob("data-*.safetensors")
    good = data.read_bytes()
    _flip_tensor(ckpt, "c")  # the last tensor: everything before it was already written
    for argv in (["export", str(ckpt), str(out / "c.safetensors")],
                 ["export", str(ckpt), str(out), "--max-shard-size", "300B"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'c'" in err[0] and "checksum" in err[0], err
        assert _files(out) == [], "a failed export left files behind"
    data.write_bytes(good)
    assert cli_main(["export", str(ckpt), str(out / "c.safetensors")]) == 0  # not "exists"
    assert cli_main(["export", str(ckpt), str(out / "sharded"), "--max-shard-size", "300B"]) == 0
    got = st.load_file(out / "c.safetensors")
    assert all(torch.equal(got[k], v) for k, v in state.items())
    index = json.loads((out / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) + ["model.safetensors.index.json"] == _files(out / "sharded")


def test_no_partial_file_under_a_final_name_and_the_index_comes_last(tmp_path):
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    _checkpoint(ckpt)
    seen = []

    def watch(name: str, nbytes: int) -> None:  # called while the files are being written
        seen.append([n for n in _files(out) if not n.startswith(".")])

    result = export_checkpoint(ckpt, out, max_shard_size="300B", on_tensor=watch)
    assert len(result.files) == 3 and seen and all(names == [] for names in seen), seen
    assert _files(out) == sorted([f.name for f in result.files] + ["model.safetensors.index.json"])


def test_leftovers_of_an_interrupted_export_do_not_block_a_rerun(tmp_path):
    """A kill leaves temporary files, or (between the renames) shards without an index:
    neither is a complete export, and a rerun without --overwrite replaces them."""
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    state = _checkpoint(ckpt)
    out.mkdir()
    (out / "model-00001-of-00003.safetensors").write_bytes(b"torn")
    (out / ".model-00002-of-00003.safetensors.0badcafe.partial").write_bytes(b"torn")
    result = export_checkpoint(ckpt, out, max_shard_size="300B")
    merged = {}
    for f in result.files:
        merged.update(st.load_file(out / f.name))
    assert all(torch.equal(merged[k], v) for k, v in state.items())
    with pytest.raises(safeckpt.CheckpointExistsError):  # a complete export is not replaced
        export_checkpoint(ckpt, out, max_shard_size="300B")


def test_a_failed_overwrite_leaves_the_old_export_as_it_was(tmp_path):
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    _checkpoint(ckpt)
    export_checkpoint(ckpt, out, max_shard_size="300B")
    before = {name: (out / name).read_bytes() for name in _files(out)}
    _flip_tensor(ckpt, "c")
    with pytest.raises(safeckpt.CorruptCheckpointError):
        export_checkpoint(ckpt, out, max_shard_size="600B", overwrite=True)
    assert {name: (out / name).read_bytes() for name in _files(out)} == before


def test_overwrite_into_fewer_shards_removes_the_old_ones(tmp_path):
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    _checkpoint(ckpt)
    export_checkpoint(ckpt, out, max_shard_size="300B")
    result = export_checkpoint(ckpt, out, max_shard_size="600B", overwrite=True)
    assert len(result.files) == 2
    assert _files(out) == sorted([f.name for f in result.files] + ["model.safetensors.index.json"])
    export_checkpoint(ckpt, out, overwrite=True)  # one file now: the shards and index go
    assert _files(out) == ["model.safetensors"]


# --------------------------------------------------------------------------- DCP imports


def _dcp(path: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return path


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_byte_flips_in_a_distcp_file_are_detected_not_imported(tmp_path):
    """Every single-byte flip either fails the import with a CheckpointError or changes
    nothing that is imported (a zip field no check covers); none imports changed values."""
    torch.manual_seed(0)
    state = {"w": torch.randn(16, 8), "b": torch.randn(8), "step": 3}
    src = _dcp(tmp_path / "dcp", state)
    (distcp,) = src.glob("*.distcp")
    good = distcp.read_bytes()
    detected = silent_same = 0
    for i, pos in enumerate(range(0, len(good), max(1, len(good) // 61))):
        raw = bytearray(good)
        raw[pos] ^= 0x10
        distcp.write_bytes(bytes(raw))
        try:
            info, _ = import_checkpoint(src, tmp_path / f"out{i}")
        except safeckpt.CheckpointError:
            detected += 1
            continue
        got = safeckpt.load_state(info.path)
        assert _same({"w": state["w"], "b": state["b"]}, {"w": got["w"], "b": got["b"]}), \
            f"a flip at byte {pos} of {distcp.name} imported changed tensors"
        silent_same += 1
    distcp.write_bytes(good)
    # the tensors' bytes and the pickles are under CRC-32s; zip fields such as timestamps are not
    assert detected >= 25, (detected, silent_same)


def test_a_damaged_dcp_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    src = _dcp(tmp_path / "dcp", {"w": torch.randn(64, 64)})
    (distcp,) = src.glob("*.distcp")
    distcp.write_bytes(distcp.read_bytes()[:1000])  # truncated
    assert cli_main(["import", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and distcp.name in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "out").exists()


def test_numpy_values_and_numpy_rng_state_are_imported_natively(tmp_path):
    np.random.seed(7)
    state = {"w": torch.arange(6.0), "rng": np.random.get_state(), "arr": np.arange(5, dtype=np.int16),
             "x": np.float32(2.5), "nested": {"ids": np.array([[1, 2], [3, 4]], dtype=np.uint8)}}
    torch.save(state, tmp_path / "plain.pt")
    _dcp(tmp_path / "dcp", state)
    for src in (tmp_path / "plain.pt", tmp_path / "dcp"):
        info, _ = import_checkpoint(src, tmp_path / f"out-{src.name}")
        got = safeckpt.load_state(info.path)
        assert _same(got["arr"], state["arr"]) and _same(got["nested"]["ids"], state["nested"]["ids"]), src
        assert got["x"] == state["x"] and got["x"].dtype == np.float32
        np.random.set_state(got["rng"])
        expect = np.random.RandomState()
        expect.set_state(state["rng"])
        assert np.random.rand() == expect.rand()
    with pytest.raises(safeckpt.UnsafeObjectError):  # object arrays still need pickle
        torch.save({"o": np.array([1, "a"], dtype=object)}, tmp_path / "obj.pt")
        import_checkpoint(tmp_path / "obj.pt", tmp_path / "out-obj")


def test_a_sharded_dcp_tensor_is_assembled_and_an_overlap_is_refused(tmp_path):
    """A tensor in two chunks, as two ranks save it (the metadata rewritten to point the
    chunks of ``w`` at the items of two saved halves); the chunks must tile the tensor."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    full = torch.arange(12.0).reshape(3, 4)
    src = _dcp(tmp_path / "dcp", {"top": full[:1].clone(), "bottom": full[1:].clone(), "w": full})
    meta = pickle.loads((src / ".metadata").read_bytes())

    def split(*chunks: tuple[list[int], str]) -> None:  # (offsets, the saved item it reads)
        saved = {name: meta.storage_data[MetadataIndex(name, [0, 0])] for name in ("top", "bottom")}
        shapes = {"top": [1, 4], "bottom": [2, 4]}
        meta.state_dict_metadata["w"].chunks = [
            ChunkStorageMetadata(torch.Size(at), torch.Size(shapes[name])) for at, name in chunks]
        for key in [k for k in meta.storage_data if k.fqn == "w"]:
            del meta.storage_data[key]
        for at, name in chunks:
            meta.storage_data[MetadataIndex("w", at)] = dataclasses.replace(saved[name])
        (src / ".metadata").write_bytes(pickle.dumps(meta))

    split(([0, 0], "top"), ([1, 0], "bottom"))
    assert torch.equal(read_dcp(str(src))["w"], full)
    split(([0, 0], "bottom"), ([1, 0], "bottom"))  # rows 1 twice
    with pytest.raises(safeckpt.CorruptCheckpointError, match="cover|overlap"):
        read_dcp(str(src))


PROBE = """
import json, sys, threading, time
import torch
import torch.distributed.checkpoint  # imported before the baseline: its modules are not the import's memory
from safeckpt.interop.imports import import_checkpoint

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

base, peak, done = anon_kib(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon_kib())
        time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
import_checkpoint(sys.argv[1], sys.argv[2])
done.set(); t.join()
print(json.dumps({"extra_mib": (max(peak[0], anon_kib()) - base) / 1024}))
"""


@pytest.mark.parametrize("kind", ["dcp", "torch"])
def test_an_import_streams_tensor_by_tensor(tmp_path, kind):
    """128 MiB in 16 tensors: the import's anonymous memory grows by a fraction of it
    (the sources are memory-mapped; before, DCP's loader held the whole state)."""
    state = {f"t{i}": torch.full((2 << 20,), float(i)) for i in range(16)}  # 8 MiB each
    src = _dcp(tmp_path / "dcp", state) if kind == "dcp" else tmp_path / "plain.pt"
    if kind == "torch":
        torch.save(state, src)
    del state
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(safeckpt.__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", PROBE, str(src), str(tmp_path / "out")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    extra = json.loads(r.stdout.strip().splitlines()[-1])["extra_mib"]
    print(f"{kind}: import of 128 MiB raised anonymous memory by {extra:.0f} MiB")
    assert extra < 48, f"the import of 128 MiB held {extra:.0f} MiB of anonymous memory"
    got = safeckpt.load_state(tmp_path / "out")
    assert torch.equal(got["t15"], torch.full((2 << 20,), 15.0))


def test_byte_flips_in_a_torch_save_file_are_detected_not_imported(tmp_path):
    """torch.save files are zip archives too: their CRC-32s are checked on import."""
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 8), "step": 3}
    src = tmp_path / "plain.pt"
    torch.save(state, src)
    good = src.read_bytes()
    detected = 0
    for i, pos in enumerate(range(0, len(good), max(1, len(good) // 61))):
        raw = bytearray(good)
        raw[pos] ^= 0x10
        src.write_bytes(bytes(raw))
        try:
            info, _ = import_checkpoint(src, tmp_path / f"out{i}")
        except safeckpt.CheckpointError:
            detected += 1
            continue
        assert torch.equal(safeckpt.load_state(info.path)["w"], state["w"]), f"a flip at byte {pos} imported"
    assert detected >= 30, detected
