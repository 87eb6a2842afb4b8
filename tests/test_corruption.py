"""Damaged checkpoints: each kind of damage is a test, made for real on disk.

For every scenario: ``load`` raises ``CorruptCheckpointError`` naming the file (and the
tensor key where there is one), ``verify`` reports it, nothing is loaded as valid,
nothing outside the checkpoint folder is opened, ``CheckpointManager.restore`` falls
back to the previous step with a warning naming the skipped step and the reason, and
when every committed checkpoint is damaged ``restore`` raises.
"""

from __future__ import annotations

import builtins
import os
import random
import shutil
import struct
import warnings
from pathlib import Path
from typing import Callable

import pytest

import safeckpt
from safeckpt.format.manifest import Manifest, decode_manifest, editable, encode_manifest
from save_child import make_state, make_template, state_mismatch

KEY = "model.r"  # the tensor the data-level scenarios damage


# --------------------------------------------------------------------------- helpers


def _manifest(ckpt: Path) -> Path:
    found = sorted(ckpt.glob("manifest-*.json"))
    assert len(found) == 1, found
    return found[0]


def _data(ckpt: Path) -> Path:
    found = sorted(ckpt.glob("data-*.safetensors"))
    assert len(found) == 1, found
    return found[0]


def _decoded(ckpt: Path) -> Manifest:
    path = _manifest(ckpt)
    return decode_manifest(path.read_bytes(), str(path))


def _rewrite(ckpt: Path, mutate: Callable[[Manifest], None]) -> None:
    """Change the manifest and write it back properly framed, with a correct checksum,
    so that only what ``mutate`` changed is wrong."""
    path = _manifest(ckpt)
    m = decode_manifest(path.read_bytes(), str(path))
    m.tensors = editable(m.tensors)
    mutate(m)
    path.write_bytes(encode_manifest(m))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _rename_data(m: Manifest, new: str) -> None:
    (entry,) = m.files.values()
    old = entry.name
    entry.name = new
    m.files = {new: entry}
    for t in m.tensors.values():
        for c in t.chunks:
            if c.file == old:
                c.file = new


# --------------------------------------------------------------------------- scenarios
# Each takes the checkpoint folder, damages it, and returns the strings the error must
# contain. Paths that must never be opened are collected in OUTSIDE.


def flipped_tensor_byte(ckpt: Path) -> list[str]:
    chunk = _decoded(ckpt).tensors[KEY].chunks[0]
    _flip(ckpt / chunk.file, (chunk.start + chunk.end) // 2)
    return [chunk.file, KEY]


def flipped_header_byte(ckpt: Path) -> list[str]:
    data = _data(ckpt)
    with open(data, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
    _flip(data, 8 + n // 3)
    return [data.name, "header"]


def truncated_data(ckpt: Path) -> list[str]:
    data = _data(ckpt)
    os.truncate(data, data.stat().st_size - 1000)
    return [data.name]


def extra_tail(ckpt: Path) -> list[str]:
    data = _data(ckpt)
    with open(data, "ab") as f:
        f.write(b"\0" * 4096)
    return [data.name]


def missing_data(ckpt: Path) -> list[str]:
    data = _data(ckpt)
    data.unlink()
    return [data.name, "missing"]


def truncated_manifest(ckpt: Path) -> list[str]:
    path = _manifest(ckpt)
    os.truncate(path, path.stat().st_size // 2)
    return [path.name]


def garbled_manifest(ckpt: Path) -> list[str]:
    path = _manifest(ckpt)
    path.write_bytes(random.Random(7).randbytes(path.stat().st_size))
    return [path.name]


def future_version(ckpt: Path) -> list[str]:
    path = _manifest(ckpt)

    def bump(m: Manifest) -> None:
        m.version = 99
    _rewrite(ckpt, bump)
    return [path.name, "99", "upgrade"]


def _outside_copy(ckpt: Path, target: Path) -> None:
    """An exact copy of the data file outside the folder: were the name followed, the
    checkpoint would load without any other error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_data(ckpt), target)


def name_parent_dir(ckpt: Path) -> list[str]:
    _outside_copy(ckpt, ckpt.parent / "x")
    _rewrite(ckpt, lambda m: _rename_data(m, "../x"))
    return [_manifest(ckpt).name, "../x"]


def name_parent_dir_nested(ckpt: Path) -> list[str]:
    _outside_copy(ckpt, ckpt.parent / "x")
    _rewrite(ckpt, lambda m: _rename_data(m, "sub/../../x"))
    return [_manifest(ckpt).name, "sub/../../x"]


def name_absolute_copy(ckpt: Path) -> list[str]:
    target = ckpt.parent / "elsewhere" / "data.safetensors"
    _outside_copy(ckpt, target)
    _rewrite(ckpt, lambda m: _rename_data(m, str(target)))
    return [_manifest(ckpt).name, str(target)]


def name_etc_passwd(ckpt: Path) -> list[str]:
    def to_passwd(m: Manifest) -> None:
        _rename_data(m, "/etc/passwd")
        m.files["/etc/passwd"].size = os.path.getsize("/etc/passwd")
    _rewrite(ckpt, to_passwd)
    return [_manifest(ckpt).name, "/etc/passwd"]


def name_replace_temp(ckpt: Path) -> list[str]:
    """The data file under the name of a temporary file of safeckpt's replacements,
    which its cleanup deletes as garbage (format §2.5): the manifest is invalid even
    though the file is there, whole."""
    temp = f".{_data(ckpt).name}.safeckpt-0123456789ab.tmp"
    _data(ckpt).rename(ckpt / temp)
    _rewrite(ckpt, lambda m: _rename_data(m, temp))
    return [_manifest(ckpt).name, temp, "temporary file"]


def huge_header_length(ckpt: Path) -> list[str]:
    data = _data(ckpt)
    with open(data, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 62))
    return [data.name]


def range_beyond_file(ckpt: Path) -> list[str]:
    size = _data(ckpt).stat().st_size

    def shift(m: Manifest) -> None:
        chunk = m.tensors[KEY].chunks[0]
        chunk.start, chunk.end = size + 8, size + 8 + (chunk.end - chunk.start)
    _rewrite(ckpt, shift)
    return [_manifest(ckpt).name, KEY]


def range_beyond_file_grown(ckpt: Path) -> list[str]:
    """The manifest claims a bigger file, and a range inside the claimed size."""
    data = _data(ckpt)
    size = data.stat().st_size

    def grow(m: Manifest) -> None:
        (entry,) = m.files.values()
        entry.size = size + (1 << 20)
        chunk = m.tensors[KEY].chunks[0]
        chunk.start, chunk.end = size + 8, size + 8 + (chunk.end - chunk.start)
    _rewrite(ckpt, grow)
    return [data.name]


SCENARIOS = {f.__name__: f for f in (
    flipped_tensor_byte, flipped_header_byte, truncated_data, extra_tail, missing_data,
    truncated_manifest, garbled_manifest, future_version, name_parent_dir, name_parent_dir_nested,
    name_absolute_copy, name_etc_passwd, name_replace_temp, huge_header_length, range_beyond_file,
    range_beyond_file_grown,
)}


def _outside(ckpt: Path) -> set[str]:
    return {str(ckpt.parent / "x"), str(ckpt.parent / "elsewhere" / "data.safetensors"), "/etc/passwd"}


@pytest.fixture
def opened(monkeypatch):
    """Every path opened, listed or stat'ed through the usual calls."""
    seen: list[str] = []

    def wrap(fn):
        def inner(path, *a, **k):
            if isinstance(path, (str, bytes, os.PathLike)):
                seen.append(os.path.realpath(os.fsdecode(path)))
            return fn(path, *a, **k)
        return inner

    for mod, name in ((builtins, "open"), (os, "open"), (os, "scandir"), (os, "listdir"),
                      (os, "stat")):
        monkeypatch.setattr(mod, name, wrap(getattr(mod, name)))
    return seen


def _assert_inside(seen: list[str], ckpt: Path, outside: set[str]) -> None:
    bad = sorted({p for p in seen if p in outside})
    assert not bad, f"opened files outside the checkpoint folder: {bad}"
    inside = os.path.realpath(ckpt)
    base = os.path.realpath(ckpt.parent)
    strays = sorted({p for p in seen if p.startswith(base + os.sep)
                     and not (p == inside or p.startswith(inside + os.sep))})
    assert not strays, f"touched paths outside {inside}: {strays}"


def _assert_names(message: str, expected: list[str]) -> None:
    for s in expected:
        assert s in message, f"{s!r} not in the error: {message}"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    safeckpt.save(make_state(7), path)
    assert state_mismatch(safeckpt.load_state(path), 7) is None
    return path


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_load_raises_naming_file_and_key(ckpt, scenario, opened):
    expected = SCENARIOS[scenario](ckpt)
    opened.clear()
    state = make_template()
    with pytest.raises(safeckpt.CorruptCheckpointError) as exc:
        safeckpt.load(state, ckpt)
    _assert_names(str(exc.value), expected)
    assert isinstance(exc.value, ValueError)
    with pytest.raises(safeckpt.CorruptCheckpointError) as exc:
        safeckpt.load_state(ckpt)
    _assert_names(str(exc.value), expected)
    _assert_inside(opened, ckpt, _outside(ckpt))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_verify_reports_naming_file_and_key(ckpt, scenario, opened):
    expected = SCENARIOS[scenario](ckpt)
    opened.clear()
    report = safeckpt.verify(ckpt)
    assert not report.ok and not report
    assert any(all(s in p for s in expected) for p in report.problems), \
        f"no problem names {expected}: {report.problems}"
    _assert_inside(opened, ckpt, _outside(ckpt))


def test_manager_restore_never_skips_a_newer_format(tmp_path):
    """A checkpoint written by a newer safeckpt is not damage: restoring an older one
    instead would silently resume from the past. Upgrading is the remedy."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root)
    mgr.save(100, make_state(100))
    mgr.save(200, make_state(200))
    future_version(Path(mgr.path(200)))
    with pytest.raises(safeckpt.UnsupportedFormatError, match="upgrade"):
        safeckpt.CheckpointManager(root).restore(make_template())
    with pytest.warns(UserWarning, match="written by a newer safeckpt .* garbage collection skipped"):
        assert mgr.gc() == []
    assert safeckpt.CheckpointManager(root).steps() == [100]
    with pytest.raises(safeckpt.UnsupportedFormatError):  # nor is it written over
        safeckpt.save(make_state(1), mgr.path(200))


FALLBACK = [s for s in SCENARIOS if s != "future_version"]


@pytest.mark.parametrize("scenario", FALLBACK)
def test_manager_restore_falls_back_past_it(tmp_path, scenario, opened):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root)
    mgr.save(100, make_state(100))
    mgr.save(200, make_state(200))
    expected = SCENARIOS[scenario](Path(mgr.path(200)))
    opened.clear()
    state = make_template()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = safeckpt.CheckpointManager(root).restore(state)
    assert restored == 100
    assert state_mismatch(state, 100) is None
    messages = [str(w.message) for w in caught]
    assert any("step 200" in m and all(s in m for s in expected) for m in messages), \
        f"no warning names step 200 and {expected}: {messages}"
    assert not any(p in {str(Path(mgr.path(200)).parent / "x"), "/etc/passwd"} or "elsewhere" in p
                   for p in opened)


@pytest.mark.parametrize("scenario", FALLBACK)
def test_manager_restore_raises_when_all_are_corrupt(tmp_path, scenario):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root)
    mgr.save(100, make_state(100))
    mgr.save(200, make_state(200))
    for step in (100, 200):
        SCENARIOS[scenario](Path(mgr.path(step)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(safeckpt.CorruptCheckpointError) as exc:
            safeckpt.CheckpointManager(root).restore(make_template())
    assert "step 100" in str(exc.value) and "step 200" in str(exc.value), str(exc.value)


def test_manifest_damage_makes_the_step_not_committed(tmp_path):
    """Manifest-level damage: the step is not listed, not the latest, not loadable."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root)
    mgr.save(100, make_state(100))
    mgr.save(200, make_state(200))
    truncated_manifest(Path(mgr.path(200)))
    assert mgr.steps() == [100]
    assert mgr.latest_step() == 100
