"""A fork server for crash tests: real processes, really SIGKILLed, without paying for
``import torch`` once per kill.

``python save_child.py serve`` imports torch and safeckpt once, then answers one JSON
command per line on stdin with one JSON line on stdout:

- ``{"cmd": "calibrate", "dir": D}`` -> ``{"seconds": T}``: the median time of a save of
  ``make_state`` into ``D`` (so a test can aim its kills inside saves);
- ``{"cmd": "fork", "mode": M, "args": {...}}`` -> ``{"pid": P}``: fork a child that runs
  ``MODES[M](**args)``; the test kills it with SIGKILL whenever it likes;
- ``{"cmd": "wait", "pid": P}`` -> ``{"code": C, "signal": S}``: reap that child.

Children report progress by appending ``begin N`` / ``done N`` lines to a file (one
``os.write`` each), so the parent knows which saves had returned before the kill. A
child that raises writes its traceback to ``<progress>.err`` and exits 1; a child
whose server dies is killed too (PR_SET_PDEATHSIG), and every child gives up after
``limit_s`` seconds so nothing can loop forever.

``make_state(step)`` is the state every test saves: a few MB whose every value is a
function of ``step``, so a restored state shows exactly which step it came from and a
mix of two steps cannot pass for either.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from forkserver import ServerProcess

N_BIG = 1 << 20        # float32: 4 MiB
N_RAND = 1 << 18       # int64: 2 MiB
N_SMALL = 10           # small tensors go through the coalescing path


def make_state(step: int) -> dict:
    """A ~6 MiB state whose every value is a deterministic function of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "w": torch.arange(N_BIG, dtype=torch.float32) + float(step),
            "r": torch.randint(0, 1 << 40, (N_RAND,), generator=g),
        },
        "small": [torch.full((97 + i,), float(step * 10 + i)) for i in range(N_SMALL)],
        "step": step,
        "name": f"step {step}",
    }


def make_template() -> dict:
    """A state of the right structure with values no step produces (to load into)."""
    return {
        "model": {"w": torch.full((N_BIG,), -1.0), "r": torch.full((N_RAND,), -1, dtype=torch.int64)},
        "small": [torch.full((97 + i,), -1.0) for i in range(N_SMALL)],
        "step": -1,
        "name": "",
    }


def state_mismatch(got: dict, step: int) -> str | None:
    """None when ``got`` holds exactly ``make_state(step)``, else what differs."""
    want = make_state(step)
    for key in ("w", "r"):
        if not torch.equal(got["model"][key], want["model"][key]):
            return f"model.{key} differs from step {step}'s values"
    if len(got["small"]) != len(want["small"]):
        return "small has the wrong length"
    for i, (a, b) in enumerate(zip(got["small"], want["small"])):
        if not torch.equal(a, b):
            return f"small.{i} differs from step {step}'s values"
    if got["step"] != step or got["name"] != want["name"]:
        return f"plain values are step={got['step']!r} name={got['name']!r}, expected step {step}"
    return None


# --------------------------------------------------------------------------- child modes


class _Progress:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, what: str, n: int) -> None:
        os.write(self.fd, f"{what} {n}\n".encode())


def read_progress(path: str) -> tuple[list[int], list[int]]:
    """(steps begun, steps done) from a progress file (missing file: nothing yet)."""
    begun, done = [], []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return begun, done
    for line in text.splitlines():
        what, _, n = line.partition(" ")
        if n.isdigit():
            (begun if what == "begin" else done).append(int(n))
    return begun, done


def mode_manager_loop(root: str, progress: str, keep_last: int = 2, limit_s: float = 60.0) -> None:
    """Save step after step with a fresh ``CheckpointManager`` until killed."""
    import safeckpt
    report = _Progress(progress)
    mgr = safeckpt.CheckpointManager(root, keep_last=keep_last)
    latest = mgr.restore(make_state(0))  # a resumed job continues its run (and its retention)
    step = 0 if latest is None else latest + 1
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        state = make_state(step)
        report("begin", step)
        mgr.save(step, state)
        report("done", step)
        step += 1


def mode_overwrite_loop(path: str, progress: str, start: int, limit_s: float = 60.0) -> None:
    """Overwrite one checkpoint path with value after value until killed."""
    import safeckpt
    report = _Progress(progress)
    deadline = time.monotonic() + limit_s
    value = start
    while time.monotonic() < deadline:
        state = make_state(value)
        report("begin", value)
        safeckpt.save(state, path, overwrite=True)
        report("done", value)
        value += 1


def mode_readme_loop(root: str, result: str, total: int, every: int, resume: str = "next") -> None:
    """The README's training loop: restore, train, save every ``every`` steps; the
    model's final weights go to ``result``. ``resume="next"`` continues after the
    restored step (as the README writes it); ``"same"`` starts at the restored step
    again (``restore(state) or 0``), which saves that step a second time."""
    import safeckpt
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"model": model, "optim": optim}
    with safeckpt.CheckpointManager(root, keep_last=2) as mgr:
        restored = mgr.restore(state)
        start = (0 if restored is None else restored + 1) if resume == "next" else (restored or 0)
        for step in range(start, total):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            if step % every == 0:
                mgr.save(step, state)
    torch.save(model.state_dict(), result)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


def mode_crash_at(path: str, value: int, point: str, overwrite: bool = True) -> None:
    """One save of ``make_state(value)`` that SIGKILLs itself at ``point``:

    ``mid_data`` (part of the data file written), ``before_manifest`` (data file
    complete and fsynced), ``empty_manifest`` (the manifest file created, nothing in it
    yet), ``torn_manifest`` (half the manifest's bytes on disk),
    ``before_retire`` (new manifest durable, old files not yet deleted), ``mid_retire``
    (the first old file deleted)."""
    import safeckpt
    from safeckpt.storage.local import LocalStorage

    real_write = LocalStorage.write_file

    def write_file(self, name, parts):
        if name.startswith("data-") and point == "mid_data":
            def some_then_die():
                for i, part in enumerate(parts):
                    yield part
                    if i >= 1:
                        # the generator resumes only after the previous part was written
                        _die()
            return real_write(self, name, some_then_die())
        if name.startswith("manifest-"):
            if point == "before_manifest":
                _die()
            if point == "empty_manifest":  # created, nothing written yet
                real_write(self, name, [])
                _die()
            if point == "torn_manifest":
                data = b"".join(bytes(p) for p in parts)
                real_write(self, name, [data[: len(data) // 2]])
                _die()
        return real_write(self, name, parts)

    LocalStorage.write_file = write_file
    if point == "before_retire":  # the first delete of a save that got this far is retirement
        LocalStorage.delete = lambda *a, **k: _die()
    if point == "mid_retire":
        real_unlink = os.unlink

        def unlink(p, *a, **k):
            real_unlink(p, *a, **k)
            _die()
        os.unlink = unlink
    safeckpt.save(make_state(value), path, overwrite=overwrite)
    raise AssertionError(f"crash point {point!r} was never reached")


def mode_save_as(path: str, result: str, uid: int, gid: int) -> None:
    """Drop to ``uid``/``gid`` (real permission checks, even for a root test run), try
    one save to ``path`` and write what happened to ``result`` as JSON."""
    import safeckpt
    fd = os.open(result, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # before dropping
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
        safeckpt.save(make_state(0), path)
        out = {"ok": True}
    except Exception as exc:  # reported, not raised: the test judges it
        out = {"ok": False, "type": type(exc).__name__, "message": str(exc),
               "errno": getattr(exc, "errno", None),
               "is_storage_error": isinstance(exc, safeckpt.StorageError)}
    os.write(fd, json.dumps(out).encode())
    os.close(fd)


MODES = {"manager_loop": mode_manager_loop, "overwrite_loop": mode_overwrite_loop,
         "readme_loop": mode_readme_loop,
         "crash_at": mode_crash_at, "save_as": mode_save_as}


# --------------------------------------------------------------------------- server


def _die_with_parent() -> None:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _run_child(mode: str, args: dict) -> None:
    code = 0
    try:
        _die_with_parent()
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # stdout is the protocol pipe
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        MODES[mode](**args)
    except BaseException:
        code = 1
        err = args.get("progress", args.get("path", "/nonexistent")) + ".err"
        try:
            Path(err).write_text(traceback.format_exc())
        except OSError:
            pass
    os._exit(code)


def _calibrate(folder: str) -> float:
    import safeckpt
    times = []
    for i in range(3):
        state = make_state(i)
        t = time.perf_counter()
        safeckpt.save(state, os.path.join(folder, f"c{i}"))
        times.append(time.perf_counter() - t)
    return sorted(times)[1]


def serve() -> None:
    torch.set_num_threads(1)  # forked children must not inherit an OpenMP pool
    import safeckpt.protocol.checkpoint, safeckpt.run.manager  # noqa: F401,E401  (the API is imported on first use: once, before any fork)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "fork":
            pid = os.fork()
            if pid == 0:
                _run_child(req["mode"], req["args"])
            reply = {"pid": pid}
        elif req["cmd"] == "wait":
            _, status = os.waitpid(req["pid"], 0)
            reply = {"code": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
                     "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
        elif req["cmd"] == "calibrate":
            reply = {"seconds": _calibrate(req["dir"])}
        else:
            reply = {"error": f"unknown command {req['cmd']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# --------------------------------------------------------------------------- client


class ForkServer(ServerProcess):
    """The test side: start ``serve()`` in a subprocess and fork children through it."""

    def __init__(self, src: str, script: str = __file__) -> None:
        """``script`` (this file, or one that adds modes to ``MODES``) runs ``serve()``."""
        super().__init__(src, script)

    def fork(self, mode: str, **args) -> int:
        return self.request(cmd="fork", mode=mode, args=args)["pid"]

    def wait(self, pid: int) -> dict:
        return self.request(cmd="wait", pid=pid)

    def kill(self, pid: int) -> dict:
        """SIGKILL ``pid`` (a child of the server) and reap it."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # pragma: no cover - a zombie still has its pid
            pass
        return self.wait(pid)

    def calibrate(self, folder: str) -> float:
        return self.request(cmd="calibrate", dir=folder)["seconds"]


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit("usage: save_child.py serve")
