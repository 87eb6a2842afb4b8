"""The test suite cleans up after itself: a run leaves nothing in the system's temporary
folder (it used to leave a folder per storage conformance test, torchrun's log folders,
SeaweedFS's sockets and logs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

LEAVES_FILES = '''
import subprocess, sys, tempfile

def test_forgets_a_folder_and_starts_a_process_that_does_too():
    tempfile.mkdtemp(prefix="forgotten-")
    subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkdtemp(prefix='forgotten-child-')"],
                   check=True)
'''


def test_a_run_leaves_nothing_in_the_temp_folder(tmp_path):
    """A test (and a process it starts) that forgets a temporary folder leaves it under
    pytest's own temporary folder, which pytest prunes, not in $TMPDIR."""
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    (tmp_path / "test_forgetful.py").write_text(LEAVES_FILES)
    env = {**os.environ, "TMPDIR": str(system_tmp),
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS / "helpers"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_forgetful.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    left = sorted(os.listdir(system_tmp))
    assert all(name.startswith("pytest-of-") for name in left), f"left in $TMPDIR: {left}"
    kept = {p.name.rsplit("-", 1)[0] for p in system_tmp.glob("pytest-of-*/pytest-[0-9]*/tmp*/forgotten-*")}
    assert kept == {"forgotten", "forgotten-child"}, kept
