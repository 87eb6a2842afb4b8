"""Shared fixtures. Helper scripts live in tests/helpers/ (importable by module name)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS / "helpers") not in sys.path:
    sys.path.insert(0, str(_TESTS / "helpers"))


@pytest.fixture(scope="session", autouse=True)
def temp_folder_of_the_run(tmp_path_factory):
    """The system's temporary folder, for the tests and every process they start, is one
    under pytest's own (which pytest prunes, keeping the last 3 runs): what they leave
    there (torchrun's log folders, a server's sockets and logs, a folder a test made and
    forgot) never piles up in /tmp."""
    folder = tmp_path_factory.mktemp("tmp")
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # computed again, from TMPDIR
    yield folder
    if before[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]


@pytest.fixture(scope="session")
def fork_server():
    """One process that imported torch and safeckpt once and forks real children to
    SIGKILL (tests/helpers/save_child.py), so a kill costs a fork, not an import."""
    import safeckpt
    from save_child import ForkServer

    # the children import the same safeckpt as this process
    server = ForkServer(src=str(Path(safeckpt.__file__).resolve().parent.parent))
    yield server
    server.close()


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's CPU shared-memory op (every DeepSpeed process loads it), built by the
    setup (``./run tests``, tests/helpers/deepspeed_op.py) into the venv's own folder:
    a test never compiles it (a compile under a launch's timeout, or a killed one's lock
    left behind, hangs every later DeepSpeed process)."""
    import os

    import deepspeed_op
    pytest.importorskip("deepspeed")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(deepspeed_op.extensions_dir())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not deepspeed_op.built():
        pytest.skip(f"DeepSpeed's {deepspeed_op.NAME} op is not built in {deepspeed_op.extensions_dir()}: "
                    "./run tests builds it (or: python tests/helpers/deepspeed_op.py)")


@pytest.fixture(scope="module")
def faulty_writer():
    """The async writer process of this module's tests has the faults of
    tests/helpers/writer_faults.py installed (folders named ``*@full``, ``*@eio``,
    ``*@held``); a fresh one before and after the module."""
    import writer_faults
    from safeckpt.run import writer

    writer.stop()
    saved, writer.COMMAND = writer.COMMAND, writer_faults.writer_command()
    yield
    writer.stop()
    writer.COMMAND = saved


@pytest.fixture(params=["process", "thread"])
def async_mode(request, monkeypatch, faulty_writer):
    """Async saves of one process run in the writer process, then on a thread of this
    process (``SAFECKPT_ASYNC_WRITER``), with the faults of ``faulty_writer`` either way."""
    import writer_faults
    from safeckpt.run import writer

    if request.param == "process" and not writer.SUPPORTED:
        pytest.skip("no writer process on this platform (Linux only)")
    monkeypatch.setenv(writer.ENV, request.param)
    writer_faults.install(monkeypatch.setattr)  # for the saves of this process
    return request.param
