"""``safeckpt verify`` (read every byte, check every checksum) and ``safeckpt gc``
(remove what interrupted saves left)."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable

import click

from ..run import garbage
from ..errors import CheckpointError
from ..format.folder import CheckpointState, folder_state
from ..protocol.filecheck import CheckedFiles
from ..storage import Storage, StorageWrapper
from ._common import (CliError, console, count_states, human_bytes, locate, one_line, print_json, progress_console,
                      say, storage_option_flag, storage_options, table, text)


class _Counting(StorageWrapper):
    """A storage that reports every byte read (for the progress bar)."""

    def __init__(self, inner: Storage, advance: Callable[[int], None]) -> None:
        super().__init__(inner)
        self.advance = advance

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(name, offset, out)
        self.advance(out.nbytes)


@dataclass
class Checked:
    """The verdict on one checkpoint folder."""

    path: str
    step: int | None = None
    status: CheckpointState = CheckpointState.COMMITTED  # CheckpointState.CORRUPT also when data fails its checksums
    problems: list[str] = field(default_factory=list)
    file_count: int = 0
    bytes: int = 0              # bytes of the folder's own files (as in ls)
    bytes_read: int = 0         # bytes read and checked: its own files and the data it shares

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "status": self.status.value, "problems": self.problems,
                "file_count": self.file_count, "bytes": self.bytes, "bytes_read": self.bytes_read}


def _targets(paths: tuple[str, ...], options: dict) -> tuple[list[Storage], list[str]]:
    """Checkpoint folders named by ``paths`` (a checkpoint, or every checkpoint folder in
    one), and why each path that names none does not: a bad path is reported with the
    others, never instead of them."""
    out: list[Storage] = []
    bad: list[str] = []
    for path in paths:
        try:
            out += locate(path, options).checkpoints()
        except (CheckpointError, OSError) as exc:  # StorageError too
            bad.append(one_line(exc))
    return out, bad


def verify_all(storages: list[Storage], jobs: int, progress: Any = None) -> list[Checked]:
    """Verify every checkpoint folder, all their files in parallel on ``jobs`` threads."""
    results = [Checked(s.url) for s in storages]
    work: list[tuple[Checked, Storage, Any, str, int]] = []
    for result, storage in zip(results, storages):
        found = folder_state(storage)
        result.status, manifest = found.state, found.manifest
        if manifest is None:
            result.problems = [] if result.status is CheckpointState.RETIRED else [found.problem]
            if result.status is not CheckpointState.UNREADABLE:
                result.bytes = sum(size for size in storage.listdir().values() if size is not None)
            continue
        result.step, result.file_count, result.bytes = manifest.step, len(manifest.files), manifest.total_bytes
        result.bytes_read = sum(f.size for f in manifest.files.values())
        work += [(result, storage, manifest, name, f.size) for name, f in manifest.files.items()]
    total = sum(w[4] for w in work)
    task = progress.add_task("verifying", total=total) if progress is not None else None

    def advance(n: int) -> None:
        if progress is not None:
            progress.advance(task, n)

    def check(storage: Storage, manifest: Any, name: str) -> list[str]:
        reader = CheckedFiles(_Counting(storage, advance), manifest)
        try:
            return reader.verify_file(name)
        except CheckpointError as exc:  # unreadable (missing, I/O error): a finding, not a crash
            return [str(exc)]

    with ThreadPoolExecutor(max(1, jobs), thread_name_prefix="safeckpt-verify") as pool:
        futures = {pool.submit(check, storage, manifest, name): (result, size)
                   for result, storage, manifest, name, size in work}
        for future in as_completed(futures):
            result, size = futures[future]
            problems = future.result()
            if problems:
                result.status = CheckpointState.CORRUPT
                result.problems += problems
    return results


@click.command("verify")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=8, show_default=True,
              help="files read and checked at once")
@click.option("--json", "as_json", is_flag=True, help="print the verdicts as JSON")
@storage_option_flag
def verify_command(paths: tuple[str, ...], jobs: int, as_json: bool, storage_option: tuple[str, ...]) -> int:
    """Read every byte of checkpoints and check every checksum.

    PATH is a checkpoint folder or a run root (then every step folder is checked).
    Exits 0 when all are sound, 1 when any problem is found (each printed with its file
    and tensor), a folder cannot be read, or a checkpoint is of a newer format (this
    safeckpt cannot check it), 2 when a PATH names no checkpoint (the others are still
    checked and reported, that one is an error line). A torn save (a step folder
    without a manifest), an empty or a retired folder is reported but is not a failure."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    storages, bad = _targets(paths, storage_options(storage_option))
    if not storages:
        raise CliError("; ".join(bad))
    err = progress_console()
    started = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal) as progress:
        results = verify_all(storages, jobs, progress)
    seconds = time.monotonic() - started
    if as_json:
        print_json([r.as_dict() for r in results])
    else:
        out = console()
        for r in results:
            label = r.status.label.split(" (")[0].ljust(14)
            if r.status == CheckpointState.COMMITTED:
                say(out, f"{label}{r.path}  ({r.file_count} file(s), {human_bytes(r.bytes_read)}, every checksum matches)")
            else:
                say(out, f"{label}{r.path}  ({_WHY[r.status]})")
                for p in r.problems if r.status in _FINDINGS else []:
                    say(out, f"  - {p}")
        say(out, f"checked {len(results)} checkpoint folder(s), {human_bytes(sum(r.bytes_read for r in results))} "
                 f"read in {seconds:.1f}s: {count_states(r.status for r in results)}")
    for line in bad:  # every path is reported; one that names no checkpoint is bad input
        print(f"safeckpt: error: {line}", file=sys.stderr)
    return 2 if bad else 1 if any(r.status in _FINDINGS for r in results) else 0


_FINDINGS = (CheckpointState.CORRUPT, CheckpointState.NEWER_FORMAT, CheckpointState.UNREADABLE)  # exit 1


_WHY = {CheckpointState.TORN: "no manifest: a save that never committed; 'safeckpt gc' removes its files",
        CheckpointState.EMPTY: "nothing in it",
        CheckpointState.RETIRED: "deleted by retention; keeps data newer checkpoints share",
        CheckpointState.CORRUPT: "problems below",
        CheckpointState.NEWER_FORMAT: "written by a newer safeckpt: this one cannot check it",
        CheckpointState.UNREADABLE: "cannot be read: problems below"}


def _sizes(root: Storage, names: list[str], single: bool) -> dict[str, int]:
    """Sizes of ``folder/name`` entries (or plain names in a single checkpoint folder)."""
    sizes: dict[str, int] = {}
    folders: dict[str, list[str]] = {}
    for n in names:
        folder, _, base = n.rpartition("/") if not single else ("", "", n)
        folders.setdefault(folder, []).append(base)
    for folder, bases in folders.items():
        listing = (root.child(folder) if folder else root).listdir()
        for b in bases:
            sizes[f"{folder}/{b}" if folder else b] = listing.get(b) or 0
    return sizes


@click.command("gc")
@click.argument("root")
@click.option("--dry-run", is_flag=True, help="only list what would be removed")
@click.option("--min-age", type=click.FloatRange(min=0), default=3600, show_default=True, metavar="SECONDS",
              help="spare saves younger than this (a live job may still be writing them); 0 spares none")
@click.option("--json", "as_json", is_flag=True, help="print what was (or would be) removed as JSON")
@storage_option_flag
def gc_command(root: str, dry_run: bool, min_age: float, as_json: bool, storage_option: tuple[str, ...]) -> int:
    """Remove what interrupted saves left behind: data files no committed checkpoint
    needs and manifests that lost, in the step folders of ROOT (or in one checkpoint
    folder). Never a committed checkpoint, never a file safeckpt did not write, never a
    save younger than --min-age. The same rules as CheckpointManager.gc."""
    place = locate(root, storage_options(storage_option))
    if place.kind == "folders":  # not a run root: gc's rules (retired, torn, old) are a manager's
        raise CliError(f"{place.storage.url} holds checkpoint folders but is not a run root (no "
                       f"step-NNNNNNNNN folders); run gc on each of them, e.g. {place.checkpoints()[0].url}")
    storage = place.storage
    single = place.kind == "checkpoint"
    if single:
        manifests, data = garbage.garbage_in(storage, min_age_s=min_age)
        doomed = manifests + data
    else:
        doomed = garbage.collect(storage, min_age_s=min_age, dry_run=True)
    sizes = _sizes(storage, doomed, single)
    aborted = 0
    if not dry_run and doomed:
        if single:
            storage.delete(manifests)  # manifests first, data after
            storage.delete(data)
        else:
            doomed = garbage.collect(storage, min_age_s=min_age, dry_run=False)
    if not dry_run and hasattr(storage, "abort_stale_uploads"):
        aborted = storage.abort_stale_uploads(older_than=min_age)
    total = sum(sizes.get(n, 0) for n in doomed)
    if as_json:
        print_json({"path": storage.url, "dry_run": dry_run, "files": [{"name": n, "bytes": sizes.get(n, 0)}
                                                                      for n in doomed],
                    "bytes": total, "aborted_uploads": aborted})
        return 0
    out = console()
    if not doomed:
        say(out, f"nothing to remove in {storage.url}"
                       + (f" (saves younger than {min_age:g}s are spared; see --min-age)" if min_age else ""))
    else:
        t = table("file", "size", right=("size",))
        for n in doomed:
            t.add_row(text(n), text(human_bytes(sizes.get(n))))
        out.print(t)
        verb = "would remove" if dry_run else "removed"
        say(out, f"{verb} {len(doomed)} file(s), {human_bytes(total)} in {storage.url}"
                       + (" (dry run: nothing changed)" if dry_run else ""))
    if aborted:
        say(out, f"aborted {aborted} stale multipart upload(s)")
    return 0

