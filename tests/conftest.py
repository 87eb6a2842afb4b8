"""Shared fixtures. Helper scripts live in tests/helpers/ (importable by module name)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS / "helpers") not in sys.path:
    sys.path.insert(0, str(_TESTS / "helpers"))


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
    """DeepSpeed's CPU shared-memory op (every DeepSpeed process loads it), compiled here
    once before any rank or child starts, or found in ~/.cache/torch_extensions: on a
    fresh machine the compile takes from 35 s (idle) to minutes (busy), which must not
    count against a launch's timeout."""
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load()
