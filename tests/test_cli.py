"""The safeckpt command, run as a real subprocess."""

import os
import subprocess
import sys

import torch

import safeckpt


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "safeckpt", *args], capture_output=True, text=True, env=env)


def test_version_and_help():
    out = _run("--version")
    assert out.returncode == 0 and safeckpt.__version__ in out.stdout
    out = _run("--help")
    assert out.returncode == 0 and "verify" in out.stdout


def test_verify_exit_codes(tmp_path):
    path = tmp_path / "ck"
    safeckpt.save({"w": torch.arange(100.0)}, path)
    ok = _run("verify", str(path))
    assert ok.returncode == 0 and "ok" in ok.stdout
    data = next(p for p in path.iterdir() if p.name.startswith("data-"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad = _run("verify", str(path))
    assert bad.returncode == 1 and "'w'" in bad.stdout and data.name in bad.stdout


def test_missing_path_is_one_clear_line(tmp_path):
    out = _run("verify", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "no checkpoint" in out.stderr
