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
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import expected_warnings
import pytest
import torch

import safeckpt
from safeckpt.lease import LEASE_RE
from safeckpt.checkpoint import read_committed
from safeckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from safeckpt.garbage import RETIRED
from safeckpt.manager import step_folder
from safeckpt.manifest import is_shared, manifest_seq
from safeckpt.storage import Storage
from safeckpt.testing import PROFILES, crash_points

SCENARIOS = ("first-save", "overwrite", "async-overwrite", "manager-retention", "incremental-retention",
             "tiered-replication")
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
                                                                        SCENARIOS.index(kv[0][1]))):
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


# the two longest scenarios on NFS and Windows (~80 s together) run with --slow; every
# scenario keeps POSIX, a FUSE mount without rename and an object store in the default suite
_LONG = {("nfs", "tiered-replication"), ("windows", "tiered-replication"),
         ("nfs", "incremental-retention"), ("windows", "incremental-retention")}
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
