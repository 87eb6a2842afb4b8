"""A ``torch.save`` file whose zip structure was changed in any field is loaded with
exactly the saved values or refused with ``CorruptCheckpointError`` naming the file,
before torch's reader (which trusts every field and checks no CRC-32) sees it.

The faults are real: one bit of a real ``torch.save`` archive flipped, every bit of its
central directory, end records and local headers in turn, and the archive loaded by
torch itself, by ``SafeCheckpointIO`` (which falls back past a refused ``last.ckpt``) and
by ``safeckpt import``. Before the structure was checked field by field, a flipped
"folder" bit of a tensor's record loaded the tensor as uninitialised memory, and a
flipped size or flag made torch raise an untyped ``RuntimeError`` (no fallback), or
the import a ``zlib.error``.
"""

from __future__ import annotations

import io
import os
import random
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt.interop.torchfile import check_torch_file

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def central_records(data: bytes) -> tuple[int, list[int]]:
    """(offset of the central directory, offset of each of its records)."""
    eocd = len(data) - 22
    cd_size, cd_offset = struct.unpack_from("<II", data, eocd + 12)
    if data[eocd - 20:eocd - 16] == b"PK\x06\x07":  # zip64: the real values are in its end record
        cd_size, cd_offset = struct.unpack_from("<QQ", data, eocd - 20 - 56 + 40)
    out, pos = [], cd_offset
    while pos < cd_offset + cd_size:
        out.append(pos)
        pos += 46 + sum(struct.unpack_from("<HHH", data, pos + 28))
    return cd_offset, out


def structure_bytes(data: bytes) -> list[int]:
    """Every byte of the archive's structure: each local header (fixed part, name and
    extra field), the central directory and the end records."""
    cd_offset, records = central_records(data)
    where = set(range(cd_offset, len(data)))
    for pos in records:
        header = struct.unpack_from("<I", data, pos + 42)[0]
        if header == 0xFFFFFFFF:  # in the zip64 field: uncompressed, compressed size, offset
            header = struct.unpack_from("<Q", data, pos + 46 + struct.unpack_from("<H", data, pos + 28)[0] + 20)[0]
        name_len, extra_len = struct.unpack_from("<HH", data, header + 26)
        where.update(range(header, header + 30 + name_len + extra_len))
    return sorted(where)


def with_zip64_record(data: bytes, index: int) -> bytes:
    """The archive with central record ``index`` keeping its sizes and local header
    offset in a zip64 extra field, as torch writes the records of a file past 4 GiB."""
    cd_offset, positions = central_records(data)
    ends = positions[1:] + [len(data) - 22 - 20 - 56]
    records = [bytearray(data[a:b]) for a, b in zip(positions, ends)]
    r = records[index]
    csize, usize = struct.unpack_from("<II", r, 20)
    header = struct.unpack_from("<I", r, 42)[0]
    assert struct.unpack_from("<H", r, 30)[0] == 0, "expected no extra field"
    struct.pack_into("<II", r, 20, 0xFFFFFFFF, 0xFFFFFFFF)
    struct.pack_into("<I", r, 42, 0xFFFFFFFF)
    struct.pack_into("<H", r, 30, 28)
    records[index] = r + struct.pack("<HHQQQ", 1, 24, usize, csize, header)
    cd = b"".join(records)
    tail = bytearray(data[ends[-1]:])  # zip64 end record, its locator, the end record
    struct.pack_into("<Q", tail, 40, len(cd))
    struct.pack_into("<Q", tail, 56 + 8, cd_offset + len(cd))
    struct.pack_into("<I", tail, 56 + 20 + 12, len(cd))
    return data[:cd_offset] + cd + bytes(tail)


def flips(data: bytes) -> list[tuple[int, int]]:
    return [(i, bit) for i in structure_bytes(data) for bit in range(8)]


def flipped(data: bytes, where: tuple[int, int]) -> bytes:
    out = bytearray(data)
    out[where[0]] ^= 1 << where[1]
    return bytes(out)


def same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], v) for k, v in want.items())
    return type(got) is type(want) and got == want


def tensor_record(data: bytes) -> int:
    """The index of the largest tensor's record in the central directory."""
    infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    return max(range(len(infos)), key=lambda i: ("/data/" in infos[i].filename, infos[i].file_size))


def known_faults(data: bytes) -> list[tuple[int, int]]:
    """The flips the adversarial pass found: a tensor record's DOS folder bit, and bits
    of each record's flags and compressed size."""
    _, records = central_records(data)
    out = [(records[tensor_record(data)] + 38, 4)]
    for pos in records:
        out += [(pos + 8, 0), (pos + 20, 0), (pos + 23, 7)]
    return out


SAVED = {"state_dict": {"w": torch.arange(6.0), "b": torch.tensor([1, -2], dtype=torch.int8)},
         "epoch": 3, "global_step": 12}
OLDER = {"state_dict": {"w": torch.full((6,), 9.0), "b": torch.tensor([0, 0], dtype=torch.int8)},
         "epoch": 2, "global_step": 8}


@pytest.fixture(scope="module", params=["as-written", "zip64-record"])
def archive(request) -> bytes:
    data = torch_bytes(SAVED)
    return data if request.param == "as-written" else with_zip64_record(data, tensor_record(data))


# -- the check itself, then torch --------------------------------------------------------------
def test_every_bit_of_the_zip_structure_loads_exactly_or_is_refused(archive):
    """Each of the ~10,000 single-bit changes of the structure (every field of every
    local header, central record and end record, and the zip64 ones) either passes the
    check and ``torch.load`` then returns exactly the saved values, or is refused with
    ``CorruptCheckpointError`` naming the file."""
    assert check_torch_file(io.BytesIO(archive), "x.ckpt")
    assert same(torch.load(io.BytesIO(archive), weights_only=True), SAVED)
    outcomes = {"loaded": 0, "refused": 0}
    for where in flips(archive):
        f = io.BytesIO(flipped(archive, where))
        try:
            check_torch_file(f, "x.ckpt")
        except safeckpt.CorruptCheckpointError as exc:
            assert str(exc).startswith("x.ckpt: "), exc
            outcomes["refused"] += 1
            continue
        try:
            got = torch.load(f, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - the failure this test exists to catch
            pytest.fail(f"byte {where[0]} bit {where[1]}: passed the check, then torch.load raised "
                        f"{type(exc).__name__}: {exc}")
        assert same(got, SAVED), f"byte {where[0]} bit {where[1]}: passed the check and loaded other values"
        outcomes["loaded"] += 1
    assert outcomes["loaded"] and outcomes["refused"] > outcomes["loaded"], outcomes  # times, attributes, padding


# -- SafeCheckpointIO: the file layout's load and fallback --------------------------------------
def _lightning_outcomes(tmp_path: Path, faults: list[tuple[int, int]]) -> None:
    """``load_checkpoint("last.ckpt")`` with each fault in last.ckpt: the saved values,
    or the intact older checkpoint with a ``SkippedCheckpointWarning``; with
    ``fallback=False`` the same, or ``CorruptCheckpointError`` naming last.ckpt."""
    pytest.importorskip("lightning")
    from safeckpt.integrations.lightning import SafeCheckpointIO

    data = torch_bytes(SAVED)
    (tmp_path / "epoch=2-step=8.ckpt").write_bytes(torch_bytes(OLDER))
    last = tmp_path / "last.ckpt"
    plugin, strict = SafeCheckpointIO(), SafeCheckpointIO(fallback=False)
    for where in faults:
        last.write_bytes(flipped(data, where))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = plugin.load_checkpoint(str(last))
        skipped = [w for w in caught if issubclass(w.category, safeckpt.SkippedCheckpointWarning)]
        if skipped:
            assert same(got, OLDER), f"{where}: fell back, but not to the intact checkpoint"
            assert "last.ckpt failed its check" in str(skipped[0].message)
            with pytest.raises(safeckpt.CorruptCheckpointError, match="last.ckpt"):
                strict.load_checkpoint(str(last))
        else:
            assert same(got, SAVED), f"byte {where[0]} bit {where[1]}: loaded other values, no warning"


def test_lightning_loads_a_changed_last_ckpt_exactly_or_falls_back(tmp_path):
    data = torch_bytes(SAVED)
    sample = random.Random(0).sample(flips(data), 150)
    _lightning_outcomes(tmp_path, known_faults(data) + sample)


@pytest.mark.slow
def test_lightning_loads_a_changed_last_ckpt_exactly_or_falls_back_every_bit(tmp_path):
    _lightning_outcomes(tmp_path, flips(torch_bytes(SAVED)))


# -- safeckpt import ------------------------------------------------------------------------------
def _import_outcomes(tmp_path: Path, faults: list[tuple[int, int]]) -> None:
    """``import_checkpoint`` of the file with each fault: the saved values, or one
    ``CorruptCheckpointError`` naming the file, and nothing at the destination."""
    data = torch_bytes(SAVED)
    src = tmp_path / "model.pt"
    for n, where in enumerate(faults):
        src.write_bytes(flipped(data, where))
        dest = tmp_path / f"imported-{n}"
        try:
            safeckpt.import_checkpoint(src, dest)
        except safeckpt.CorruptCheckpointError as exc:
            assert str(src) in str(exc), exc
            assert not dest.exists()
            continue
        assert same(safeckpt.load_state(dest), SAVED), f"byte {where[0]} bit {where[1]}: imported other values"


def test_import_of_a_changed_torch_file_is_exact_or_one_corrupt_error(tmp_path):
    data = torch_bytes(SAVED)
    eocd = len(data) - 22
    cd_offset, _ = central_records(data)
    locator_disk = (eocd - 20 + 4, 0)  # the adversarial pass's: zipfile.BadZipFile
    method = (cd_offset + 10, 3)       # the first record "deflated": zlib.error
    _import_outcomes(tmp_path, [locator_disk, method] + random.Random(1).sample(flips(data), 40))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(flipped(data, method))
    p = subprocess.run([sys.executable, "-m", "safeckpt", "import", str(bad), str(tmp_path / "cli")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *sys.path])})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"safeckpt: error: {bad}: not a sound torch.save archive"), lines[0]


@pytest.mark.slow
def test_import_of_a_changed_torch_file_is_exact_or_one_corrupt_error_every_bit(tmp_path):
    _import_outcomes(tmp_path, flips(torch_bytes(SAVED)))
