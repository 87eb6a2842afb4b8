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
    again = manifestcache.decode(bytes(data), "b")
    assert calls == ["a"] and again.save_id == first.save_id and again.tensors is first.tensors
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
    for k, v in enumerate(variants):
        manifestcache.decode(v, f"v{k}")
    assert len(manifestcache._cache) == 3 and manifestcache._held[0] <= 3 * len(data) + 30
    calls = []
    real = manifestcache.decode_manifest
    monkeypatch.setattr(manifestcache, "decode_manifest", lambda d, w: calls.append(w) or real(d, w))
    manifestcache.decode(variants[-1], "newest")
    manifestcache.decode(variants[0], "oldest")
    assert calls == ["oldest"]  # the newest stayed, the oldest went


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


def _scribble(value):
    """Change every container inside ``value`` in place, as a careless caller might."""
    if isinstance(value, dict):
        for v in value.values():
            _scribble(v)
        value["scribbled"] = True
    elif isinstance(value, list):
        for v in value:
            _scribble(v)
        value.append("scribbled")
    elif isinstance(value, set):
        value.add("scribbled")


def test_what_a_caller_receives_never_aliases_the_cache(tmp_path):
    """Values a listing returns are the caller's own: changing them changes nothing that
    a later listing, load or manager sees."""
    metadata = {"cfg": {"lr": [0.1, 0.01], "sched": {"kind": "cosine", "warmup": [100]}}, "tags": {"a", "b"},
                "epoch": 3}
    metrics = {"loss": 0.5, "history": [0.9, 0.7]}
    with safeckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2), "cfg": {"lr": [0.1]}}, metadata=metadata, metrics=metrics)
    root = tmp_path / "run"
    for attempt in range(2):  # the second attempt: what the first one scribbled on must not show
        first = safeckpt.list_checkpoints(root)[0]
        assert first.metadata == metadata and first.metrics == metrics, f"attempt {attempt}: {first}"
        _scribble(first.metadata)
        _scribble(first.metrics)
        m = manifestcache.decode(next((root / "step-000000001").glob("manifest-*.json")).read_bytes(), "m")
        assert m.metadata == metadata and m.metrics == metrics
        _scribble(m.metadata)
        state = safeckpt.load_state(root / "step-000000001")
        assert state["cfg"] == {"lr": [0.1]}
        _scribble(state)
    assert safeckpt.list_checkpoints(root)[0].metadata == metadata
