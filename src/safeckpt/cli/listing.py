"""``safeckpt ls`` and ``safeckpt show``: what is in a run root, what is in a checkpoint."""

from __future__ import annotations

import math
from typing import Any

import click

from ..format.folder import CheckpointState, read_committed
from ..run.listing import CheckpointStatus, checkpoint_status, list_checkpoints
from ..format.manifest import Manifest
from ..storage import Storage
from ..format.dtypes import itemsize_of
from ..format.tree import leaf_values
from ..format.names import step_folder, step_of
from ._common import (CliError, Place, compact, console, count_states, decode, human_bytes, iso_time, jsonable,
                      locate, print_json, say, storage_option_flag, storage_options, table, text, when)


def _row(c: CheckpointStatus) -> dict[str, Any]:
    """One checkpoint folder as a plain record (the ``--json`` row)."""
    problems = [] if c.state in (CheckpointState.COMMITTED, CheckpointState.RETIRED) else [c.problem]
    return {"step": c.step, "path": c.path, "status": c.state.value, "bytes": c.bytes,
            "shared_bytes": c.shared_bytes, "created": c.created,
            "time": None if c.created is None else iso_time(c.created), "world_size": c.world_size,
            "metrics": jsonable(c.metrics), "metadata": jsonable(c.metadata), "save_id": c.save_id,
            "file_count": c.file_count, "tensor_count": c.tensor_count, "problems": problems}


def _rows(place: Place) -> list[dict[str, Any]]:
    if place.kind == "root":
        return [_row(c) for c in list_checkpoints(place.storage)]
    return [_row(checkpoint_status(folder)) for folder in place.checkpoints()]


def _ignored(place: Place) -> list[str]:
    """Folders of a run root named like a step folder without being one (``step-0000000002``:
    a step's folder is exactly ``step-`` and the step zero-padded to 9 digits)."""
    if place.kind != "root":
        return []
    return sorted(n for n, size in place.storage.listdir().items()
                  if size is None and n.startswith("step-") and step_of(n) is None)


@click.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list (step, path, status, bytes, metrics, ...)")
@storage_option_flag
def ls_command(root: str, as_json: bool, storage_option: tuple[str, ...]) -> int:
    """List the checkpoints of a run root (its step-NNNNNNNNN folders), or of a folder
    whose sub-folders are checkpoints (then also named by their folder): step, time,
    the bytes each owns (its own files) and shares (data read from older checkpoints
    of an incremental run), world size, metrics and status (committed, torn save,
    CORRUPT, newer format, empty, retired).

    ROOT is a local path or a URL such as s3://bucket/run; a single checkpoint folder
    lists as one row."""
    place = locate(root, storage_options(storage_option))
    rows = _rows(place)
    if as_json:
        print_json(rows)
        return 0
    out = console()
    named = any(_name(r) != (None if r["step"] is None else step_folder(r["step"])) for r in rows)
    t = table(*(("name",) if named else ()), "step", "time", "owns", "shares", "world", "metrics", "status",
              right=("step", "owns", "shares", "world"))
    for r in rows:
        t.add_row(*((text(_name(r)),) if named else ()), text("-" if r["step"] is None else r["step"]),
                  text(when(r["created"])),
                  text(human_bytes(r["bytes"])), text(human_bytes(r["shared_bytes"]) if r["shared_bytes"] else "-"),
                  text(r["world_size"] or "-"),
                  text(compact(r["metrics"]) if r["metrics"] else "-"),
                  text(CheckpointState(r["status"]).label))
    out.print(t)
    say(out, f"{len(rows)} checkpoint folder(s) in {root}: {count_states(r['status'] for r in rows)}")
    for r in rows:
        if r["status"] not in (CheckpointState.COMMITTED, CheckpointState.TORN, CheckpointState.RETIRED):
            say(out, f"  {_name(r) if named else 'step ' + str(r['step'])}: {'; '.join(r['problems'])}")
    ignored = _ignored(place)
    if ignored:
        say(out, f"ignored (not step folder names, which are step- and the step zero-padded to 9 digits): "
                 f"{', '.join(ignored)}")
    return 0


def _name(row: dict[str, Any]) -> str:
    """The name of a row's folder: listed beside the step unless every folder is the
    step's own (``step-000000100``), so that ``last.ckpt`` and ``epoch=2-step=12.ckpt``,
    both of step 12, are told apart."""
    return row["path"].rstrip("/").rpartition("/")[2]


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def describe_checkpoint(storage: Storage, m: Manifest, select: str | None) -> dict[str, Any]:
    """A checkpoint as a plain record (the ``--json`` of ``show``)."""
    tensors = []
    for name, e in m.tensors.items():
        if select and not name.startswith(select):
            continue
        tensors.append({"name": name, "dtype": e.dtype, "shape": list(e.shape), "chunks": len(e.chunks),
                        "bytes": math.prod(e.shape) * itemsize_of(e.dtype, name)})
    values = {k: jsonable(decode(v, k)) for k, v in leaf_values(m.tree).items()
              if not select or k.startswith(select)}
    return {"path": storage.url, "step": m.step, "status": CheckpointState.COMMITTED.value, "save_id": m.save_id, "seq": m.seq,
            "format_version": m.version, "created": m.created, "time": iso_time(m.created),
            "world_size": m.world_size, "bytes": m.total_bytes, "shared_bytes": m.shared_bytes(),
            "files": [{"name": f.name, "bytes": f.size, "rank": f.rank, "checksum": f.checksum}
                      for f in m.files.values()],
            "tensors": tensors, "values": values, "metadata": jsonable(m.metadata),
            "metrics": jsonable(m.metrics)}


@click.command("show")
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="print the description as JSON")
@click.option("--select", metavar="PREFIX", help="only tensors and values whose name starts with PREFIX")
@storage_option_flag
def show_command(ckpt: str, as_json: bool, select: str | None, storage_option: tuple[str, ...]) -> int:
    """Show what a checkpoint holds: its tensors (name, dtype, global shape, number of
    chunks, bytes), its other values, metadata and metrics.

    CKPT is a checkpoint folder (local path or URL), e.g. run/step-000000100."""
    storage = locate(ckpt, storage_options(storage_option)).one_checkpoint("show")
    m = read_committed(storage)
    info = describe_checkpoint(storage, m, select)
    if select and not info["tensors"] and not info["values"]:
        names = [*m.tensors, *leaf_values(m.tree)]
        raise CliError(f"nothing in {storage.url} starts with {select!r} (names: {', '.join(names[:5])}"
                       f"{', ...' if len(names) > 5 else ''})")
    if as_json:
        print_json(info)
        return 0
    out = console()
    head = table("", "")
    head.show_header = False
    for key, value in [("checkpoint", info["path"]), ("step", "-" if m.step is None else m.step),
                       ("created", when(m.created)), ("world size", m.world_size),
                       ("save id", f"{m.save_id} (manifest {m.seq}, format {m.version})"),
                       ("files", f"{len(m.files)}, {human_bytes(m.total_bytes)}"
                                 + (f" (+ {human_bytes(m.shared_bytes())} shared with older checkpoints)"
                                    if m.shared_files_bytes else "")),
                       ("metadata", compact(info["metadata"], 200) if m.metadata else "-"),
                       ("metrics", compact(info["metrics"], 200) if m.metrics else "-")]:
        head.add_row(text(key), text(value))
    out.print(head)
    sealed = [f for f in m.files.values() if f.header_size is None]
    if sealed:  # files another tool wrote, which the manifest seals (safeckpt.seal)
        f = table("sealed file", "size", "checksum", right=("size",),
                  title=f"{len(sealed)} sealed file(s), {human_bytes(sum(x.size for x in sealed))}")
        for x in sealed:
            f.add_row(text(x.name), text(human_bytes(x.size)), text((x.checksum or "-").partition(":")[0]))
        out.print()
        out.print(f)
    if info["tensors"] or not sealed:
        t = table("tensor", "dtype", "shape", "chunks", "size", right=("chunks", "size"),
                  title=f"{len(info['tensors'])} tensor(s), {human_bytes(sum(x['bytes'] for x in info['tensors']))}")
        for x in info["tensors"]:
            t.add_row(text(x["name"]), text(x["dtype"]), text(_shape(x["shape"])), text(x["chunks"]),
                      text(human_bytes(x["bytes"])))
        out.print()
        out.print(t)
    if info["values"]:
        v = table("value", "content", title=f"{len(info['values'])} other value(s)")
        for k, node in leaf_values(m.tree).items():
            if not select or k.startswith(select):
                v.add_row(text(k), text(compact(decode(node, k), 100)))
        out.print()
        out.print(v)
    return 0

