"""DeepSpeed's CPU shared-memory op, which every DeepSpeed process loads: built once by
the setup (``./run tests``), never inside a test.

    python tests/helpers/deepspeed_op.py     # build it into $TORCH_EXTENSIONS_DIR

DeepSpeed compiles the op the first time a process loads it, guarded by a lock file in
the extensions folder; a build killed half way leaves that lock behind and every later
load waits on it forever. The setup builds into a folder of the project's own
(``.venv/torch_extensions``), where nothing else builds, so a lock found there before a
build is stale and is removed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

NAME = "deepspeed_shm_comm"


def extensions_dir() -> Path:
    """Where the op lives: ``$TORCH_EXTENSIONS_DIR``, by default the venv's own folder."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def built() -> bool:
    """Whether the op is compiled for this torch (torch rebuilds it, in whichever process
    loads it first, when it was built against another path: a venv reached through a
    link, a copy) and no build of it is under way or was left half done."""
    import torch

    folder = extensions_dir() / NAME
    try:
        ninja = (folder / "build.ninja").read_text()
    except OSError:
        return False
    return ((folder / f"{NAME}.so").is_file() and not (folder / "lock").exists()
            and os.path.dirname(torch.__file__) in ninja)


def build() -> None:
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        print(f"==> DeepSpeed's {NAME} op does not build here; its tests will say why they skip")
        return
    (extensions_dir() / NAME / "lock").unlink(missing_ok=True)  # a killed build's; nothing else builds here
    if not built():
        print(f"==> building DeepSpeed's {NAME} op into {extensions_dir()} (once; a few minutes)")
    builder.load(verbose=False)


if __name__ == "__main__":
    build()
