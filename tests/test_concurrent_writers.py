"""Two writers of one checkpoint path, forced into each interleaving with storage
hooks and raced for real in separate processes: nothing committed is ever lost, and
without ``overwrite`` exactly one save wins while the other raises
``CheckpointExistsError`` (issue 17, items 1 and 2)."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Callable, Iterable

import pytest
import torch

import safeckpt
from safeckpt.storage import open as open_storage
from safeckpt.storage.base import Buffer, StorageWrapper

WAIT_S = 30


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value), "value": value}


def _value_at(path: Path) -> float:
    loaded = safeckpt.load_state(path)
    assert torch.equal(loaded["w"], torch.full((64,), loaded["value"]))
    return loaded["value"]


class Hooked(StorageWrapper):
    """A storage whose manifest writes call ``before`` first and ``after`` once written;
    ``middle`` runs halfway through writing the manifest's bytes (a slow write)."""

    def __init__(self, inner, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None,
                 middle: Callable[[], None] | None = None) -> None:
        super().__init__(inner)
        self.before, self.after, self.middle = before, after, middle

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        if not name.startswith("manifest-"):
            return self.inner.write_file(name, parts)
        if self.before:
            self.before()
        if self.middle:
            data = b"".join(bytes(p) for p in parts)
            middle = self.middle

            def slow():
                yield data[: len(data) // 2]
                middle()
                yield data[len(data) // 2:]
            parts = slow()
        n = self.inner.write_file(name, parts)
        if self.after:
            self.after()
        return n


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait(event: threading.Event) -> None:
    assert event.wait(WAIT_S), "the other writer never got there"


@pytest.mark.parametrize("first_to_clean_up", ["older", "newer"])
def test_two_overwrites_that_both_commit_lose_nothing(tmp_path, first_to_clean_up):
    """A commits manifest 2, B commits manifest 3, then each cleans up: whatever the
    order, the newest commit (B's) and its data survive; the oldest one is removed."""
    path = tmp_path / "ckpt"
    safeckpt.save(_state(1.0), path)
    a_committed, b_committed, a_may_clean = threading.Event(), threading.Event(), threading.Event()

    def a_after():
        a_committed.set()
        _wait(a_may_clean)
    a_storage = Hooked(open_storage(path), after=a_after)
    ta, a = _in_thread(lambda: safeckpt.save(_state(2.0), a_storage, overwrite=True))
    _wait(a_committed)
    if first_to_clean_up == "older":
        b_storage = Hooked(open_storage(path), after=lambda: (a_may_clean.set(), ta.join(WAIT_S)))
    else:
        b_storage = Hooked(open_storage(path), after=b_committed.set)
    info_b = safeckpt.save(_state(3.0), b_storage, overwrite=True)
    a_may_clean.set()
    ta.join(WAIT_S)
    assert "error" not in a, a
    assert (a["result"].seq, info_b.seq) == (2, 3)
    assert _value_at(path) == 3.0
    names = sorted(os.listdir(path))
    assert [n for n in names if n.startswith("manifest-")] == ["manifest-000003.json"], names
    assert len([n for n in names if n.startswith("data-")]) == 1, names  # only B's data left
    assert safeckpt.verify(path).ok


def test_two_overwrites_of_the_same_sequence_one_wins(tmp_path):
    """Both plan sequence 2; the second to create the manifest gets CheckpointExistsError
    and the first one's checkpoint is what loads."""
    path = tmp_path / "ckpt"
    safeckpt.save(_state(1.0), path)
    a_at_manifest, b_done = threading.Event(), threading.Event()
    a_storage = Hooked(open_storage(path), before=lambda: (a_at_manifest.set(), _wait(b_done)))
    ta, a = _in_thread(lambda: safeckpt.save(_state(2.0), a_storage, overwrite=True))
    _wait(a_at_manifest)
    safeckpt.save(_state(3.0), path, overwrite=True)
    b_done.set()
    ta.join(WAIT_S)
    assert isinstance(a.get("error"), safeckpt.CheckpointExistsError), a
    assert "another writer committed manifest-000002.json" in str(a["error"])
    assert _value_at(path) == 3.0
    assert safeckpt.verify(path).ok
    assert not [n for n in os.listdir(path) if n.startswith("data-") and a_storage.url in n]


def test_a_save_never_takes_over_a_manifest_being_written(tmp_path):
    """A's manifest is created and half written when B saves without overwrite: B must
    not treat it as the leftover of a crash. A commits; B gets CheckpointExistsError."""
    path = tmp_path / "ckpt"
    a_half, b_done = threading.Event(), threading.Event()
    a_storage = Hooked(open_storage(path), middle=lambda: (a_half.set(), _wait(b_done)))
    ta, a = _in_thread(lambda: safeckpt.save(_state(1.0), a_storage))
    _wait(a_half)
    with pytest.raises(safeckpt.CheckpointExistsError, match="being written right now by another save"):
        safeckpt.save(_state(2.0), path)
    b_done.set()
    ta.join(WAIT_S)
    assert "error" not in a, a
    assert _value_at(path) == 1.0
    assert [n for n in os.listdir(path) if n.startswith("data-")] == [f"data-{a['result'].save_id}-r00000.safetensors"]


def test_two_first_saves_that_plan_together_one_wins(tmp_path):
    """Both find the folder empty and plan sequence 1: exclusive create decides."""
    path = tmp_path / "ckpt"
    a_at_manifest, b_done = threading.Event(), threading.Event()
    a_storage = Hooked(open_storage(path), before=lambda: (a_at_manifest.set(), _wait(b_done)))
    ta, a = _in_thread(lambda: safeckpt.save(_state(1.0), a_storage))
    _wait(a_at_manifest)
    safeckpt.save(_state(2.0), path)
    b_done.set()
    ta.join(WAIT_S)
    assert isinstance(a.get("error"), safeckpt.CheckpointExistsError), a
    assert _value_at(path) == 2.0
    assert len([n for n in os.listdir(path) if n.startswith("data-")]) == 1, "the loser's data was left"


def test_a_torn_manifest_is_replaced_only_when_asked(tmp_path):
    """A crash left a torn manifest: a save without overwrite refuses it (it cannot tell
    a crash from a save in progress) and says what to do; overwrite=True replaces it."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "manifest-000001.json").write_bytes(b'{"safeckpt":{"format_')
    with pytest.raises(safeckpt.CheckpointExistsError, match="pass overwrite=True"):
        safeckpt.save(_state(1.0), path)
    safeckpt.save(_state(1.0), path, overwrite=True)
    assert _value_at(path) == 1.0


# --------------------------------------------------------------------------- real processes

ROUNDS = 16


def _racer(root: str, rank: int, overwrite: bool, barrier, results) -> None:
    torch.set_num_threads(1)
    for r in range(ROUNDS):
        path = os.path.join(root, f"round-{r}")
        barrier.wait(WAIT_S)
        try:
            info = safeckpt.save(_state(10.0 * r + rank), path, overwrite=overwrite)
            results.put((r, rank, "ok", info.seq))
        except safeckpt.CheckpointExistsError as exc:
            results.put((r, rank, "exists", str(exc)))
        except BaseException as exc:  # noqa: BLE001 - any other outcome fails the test
            results.put((r, rank, "error", repr(exc)))


@pytest.mark.parametrize("overwrite", [False, True], ids=["exclusive", "overwrite"])
def test_two_processes_racing_for_one_path(tmp_path, overwrite):
    """Two processes save to the same fresh path at the same moment, round after round
    (with ``overwrite``, every path holds an earlier checkpoint first)."""
    ctx = multiprocessing.get_context("fork")
    if overwrite:
        for r in range(ROUNDS):
            safeckpt.save(_state(-1.0), tmp_path / f"round-{r}")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(tmp_path), rank, overwrite, barrier, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    outcomes: dict[int, dict[int, tuple]] = {}
    for _ in range(2 * ROUNDS):
        r, rank, kind, detail = results.get(timeout=120)
        outcomes.setdefault(r, {})[rank] = (kind, detail)
    for p in procs:
        p.join(WAIT_S)
    for r, by_rank in sorted(outcomes.items()):
        kinds = {rank: k for rank, (k, _) in by_rank.items()}
        assert "error" not in kinds.values(), by_rank
        winners = [rank for rank, k in kinds.items() if k == "ok"]
        value = _value_at(tmp_path / f"round-{r}")
        if not overwrite:
            assert len(winners) == 1, f"round {r}: {by_rank}"
            assert value == 10.0 * r + winners[0], f"round {r}: the winner's state must be what loads"
        else:
            assert winners, f"round {r}: {by_rank}"
            newest = max(winners, key=lambda rank: by_rank[rank][1])
            assert value == 10.0 * r + newest, f"round {r}: {by_rank} but {value} loads"
        assert safeckpt.verify(tmp_path / f"round-{r}").ok
