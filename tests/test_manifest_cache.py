"""Decoded manifests are remembered by their bytes: a manager's retention and garbage
collection after each (async) save decode each committed manifest once, not once per
save; altered bytes are always decoded (and refused) afresh."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import safeckpt
from safeckpt.format import manifestcache
from safeckpt.format.manifest import decode_manifest, encode_manifest


@pytest.fixture(autouse=True)
def _fresh_cache():
    manifestcache.clear()
    yield
    manifestcache.clear()


def _manifest_bytes(tmp_path, n: int = 30) -> bytes:
    safeckpt.save({f"t{i}": torch.full((4,), float(i)) for i in range(n)}, tmp_path / "c")
    return next((tmp_path / "c").glob("manifest-*.json")).read_bytes()


def test_the_same_bytes_are_decoded_once_and_altered_bytes_are_refused(tmp_path, monkeypatch):
    data = _manifest_bytes(tmp_path)
    calls = []
    real = manifestcache.decode_manifest
    monkeypatch.setattr(manifestcache, "decode_manifest", lambda d, w: calls.append(w) or real(d, w))
    first = manifestcache.decode(data, "a")
    assert manifestcache.decode(bytes(data), "b") is first and calls == ["a"]
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    with pytest.raises(safeckpt.CorruptCheckpointError):
        manifestcache.decode(bytes(flipped), "flipped")
    with pytest.raises(safeckpt.CorruptCheckpointError):
        manifestcache.decode(bytes(flipped), "flipped again")  # a refusal is never remembered
    assert calls == ["a", "flipped", "flipped again"]


def test_memory_is_bounded(tmp_path, monkeypatch):
    data = _manifest_bytes(tmp_path)
    monkeypatch.setattr(manifestcache, "LIMIT_BYTES", 3 * len(data))
    m = decode_manifest(data, "m")
    variants = [encode_manifest(dataclasses.replace(m, created=float(k))) for k in range(5)]  # valid, new bytes
    decoded = [manifestcache.decode(v, f"v{k}") for k, v in enumerate(variants)]
    assert len(manifestcache._cache) == 3 and manifestcache._held[0] <= 3 * len(data) + 30
    assert manifestcache.decode(variants[-1], "again") is decoded[-1]  # the newest stay
    assert manifestcache.decode(variants[0], "again") is not decoded[0]  # the oldest went


def test_async_manager_saves_decode_each_committed_manifest_once(tmp_path, monkeypatch):
    decoded: list[str] = []
    real = manifestcache.decode_manifest

    def counting(data, where):
        if threading.current_thread().name.startswith("safeckpt-async-save"):
            decoded.append(where.split("/")[-2])  # the step folder
        return real(data, where)

    monkeypatch.setattr(manifestcache, "decode_manifest", counting)
    state = {f"p{i}": torch.full((8,), float(i)) for i in range(200)}
    with safeckpt.CheckpointManager(tmp_path / "run", keep_last=3, async_save=True) as mgr:
        for step in range(1, 7):
            state["p0"].fill_(step)
            mgr.save(step, state).result(timeout=60)
        assert mgr.steps() == [4, 5, 6]
    # retention and gc read every committed manifest after every save: each decoded once
    assert sorted(decoded) == sorted(set(decoded)), decoded
    assert safeckpt.load_state(mgr.path(6))["p0"][0].item() == 6
