"""What a checkpoint may be made of: regular files inside its folder, and for
incremental runs files of sibling ``step-*`` checkpoints. FIFOs never block anything,
symlinks are never followed (unless asked), and references never leave the run root
(issue 17, items 4 and 5; docs/format.md §1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt.format.checksum import checksum
from safeckpt.format.manifest import decode_manifest, encode_manifest

HANG_S = 60  # a subprocess that takes this long is hung


def _state(value: float = 1.0) -> dict:
    return {"w": torch.full((16,), value), "step": 1}


def _run(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with a deadline: a hang fails, never blocks the suite."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=HANG_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {HANG_S} s: {code}\n{exc.stdout}\n{exc.stderr}")


def _rewrite_manifest(folder: Path, change) -> None:
    """Change the decoded body of the only manifest and write it back correctly framed."""
    (name,) = [p for p in folder.iterdir() if p.name.startswith("manifest-")]
    data = name.read_bytes()
    body = json.loads(data[len(b'{"safeckpt":'):data.rindex(b',"checksum":')])
    change(body)
    raw = json.dumps(body, separators=(",", ":")).encode()
    name.write_bytes(b'{"safeckpt":' + raw + f',"checksum":"{checksum(raw)}"}}\n'.encode())


# --------------------------------------------------------------------------- FIFOs


def test_a_fifo_named_like_a_newer_manifest_is_ignored(tmp_path):
    run = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(run)
    mgr.save(1, _state(1.0))
    folder = Path(mgr.path(1))
    os.mkfifo(folder / "manifest-000002.json")
    out = _run(f"""
        import torch, safeckpt
        from safeckpt.cli import main
        root, ck = {str(run)!r}, {str(folder)!r}
        assert safeckpt.load_state(ck)["step"] == 1
        mgr = safeckpt.CheckpointManager(root)
        state = {{"w": torch.zeros(16), "step": 0}}
        assert mgr.restore(state) == 1 and state["w"][0] == 1.0
        try:  # the next sequence's name is taken by something safeckpt never wrote
            safeckpt.save({{"w": torch.full((16,), 2.0), "step": 2}}, ck, overwrite=True)
        except safeckpt.CheckpointExistsError as exc:
            assert "not a regular file" in str(exc), exc
        else:
            raise SystemExit("saved over a FIFO")
        assert safeckpt.load_state(ck)["step"] == 1
        try:
            main(["ls", root])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        print("OK")
    """)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    assert (folder / "manifest-000002.json").exists(), "a FIFO safeckpt did not write was removed"


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-fifo"])
def test_a_fifo_listed_as_a_data_file_is_refused_without_blocking(tmp_path, kind):
    ck = tmp_path / "ck"
    safeckpt.save(_state(), ck)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def add_empty_file(body):
        body["files"].append({"name": "extra.bin", "size": 0})
    _rewrite_manifest(ck, add_empty_file)
    if kind == "fifo":
        os.mkfifo(ck / "extra.bin")
    else:
        os.symlink(fifo, ck / "extra.bin")
    out = _run(f"""
        import safeckpt
        for fn in (lambda: safeckpt.load_state({str(ck)!r}), lambda: safeckpt.load_state({str(ck)!r}, verify=False)):
            try:
                fn()
            except safeckpt.CorruptCheckpointError as exc:
                assert "extra.bin" in str(exc), exc
            else:
                raise SystemExit("loaded a checkpoint that names a FIFO")
        report = safeckpt.verify({str(ck)!r})
        assert not report.ok and "extra.bin" in report.problems[0], report.problems
        print("OK")
    """)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_a_folder_named_like_a_manifest_is_not_one(tmp_path):
    ck = tmp_path / "ck"
    safeckpt.save(_state(3.0), ck)
    (ck / "manifest-000002.json").mkdir()
    assert safeckpt.load_state(ck)["w"][0] == 3.0
    safeckpt.save(_state(4.0), ck, overwrite=True)
    assert safeckpt.load_state(ck)["w"][0] == 4.0
    assert (ck / "manifest-000002.json").is_dir()


# --------------------------------------------------------------------------- symlinks


def test_a_data_file_that_is_a_symlink_is_never_read(tmp_path):
    """``data.bin -> /etc/passwd`` under a correctly framed manifest: neither a verified
    nor an unverified load returns those bytes."""
    ck = tmp_path / "ck"
    safeckpt.save({"w": torch.zeros(64, dtype=torch.uint8)}, ck)
    (data,) = [p for p in ck.iterdir() if p.name.startswith("data-")]
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * data.stat().st_size)  # the size the manifest lists
    data.unlink()
    os.symlink(secret, data)  # a link to a file of the right size and content layout
    for verify in (True, False):
        with pytest.raises(safeckpt.CorruptCheckpointError, match=data.name):
            safeckpt.load_state(ck, verify=verify)


def test_a_symlink_with_matching_checksums_is_refused_too(tmp_path):
    """The linked file is a byte-exact copy, so checksums match: refused by its type."""
    ck = tmp_path / "ck"
    safeckpt.save(_state(), ck)
    (data,) = [p for p in ck.iterdir() if p.name.startswith("data-")]
    copy = tmp_path / "elsewhere.safetensors"
    copy.write_bytes(data.read_bytes())
    data.unlink()
    os.symlink(copy, data)
    with pytest.raises(safeckpt.CorruptCheckpointError, match="missing|symbolic link"):
        safeckpt.load_state(ck)
    assert not safeckpt.verify(ck).ok
    # the explicit opt-in, for folders made of links (a Hugging Face cache)
    loaded = safeckpt.load_state(ck, storage_options={"follow_symlinks": True})
    assert torch.equal(loaded["w"], _state()["w"])


def test_files_in_a_symlinked_subfolder_are_refused(tmp_path):
    """A sealed checkpoint names ``sub/model.bin``; ``sub`` is a link to another folder."""
    ck = tmp_path / "ck"
    (ck / "sub").mkdir(parents=True)
    (ck / "sub" / "model.bin").write_bytes(b"weights!" * 4)
    safeckpt.seal(ck)
    elsewhere = tmp_path / "elsewhere"
    (ck / "sub").rename(elsewhere)
    os.symlink(elsewhere, ck / "sub")
    report = safeckpt.verify(ck)
    assert not report.ok and "sub/model.bin" in " ".join(report.problems), report.problems
    storage = safeckpt.storage.open(ck)
    with pytest.raises(safeckpt.CorruptCheckpointError, match="symbolic link"):
        storage.read("sub/model.bin", 0, 8)


def test_a_checkpoint_reached_through_a_symlinked_root_loads(tmp_path):
    """The user's own path may be a link (a run root on a scratch disk): only what lies
    below it must be real files."""
    real = tmp_path / "scratch"
    real.mkdir()
    os.symlink(real, tmp_path / "run")
    mgr = safeckpt.CheckpointManager(tmp_path / "run")
    mgr.save(1, _state(5.0))
    assert safeckpt.load_state(tmp_path / "run" / "step-000000001")["w"][0] == 5.0
    state = _state(0.0)
    assert safeckpt.CheckpointManager(tmp_path / "run").restore(state) == 1


# --------------------------------------------------------------------------- references


def _incremental_run(root: Path) -> tuple[Path, Path]:
    mgr = safeckpt.CheckpointManager(root, incremental=True, chunk_size=1 << 16)
    big = {"a": torch.arange(1 << 16, dtype=torch.float32), "b": torch.zeros(1 << 14)}
    mgr.save(1, big)
    big["b"] += 1
    mgr.save(2, big)
    return Path(mgr.path(1)), Path(mgr.path(2))


def test_a_reference_outside_the_step_folders_is_corrupt(tmp_path):
    root = tmp_path / "run"
    first, second = _incremental_run(root)
    notes = root / "notes"
    notes.mkdir()
    shared = [f for f in os.listdir(first) if f.startswith("data-")][0]
    (notes / "secret.bin").write_bytes((first / shared).read_bytes())

    def point_at_notes(body):
        for f in body["files"]:  # format 3: chunks name files by their place in this list
            if f["name"].startswith("../"):
                f["name"] = "../notes/secret.bin"
    _rewrite_manifest(second, point_at_notes)
    with pytest.raises(safeckpt.CorruptCheckpointError, match="not a checkpoint of the run"):
        safeckpt.load_state(second)
    mgr = safeckpt.CheckpointManager(root, incremental=True, chunk_size=1 << 16)
    with pytest.warns(UserWarning, match="step 2"):
        assert mgr.restore({"a": torch.zeros(1 << 16), "b": torch.zeros(1 << 14)}) == 1


def test_a_reference_into_a_symlinked_step_folder_is_refused(tmp_path):
    root = tmp_path / "run"
    first, second = _incremental_run(root)
    moved = tmp_path / "moved"
    first.rename(moved)
    os.symlink(moved, first)
    with pytest.raises(safeckpt.CorruptCheckpointError, match="missing"):
        safeckpt.load_state(second)
    m = decode_manifest((second / "manifest-000001.json").read_bytes(), "m")
    assert any(f.startswith("../step-000000001/") for f in m.files)
    assert encode_manifest(m)  # the manifest itself is well formed: the link is what is refused


def test_a_step_folder_that_is_a_symlink_is_never_written_through(tmp_path):
    """docs/format.md §2.6: ``run/step-000000005 -> elsewhere`` is not the manager's to
    write: saving step 5 is refused at once, naming the link, and the folder it points to
    is left exactly as it was (nothing written into it, nothing deleted)."""
    import time

    other, root = tmp_path / "elsewhere", tmp_path / "run"
    safeckpt.save(_state(), other)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    root.mkdir()
    os.symlink(other, root / "step-000000005")
    started = time.monotonic()
    with safeckpt.CheckpointManager(root) as mgr:
        with pytest.raises(safeckpt.CheckpointError, match="step-000000005 is a symbolic link") as err:
            mgr.save(5, _state(2.0))
        assert "not shared" not in str(err.value)
        assert time.monotonic() - started < 3  # refused, not a wait for other ranks
        mgr.save(6, _state(3.0))  # the root itself is fine
        assert mgr.steps() == [6]
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
