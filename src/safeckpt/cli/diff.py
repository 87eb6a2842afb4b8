"""``safeckpt diff``: what differs between two checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import click
import torch

from ..format import codec
from ..format.folder import read_committed
from ..errors import CheckpointError
from ..format.tree import leaf_values
from ..interop.export import read_tensors
from ..format.compact import TableEntry
from ..format.manifest import Manifest, TensorEntry
from ..storage import Storage
from ._common import (compact, console, decode, jsonable, locate, print_json, say,
                      storage_option_flag, storage_options)

BLOCK = 1 << 22  # elements compared at a time


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


@dataclass
class TensorDiff:
    name: str
    max_abs_diff: float
    differing: int
    numel: int


@dataclass
class Diff:
    """Differences between checkpoints A and B. Metadata and metrics are reported but
    do not make two checkpoints different: the saved state does."""

    identical_tensors: int = 0
    differ: list[TensorDiff] = field(default_factory=list)
    within_tolerance: list[TensorDiff] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)     # dtype or shape
    added: list[dict[str, Any]] = field(default_factory=list)       # tensors only in B
    removed: list[dict[str, Any]] = field(default_factory=list)     # tensors only in A
    values: list[dict[str, Any]] = field(default_factory=list)      # plain values added/removed/changed
    info: list[dict[str, Any]] = field(default_factory=list)        # metadata / metrics
    verified: bool = False     # every byte of both read and checked against its checksums first
    corrupt: list[str] = field(default_factory=list)                # what the verification found
    not_read: int = 0          # identical tensors judged by their checksums alone (not verified)

    @property
    def identical(self) -> bool:
        return not (self.differ or self.changed or self.added or self.removed or self.values or self.corrupt)


def _same_bytes(a: TensorEntry | TableEntry, b: TensorEntry | TableEntry, ma: Manifest, mb: Manifest) -> bool:
    """Equal chunk layout and block checksums: the bytes are equal, nothing to read."""
    if ma.block_size != mb.block_size or len(a.chunks) != len(b.chunks):
        return False
    def key(c: Any) -> tuple:
        return c.offsets, c.shape
    return all(x.offsets == y.offsets and x.shape == y.shape and x.checksums == y.checksums
               for x, y in zip(sorted(a.chunks, key=key), sorted(b.chunks, key=key)))


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(max absolute difference, number of differing elements) of two tensors of one
    dtype and shape; equal bytes (NaNs in the same places included) count as equal, a
    NaN against a number as infinitely far."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst, count = 0.0, 0
    for i in range(0, fa.numel(), BLOCK):
        x, y = fa[i:i + BLOCK], fb[i:i + BLOCK]
        if torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            continue
        try:
            wide = torch.complex128 if x.is_complex() else torch.float64
            xd, yd = x.to(wide), y.to(wide)  # ints: exact up to 2**53
        except (RuntimeError, TypeError):  # a dtype without arithmetic: count differing elements
            xb = x.view(torch.uint8).reshape(x.numel(), -1)
            yb = y.view(torch.uint8).reshape(y.numel(), -1)
            differs = (xb != yb).any(dim=1)
            count += int(differs.sum())
            worst = math.nan
            continue
        nan_x = torch.isnan(xd.abs() if xd.is_complex() else xd)
        nan_y = torch.isnan(yd.abs() if yd.is_complex() else yd)
        d = torch.nan_to_num((xd - yd).abs(), nan=math.inf, posinf=math.inf)
        d = torch.where(nan_x & nan_y, torch.zeros_like(d), d)
        same_inf = (xd == yd)  # equal infinities subtract to NaN: they are equal
        d = torch.where(same_inf, torch.zeros_like(d), d)
        differs = d != 0
        n = int(differs.sum())
        if n:
            count += n
            worst = max(worst, float(d.max())) if not math.isnan(worst) else worst
    return worst, count


_KINDS = {"object": "dict", "$dict": "dict", "$odict": "dict", "list": "list", "$tuple": "tuple",
          "$size": "torch.Size"}  # a dict and an OrderedDict load alike


def containers(tree: Any) -> dict[str, str]:
    """Every container of a saved tree by its dotted name, described by its type and
    the types of its keys: ``{0: ...}`` and ``{"0": ...}`` have the same dotted names,
    but an optimizer loads only one of them."""
    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        tag = codec.tag_of(node)
        if tag == "$local":
            for rank, child in enumerate(node["$local"]):
                walk(child, f"{key}@{rank}")
            return
        if tag not in _KINDS:
            return
        try:
            items = codec.items_of(node, key, False)
        except CheckpointError:
            return
        kind = _KINDS[tag]
        if tag in ("object", "$dict", "$odict") and items:
            kind += " with " + "/".join(sorted({type(k).__name__ for k, _ in items})) + " keys"
        out[key or "<root>"] = kind
        for k, child in items:
            walk(child, codec.child_key(key, k))

    walk(tree, "")
    return out


def diff_checkpoints(sa: Storage, sb: Storage, *, atol: float = 0.0, verify: bool = True) -> Diff:
    """Compare A and B. ``verify`` first reads both checkpoints in full and checks every
    checksum (as ``safeckpt verify``), so that equal checksums prove equal bytes on
    storage; then tensors with equal block checksums are equal without reading them
    again. Without it, such tensors are called equal by their manifests alone
    (``not_read``): a copy whose bytes rotted would pass."""
    ma, mb = read_committed(sa), read_committed(sb)
    out = Diff(verified=verify)
    if verify:
        from .check import verify_all

        out.corrupt = [p for checked in verify_all([sa, sb], jobs=8) for p in checked.problems]
        if out.corrupt:
            return out
    for name in ma.tensors.keys() - mb.tensors.keys():
        e = ma.tensors[name]
        out.removed.append({"name": name, "dtype": e.dtype, "shape": e.shape})
    for name in mb.tensors.keys() - ma.tensors.keys():
        e = mb.tensors[name]
        out.added.append({"name": name, "dtype": e.dtype, "shape": e.shape})
    to_read = []
    for name in (n for n in ma.tensors if n in mb.tensors):
        a, b = ma.tensors[name], mb.tensors[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.changed.append({"name": name, "a": {"dtype": a.dtype, "shape": a.shape},
                                "b": {"dtype": b.dtype, "shape": b.shape}})
        elif _same_bytes(a, b, ma, mb):
            out.identical_tensors += 1
            out.not_read += not verify
        else:
            to_read.append(name)
    # one batch of A and the same batch of B at a time
    for (name, ta), (_, tb) in zip(read_tensors(sa, ma, to_read), read_tensors(sb, mb, to_read)):
        worst, count = compare_tensors(ta, tb)
        if count == 0:
            out.identical_tensors += 1
        elif worst <= atol:
            out.within_tolerance.append(TensorDiff(name, worst, count, ta.numel()))
        else:
            out.differ.append(TensorDiff(name, worst, count, ta.numel()))
    va, vb = leaf_values(ma.tree), leaf_values(mb.tree)
    for key in va.keys() | vb.keys():
        if key not in vb:
            out.values.append({"name": key, "change": "removed", "a": decode(va[key], key)})
        elif key not in va:
            out.values.append({"name": key, "change": "added", "b": decode(vb[key], key)})
        elif va[key] != vb[key]:
            out.values.append({"name": key, "change": "changed", "a": decode(va[key], key),
                               "b": decode(vb[key], key)})
    ca, cb = containers(ma.tree), containers(mb.tree)
    for key in ca.keys() & cb.keys():
        if ca[key] != cb[key]:
            out.values.append({"name": key, "change": "changed", "a": ca[key], "b": cb[key], "container": True})
    out.values.sort(key=lambda v: v["name"])
    for what, da, db in (("metadata", ma.metadata, mb.metadata), ("metrics", ma.metrics, mb.metrics)):
        for key in sorted(da.keys() | db.keys(), key=str):
            if da.get(key, ABSENT) != db.get(key, ABSENT):
                out.info.append({"name": f"{what}.{key}", "a": da.get(key, ABSENT), "b": db.get(key, ABSENT)})
    for lst in (out.removed, out.added, out.changed):
        lst.sort(key=lambda v: v["name"])
    return out


def _as_json(d: Diff) -> dict[str, Any]:
    def td(x: TensorDiff) -> dict[str, Any]:
        return {"name": x.name, "max_abs_diff": jsonable(x.max_abs_diff), "differing": x.differing,
                "numel": x.numel}
    return {"identical": d.identical, "verified": d.verified, "corrupt": d.corrupt,
            "identical_tensors": d.identical_tensors, "not_read": d.not_read,
            "differ": [td(x) for x in d.differ], "within_tolerance": [td(x) for x in d.within_tolerance],
            "changed": d.changed, "added": d.added, "removed": d.removed,
            "values": [{k: jsonable(v) for k, v in x.items()} for x in d.values],
            "info": [{k: None if v is ABSENT else jsonable(v) for k, v in x.items()} for x in d.info]}


def _shape(e: dict) -> str:
    return f"{e['dtype']} [{', '.join(map(str, e['shape']))}]"


@click.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="tensors whose max absolute difference is at most this count as equal")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="first read every byte of both and check every checksum, so that a copy whose bytes "
                   "rotted is found; --no-verify trusts the checksums the manifests record")
@click.option("--json", "as_json", is_flag=True, help="print the differences as JSON")
@storage_option_flag
def diff_command(a: str, b: str, atol: float, verify: bool, as_json: bool, storage_option: tuple[str, ...]) -> int:
    """Compare two checkpoints: tensors that differ (max absolute difference), changed
    shapes or dtypes, added and removed tensors, differing plain values.

    Exits 0 when the saved states are identical, 1 when they differ or a checksum
    fails. Checkpoints saved by different numbers of ranks compare by their full
    tensors. Metadata and metrics differences are shown but do not count. Both
    checkpoints are first read in full and every checksum checked (as verify does), so
    that tensors with equal checksums are then equal on storage too; --no-verify skips
    that, and such tensors are called equal by their manifests alone (said in the
    summary)."""
    options = storage_options(storage_option)
    first, second = (locate(p, options).one_checkpoint("compare") for p in (a, b))
    d = diff_checkpoints(first, second, atol=atol, verify=verify)
    if as_json:
        print_json(_as_json(d))
        return 0 if d.identical else 1
    out = console()
    for problem in d.corrupt:
        say(out, f"corrupt   {problem}")
    for x in d.differ:
        say(out, f"differ    {x.name}: max abs diff {x.max_abs_diff:.6g} "
                       f"({x.differing} of {x.numel} elements)")
    for c in d.changed:
        say(out, f"changed   {c['name']}: {_shape(c['a'])} -> {_shape(c['b'])}")
    for e in d.removed:
        say(out, f"removed   {e['name']}: {_shape(e)} (only in A)")
    for e in d.added:
        say(out, f"added     {e['name']}: {_shape(e)} (only in B)")
    for v in d.values:
        if v.get("container"):
            say(out, f"value     {v['name']}: {v['a']} -> {v['b']}")
        elif v["change"] == "changed":
            say(out, f"value     {v['name']}: {compact(v['a'])} -> {compact(v['b'])}")
        else:
            side = "a" if v["change"] == "removed" else "b"
            say(out, f"value     {v['name']}: {v['change']} ({compact(v[side])})")
    for x in d.within_tolerance:
        say(out, f"close     {x.name}: max abs diff {x.max_abs_diff:.6g} <= --atol {atol:g}")
    for i in d.info:
        say(out, f"note      {i['name']}: {compact(i['a'])} -> {compact(i['b'])}")
    unread = f" ({d.not_read} by their checksums, bytes not read)" if d.not_read else ""
    close = f", {len(d.within_tolerance)} close (within --atol {atol:g})" if atol else ""
    summary = (f"{d.identical_tensors} identical tensor(s){unread}{close}, {len(d.differ)} differ, "
               f"{len(d.changed)} changed, {len(d.added)} added, {len(d.removed)} removed; "
               f"{len(d.values)} value(s) differ")
    if d.corrupt:
        summary = f"{len(d.corrupt)} problem(s) found reading every byte; nothing compared"
    say(out, "compared: every byte of both read and checked against its checksums, then tensors by checksum "
        "or value" if d.verified else "compared: tensors with equal checksums by their checksums alone (--no-verify: "
        "their bytes were not read), the others by value")
    say(out, ("identical: " if d.identical else "different: ") + summary)
    return 0 if d.identical else 1

