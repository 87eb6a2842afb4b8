"""Runs the Python blocks of the docs as a reader would paste them (tests/test_doc_snippets.py).

``python snippet_runner.py JOBS.json`` imports torch and safeckpt once, then runs every
job twice, each time in a fresh forked process (an empty ``__main__`` namespace, the
job's folder as the working directory, its threads joined and ``atexit`` handlers run at
the end), the second run in the folder the first one left. Jobs run side by side,
``parallel`` at a time, so a dozen blocks cost one ``import torch``.

A job is a list of parts, run in order in one namespace (a block and the blocks it
continues). A part whose code starts with ``>>>`` is a doctest: its outputs must match.
After a job's first run its folder is copied to ``FOLDER.first`` (what a fresh run made,
for the tests that check the figures a page shows). The results, one per job, go to
stdout as JSON: ``{"id": ..., "runs": [{"ok": bool, "seconds": s, "output": text}]}``.
"""

from __future__ import annotations

import atexit
import builtins
import doctest
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback

# what the blocks import, imported before forking; torch._dynamo: torch.optim imports it
# (with sympy) when the first optimizer is made, seconds that every block would pay again
PRELOAD = ("numpy", "torch", "torch._dynamo", "safeckpt.protocol.checkpoint", "safeckpt.run.manager",
           "safeckpt.interop.export", "safeckpt.interop.imports", "safeckpt.testing", "safetensors.torch")


def run_parts(parts: list[dict]) -> int:
    """Run a job's parts in one fresh namespace; 0 when all ran (and matched), else 1."""
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    for part in parts:
        if part["code"].lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(part["code"], namespace, f"{part['file']}:{part['line']}",
                                                       part["file"], part["line"] - 1)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, out=sys.stdout.write, clear_globs=False)
            if runner.failures:
                return 1
            continue
        code = compile("\n" * (part["line"] - 1) + part["code"], part["file"], "exec")  # line numbers as on the page
        try:
            exec(code, namespace)
        except BaseException:  # noqa: BLE001 - what the reader would see, then a failed run
            traceback.print_exc()
            return 1
    return 0


def child(job: dict, log: str) -> None:
    """In the forked process: run the job with stdout and stderr going to ``log``, then
    end as a script ends (the threads it started joined, then ``atexit`` handlers, as the
    interpreter does), but without tearing the interpreter down: unloading torch costs
    seconds, and nothing of the snippet runs there."""
    os.setpgid(0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(job["folder"])
    sys.argv = [job["parts"][-1]["file"]]
    code = run_parts(job["parts"])
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - an error at exit fails the run, as it would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    for module in PRELOAD:
        __import__(module)
    jobs = spec["jobs"]
    results = {job["id"]: [] for job in jobs}
    todo = [(job, 0) for job in jobs]
    running: dict[int, tuple[dict, int, float, str]] = {}
    while todo or running:
        while todo and len(running) < spec["parallel"]:
            job, run = todo.pop(0)
            log = os.path.join(spec["logs"], f"{jobs.index(job)}-{run}.log")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child(job, log)  # never returns
            running[pid] = (job, run, time.monotonic(), log)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.02)
            for pid, (job, run, started, log) in list(running.items()):
                if time.monotonic() - started > spec["timeout"]:
                    try:
                        os.killpg(pid, signal.SIGKILL)  # with whatever it started
                    except ProcessLookupError:
                        pass
            continue
        job, run, started, log = running.pop(pid)
        with open(log, errors="replace") as fh:
            output = fh.read()
        if os.WIFSIGNALED(status):
            output += f"\n[killed by signal {os.WTERMSIG(status)}; limit {spec['timeout']} s]"
        ok = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        results[job["id"]].append({"ok": ok, "seconds": round(time.monotonic() - started, 2), "output": output})
        if run == 0:
            shutil.copytree(job["folder"], job["folder"] + ".first", symlinks=True)
            if ok:  # the second paste, in the folder the first one left
                todo.append((job, 1))
    json.dump([{"id": i, "runs": r} for i, r in results.items()], sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
