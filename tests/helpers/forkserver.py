"""The test side of a fork server: a helper script run as ``SCRIPT serve`` that imports
torch once and then forks children on request, one JSON line per request and reply.

``save_child.ForkServer`` (single processes to kill) and ``dist_worker.ForkServer``
(ranks of a gloo group) add their commands on top of this.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parent


class ServerProcess:
    """Start ``script serve`` with ``src`` and this folder importable, and talk to it."""

    def __init__(self, src: str, script: "str | Path", env: dict | None = None) -> None:
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join([src, str(HELPERS), env.get("PYTHONPATH", "")])
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, str(script), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        ready = self._read()
        assert ready.get("ready"), ready

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit {self.proc.poll()})")
        return json.loads(line)

    def request(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
