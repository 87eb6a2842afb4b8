"""The local tier on many nodes: each node's ranks commit to that node's own disk.

Nodes are told apart by host name (``SAFECKPT_NODE_ID`` overrides it: a test hook, and
for hosts that share a name). A save runs the usual protocol, except that no rank
sees every file: each rank writes its data file to its node's local folder, rank 0
decides the commit from the ranks' reports, and then every node records the decision
on its own disk in a *holding record* (``holds-<save_id>-<tag>.json``: the files of
the save this folder holds, and the job's full manifest). A node's copy belongs to a
committed save exactly when such a record is valid there (its checksum matches and
every file it lists exists with that size); data without a record is an aborted save.

Behind each save, on a background gloo group (never the training's), every rank in
the same order: with ``local_replicas=1`` each node's first rank sends its node's files
to the next node, which records them (``holds-<id>-peer.json``); then every rank copies
its own data files to the durable root, and rank 0 writes the durable manifest last,
once every rank has confirmed its upload. A node deletes what a save replaces (older
saves of its step, steps beyond ``keep_local``) only once that save is whole on the
nodes' disks: recorded on every node and, with a replica, every node's replica
confirmed (or the save is durable). So the loss of one node never takes the last local copy the others lack.

Restore: the nodes' first ranks tell rank 0 what their disks hold; rank 0 picks the
newest save whose files are all held by some node or by the durable root (a save
never half available is never chosen), each rank plans its reads, files a node lacks
are sent by a node that holds them (and recorded there, healing a replaced disk), and
the rest is read from the durable root.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

from ..protocol.checkpoint import load_manifest
from ..format.folder import committed_steps, read_committed, step_folders
from ..format.checksum import checksum
from ..protocol.commit import (DATA_RE, SaveRun, describe_error, read_existing, refuse_existing, retire_replaced,
                     write_manifest)
from ..errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, ReplicationWarning,
                      SaveAbortedError, SkippedCheckpointWarning, StorageError, warn)
from ..protocol.group import TorchGroup, node_id, resolve
from ..format.manifest import Manifest, decode_manifest, encode_manifest, manifest_name, manifest_seq
from ..format.names import step_folder
from ..storage import Storage
from .tiered import belongs, checked_parts, copy_file, file_checks, warn_foreign

if TYPE_CHECKING:
    from .manager import CheckpointManager

log = logging.getLogger(__name__)
RECORD_PREFIX = "holds-"


@dataclass
class NodeLayout:
    """Which ranks share a node (and so a local folder); node k's first rank leads it."""

    nodes: list[str]
    node_of: list[int]  # rank -> node index

    @classmethod
    def of(cls, group: Any) -> "NodeLayout":
        ids = group.all_gather(node_id())
        nodes = list(dict.fromkeys(ids))
        return cls(nodes, [nodes.index(i) for i in ids])

    def ranks(self, node: int) -> list[int]:
        return [r for r, k in enumerate(self.node_of) if k == node]

    def leader(self, node: int) -> int:
        return self.ranks(node)[0]


# -- holding records -----------------------------------------------------------------


def record_name(save_id: str, tag: str, node: str) -> str:
    """Named for the writing node too: nodes that do share a folder never collide."""
    return f"{RECORD_PREFIX}{save_id}-{tag}-{checksum(node.encode())[-8:]}.json"


def owner(name: str) -> str | None:
    """The save id in the name of a record or data file, else None."""
    if name.startswith(RECORD_PREFIX):
        return name[len(RECORD_PREFIX):].split("-", 1)[0]
    found = DATA_RE.fullmatch(name)
    return found.group(1) if found else None


def write_record(folder: Storage, manifest_bytes: bytes, node: str, files: dict[str, int], tag: str,
                 save_id: str) -> None:
    """Record, durably, that ``folder`` holds ``files`` of the save ``manifest_bytes`` commits."""
    payload = json.dumps({"node": node, "files": files, "manifest": manifest_bytes.decode()},
                         sort_keys=True).encode()
    name = record_name(save_id, tag, node)
    folder.delete([name])  # a torn record of an earlier attempt at this very record
    folder.write_file(name, [payload, b"\n", checksum(payload).encode(), b"\n"])


@dataclass
class Holding:
    """What one node's folder holds of one committed save."""

    manifest: Manifest
    manifest_bytes: bytes
    files: dict[str, int]


@dataclass
class Record:
    """One record file as read: the save it records (None when it is torn or not a
    record), the files it says the folder holds, and why it counts for nothing."""

    name: str
    manifest: Manifest | None = None
    manifest_bytes: bytes = b""
    files: dict[str, int] = dataclasses.field(default_factory=dict)
    problem: str = ""  # "" for a valid record, and for a torn one (a crash leaves it: not worth a word)


def read_record(folder: Storage, name: str, step: int, listing: dict[str, int | None]) -> Record:
    """A record of ``folder`` (the folder of ``step``), checked whole: its framing, the
    shape and types of every field, its manifest (§5 valid, of this step, of the save
    its name says), and every file it names (a data file of that manifest, present
    with that size). Never raises: whatever is wrong makes it count for nothing."""
    where = f"{folder.url}/{name}"
    try:
        payload, stored, rest = folder.read(name).split(b"\n")
    except (OSError, ValueError):
        return Record(name)
    if rest or checksum(payload).encode() != stored:
        return Record(name)
    try:
        body = json.loads(payload)
        if not (isinstance(body, dict) and isinstance(body.get("manifest"), str)
                and isinstance(body.get("files"), dict) and isinstance(body.get("node"), str)):
            return Record(name, problem=f"{where}: not a holding record (files, manifest and node of the "
                                        "wrong type, or missing)")
        data = body["manifest"].encode()
        m = decode_manifest(data, where)
    except (ValueError, RecursionError, CheckpointError) as exc:  # UnicodeError is a ValueError
        return Record(name, problem=f"{where}: {exc}")
    if owner(name) != m.save_id:
        return Record(name, m, data, problem=f"{where}: named for another save than its own ({m.save_id})")
    if m.step != step:
        return Record(name, m, data, problem=f"{where}: records save {m.save_id} of step {m.step} in the folder "
                                             f"of step {step} (copied or moved by hand?)")
    files: dict[str, Any] = body["files"]
    for f, size in files.items():
        entry = m.files.get(f)
        if entry is None or not DATA_RE.fullmatch(f) or type(size) is not int or size != entry.size:
            return Record(name, m, data, problem=f"{where}: names {f!r:.80} with size {size!r:.40}, not a data "
                                                 "file of its save")
        if listing.get(f) != size:
            return Record(name, m, data, problem=f"{where}: names {f}, which is missing here or has another size")
    return Record(name, m, data, files)


def read_records(folder: Storage, step: int) -> list[Record]:
    """Every record in the folder of ``step``."""
    listing = folder.listdir()
    return [read_record(folder, n, step, listing) for n in sorted(listing)
            if n.startswith(RECORD_PREFIX) and n.endswith(".json") and listing[n] is not None]


def holdings(records: list[Record], home: str) -> dict[str, Holding]:
    """What the folder holds, by save id, of the saves of the durable root ``home``:
    the union of the files of their valid records."""
    out: dict[str, Holding] = {}
    for r in records:
        if r.manifest is not None and not r.problem and belongs(r.manifest, home):
            out.setdefault(r.manifest.save_id, Holding(r.manifest, r.manifest_bytes, {})).files.update(r.files)
    return out


def theirs(records: list[Record], home: str) -> set[str]:
    """Save ids of another durable root's records (whatever their state): a job never
    deletes what they name."""
    return {r.manifest.save_id for r in records if r.manifest is not None and not belongs(r.manifest, home)}


def read_holdings(folder: Storage, step: int, home: str) -> dict[str, Holding]:
    """What ``folder`` (the folder of ``step``) holds of the saves of ``home``."""
    return holdings(read_records(folder, step), home)


def drop_aborted(folder: Storage, keep: str, step: int) -> None:
    """After this node recorded save ``keep`` in ``folder``: the data of saves that no
    record there names (attempts that never reached a decision). Saves recorded here
    stay (another root's too), and so do their files still arriving (a replica behind
    an older save)."""
    records = read_records(folder, step)
    named = {r.manifest.save_id for r in records if r.manifest is not None}
    folder.delete([n for n in folder.listdir() if (m := DATA_RE.fullmatch(n)) and m.group(1) not in named | {keep}])


def drop_replaced(folder: Storage, newer: Manifest, home: str) -> None:
    """Once save ``newer`` is whole on the nodes' disks: records first, then data, of the
    saves of this step recorded here *before* it (the ones it replaces). A later save
    of the step, being written meanwhile (a loop that re-saves the step it restored),
    is not touched, nor another root's save."""
    records = read_records(folder, cast(int, newer.step))
    old = {sid for sid, h in holdings(records, home).items() if h.manifest.created < newer.created
           and sid != newer.save_id} - theirs(records, home)
    listing = folder.listdir()
    folder.delete([n for n in listing if n.startswith(RECORD_PREFIX) and owner(n) in old])
    folder.delete([n for n in listing if DATA_RE.fullmatch(n) and owner(n) in old])


def delete_local(folder: Storage, step: int, home: str) -> None:
    """Retention on one node: records first (the copy stops counting), then the rest;
    what another root's records name stays, and so then does the folder."""
    kept = theirs(read_records(folder, step), home)
    listing = folder.listdir()
    folder.delete([n for n in listing if n.startswith(RECORD_PREFIX) and owner(n) not in kept])
    folder.delete([n for n in listing if listing[n] is not None and owner(n) not in kept])
    if not kept:
        folder.remove_folder()


# -- bytes between ranks -------------------------------------------------------------


def _read_checked(folder: Storage, m: Manifest, name: str) -> bytearray:
    """A whole data file, every checksummed range checked: rot is never copied on."""
    f = m.files[name]
    return bytearray().join(checked_parts(folder, name, f.size, file_checks(m).get(name, []), f.checksum))


def send_file(group: TorchGroup, folder: Storage, m: Manifest, name: str, dst: int, problems: list[str]) -> None:
    """Send one data file, checked; one that cannot be read goes as nothing (and is
    reported here), so the exchange stays in step and the receiver stores nothing."""
    try:
        blob = _read_checked(folder, m, name)
    except (CheckpointError, OSError) as exc:
        problems.append(f"reading {name}: {exc}")
        blob = bytearray()
    group.send_bytes(blob, dst)


def receive_file(group: TorchGroup, folder: Storage, m: Manifest, name: str, src: int,
                 problems: list[str]) -> bool:
    """Receive one data file into ``folder``; True when it arrived whole and is durable."""
    blob = group.recv_bytes(src)
    try:
        if len(blob) != m.files[name].size:
            raise SaveAbortedError(f"{name} arrived with {len(blob)} bytes, not {m.files[name].size} "
                                   "(the sender could not read it)")
        folder.delete([name])  # a leftover of an interrupted transfer: no record names it
        folder.write_file(name, [blob])
        return True
    except (CheckpointError, OSError) as exc:
        problems.append(f"storing {name}: {exc}")
        return False


@dataclass
class Survey:
    """What one node's folder holds of its root's saves, by step and save id, and what
    it passed over (another root's records; records that count for nothing)."""

    held: dict[int, dict[str, Holding]] = dataclasses.field(default_factory=dict)
    foreign: list[tuple[str, Manifest]] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)


@dataclass
class Option:
    """A save a restore may load: every file held by some node (``nodes[k]``: the files
    node k holds) or by the durable root (``durable``: it holds the committed copy)."""

    step: int
    save_id: str
    created: float
    manifest_bytes: bytes
    nodes: list[list[str]]
    durable: bool


# -- saving ----------------------------------------------------------------------------


class NodeSaveRun(SaveRun):
    """The save protocol with the data on every node's own disk (see module docstring).
    A node's folder holds no manifest: holding records name its files, and the tier's
    own retention removes what none names."""

    manifests_name_all_files = False

    def __init__(self, *args: Any, tier: "NodeTier", **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "existing": functools.partial(tier.existing, step=kwargs["step"])})
        self.tier = tier
        self.encoded: bytes | None = None
        self.where = f"<each node's local tier>/{self.storage.url.rsplit('/', 1)[-1]}"

    def _check_visible(self, reports: list) -> None:
        """No rank sees the other nodes' disks: each report is its rank's fsynced file."""

    def _write_manifest(self, manifest: Manifest) -> None:
        self.encoded = encode_manifest(manifest)  # the decision; recorded on every node below
        self.committed = True

    def _retire_old(self, manifest: Manifest) -> None:
        """Each node drops the replaced save once it has recorded the new one."""

    def run(self, flatten: Any) -> Manifest:
        summary = super().run(flatten)
        data = self.group.broadcast(self.encoded)
        manifest = decode_manifest(data, "the commit decision")
        error = None
        layout, rank = self.tier.layout, self.group.rank
        if rank == layout.leader(layout.node_of[rank]):
            mine = {n: f.size for n, f in manifest.files.items() if layout.node_of[cast(int, f.rank)] == layout.node_of[rank]}
            try:
                write_record(self.storage, data, node_id(), mine, "own", manifest.save_id)
                drop_aborted(self.storage, manifest.save_id, cast(int, manifest.step))
            except Exception as exc:  # noqa: BLE001 - every rank learns of it below
                error = describe_error(exc)
        failed = {layout.nodes[layout.node_of[r]]: e for r, e in enumerate(self.group.all_gather(error)) if e}
        if failed:
            raise SaveAbortedError(f"step {manifest.step}: the save was decided but node(s) {sorted(failed)} "
                                   f"could not record it on their disk; their local copy does not count "
                                   f"(the durable root still gets it): {failed}")
        self.tier.sync.submit(step_folder(cast(int, manifest.step)), data)
        return summary


class NodeSync:
    """Every rank's background worker: peer replica, then upload, then the durable
    manifest. Jobs run one at a time and in the order of the saves on every rank (their
    collectives must match), so ``submit`` waits for the job before."""

    def __init__(self, tier: "NodeTier") -> None:
        self.tier = tier
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, folder: str, data: bytes, replicate: bool = True) -> None:
        self.join()
        self._thread = threading.Thread(target=self._work, args=(folder, data, replicate), name="safeckpt-nodes")
        self._thread.start()

    def _work(self, folder: str, data: bytes, replicate: bool) -> None:
        try:
            self.tier.behind(folder, data, replicate)
        except BaseException as exc:  # noqa: BLE001 - kept for wait(); training goes on
            self._error = exc
            warn(f"replicating {folder} behind the save failed (the local copies are intact): {exc}",
                 ReplicationWarning)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        self.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


class NodeTier:
    """The manager's local tier when its ranks span several nodes. Its manager hands it
    what it needs of the run: which checkpoint of a step a save may replace
    (``may_replace(step)``, see ``refuse_existing``), the writer lease check
    (``check_lease``) and the durable root's retention (``after_durable(manifest)``).

    Every record names the durable root its save belongs to (``home``: rank 0's URL
    of it); records of another root are never restored, uploaded, replaced or deleted."""

    def __init__(self, manager: "CheckpointManager", layout: NodeLayout, replicas: int, *,
                 may_replace: Callable[[int], Any], check_lease: Callable[[], None],
                 after_durable: Callable[[Manifest], None]) -> None:
        if manager.chunk_size is not None:
            raise ValueError("incremental=True is not supported with a local tier on several nodes")
        if manager.process_group is not None:  # its background collectives need a group of their own
            raise ValueError("process_group= is not supported with a local tier on several nodes: the "
                             "manager runs on the default world (torch.distributed's default group)")
        self.manager = manager
        self.layout = layout
        self.replicas = replicas
        self.may_replace = may_replace
        self.check_lease = check_lease
        self.after_durable = after_durable
        self.group = manager.group
        self.home: str = self.group.broadcast(manager.storage.url)
        self.background = resolve(manager.process_group, purpose="nodes")
        self.sync = NodeSync(self)

    @property
    def local(self) -> Storage:
        assert self.manager.local is not None  # a node tier is made only with a local folder
        return self.manager.local

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def node(self) -> int:
        return self.layout.node_of[self.rank]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.layout.leader(self.node)

    def prepare(self, request: Any) -> None:
        request.runner = functools.partial(NodeSaveRun, tier=self)
        request.durable_root = self.home

    def existing(self, folder: Storage, step: int) -> tuple[Manifest | None, int]:
        """Rank 0: the save its node recorded in ``folder`` (what a new save replaces)."""
        held = read_holdings(folder, step, self.home)
        newest = max(held.values(), key=lambda h: h.manifest.created, default=None)
        seq = max((h.manifest.seq for h in held.values()), default=0)
        return (newest.manifest if newest else None), seq

    # -- behind each save (background group, every rank, in order) -----------------------
    def behind(self, folder: str, data: bytes, replicate: bool = True) -> None:
        """Replica, upload, then local retention: only once every node confirmed its
        replica (without replicas: its record, before this runs), or the save is durable,
        does a node delete what the new save replaces, so a node lost meanwhile never
        takes the last copy that survives it. A failed upload alone does not stop local
        retention (the disks fill up otherwise)."""
        m = decode_manifest(data, folder)
        failed: dict[str, str] = {}
        if self.replicas and replicate:
            problems = self.background.all_gather(self._replicate(folder, m, data))
            failed = {self.layout.nodes[self.layout.node_of[r]]: e for r, e in enumerate(problems) if e}
        durable = False
        try:
            self._upload(folder, m)
            durable = True
        finally:
            if self.is_leader and (durable or not failed):
                self._retain_local(m)
        if failed:
            raise SaveAbortedError(f"the peer replica of step {m.step} is incomplete on node(s) {sorted(failed)} "
                                   f"(the durable copy is not affected): {failed}")

    def _replicate(self, folder: str, m: Manifest, data: bytes) -> str | None:
        """Node k's first rank sends its node's files to node k+1's (a ring); the receiver
        records what arrived whole. Sends and receives alternate by node parity, so no
        pair waits on the other; a file that cannot be read or stored is reported, never
        left half-way in the exchange (the ranks' collectives stay in step)."""
        if not self.is_leader:
            return None
        g, count, k = cast(TorchGroup, self.background), len(self.layout.nodes), self.node  # several nodes
        nxt, prev = self.layout.leader((k + 1) % count), self.layout.leader((k - 1) % count)
        here = self.local.child(folder)
        mine = sorted(n for n, f in m.files.items() if self.layout.node_of[cast(int, f.rank)] == k)
        problems: list[str] = []

        def send() -> None:
            g.send_bytes(json.dumps(mine).encode(), nxt)
            for name in mine:
                send_file(g, here, m, name, nxt, problems)

        def receive() -> dict[str, int]:
            names = json.loads(bytes(g.recv_bytes(prev)))
            return {n: m.files[n].size for n in names if receive_file(g, here, m, n, prev, problems)}

        if k % 2 == 0:
            send()
            got = receive()
        else:
            got = receive()
            send()
        try:
            if got:
                write_record(here, data, node_id(), got, "peer", m.save_id)
        except (CheckpointError, OSError) as exc:
            problems.append(f"recording the replica: {exc}")
        log.info("node %s: holds the replica of step %s from the node before", node_id(), m.step)
        return "; ".join(problems) or None

    def _upload(self, folder: str, m: Manifest) -> None:
        """Every rank copies its own files; rank 0 commits the durable copy last."""
        g, src, dst = self.background, self.local.child(folder), self.manager.storage.child(folder)
        go = self._durable_plan(dst, m) if g.rank == 0 else None
        go = g.broadcast(go)
        if isinstance(go, str):
            raise SaveAbortedError(go)
        error = None
        if go:
            checks = file_checks(m)
            try:
                for name, f in m.files.items():
                    if f.rank == g.rank:
                        dst.delete([name])  # a leftover of an interrupted upload
                        copy_file(src, name, dst, name, f.size, checks.get(name, ()), f.checksum)
            except Exception as exc:  # noqa: BLE001 - reported to rank 0
                error = describe_error(exc)
        errors = g.gather(error)
        outcome = None
        if g.rank == 0 and go:
            assert errors is not None  # rank 0 gathers
            failed = {r: e for r, e in enumerate(errors) if e}
            try:
                if failed:
                    raise SaveAbortedError(f"uploading step {m.step} to {dst.url} failed on rank(s) "
                                           f"{sorted(failed)}: {failed}; no durable manifest written")
                self._commit_durable(dst, m)
            except Exception as exc:  # noqa: BLE001 - every rank raises it
                outcome = describe_error(exc)
        outcome = g.broadcast(outcome)
        if outcome:
            raise SaveAbortedError(outcome)

    def _durable_plan(self, dst: Storage, m: Manifest) -> bool | str:
        """Rank 0: upload (True), already there (False) or why not (a message)."""
        try:
            old, max_seq = read_existing(dst)
            if old is not None and old.save_id == m.save_id:
                return False
            refuse_existing(dst, old, max_seq, self.may_replace(cast(int, m.step)))
            return True
        except Exception as exc:  # noqa: BLE001
            return describe_error(exc)

    def _commit_durable(self, dst: Storage, m: Manifest) -> None:
        old, max_seq = read_existing(dst)
        final = dataclasses.replace(m, seq=max(m.seq, max_seq + 1))
        listing = dst.listdir()
        dst.delete([n for n in listing if (manifest_seq(n) is not None and (old is None or
                    n != manifest_name(old.seq))) or (DATA_RE.fullmatch(n) and n not in m.files
                    and (old is None or n not in old.files))])
        self.check_lease()
        write_manifest(dst, final, "upload")
        read_committed(dst)
        retire_replaced(dst, old, final)
        log.info("step %s is durable in %s", m.step, dst.url)
        self.after_durable(final)

    def _retain_local(self, m: Manifest) -> None:
        """After save ``m`` is whole on the nodes' disks: this node drops the saves of its
        step that ``m`` replaces and keeps the newest ``keep_local`` recorded steps up to
        it; older step folders without a record are aborted saves. Newer steps are left
        alone: one only some nodes recorded (a job that died then) is not whole, and is
        no reason to delete this."""
        step = cast(int, m.step)
        drop_replaced(self.local.child(step_folder(step)), m, self.home)
        keep = self.manager.local_retention.keep_last
        if not keep:
            return
        older = [s for s in step_folders(self.local) if s < step]
        recorded = [s for s in older if read_holdings(self.local.child(step_folder(s)), s, self.home)]
        spared = set(recorded[max(0, len(recorded) - (keep - 1)):]) if keep > 1 else set()
        for s in older:
            if s not in spared:
                delete_local(self.local.child(step_folder(s)), s, self.home)

    # -- restoring (foreground group, every rank) ----------------------------------------
    def survey(self, step: int | None) -> Survey:
        """A node's first rank: what this node's folder holds of this root's saves (of
        ``step``, or all), and what it passed over."""
        out = Survey()
        for s in step_folders(self.local):
            if step not in (None, s):
                continue
            records = read_records(self.local.child(step_folder(s)), s)
            if held := holdings(records, self.home):
                out.held[s] = held
            out.foreign += [(f"{self.local.child(step_folder(s)).url}/{r.name}", r.manifest) for r in records
                            if r.manifest is not None and not belongs(r.manifest, self.home)]
            out.skipped += [r.problem for r in records if r.problem and (r.manifest is None or belongs(r.manifest, self.home))]
        return out

    def choose(self, surveys: list["Survey | str"], step: int | None) -> list[Option]:
        """Rank 0: the saves whose every file some node or the durable root holds, newest
        first (by step, then ``created``); warns of what the nodes passed over."""
        per_node = [sv.held if isinstance(sv, Survey) else {} for sv in surveys]
        foreign = [found for sv in surveys if isinstance(sv, Survey) for found in sv.foreign]
        skipped = [line for sv in surveys if isinstance(sv, Survey) for line in sv.skipped]
        skipped += [f"node {self.layout.nodes[k]}: its folder could not be read ({sv})"
                    for k, sv in enumerate(surveys) if isinstance(sv, str)]
        if foreign:
            warn_foreign(self.home, foreign)
        saves: dict[tuple[int, str], tuple[Holding, list[set[str]]]] = {}
        for k, held in enumerate(per_node):
            for s, by_id in held.items():
                for sid, h in by_id.items():
                    entry = saves.setdefault((s, sid), (h, [set() for _ in per_node]))
                    entry[1][k] |= set(h.files)
        durable = {s: m for s, m in committed_steps(self.manager.storage).items() if step in (None, s)}
        options: list[Option] = []
        partial: list[tuple[int, str]] = []
        for (s, sid), (h, nodes) in saves.items():
            there = set(durable[s].files) if s in durable and durable[s].save_id == sid else set()
            missing = set(h.manifest.files) - set().union(there, *nodes)
            if not missing:
                options.append(Option(s, sid, h.manifest.created, h.manifest_bytes, [sorted(n) for n in nodes],
                                      bool(there)))
            else:
                partial.append((s, f"step {s} (save {sid}): {len(missing)} of its {len(h.manifest.files)} files "
                                   "are on no node's disk and not in the durable root (passed over, never loaded)"))
        for s, m in durable.items():
            if not any(o.step == s and o.save_id == m.save_id for o in options):
                options.append(Option(s, m.save_id, m.created, encode_manifest(m), [[] for _ in per_node], True))
        newest = max((o.step for o in options), default=-1)
        skipped += [text for s, text in sorted(partial) if s >= newest]
        if skipped:
            warn("restore: passed over what the nodes' folders hold:\n  " + "\n  ".join(skipped),
                 SkippedCheckpointWarning)
        return sorted(options, key=lambda o: (o.step, o.created), reverse=True)

    def restore(self, state: dict, step: int | None, strict: bool) -> int | None:
        """The newest save whole on the nodes or in the durable root; one that fails to
        load (on every rank together: rot, a file no node could send) gives way to the
        next, with a warning."""
        mine: Survey | str | None = None
        if self.is_leader:
            try:
                mine = self.survey(step)
            except Exception as exc:  # noqa: BLE001 - this node then holds nothing; the others go on
                mine = describe_error(exc)
        gathered = self.group.gather(mine)
        choice: Any = None
        if self.rank == 0:
            leaders = [self.layout.leader(k) for k in range(len(self.layout.nodes))]
            try:
                choice = self.choose([cast(list, gathered)[r] for r in leaders], step)
            except Exception as exc:  # noqa: BLE001 - raised on every rank
                choice = exc
        choice = self.group.broadcast(choice)
        if isinstance(choice, Exception):
            raise choice
        failed: list[str] = []
        for option in choice:
            try:
                m = self._load(state, option, strict)
            except (CorruptCheckpointError, StorageError) as exc:  # every rank raised it together
                failed.append(f"{step_folder(option.step)} (save {option.save_id}): {exc}")
                continue
            if failed:
                warn(f"restored {step_folder(option.step)}; newer saves failed to load:\n  " + "\n  ".join(failed),
                     SkippedCheckpointWarning)
            return m.step
        if failed:
            raise CorruptCheckpointError("no save the nodes or the durable root hold whole could be restored:\n  "
                                         + "\n  ".join(failed))
        if step is not None:
            raise CheckpointNotFoundError(f"no node and not {self.manager.storage.url} holds step {step} whole")
        return None

    def _load(self, state: dict, option: Option, strict: bool) -> Manifest:
        """Load one save: each rank from its node's disk (files it lacks from another
        node), else the durable root; if that fails, from the durable copy alone."""
        folder, data = step_folder(option.step), option.manifest_bytes
        m = decode_manifest(data, folder)
        held = [set(n) for n in option.nodes]
        durable = self.manager.storage.child(folder) if option.durable else None
        try:
            load_manifest(state, Nearest(self.local.child(folder), durable, held[self.node]), m, self.group,
                          strict=strict, allow_pickle=self.manager.allow_pickle,
                          before_read=lambda need: self._bring(folder, m, data, held, need))
        except (CorruptCheckpointError, StorageError) as exc:  # every rank raised it together
            if durable is None:
                raise
            warn(f"restoring {folder} from the nodes' disks failed ({exc}); reading the durable copy "
                 f"{durable.url} instead", SkippedCheckpointWarning)
            load_manifest(state, durable, m, self.group, strict=strict, allow_pickle=self.manager.allow_pickle)
        self.manager.run_id = m.run_id or self.manager.run_id
        if not option.durable:
            self._upload_later(folder, m, data, held[self.node])
        log.info("restored step %s (%s)", m.step, "local disks" if not option.durable else "local disks and durable root")
        return m

    def _upload_later(self, folder: str, m: Manifest, data: bytes, held: set[str]) -> None:
        """After restoring a save the durable root lacks (the last job died before its
        upload): upload it now, if every rank's own files are on its node's disk (the
        same layout as the save)."""
        mine = {n for n, f in m.files.items() if f.rank == self.rank}
        ready = m.world_size == self.group.size and mine <= held
        if all(self.group.all_gather(ready)):
            self.sync.submit(folder, data, replicate=False)

    def _bring(self, folder: str, m: Manifest, data: bytes, nodes: list[set[str]], need: set[str]) -> None:
        """Each node gets, from a node holding them, the files its ranks will read and
        neither its disk nor the durable root has (peer first: it is nearer)."""
        needs = self.group.all_gather(sorted(need))
        here = self.local.child(folder)
        plan = []  # (file, from node, to node)
        for k in range(len(self.layout.nodes)):
            lacking = set().union(*(needs[r] for r in self.layout.ranks(k))) - nodes[k]
            for name in sorted(lacking):
                holder = next((j for j, held in enumerate(nodes) if name in held), None)
                if holder is not None:
                    plan.append((name, holder, k))
        problems: list[str] = []
        got: dict[str, int] = {}
        if self.is_leader:
            for name, src, dst in plan:
                if src == self.node:
                    send_file(cast(TorchGroup, self.group), here, m, name, self.layout.leader(dst), problems)
                elif dst == self.node and receive_file(cast(TorchGroup, self.group), here, m, name, self.layout.leader(src),
                                                       problems):
                    got[name] = m.files[name].size
            try:
                if got:
                    write_record(here, data, node_id(), got, f"restored-{os.urandom(4).hex()}", m.save_id)
            except (CheckpointError, OSError) as exc:
                problems.append(f"recording {sorted(got)}: {exc}")
        outcomes = self.group.all_gather(("; ".join(problems) or None, sorted(got)))
        failed = {r: e for r, (e, _) in enumerate(outcomes) if e}
        if failed:
            raise CorruptCheckpointError(f"restoring {folder}: bringing files from other nodes failed: {failed}")
        for r, (_, brought) in enumerate(outcomes):  # every rank of a node reads them from its disk now
            nodes[self.layout.node_of[r]] |= set(brought)


class Nearest(Storage):
    """Reads each file from this node's folder when a record there names it (``held``),
    else from the durable root: a file no record names may be a torn leftover."""

    def __init__(self, local: Storage, durable: Storage | None, held: set[str]) -> None:
        self.primary, self.durable, self.held = local, durable, held
        self.url = local.url

    def _pick(self, name: str) -> Storage:
        return self.primary if name in self.held or self.durable is None else self.durable

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._pick(name).read_into(name, offset, out)

    def listdir(self) -> dict[str, int | None]:
        return {**(self.durable.listdir() if self.durable else {}), **self.primary.listdir()}

    def child(self, name: str) -> Storage:
        raise NotImplementedError

    def write_file(self, name: str, parts: Any) -> int:
        raise NotImplementedError("restore only reads")

    def delete(self, names: Any) -> None:
        raise NotImplementedError("restore only reads")

    def remove_folder(self) -> None:
        raise NotImplementedError("restore only reads")
