"""DeepSpeed ZeRO 1, 2 and 3 with safeckpt's checkpoint engine, on 2 real gloo ranks
(DeepSpeed's CPU accelerator), SIGKILLed at random moments during save_checkpoint.

The ranks run scenarios of tests/helpers/ds_worker.py, forked from a server that
imported torch and deepspeed once, so a kill costs a fork and ``deepspeed.initialize``
(about 3 s), not two fresh interpreters. After every kill this process checks what is
on disk: ``latest`` names a committed tag, every committed tag verifies, the newest one
is the save that last returned or the one in flight; the next launch resumes from it,
from a different random model. The last launch runs to the end, and its weights must
equal bit for bit those of a run that was never interrupted.

DeepSpeed's CPU accelerator compiles a small shared-memory extension the first time
(about 35 s on an idle machine, minutes on a busy one): the setup (``./run tests``) builds
it into ``.venv/torch_extensions`` and the ``deepspeed_ops`` fixture (conftest.py) points
every rank there, so no launch compiles or times out on it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

import safeckpt  # noqa: E402
import dist_worker as dw  # noqa: E402
import ds_worker  # noqa: E402
from safeckpt.integrations import deepspeed as sds  # noqa: E402
from safeckpt.storage import LocalStorage  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
RUN_ENV = {"SAFECKPT_TIMEOUT": "20", "DIST_WORKER_STEP_TIMEOUT": "60"}
SEED = 20261201
KILLS = {1: 2, 2: 2, 3: 2}          # 6 kills in the default suite
SLOW_KILLS = {1: 10, 2: 10, 3: 10}
KEEP_LAST = 3


@pytest.fixture(scope="module")
def server(deepspeed_ops):
    srv = ds_worker.DeepSpeedForkServer(SRC, env=RUN_ENV)
    yield srv
    srv.close()


class Runs:
    """Launches of 2 ranks, each with its own output folder, all saving under ``root``."""

    def __init__(self, server, tmp: Path) -> None:
        self.server, self.tmp, self.count = server, tmp, 0
        self.root = tmp / "ckpt"
        self.root.mkdir()

    def _out(self) -> Path:
        self.count += 1
        return self.tmp / f"launch{self.count}"

    def run(self, scenarios: list[str], opts: dict, timeout: float = 120.0, env: dict | None = None) -> dw.Launch:
        return self.server.launch(2, scenarios, self.root, self._out(), timeout=timeout, opts=opts, env=env)

    def killed(self, opts: dict, delay: float) -> tuple[dw.Launch, Path]:
        """Start ``ds_run``, SIGKILL both ranks ``delay`` seconds after rank 0 began its
        first save."""
        out = self._out()
        out.mkdir()
        t0 = time.monotonic()
        pids = self.server.request(cmd="launch", world=2, port=dw.free_port(), out=str(out), root=str(self.root),
                                   scenarios=["ds_run"], env={}, opts=opts, limit_s=118)["pids"]
        deadline = time.monotonic() + 90
        while not ds_worker.read_progress(out / "progress-r0")["begin"] and time.monotonic() < deadline:
            time.sleep(0.005)
        began = bool(ds_worker.read_progress(out / "progress-r0")["begin"])
        time.sleep(delay if began else 0)
        for pid in random.Random(delay).sample(pids, len(pids)):
            os.kill(pid, signal.SIGKILL)
        reply = self.server.request(cmd="wait", pids=pids, timeout=30)
        launch = dw.Launch(2, out, ["ds_run"], reply["status"], reply["timed_out"], time.monotonic() - t0, pids)
        assert began, f"no save began within 90 s:\n{launch.describe()}"
        return launch, out


def committed(folder: Path) -> list[sds.Tag]:
    return sds.scan(LocalStorage(folder))[0]


def check_disk(folder: Path) -> int | None:
    """The invariants after a kill; returns the newest committed step."""
    tags = committed(folder)
    latest = folder / sds.LATEST
    if latest.exists():
        name = latest.read_text()
        assert name in {t.folder for t in tags}, f"latest names {name!r}, which is not committed: {tags}"
    for t in tags:
        report = safeckpt.verify(folder / t.folder)
        assert report.ok, f"committed tag {t.folder} does not verify: {report.problems}"
    assert len({t.tag for t in tags}) <= KEEP_LAST + 1, [t.folder for t in tags]
    return tags[0].manifest.step if tags else None


def kill_and_resume(runs: Runs, stage: int, kills: int, rng: random.Random) -> int:
    """``kills`` launches SIGKILLed at random moments, then one that trains to the end;
    returns the last step."""
    folder = runs.root / f"zero{stage}"
    newest = None
    for i in range(kills):
        # a new random model for each resume; the first model while nothing is committed
        # (the uninterrupted reference starts from it)
        opts = {"stage": stage, "seed": 101 + i if newest else 100, "keep_last": KEEP_LAST,
                "total": 10 ** 6}  # killed, never done
        launch, out = runs.killed(opts, rng.uniform(0.0, 0.5))
        assert all(st["signal"] == signal.SIGKILL for st in launch.status), (
            f"a rank ended before the kill:\n{launch.describe()}")
        progress = ds_worker.read_progress(out / "progress-r0")
        assert progress["resumed"] == [newest or 0], (progress, newest)
        in_flight = progress["begin"][-1] if len(progress["begin"]) > len(progress["done"]) else None
        allowed = {progress["done"][-1] if progress["done"] else newest, in_flight}
        found = check_disk(folder)
        assert found in allowed, f"newest committed step {found}; last save returned {progress['done'][-1:]}, " \
                                 f"in flight {in_flight}"
        newest = found
    # a new random model when it resumes; the first launch's when nothing was committed
    total = max(ds_worker.TOTAL_STEPS, (newest or 0) + 5)
    final = runs.run(["ds_run", "ds_reference"], {"stage": stage, "seed": 7 if newest else 100,
                                                  "first_seed": 100, "keep_last": KEEP_LAST, "total": total})
    (got,), (want,) = final.results("ds_run", [0]), final.results("ds_reference", [0])
    assert got["resumed"] == (newest or 0)
    assert got["steps"] == total
    for rank in range(2):  # every resume brought back exactly the state that was saved at its step
        records = ds_worker.read_states(runs.root / f"zero{stage}-states-r{rank}")
        saved: dict[int, set] = {}
        for what, step, d in records:
            if what == "saved":
                saved.setdefault(step, set()).add(d)
        for what, step, d in records:
            if what == "loaded":
                assert d in saved.get(step, ()), f"ZeRO-{stage} rank {rank}: the state loaded at step {step} " \
                                                  f"was never saved (saved: {saved.get(step)})"
        assert all(len(v) == 1 for v in saved.values()), \
            f"ZeRO-{stage} rank {rank}: training is not deterministic: {[k for k, v in saved.items() if len(v) > 1]}"
    assert got["digest"] == want["digest"], f"ZeRO-{stage}: resumed from step {newest}, not bit-exact"
    check_disk(folder)
    return total


# ZeRO-1 saves the files ZeRO-2 does (model states + partitioned optimizer states): with --slow
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_sigkill_during_save_resume_bit_exact(server, tmp_path, stage):
    total = kill_and_resume(Runs(server, tmp_path), stage, KILLS[stage], random.Random(SEED + stage))
    # DeepSpeed's own recovery script reads the committed tag that latest names
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    folder = tmp_path / "ckpt" / f"zero{stage}"
    assert (folder / "latest").read_text() == f"global_step{total}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    final = torch.load(tmp_path / "ckpt" / f"zero{stage}-final.pt")
    assert sorted(fp32) == sorted(final)
    assert all(torch.equal(fp32[k], final[k]) for k in final)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sigkill_during_save_many(server, tmp_path, stage):
    kill_and_resume(Runs(server, tmp_path), stage, SLOW_KILLS[stage], random.Random(SEED + 10 * stage))


def test_rank_raises_inside_save(server, tmp_path):
    runs = Runs(server, tmp_path)
    data = runs.run(["ds_rank_raises"], {"stage": 2}).results("ds_rank_raises")
    for rank, d in enumerate(data):
        failed = d["failed"]
        assert failed["is_save_aborted"], (rank, failed)
        assert "rank(s) 1" in failed["message"] and "No space left" in failed["message"], failed["message"]
        assert d["after"] == d["before"], f"rank {rank}: the failed save changed the folder"
        assert d["retry"]["raised"] is None, d["retry"]
    folder = runs.root / "raise2"
    assert sds.committed_tags(folder) == ["global_step2", "global_step1"]
    assert (folder / "latest").read_text() == "global_step2"


def test_kill_between_commit_and_latest(server, tmp_path):
    runs = Runs(server, tmp_path)
    # rank 1, left waiting for rank 0's outcome, gives up after SAFECKPT_TIMEOUT
    launch = runs.run(["ds_kill_before_latest"], {"stage": 2}, timeout=60, env={"SAFECKPT_TIMEOUT": "3"})
    assert launch.status[0]["signal"] == signal.SIGKILL, launch.describe()
    folder = runs.root / "latest2"
    assert (folder / "latest").read_text() == "global_step1"   # the commit of step 2 happened, latest did not move
    assert sds.committed_tags(folder) == ["global_step2", "global_step1"]
    resumed = runs.run(["ds_resume_once"], {"stage": 2, "folder": "latest2"}).results("ds_resume_once")
    assert [r["steps"] for r in resumed] == [2, 2]   # the newest committed tag, not what latest says
    # the safeckpt command on a committed DeepSpeed tag
    env = {**os.environ, "PYTHONPATH": SRC}
    for cmd, expect in (("verify", ": 1 committed"), ("ls", "committed"), ("show", "integration='deepspeed'")):
        done = subprocess.run([sys.executable, "-m", "safeckpt", cmd, str(folder / "global_step2")], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and expect in done.stdout, (cmd, done.stdout, done.stderr)


# -- every crash point of a save and a re-save, on simulated disks ---------------------
# The ranks' files and rank 0's commit sequence (seal, latest, the staged re-save moved
# into its tag, retention), driven through the engine's own calls in this process,
# crashed at every storage operation with a kill, a loss of everything unsynced and
# random power cuts (safeckpt.testing.crash_points).

from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo  # noqa: E402
from safeckpt.testing import crash_points  # noqa: E402

TAG = "global_step5"
FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_optim_states.pt")


def engine_save(storage, tag: str, step: int, value: float) -> None:
    """What ``save_checkpoint`` asks of the engine: create, one save per file, commit."""
    ckpt = sds.SafeCheckpointEngine(storage_options={"fs": storage.fs}, keep_last=2)
    ckpt.begin(True, step)
    info = CheckpointCommitInfo(tag=tag, save_dir=storage.path, save_latest=True)
    ckpt.create(info)
    for name in FILES:
        ckpt.save({"w": torch.full((300,), value), "step": step}, os.path.join(storage.path, tag, name))
    ckpt.commit(info)
    ckpt.end()


def engine_load(storage, tag: str | None = None) -> tuple[str, float]:
    """(folder, value) of what ``load_checkpoint`` would load; every file checked."""
    ckpt = sds.SafeCheckpointEngine(storage_options={"fs": storage.fs})
    folder = ckpt.choose(storage.path, tag)
    values = {float(ckpt.load(os.path.join(storage.path, folder, name))["w"][0]) for name in FILES}
    ckpt.loaded()
    assert len(values) == 1, f"{folder} mixes saves: {values}"
    return folder, values.pop()


# the default suite crashes a re-save on POSIX (test_crash_matrix.py runs every profile);
# every kind and profile with --slow
CRASH_CASES = [pytest.param(kind, profile, marks=[] if (kind, profile) == ("resave", "posix") else pytest.mark.slow)
               for kind in ("resave", "save") for profile in ("posix", "nfs", "fuse-object", "windows")]


@pytest.mark.filterwarnings("ignore:loading global_step:UserWarning")
@pytest.mark.parametrize("kind,profile", CRASH_CASES)
def test_every_crash_point_of_a_save(kind, profile):
    """``resave``: a committed tag saved again; ``save``: a new tag next to an older one."""
    old_tag = "global_step4" if kind == "save" else TAG

    def setup(storage):
        engine_save(storage, old_tag, 4, 1.0)

    runs = 0
    for cp in crash_points(lambda st: engine_save(st, TAG, 5, 2.0), profile, setup=setup, power_cuts=1):
        runs += 1
        st = cp.storage
        assert cp.error is None, f"{cp}: {cp.error!r}"
        tags = sds.scan(st)[0]
        assert tags, f"{cp}: nothing committed"
        listing = st.listdir()
        # without rename (fuse-object) latest is rewritten in place and a crash may cut it
        # short; the engine never reads it, so loading below must not care
        if sds.LATEST in listing and profile != "fuse-object":
            named = st.read(sds.LATEST).decode()
            assert named in {t.folder for t in tags}, f"{cp}: latest names {named!r}, not committed"
        folder, value = engine_load(st)
        assert value in (1.0, 2.0), f"{cp}: loaded {value}"
        if not cp.crashed and cp.outcome == "kill":
            assert (folder, value) == (TAG, 2.0), f"{cp}: the finished save loads {folder} = {value}"
        # and the run goes on: the tag saved again is whole, alone and named by latest
        engine_save(st, TAG, 5, 3.0)
        assert engine_load(st) == (TAG, 3.0), str(cp)
        assert st.read(sds.LATEST) == TAG.encode(), str(cp)
        assert not [n for n in st.listdir() if ".safeckpt-" in n], f"{cp}: {sorted(st.listdir())}"
    assert runs > 20
