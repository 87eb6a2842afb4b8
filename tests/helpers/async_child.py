"""Real processes for the async-save, preemption and writer tests.

Three ways in:

- ``python async_child.py serve``: the fork server of ``save_child.py`` (one import of
  torch, one fork per child) with this file's modes added; ``AsyncForkServer`` is its
  client. Modes:

  * ``async_loop``: a ``CheckpointManager(async_save=True)`` that resumes the run and
    saves one state, changed *in place* after every call, step after step until killed.
    ``snap N`` is logged when ``save`` returned (snapshot taken), ``done N`` when the
    commit of step N completed (from the future's callback).
  * ``dist_async``: one rank of a gloo job: ``all_reduce`` in a loop on the default group
    while a ``CheckpointManager(async_save=True)`` save runs in the background; writes
    what it saw to ``<out>/rank<r>.json``.
  * ``hold_lease``: a manager that saves once (so it holds the root's writer lease),
    logs ``done 0`` and sleeps until killed.

- ``python async_child.py train ROOT PROGRESS``: a training loop with
  ``CheckpointManager(handle_sigterm=True, async_save=True)`` that saves every few steps
  and, once ``mgr.preempted``, does one final save of its current step, closes the
  manager and exits 0 (prints ``final N``).

- ``python async_child.py fail_unobserved DIR``: async saves that fail (ENOSPC) and
  whose futures nobody looks at; the process then exits normally, and the error must
  reach stderr from the handler that finishes async saves at exit.

Every child is bounded in time (faulthandler dumps its stacks and exits).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import save_child  # noqa: E402
from save_child import ForkServer, make_state  # noqa: E402


def fill(state: dict, step: int) -> None:
    """Make ``state`` (built by ``make_state``) hold ``make_state(step)``, in place for
    tensors (the same storage a model's parameters would keep), replaced for values."""
    want = make_state(step)
    state["model"]["w"].copy_(want["model"]["w"])
    state["model"]["r"].copy_(want["model"]["r"])
    for a, b in zip(state["small"], want["small"]):
        a.copy_(b)
    state["step"] = want["step"]
    state["name"] = want["name"]


class _Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, what: str, n: int) -> None:
        os.write(self.fd, f"{what} {n}\n".encode())


def read_log(path: str) -> dict[str, list[int]]:
    """``{"snap": [...], "done": [...], ...}`` from a progress file."""
    out: dict[str, list[int]] = {}
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        what, _, n = line.partition(" ")
        if n.lstrip("-").isdigit():
            out.setdefault(what, []).append(int(n))
    return out


# --------------------------------------------------------------------------- fork modes


def mode_async_loop(root: str, progress: str, keep_last: int = 2, limit_s: float = 60.0,
                    writer: str = "process") -> None:
    """``writer``: where the saves run (``SAFECKPT_ASYNC_WRITER``)."""
    import safeckpt
    from safeckpt.run.writer import ENV
    os.environ[ENV] = writer
    faulthandler.dump_traceback_later(limit_s + 30, exit=True)
    log = _Log(progress)
    # the writer process starts with the first async save (an interpreter importing torch:
    # seconds on a busy machine); started here, so that the kills hit the loop of saves
    safeckpt.async_save({"warm": make_state(0)["model"]["w"][:1]}, progress + ".warm").result()
    mgr = safeckpt.CheckpointManager(root, keep_last=keep_last, async_save=True)
    state = make_state(0)
    latest = mgr.restore(state)
    step = 0 if latest is None else latest + 1
    log("start", step)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        fill(state, step)
        fut = mgr.save(step, state)
        log("snap", step)
        fut.add_done_callback(lambda f, s=step: log("done", s) if f.exception() is None else log("fail", s))
        step += 1
        fill(state, step)  # "training" changes the tensors while the save is in flight
    mgr.close()


def mode_hold_lease(root: str, progress: str, limit_s: float = 60.0) -> None:
    import safeckpt
    faulthandler.dump_traceback_later(limit_s + 30, exit=True)
    log = _Log(progress)
    mgr = safeckpt.CheckpointManager(root)
    mgr.save(0, make_state(0))
    log("done", 0)
    time.sleep(limit_s)
    mgr.close()


DIST_SIZES = (3_000_000, 1_000_000)  # float32 elements of the two big tensors (16 MB)


def dist_state(step: int) -> dict:
    """The same on every rank: a few large tensors and some values, a function of ``step``."""
    import torch
    return {"model": {"a": torch.arange(DIST_SIZES[0], dtype=torch.float32) * 0.5 + step,
                      "b": torch.full((DIST_SIZES[1],), float(step))},
            "opt": [torch.full((100 + i,), step * 10.0 + i) for i in range(5)],
            "step": step}


def mode_dist_async(rank: int, world: int, port: int, root: str, out: str, progress: str,
                    limit_s: float = 60.0, min_iters: int = 20) -> None:
    """One rank of the async-save-with-concurrent-collectives test (see module docstring);
    ``progress`` + ".err" receives a traceback if the rank fails outside the report."""
    faulthandler.dump_traceback_later(limit_s, exit=True)
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    import safeckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=limit_s))
    report: dict = {"rank": rank, "wrong": [], "iters": [], "overlapped": []}
    expected = float(sum(range(1, world + 1)))
    try:
        mgr = safeckpt.CheckpointManager(root, async_save=True, keep_last=1)
        state = dist_state(1)
        for step in (1, 2):
            fut = mgr.save(step, state)
            # training changes the tensors in place right away; the save has a snapshot
            state["model"]["a"].add_(1000.0)
            state["model"]["b"].zero_()
            state["step"] = -1
            iters = overlapped = 0
            while True:
                x = torch.full((4096,), float(rank + 1))
                dist.all_reduce(x)
                if not torch.all(x == expected):
                    report["wrong"].append(f"iter {iters}: got {x[:3].tolist()}, expected {expected}")
                running = not fut.done()
                overlapped += running
                flag = torch.tensor([1 if running else 0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank agrees when to stop
                iters += 1
                if flag.item() == 0 and iters >= min_iters:
                    break
            info = fut.result()
            report["iters"].append(iters)
            report["overlapped"].append(overlapped)
            report.setdefault("info", []).append({"step": info.step, "world_size": info.world_size,
                                                  "bytes": info.bytes})
            state = dist_state(2)
        mgr.wait()
        dist.barrier()
        report["steps"] = mgr.steps()
        template = dist_state(0)
        template["model"]["a"].fill_(-1)
        report["restored"] = mgr.restore(template)
        want = dist_state(2)
        report["exact"] = (torch.equal(template["model"]["a"], want["model"]["a"])
                           and torch.equal(template["model"]["b"], want["model"]["b"])
                           and all(torch.equal(a, b) for a, b in zip(template["opt"], want["opt"]))
                           and template["step"] == 2)
        mgr.close()
        dist.barrier()
    except BaseException as exc:  # reported to the test, which judges
        import traceback
        report["error"] = traceback.format_exc()
        report["error_type"] = type(exc).__name__
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


save_child.MODES.update(async_loop=mode_async_loop, hold_lease=mode_hold_lease,
                        dist_async=mode_dist_async)


class AsyncForkServer(ForkServer):
    """A ``ForkServer`` that also knows this file's modes."""

    def __init__(self, src: str) -> None:
        super().__init__(src, script=str(HERE))


# --------------------------------------------------------------------------- scripts


def train(root: str, progress: str, save_every: int = 5, limit_s: float = 60.0) -> None:
    """The preemption test's training process (see module docstring)."""
    faulthandler.dump_traceback_later(limit_s + 30, exit=True)
    import safeckpt
    log = _Log(progress)
    before = signal.getsignal(signal.SIGTERM)
    mgr = safeckpt.CheckpointManager(root, handle_sigterm=True, async_save=True, keep_last=2)
    state = make_state(0)
    step = 0
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        step += 1
        fill(state, step)  # one "training step": every tensor changes in place
        if mgr.preempted:
            fut = mgr.save(step, state)  # the final save, of the current step
            log("final", step)
            mgr.close()  # commits what is in flight
            log("committed", step if fut.done() and fut.exception() is None else -1)
            log("handler_restored", int(signal.getsignal(signal.SIGTERM) == before))
            print(f"final {step}", flush=True)
            sys.exit(0)
        if step % save_every == 0:
            mgr.save(step, state)
            log("snap", step)
        time.sleep(0.005)
    sys.exit(3)  # never preempted


def fail_unobserved(folder: str) -> None:
    """Async saves fail with ENOSPC on their data files (``writer_faults``, in the
    writer process or in this one, as ``SAFECKPT_ASYNC_WRITER`` says): one whose error
    was seen via ``result()``, then two (``async_save`` and an async manager) whose
    futures nobody looks at; the process then exits normally."""
    import safeckpt
    import writer_faults
    from safeckpt.run import writer

    writer.COMMAND = writer_faults.writer_command()
    writer_faults.install()
    try:  # an error someone saw is never reported again
        safeckpt.async_save(make_state(0), os.path.join(folder, "seen@full")).result()
    except safeckpt.StorageError:
        print("seen", flush=True)
    safeckpt.async_save(make_state(1), os.path.join(folder, "plain@full"))
    mgr = safeckpt.CheckpointManager(os.path.join(folder, "run@full"), async_save=True)
    mgr.save(7, make_state(7))
    print("returned", flush=True)  # and now the interpreter exits without looking


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "serve":
        save_child.serve()
    elif cmd == "train":
        train(sys.argv[2], sys.argv[3])
    elif cmd == "fail_unobserved":
        fail_unobserved(sys.argv[2])
    else:
        sys.exit("usage: async_child.py serve | train ROOT PROGRESS | fail_unobserved DIR")
