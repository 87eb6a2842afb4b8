"""Code that uses the public API type-checks under ``mypy --strict``: every public
signature is fully annotated (no implicit ``Any`` leaks into the caller's code), and
the package says it is typed (``py.typed``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

USER_CODE = textwrap.dedent('''
    import torch
    import safeckpt
    from safeckpt.storage import Storage, open as open_storage

    def train(root: str) -> int:
        model = torch.nn.Linear(4, 2)
        state: dict[str, object] = {"model": model, "step": 0}
        info: safeckpt.CheckpointInfo = safeckpt.save(state, f"{root}/one", overwrite=True)
        size: int = info.bytes
        safeckpt.load(state, f"{root}/one")
        full: dict[str, object] = safeckpt.load_state(f"{root}/one")
        report: safeckpt.VerifyReport = safeckpt.verify(f"{root}/one")
        ok: bool = report.ok
        future: safeckpt.SaveFuture = safeckpt.async_save(state, f"{root}/two", overwrite=True)
        done: safeckpt.CheckpointInfo = future.result()
        storage: Storage = open_storage(root)
        with safeckpt.CheckpointManager(storage, keep_last=2) as mgr:
            restored: int | None = mgr.restore(state)
            mgr.save(1, state, metrics={"loss": 0.5})
            latest: int | None = mgr.latest_step()
            steps: list[int] = mgr.steps()
        listed: list[safeckpt.CheckpointStatus] = safeckpt.list_checkpoints(root)
        states: list[safeckpt.CheckpointState] = [c.state for c in listed]
        try:
            safeckpt.load_state(f"{root}/missing")
        except safeckpt.CheckpointNotFoundError as exc:
            message: str = str(exc)
        return size + len(full) + len(states) + (restored or 0) + (latest or 0) + len(steps) + int(ok) + done.bytes
''')


@pytest.mark.slow  # ~17 s; .ci/run type-checks the package itself after the suite
def test_user_code_passes_mypy_strict(tmp_path):
    pytest.importorskip("mypy", reason="mypy comes with safeckpt[dev]")
    (tmp_path / "user.py").write_text(USER_CODE)
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                           "--ignore-missing-imports", "--no-incremental", str(tmp_path / "user.py")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
