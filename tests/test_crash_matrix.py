"""Crash matrix: every storage profile x save scenario x EVERY crash point k.

For each profile (posix, nfs, windows, fuse-object, object-store) and scenario -- (a) a
first save, (b) an overwrite of a committed checkpoint, (c) a CheckpointManager save
that triggers keep_last retention, (d) the same with incremental saves, where the new
checkpoint shares data with a retired one and retires another, (e) a save on a local
tier and its background copy to the durable root, with retention on both tiers --
``safeckpt.testing.crash_points`` crashes the save
at every storage operation k (exhaustive) and cuts the power with several outcomes (a
plain kill, everything unsynced dropped, random keep/drop/tear). After recovery:

- the previously committed checkpoint restores exactly (``torch.equal``);
- the new one is either fully committed (loads exactly the new values) or invisible
  (no valid manifest), and anything that looks committed loads exactly;
- garbage left behind is listed and bounded, and never looks committed;
- a retry of the same operation on the recovered storage succeeds.

The matrix is printed at the end of the run and written to
``.pytest_cache/d/safeckpt/crash-matrix.md``. ``-m slow`` runs many more random power
cuts per crash point.
"""

from __future__ import annotations

import copy
import functools
import shutil
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import expected_warnings
import nodes_crash_worker as nw
import pytest
import tiered_dist_worker as tw
import torch

import safeckpt
from safeckpt.run.lease import LEASE_RE
from safeckpt.format.folder import read_committed
from safeckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from safeckpt.format.names import RETIRED
from safeckpt.run.manager import step_folder
from safeckpt.format.manifest import is_shared, manifest_seq
from safeckpt.run.nodes import read_holdings
from safeckpt.storage import LocalStorage, Storage
from safeckpt.testing import PROFILES, crash_points

SCENARIOS = ("first-save", "overwrite", "async-overwrite", "manager-retention", "incremental-retention",
             "tiered-replication")
ORDER = SCENARIOS + ("nodes-victim-a", "nodes-victim-b")  # rows of the matrix (the node cells: see the end)
MAX_GARBAGE_FILES = 2  # one checkpoint's files (data + manifest) of the one interrupted save


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(8, 4, generator=g), "b": torch.randint(0, 100, (6,), generator=g)},
        "optim": {"lr": 0.1 * seed, "betas": [0.9, 0.999], "step": seed},
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "epoch": seed,
    }


STATES = {name: make_state(i + 1) for i, name in enumerate(["prev", "old", "new", "s1", "s2", "s3", "s4"])}
FROZEN = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))  # 8 chunks of 64 bytes
for _name in ("s1", "s2", "s3", "s4"):
    STATES["i" + _name] = {**STATES[_name], "frozen": FROZEN.clone()}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def state_of(storage: Storage, candidates: tuple[str, ...]) -> str:
    """Which state a checkpoint folder holds: a name from ``candidates``, ``"none"``
    (not committed: invisible), or ``"WRONG ..."`` when it looks committed but does not
    load exactly one of the candidates."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            read_committed(storage)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return "none"
        try:
            loaded = safeckpt.load_state(storage)
        except Exception as exc:  # noqa: BLE001
            return f"WRONG: looks committed but does not load: {type(exc).__name__}: {exc}"
    for name in candidates:
        if same(loaded, STATES[name]):
            return name
    return f"WRONG: committed but holds none of {candidates}"


def walk(storage: Storage, prefix: str = "") -> list[str]:
    out = []
    for name, size in sorted(storage.listdir().items()):
        if size is None:
            out += walk(storage.child(name), prefix + name + "/")
        else:
            out.append(prefix + name)
    return out


def garbage(root: Storage) -> list[str]:
    """Files under ``root`` that no winning manifest uses (nor is a winning manifest)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        used = set()
        for name, size in root.listdir().items():
            if size is not None:
                continue
            try:
                m = read_committed(root.child(name))
            except (CheckpointNotFoundError, CorruptCheckpointError):
                continue
            used |= {f[3:] if is_shared(f) else f"{name}/{f}" for f in m.files}
            used.add(f"{name}/manifest-{m.seq:06d}.json")
    # writer leases are the root's live ownership record, not leftovers of a save; a
    # retired folder's marker belongs to the shared data it still holds
    holding = {u.split("/")[0] for u in used}
    return [f for f in walk(root) if f not in used and not LEASE_RE.fullmatch(f)
            and not (f.endswith("/" + RETIRED) and f.split("/")[0] in holding)]


# -- scenarios: setup, the crashed operation, and the checks after recovery --------------

def setup_first(root: Storage) -> None:
    safeckpt.save(STATES["prev"], root.child("prev"))


def run_first(root: Storage) -> None:
    safeckpt.save(STATES["new"], root.child("ckpt"))


def setup_overwrite(root: Storage) -> None:
    safeckpt.save(STATES["prev"], root.child("prev"))
    safeckpt.save(STATES["old"], root.child("ckpt"))


def run_overwrite(root: Storage) -> None:
    safeckpt.save(STATES["new"], root.child("ckpt"), overwrite=True)


def run_async_overwrite(root: Storage) -> None:
    """The same save as ``run_overwrite``, staged and committed by the background thread."""
    safeckpt.async_save(STATES["new"], root.child("ckpt"), overwrite=True).result()


MANAGER_OPTIONS = {"manager-retention": {"keep_last": 2},
                   "incremental-retention": {"keep_last": 1, "incremental": True, "chunk_size": 64}}


def prefix_of(scenario: str) -> str:
    """The incremental scenario's states carry a frozen tensor the saves share."""
    return "i" if scenario == "incremental-retention" else ""


def blank() -> dict:
    """A fresh state to restore into (restoring replaces values in place, so no sharing)."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in make_state(99).items()} | {"frozen": torch.zeros_like(FROZEN)}


def setup_manager(root: Storage, scenario: str = "manager-retention") -> None:
    mgr = safeckpt.CheckpointManager(root, **MANAGER_OPTIONS[scenario])
    mgr.save(1, STATES[prefix_of(scenario) + "s1"])
    mgr.save(2, STATES[prefix_of(scenario) + "s2"])


def run_manager(root: Storage, scenario: str = "manager-retention") -> None:
    """A resumed job: restore (which continues the run), then save and retire."""
    mgr = safeckpt.CheckpointManager(root, **MANAGER_OPTIONS[scenario])
    target = blank()
    if not prefix_of(scenario):
        del target["frozen"]
    mgr.restore(target)
    mgr.save(3, STATES[prefix_of(scenario) + "s3"])


def check_first(point, root: Storage) -> tuple[str, list[str]]:
    problems = []
    if state_of(root.child("prev"), ("prev",)) != "prev":
        problems.append("the previously committed checkpoint 'prev' no longer restores exactly")
    got = state_of(root.child("ckpt"), ("new",))
    if got.startswith("WRONG"):
        problems.append(f"ckpt: {got}")
    if not point.crashed and got != "new":
        problems.append(f"the save returned, yet after the power cut ckpt is {got!r} (not durable)")
    left = garbage(root)
    # retry: the interrupted save must be redoable on what the crash left; a torn
    # manifest is replaced only when asked (it could be another save's, in progress)
    if got == "none":
        try:
            safeckpt.save(STATES["new"], root.child("ckpt"))
        except safeckpt.CheckpointExistsError as exc:
            if "not valid" not in str(exc):
                problems.append(f"after recovery, a retried first save raised {exc}")
            safeckpt.save(STATES["new"], root.child("ckpt"), overwrite=True)
        if state_of(root.child("ckpt"), ("new",)) != "new":
            problems.append("after recovery, a retried first save does not load exactly")
    RESULTS_AFTER.append(len(garbage(root)))
    return got, problems + _garbage_problems(left)


def check_overwrite(point, root: Storage) -> tuple[str, list[str]]:
    problems = []
    if state_of(root.child("prev"), ("prev",)) != "prev":
        problems.append("the untouched checkpoint 'prev' no longer restores exactly")
    got = state_of(root.child("ckpt"), ("old", "new"))
    if got == "none":
        problems.append("ckpt: the previously committed checkpoint was lost (no valid manifest)")
    elif got.startswith("WRONG"):
        problems.append(f"ckpt: {got}")
    if not point.crashed and got != "new":
        problems.append(f"the overwrite returned, yet after the power cut ckpt is {got!r} (not durable)")
    left = garbage(root)
    torn_newer = got == "old" and sum(manifest_seq(n) is not None for n in root.child("ckpt").listdir()) > 1
    with expected_warnings.only() as caught:  # the retry reads the old manifest past a torn newer one
        safeckpt.save(STATES["new"], root.child("ckpt"), overwrite=True)
    if bool(caught) != torn_newer:
        problems.append(f"retrying the overwrite warned {[str(w.message) for w in caught]} "
                        f"(a torn newer manifest: {torn_newer})")
    if state_of(root.child("ckpt"), ("new",)) != "new":
        problems.append("after recovery, a retried overwrite does not load exactly")
    RESULTS_AFTER.append(len(garbage(root)))
    return got, problems + _garbage_problems(left)


def check_manager(point, root: Storage, scenario: str = "manager-retention") -> tuple[str, list[str]]:
    problems = []
    p = prefix_of(scenario)
    options = MANAGER_OPTIONS[scenario]
    expect = {1: p + "s1", 2: p + "s2", 3: p + "s3"}
    got = {s: state_of(root.child(step_folder(s)), (expect[s],)) for s in expect}
    for s, g in got.items():
        if g.startswith("WRONG"):
            problems.append(f"step {s}: {g}")
    if got[2] != expect[2] and not (p and got[3] == expect[3]):
        problems.append(f"step 2 (the newest committed before the save) is {got[2]!r}, not {expect[2]}")
    if not p and got[1] == "none" and got[3] != expect[3]:
        problems.append("step 1 was deleted by retention although step 3 never committed")
    if not point.crashed and got[3] != expect[3]:
        problems.append(f"mgr.save(3) returned, yet after the power cut step 3 is {got[3]!r} (not durable)")
    committed = sorted(s for s, g in got.items() if g == expect[s])
    left = garbage(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = safeckpt.CheckpointManager(root, **options)
        if mgr.steps() != committed:
            problems.append(f"mgr.steps() is {mgr.steps()}, the committed steps are {committed}")
        target = blank()
        if not p:
            del target["frozen"]
        # a resumed job restores the newest committed step, which continues that run
        # (so its retention may delete the run's older checkpoints)
        newest = mgr.latest_step()
        if newest != (committed[-1] if committed else None):
            problems.append(f"mgr.latest_step() is {newest}, the newest committed is {committed}")
        if mgr.restore(target) != newest:
            problems.append(f"mgr.restore() did not pick the newest committed step {newest}")
        elif newest is not None and not same(target, STATES[expect[newest]]):
            problems.append(f"restoring the newest step {newest} does not load exactly")
        mgr.save(4, STATES[p + "s4"])
        keep = options["keep_last"]
        if mgr.steps() != sorted(set(committed) | {4})[-keep:]:
            problems.append(f"after recovery and save(4), steps are {mgr.steps()}")
        if state_of(root.child(step_folder(4)), (p + "s4",)) != p + "s4":
            problems.append("after recovery, save(4) does not load exactly")
        if p and not any(is_shared(f) for f in read_committed(root.child(step_folder(4))).files):
            problems.append("after recovery, the incremental save(4) shares nothing with the restored step")
        for s in mgr.steps():
            report = safeckpt.verify(root.child(step_folder(s)))
            if not report.ok:
                problems.append(f"after recovery, step {s} does not verify: {report.problems}")
    RESULTS_AFTER.append(len(garbage(root)))
    label = f"3:{'new' if got[3] == expect[3] else 'none'},1:{'kept' if got[1] == expect[1] else 'gone'}"
    return label, problems + _garbage_problems(left)


def tiered(root: Storage) -> safeckpt.CheckpointManager:
    return safeckpt.CheckpointManager(root.child("durable"), local=root.child("local"), keep_local=1, keep_last=2)


def setup_tiered(root: Storage) -> None:
    with tiered(root) as mgr:
        mgr.save(1, STATES["s1"])
        mgr.wait()  # copied before the next save (else only the newest waiting one is)
        mgr.save(2, STATES["s2"])


def run_tiered(root: Storage) -> None:
    """A resumed job saves on the local tier; the copy to the durable root and the
    retention on both tiers run in the background until ``close()``."""
    with tiered(root) as mgr:
        target = blank()
        del target["frozen"]
        mgr.restore(target)
        mgr.save(3, STATES["s3"])


def check_tiered(point, root: Storage) -> tuple[str, list[str]]:
    problems = []
    expect = {1: "s1", 2: "s2", 3: "s3", 4: "s4"}
    local, durable = root.child("local"), root.child("durable")
    got = {(tier, s): state_of(t.child(step_folder(s)), (expect[s],))
           for tier, t in (("local", local), ("durable", durable)) for s in (1, 2, 3)}
    problems += [f"{tier} step {s}: {g}" for (tier, s), g in got.items() if g.startswith("WRONG")]
    if got[("durable", 2)] != "s2":
        problems.append(f"durable step 2 (committed before the save) is {got[('durable', 2)]!r}")
    if got[("durable", 1)] != "s1" and got[("durable", 3)] != "s3":
        problems.append("durable step 1 was deleted by retention although step 3 never reached the durable root")
    if got[("local", 2)] != "s2" and got[("local", 3)] != "s3":
        problems.append("local step 2 was deleted although step 3 never committed locally")
    if not point.crashed and got[("durable", 3)] != "s3":
        problems.append(f"close() returned, yet the durable step 3 is {got[('durable', 3)]!r}")
    left = garbage(local) + garbage(durable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        newest = 3 if "s3" in (got[("local", 3)], got[("durable", 3)]) else 2
        with tiered(root) as mgr:
            target = blank()
            del target["frozen"]
            if mgr.restore(target) != newest:
                problems.append(f"restore() did not pick the newest committed step {newest}")
            elif not same(target, STATES[expect[newest]]):
                problems.append(f"restoring step {newest} does not load exactly")
            mgr.wait()
            if state_of(durable.child(step_folder(newest)), (expect[newest],)) != expect[newest]:
                problems.append(f"after restore() and wait(), the durable root lacks step {newest}")
            mgr.save(4, STATES["s4"])
        if state_of(durable.child(step_folder(4)), ("s4",)) != "s4":
            problems.append("after recovery, save(4) did not reach the durable root exactly")
        for s in safeckpt.CheckpointManager(durable).steps():
            if not safeckpt.verify(durable.child(step_folder(s))).ok:
                problems.append(f"after recovery, durable step {s} does not verify")
    RESULTS_AFTER.append(len(garbage(local) + garbage(durable)))
    label = f"local 3:{'new' if got[('local', 3)] == 's3' else 'none'},durable 3:" \
            f"{'new' if got[('durable', 3)] == 's3' else 'none'}"
    return label, problems + _garbage_problems(left)


def _garbage_problems(left: list[str]) -> list[str]:
    RESULTS_GARBAGE.append(len(left))
    if len(left) > MAX_GARBAGE_FILES:
        return [f"{len(left)} garbage files left (more than one save's {MAX_GARBAGE_FILES}): {left}"]
    return []


SCENARIO_FUNCS = {
    "first-save": (setup_first, run_first, check_first),
    "overwrite": (setup_overwrite, run_overwrite, check_overwrite),
    "async-overwrite": (setup_overwrite, run_async_overwrite, check_overwrite),
    "manager-retention": (setup_manager, run_manager, check_manager),
    "incremental-retention": (functools.partial(setup_manager, scenario="incremental-retention"),
                              functools.partial(run_manager, scenario="incremental-retention"),
                              functools.partial(check_manager, scenario="incremental-retention")),
    "tiered-replication": (setup_tiered, run_tiered, check_tiered),
}


# -- the matrix ----------------------------------------------------------------------

@dataclass
class Cell:
    ops: int = 0
    runs: int = 0
    outcomes: Counter = field(default_factory=Counter)
    max_garbage: int = 0
    max_after_retry: int = 0
    garbage_runs: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


MATRIX: dict[tuple[str, str], Cell] = {}
RESULTS_GARBAGE: list[int] = []
RESULTS_AFTER: list[int] = []  # garbage still there after the retry (no gc yet)


def render_matrix() -> str:
    lines = ["| profile | scenario | crash points k | runs | outcomes after recovery | "
             "max garbage files | runs leaving garbage | max garbage after retry | failures | s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (profile, scenario), c in sorted(MATRIX.items(), key=lambda kv: (PROFILES.index(kv[0][0]),
                                                                        ORDER.index(kv[0][1]))):
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(c.outcomes.items()))
        lines.append(f"| {profile} | {scenario} | 1..{c.ops + 1} ({c.ops} ops + finished) | {c.runs} | "
                     f"{outcomes} | {c.max_garbage} | {c.garbage_runs} | {c.max_after_retry} | {len(c.failures)} | "
                     f"{c.seconds:.1f} |")
    return "\n".join(lines)


class _MatrixReporter:
    def __init__(self, path) -> None:
        self.path = path

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not MATRIX:
            return
        text = render_matrix()
        terminalreporter.section("safeckpt crash matrix")
        terminalreporter.write_line(text)
        if self.path is not None:
            self.path.write_text(text + "\n")
            terminalreporter.write_line(f"(written to {self.path})")


@pytest.fixture(scope="module", autouse=True)
def matrix_report(request):
    pm = request.config.pluginmanager
    if not pm.has_plugin("safeckpt-crash-matrix"):
        cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
        out = cache.mkdir("safeckpt") / "crash-matrix.md" if cache else None
        pm.register(_MatrixReporter(out), "safeckpt-crash-matrix")
    yield


def run_cell(profile: str, scenario: str, power_cuts: int) -> Cell:
    setup, run, check = SCENARIO_FUNCS[scenario]
    cell = MATRIX.setdefault((profile, scenario), Cell())
    started = time.perf_counter()
    for point in crash_points(run, profile, setup=setup, power_cuts=power_cuts, seed=power_cuts):
        cell.ops = point.total
        cell.runs += 1
        if point.error is not None:
            cell.failures.append(f"{point}: the save raised {type(point.error).__name__}: {point.error}")
            continue
        del RESULTS_GARBAGE[:], RESULTS_AFTER[:]
        try:
            label, problems = check(point, point.storage)
        except Exception as exc:  # noqa: BLE001 - a recovery step itself failed
            label, problems = "ERROR", [f"recovery raised {type(exc).__name__}: {exc}"]
        cell.outcomes[label] += 1
        if RESULTS_GARBAGE:
            cell.max_garbage = max(cell.max_garbage, RESULTS_GARBAGE[0])
            cell.garbage_runs += RESULTS_GARBAGE[0] > 0
        if RESULTS_AFTER:
            cell.max_after_retry = max(cell.max_after_retry, RESULTS_AFTER[0])
        cell.failures += [f"{point}: {p}" for p in problems]
    cell.seconds += time.perf_counter() - started
    return cell


# the default suite runs every scenario on POSIX and the object store's profile, except the
# longest (a tiered save's replication, ~30 s), which runs with --slow only, as do the other
# profiles' manager and incremental cells; the short scenarios keep all five profiles
_LONG = ({(p, s) for p in PROFILES if p not in ("posix", "object-store")
          for s in ("tiered-replication", "incremental-retention", "manager-retention")}
         | {("posix", "tiered-replication")})
CELLS = [pytest.param(p, s, marks=[pytest.mark.slow] if (p, s) in _LONG else [], id=f"{p}-{s}")
         for p in PROFILES for s in SCENARIOS]


@pytest.mark.parametrize("profile, scenario", CELLS)
def test_crash_matrix(profile: str, scenario: str) -> None:
    cell = run_cell(profile, scenario, power_cuts=2)
    assert cell.ops > 0
    assert not cell.failures, f"{len(cell.failures)} failing crash point(s):\n  " + "\n  ".join(cell.failures[:40])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("profile", PROFILES)
def test_crash_matrix_many_power_cuts(profile: str, scenario: str) -> None:
    cell = run_cell(profile, scenario, power_cuts=24)
    assert not cell.failures, f"{len(cell.failures)} failing crash point(s):\n  " + "\n  ".join(cell.failures[:40])


@pytest.mark.parametrize("profile", ["posix", "object-store"])
def test_manager_restore_reads_its_storage(profile: str) -> None:
    """CheckpointManager.restore() must read through the manager's own Storage (a
    simulated disk, an object store, storage_options), not reopen its URL as a path."""
    from safeckpt.testing import storage_for_profile
    root, _ = storage_for_profile(profile)
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    mgr.save(1, STATES["s1"])
    mgr.save(2, STATES["s2"])
    target = make_state(99)
    assert mgr.restore(target) == 2
    assert same(target, STATES["s2"])


# -- the local tier on several nodes ------------------------------------------------------
# Two simulated nodes, one gloo rank each; each node's local folder is a SimulatedDisk of
# the profile in that rank's process (pickled between launches), the durable root a real
# folder both share; local_replicas=1, keep_local=1, keep_last=1 (tests/helpers/
# nodes_crash_worker.py). A resumed job restores step 1 and saves step 2: its data on
# each node's disk, the commit decision recorded on both, the peer replica, the upload,
# the durable manifest, retention on both tiers. The victim node loses power at its
# operation k (on its disk or on the durable root; its process is SIGKILLed), with the
# cell's outcome for its disk. After recovery:
#
# - whatever looks committed in the durable root loads exactly; the durable root still
#   holds step 1 unless step 2 is committed there (retention never deleted the newest
#   complete checkpoint), and likewise the nodes' disks hold step 1 whole unless step 2;
# - a job on the same layout restores exactly the newest step whole on the disks or in
#   the durable root, never one only partly there, and saves step 3 after it;
# - a job whose victim node got an empty disk restores exactly the newest step whole on
#   the other node's disk or in the durable root (so nothing committed in both tiers is
#   lost with one node); with the durable root lost as well, the newest step whole on
#   the other node's disk alone, and there always is one (the peer replica).
#
# The default suite crashes at the first operation of every phase (below) on a POSIX
# disk (either node the victim) and a FUSE mount without rename (node a: its phases are
# a superset of b's), one outcome (everything unsynced lost); ``-m slow`` crashes at
# every k on every disk profile, both victims, the outcomes in turn.

NODE_PROFILES = ("posix", "nfs", "windows", "fuse-object")
NODE_OUTCOMES = ("drop", "kill", "power-cut#0", "power-cut#1")
VICTIMS = {"a": 0, "b": 1}  # node -> its rank


@pytest.fixture(scope="module")
def nodes_server():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # a collective no rank answers (the victim is dead) fails after 8 s, not 300
    srv = nw.NodesCrashForkServer(str(Path(safeckpt.__file__).resolve().parent.parent), env={"SAFECKPT_TIMEOUT": "8"})
    yield srv
    srv.close()


def op_phase(kind: str, path: str, rank: int) -> str:
    """Which part of the save a victim's operation belongs to (``other``: reads, listings)."""
    name = path.rsplit("/", 1)[-1]
    old = f"/{step_folder(1)}" in path
    if "/durable" in path:
        if kind == "write_file":
            return {"manifest": "durable manifest", "data": "upload"}.get(name.split("-")[0], "other")
        return "durable retention" if old and kind in ("delete", "remove_folder") else "other"
    if old and kind in ("unlink", "rmdir"):
        return "local retention"
    if kind == "write" and name.startswith("holds-"):
        return "local commit record" if "-own-" in name else "peer record"
    if kind == "write" and name.startswith("data-"):
        return "local write" if name.endswith(f"-r{rank:05d}.safetensors") else "peer replica"
    return "other"


def phase_starts(log: list, rank: int) -> list[int]:
    """The first operation of every phase."""
    seen: dict[str, int] = {}
    for k, kind, path in log:
        seen.setdefault(op_phase(kind, path, rank), k)
    return sorted(k for phase, k in seen.items() if phase != "other")


def nodes_expected(step: int) -> dict:
    return {"m": tw.mat_full(step), "b": tw.bias(step), "step": step}


def node_disks(root: Path, profile: str) -> dict:
    return {n: nw.load_disk(root, n, profile).storage(nw.MOUNT) for n in VICTIMS}


def whole_on(disks: list[Storage], step: int, home: str) -> bool:
    """Some save of ``step`` (for the durable root ``home``) has every file under a valid
    record on one of ``disks``."""
    held: dict[str, set[str]] = {}
    manifests: dict = {}
    for disk in disks:
        for sid, h in read_holdings(disk.child(step_folder(step)), step, home).items():
            held.setdefault(sid, set()).update(h.files)
            manifests[sid] = h.manifest
    return any(set(m.files) <= held[sid] for sid, m in manifests.items())


def durable_state(durable: Storage, step: int) -> str:
    """``"ok"`` (committed, loads exactly), ``"none"`` (not committed) or ``"WRONG ..."``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            read_committed(durable.child(step_folder(step)))
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return "none"
        try:
            loaded = safeckpt.load_state(durable.child(step_folder(step)))
        except Exception as exc:  # noqa: BLE001
            return f"WRONG: looks committed but does not load: {type(exc).__name__}: {exc}"
    return "ok" if same(loaded, nodes_expected(step)) else "WRONG: committed but not the saved values"


def node_garbage(disks: dict, durable: Storage) -> list[str]:
    """Files no valid holding record covers on a node's disk, or no winning manifest in
    the durable root (writer leases aside)."""
    left = garbage(durable)
    for node, disk in disks.items():
        for folder in (n for n, size in disk.listdir().items() if size is None):
            held = read_holdings(disk.child(folder), int(folder[len("step-"):]), durable.url)
            used = {f for h in held.values() for f in h.files}
            for name in disk.child(folder).listdir():
                if name not in used and not any(name.startswith(f"holds-{sid}-") for sid in held):
                    left.append(f"{node}:{folder}/{name}")
    return left


def nodes_after_crash(root: Path, profile: str, victim: str) -> dict:
    """What the tiers hold after the crash, before any recovery touches them."""
    durable = LocalStorage(str(root / "durable"))
    disks = node_disks(root, profile)
    return {"durable": {s: durable_state(durable, s) for s in (1, 2)},
            "local": {s: whole_on(list(disks.values()), s, durable.url) for s in (1, 2)},
            "survivor": {s: whole_on([disks[n] for n in VICTIMS if n != victim], s, durable.url) for s in (1, 2)},
            "garbage": node_garbage(disks, durable), "crashed": (root / f"disk-{victim}.crash").exists()}


def check_nodes_point(run: dict, recover: dict, after: dict, root: Path, profile: str) -> tuple[str, list[str]]:
    problems = []
    d, local = after["durable"], after["local"]
    problems += [f"durable step {s}: {g}" for s, g in d.items() if g.startswith("WRONG")]
    if d[2] != "ok" and d[1] != "ok":
        problems.append(f"durable step 1 is {d[1]!r} although step 2 never committed there")
    if not local[2] and not local[1]:
        problems.append("the nodes' disks hold step 1 whole no more, although step 2 is not whole on them")
    if not after["crashed"]:
        if any(r["save"]["raised"] or r["close"]["raised"] for r in run.values()):
            problems.append(f"no crash, yet the save failed: {run}")
        if d[2] != "ok" or not local[2]:
            problems.append(f"close() returned, yet after the power cut step 2 is durable {d[2]!r}, "
                            f"whole on the disks: {local[2]}")
    survivor = after["survivor"]
    if not survivor[1] and not survivor[2]:
        problems.append("the surviving node's disk holds no step whole: losing the victim's disk loses the local tier")
    expect = {"same": 2 if local[2] or d[2] == "ok" else 1,
              "wiped": 2 if survivor[2] or d[2] == "ok" else 1,
              "alone": 2 if survivor[2] else 1 if survivor[1] else None}
    how = {"same": "the same disks", "wiped": "the victim's disk wiped",
           "alone": "the victim's disk and the durable root lost"}
    for rank, data in recover.items():
        for name, want in expect.items():
            got = data[name]
            if got["restore"]["raised"] or got["restored"] != want or got["problems"]:
                problems.append(f"rank {rank}, restore with {how[name]}: "
                                f"expected step {want}, got {got['restored']} {got['restore'].get('message', '')[:300]} "
                                f"{got['problems'][:3]}")
        if data["same"]["next"]["raised"]:
            problems.append(f"rank {rank}: after recovery, save(3) raised {data['same']['next']['message'][:300]}")
    durable3 = durable_state(LocalStorage(str(root / "durable")), 3)
    if durable3 != "ok":
        problems.append(f"after recovery, save(3) is {durable3!r} in the durable root")
    if not whole_on(list(node_disks(root, profile).values()), 3, str(root / "durable")):
        problems.append("after recovery, save(3) is not whole on the nodes' disks")
    label = f"local 2:{'whole' if local[2] else 'none'},durable 2:{'new' if d[2] == 'ok' else 'none'}"
    return label, problems


def run_nodes_cell(server, tmp_path, profile: str, victim: str, pick, outcome_of) -> Cell:
    cell = MATRIX.setdefault((profile, f"nodes-victim-{victim}"), Cell())
    started = time.perf_counter()
    rank = VICTIMS[victim]

    def launch(scenario: str, root: Path, **opts) -> dict:
        res = server.launch(2, [scenario], root, root / f"out-{scenario}", timeout=60,
                            opts={"profile": profile, **opts})
        return {r: res.results(scenario, ranks=[r])[0] for r in range(2)
                if (res.out / scenario / f"rank{r}.json").exists()}

    # every run works in one folder, as the setup did: the nodes' records name the durable
    # root by its path, and a job with the durable root at another path does not use them
    root, base = tmp_path / "run", tmp_path / "base"
    root.mkdir()
    launch("crash_setup", root)
    shutil.copytree(root, base)
    log = launch("crash_save", root, victim=victim, outcome="drop")[rank]["log"]
    cell.ops = len(log)
    for k in pick(log, rank):
        outcome = outcome_of(k)
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(base, root)
        cell.runs += 1
        op = " ".join(map(str, log[k - 1][1:])) if k <= len(log) else "after close"
        where = f"[{profile}, node {victim}] crash at op {k}/{len(log)} ({op}), {outcome}"
        try:
            run = launch("crash_save", root, victim=victim, outcome=outcome, k=k)
            after = nodes_after_crash(root, profile, victim)
            left = after["garbage"]
            recover = launch("crash_recover", root, wipe=victim)
            label, problems = check_nodes_point(run, recover, after, root, profile)
            cell.max_after_retry = max(cell.max_after_retry, len(node_garbage(
                node_disks(root, profile), LocalStorage(str(root / "durable")))))
            if len(recover) != 2:
                problems.append(f"a rank of the recovery failed: see {root}")
        except Exception as exc:  # noqa: BLE001 - a launch or a check itself failed
            label, left, problems = "ERROR", [], [f"{type(exc).__name__}: {exc}"]
        cell.outcomes[label] += 1
        cell.max_garbage = max(cell.max_garbage, len(left))
        cell.garbage_runs += bool(left)
        cell.failures += [f"{where}: {p}" for p in problems]
        shutil.rmtree(root, ignore_errors=True)
    cell.seconds += time.perf_counter() - started
    return cell


@pytest.mark.timeout(300)
@pytest.mark.parametrize("profile, victim", [("posix", "a"), pytest.param("posix", "b", marks=pytest.mark.slow),
                                             pytest.param("fuse-object", "a", marks=pytest.mark.slow)])
def test_crash_matrix_nodes(nodes_server, tmp_path, profile: str, victim: str) -> None:
    cell = run_nodes_cell(nodes_server, tmp_path, profile, victim,
                          lambda log, rank: phase_starts(log, rank) + [len(log) + 1], lambda k: "drop")
    assert cell.runs >= 6
    assert not cell.failures, f"{len(cell.failures)} failing crash point(s):\n  " + "\n  ".join(cell.failures[:40])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("victim", list(VICTIMS))
@pytest.mark.parametrize("profile", NODE_PROFILES)
def test_crash_matrix_nodes_every_point(nodes_server, tmp_path, profile: str, victim: str) -> None:
    cell = run_nodes_cell(nodes_server, tmp_path, profile, victim, lambda log, rank: range(1, len(log) + 2),
                          lambda k: NODE_OUTCOMES[k % len(NODE_OUTCOMES)])
    assert not cell.failures, f"{len(cell.failures)} failing crash point(s):\n  " + "\n  ".join(cell.failures[:40])
