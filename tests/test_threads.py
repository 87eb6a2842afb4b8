"""Every public save path, called from several threads at once.

A process may hold several savers (the main model and an EMA copy, a callback thread,
two managers, Lightning's checkpoint plugin): each thread saves its own state to its own
path, at the same moment as the others, round after round, and scribbles over its state
as soon as the call returns. Each committed checkpoint must then hold, bit for bit, what
its own call was given (``load_state``), and ``verify`` must accept it. States hold many
small tensors (packed into shared regions) and a few large ones (pieces of their own),
and their sizes change from round to round, so staging buffers are both reused and
replaced.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import safeckpt
from safeckpt.format.names import step_folder
from safeckpt.storage.local import LocalStorage

LARGE = (1 << 18) + 24  # float32 elements: a little over 1 MiB, a piece of its own


def make_state(thread: int, round_: int, small: int) -> dict:
    """A state only this thread and round have: ``small`` small tensors of three dtypes
    (sizes change with the round) and two large ones, one of which stays the same from
    round to round (so an incremental save shares its chunks)."""
    g = torch.Generator().manual_seed(1000 * thread + round_)
    tensors = {}
    for k in range(small):
        n = 4 + (k * 7 + round_ % 2 * 5) % 61
        kind = k % 3
        tensors[f"s{k}"] = (torch.randn(n, generator=g) if kind == 0 else
                            torch.randint(-2**40, 2**40, (n,), generator=g) if kind == 1 else
                            torch.randn(n, generator=g).to(torch.bfloat16))
    frozen = torch.Generator().manual_seed(thread)
    return {"model": tensors,
            "large": [torch.randn(LARGE, generator=g), torch.randn(LARGE, generator=frozen)],
            "round": round_, "thread": thread}


def scribble(state: dict) -> None:
    """What the training does to a state right after a save returned: change it all."""
    for t in [*state["model"].values(), *state["large"]]:
        t.fill_(-7)


def assert_holds(path: str, want: dict, root: str = "") -> None:
    """The checkpoint at ``path`` holds ``want`` exactly (``root``: the key it is under)."""
    if Path(path).is_file():  # Lightning's .ckpt: torch.save's bytes, checked as it would load them
        got = torch.load(path, weights_only=True)
    else:
        got = safeckpt.load_state(path)
        report = safeckpt.verify(path)
        assert report.ok, report.problems
    got = got[root] if root else got
    assert (got["thread"], got["round"]) == (want["thread"], want["round"]), path
    for key, t in [*want["model"].items(), *enumerate(want["large"])]:
        g = got["model"][key] if isinstance(key, str) else got["large"][key]
        assert g.dtype == t.dtype and torch.equal(g, t), \
            f"{path}: {key} holds other bytes than thread {want['thread']} saved in round {want['round']}"


Saver = Callable[[dict, int], Any]  # (state, round) -> a CheckpointInfo, a SaveFuture or None


def _savers(root: Path, closers: list[Callable[[], Any]]) -> dict[str, tuple[Saver, Callable[[int], str], str]]:
    """Each public save path: how it saves a round, where that round's checkpoint is, and
    the key its state is under in the checkpoint."""
    def manager(name: str, **kw: Any) -> tuple[Saver, Callable[[int], str], str]:
        mgr = safeckpt.CheckpointManager(root / name, **kw)
        closers.append(mgr.close)
        return (lambda state, r: mgr.save(r, state)), (lambda r: str(root / name / step_folder(r))), ""

    out = {
        "save": ((lambda state, r: safeckpt.save(state, root / f"save-{r}")), lambda r: str(root / f"save-{r}"), ""),
        **{f"async_save-{i}": ((lambda state, r, i=i: safeckpt.async_save(state, root / f"async-{i}-{r}")),
                               lambda r, i=i: str(root / f"async-{i}-{r}"), "") for i in range(2)},
        "manager": manager("mgr"),
        "manager-async": manager("mgr-async", async_save=True),
        "manager-incremental": manager("mgr-incr", incremental=True, chunk_size=1 << 16),
        "manager-incremental-async": manager("mgr-incr-async", incremental=True, chunk_size=1 << 16,
                                             async_save=True),
    }
    # Lightning's plugin, where Lightning is installed (its tests import it before these run):
    # two threads share one plugin writing Lightning's .ckpt files, one writes folders
    if importlib.util.find_spec("lightning") is not None:
        from safeckpt.integrations.lightning import SafeCheckpointIO
        file_io, folder_io = SafeCheckpointIO(async_save=True), SafeCheckpointIO(async_save=True, layout="folder")
        closers += [file_io.teardown, folder_io.teardown]
        for name, io in (("pl-file-0", file_io), ("pl-file-1", file_io), ("pl-folder", folder_io)):
            out[name] = ((lambda state, r, io=io, name=name:
                          io.save_checkpoint({"state": state, "global_step": r}, root / f"{name}-{r}.ckpt")),
                         lambda r, name=name: str(root / f"{name}-{r}.ckpt"), "state")
    return out


def run_every_save_path_at_once(root: Path, rounds: int, small: int) -> None:
    closers: list[Callable[[], Any]] = []
    savers = _savers(root, closers)
    barrier = threading.Barrier(len(savers), timeout=120)
    results: dict[str, list[Any]] = {name: [] for name in savers}
    errors: list[BaseException] = []

    def loop(thread: int, name: str) -> None:
        save = savers[name][0]
        try:
            for r in range(rounds):
                state = make_state(thread, r, small)
                barrier.wait()  # every thread saves at the same moment
                results[name].append(save(state, r))
                scribble(state)  # the call returned: what it saved is its own copy
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(i, name), name=f"saver-{name}") for i, name in enumerate(savers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for close in closers:
        close()
    if errors:
        raise errors[0]
    for name, got in results.items():
        for r, out in enumerate(got):
            if isinstance(out, safeckpt.SaveFuture):
                out.result(timeout=120)
    for thread, (name, (_, where, key)) in enumerate(savers.items()):
        assert len(results[name]) == rounds, name
        for r in range(rounds):
            assert_holds(where(r), make_state(thread, r, small), key)


def test_every_save_path_from_several_threads_commits_what_each_call_was_given(tmp_path):
    run_every_save_path_at_once(tmp_path, rounds=3, small=60)


@pytest.mark.slow
def test_every_save_path_from_several_threads_many_rounds(tmp_path):
    run_every_save_path_at_once(tmp_path, rounds=12, small=600)


def test_one_manager_saved_from_two_threads_keeps_each_save(tmp_path, monkeypatch):
    """An incremental save shares the chunks of the newest checkpoint. While thread A's
    save (step 2, sharing step 1's chunks) writes its data, thread B saves step 3 through
    the same manager, a full save whose retention (``keep_last=1``) deletes step 1. A
    manager runs one save at a time, so A's save commits (it used to fail: its shared
    chunks were gone)."""
    real = LocalStorage.write_file
    a_writing, b_returned = threading.Event(), threading.Event()

    def write_file(self, name, parts):
        if name.startswith("data-") and self.path.endswith(step_folder(2)):
            a_writing.set()
            b_returned.wait(1.0)  # B cannot save before A's save is done: A goes on after 1 s
        return real(self, name, parts)

    monkeypatch.setattr(LocalStorage, "write_file", write_file)
    frozen = torch.randn(LARGE, generator=torch.Generator().manual_seed(0))

    def state(step: int) -> dict:
        w = frozen.clone()
        w[:8] = step  # one chunk changes from step to step
        return {"w": w, "step": step}

    mgr = safeckpt.CheckpointManager(tmp_path / "run", incremental=True, chunk_size=1 << 16, full_every=3,
                                     keep_last=1)
    mgr.save(1, state(1))
    outcome: dict[str, Any] = {}

    def save_a() -> None:
        try:
            outcome["a"] = mgr.save(2, state(2))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome["a"] = exc

    a = threading.Thread(target=save_a)
    a.start()
    assert a_writing.wait(60)
    mgr.save(3, state(3))  # the third save writes everything (full_every=3)
    b_returned.set()
    a.join(60)
    assert isinstance(outcome["a"], safeckpt.CheckpointInfo), f"step 2's save failed: {outcome['a']!r}"
    assert mgr.steps() == [3]
    got = safeckpt.load_state(mgr.path(3))
    assert got["step"] == 3 and torch.equal(got["w"], state(3)["w"])
    mgr.close()
