"""Crafted checkpoints: manifests written by hand per docs/format.md, correctly framed
and checksummed, whose content is hostile (issue 17, items 6 and 9).

Every one must give a ``CheckpointError`` naming the manifest, never another exception,
a hang or a memory bomb; ``verify`` reports it; ``CheckpointManager.steps()`` does not
count it and ``restore()`` falls back past it to the older good step.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import safeckpt
from safeckpt.format import codec
from safeckpt.format.checksum import block_checksums
from safeckpt.interop.imports import import_checkpoint, read_safetensors
from safeckpt.format.manifest import decode_manifest, editable, encode_manifest, frame
from safeckpt.format.plan import PlanError, check_coverage

# --------------------------------------------------------------------------- helpers


def _body(ckpt: Path) -> tuple[Path, dict]:
    (path,) = sorted(ckpt.glob("manifest-*.json"))
    data = path.read_bytes()
    return path, json.loads(data[len(b'{"safeckpt":'):data.rindex(b',"checksum":')])


def craft(ckpt: Path, mutate: Callable[[dict], "bytes | None"]) -> Path:
    """Rewrite the manifest of ``ckpt``: ``mutate`` changes the JSON body in place (or
    returns raw body bytes); the result is framed with a correct checksum, so only what
    ``mutate`` did is wrong."""
    path, body = _body(ckpt)
    raw = mutate(body)
    path.write_bytes(frame(raw if raw is not None else json.dumps(body).encode()))
    return path


def _state() -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2), "step": 7,
            "meta": {"tags": {"a", "b"}, "pair": (1, 2), "ids": {1: "x"}}}


def as_format_1(ckpt: Path) -> Path:
    """Re-encode the committed manifest as format 1 (one JSON entry per tensor and chunk),
    whose reader every earlier checkpoint goes through; format 3's tables have their own
    crafted cases in test_compact_manifest.py."""
    (path,) = sorted(ckpt.glob("manifest-*.json"))
    m = decode_manifest(path.read_bytes(), str(path))
    path.write_bytes(encode_manifest(dataclasses.replace(m, version=1, tensors=editable(m.tensors))))
    return ckpt


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ck"
    safeckpt.save(_state(), path)
    return as_format_1(path)


def assert_refused(ckpt: Path, manifest: Path) -> None:
    """load_state, load and verify all refuse it with a typed error naming the file."""
    for call in (lambda: safeckpt.load_state(ckpt), lambda: safeckpt.load(_state(), ckpt),
                 lambda: safeckpt.load_state(ckpt, verify=False)):
        with pytest.raises(safeckpt.CorruptCheckpointError) as info:
            call()
        assert manifest.name in str(info.value), info.value
    report = safeckpt.verify(ckpt)
    assert not report.ok and manifest.name in report.problems[0]


def _deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _nest(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = {"a": node}
    return node


def _set(path: list, value: Any) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _shape(shape: list, nbytes: int = 8) -> Callable[[dict], None]:
    """Tensor ``b`` (2 float32 values) given ``shape``, its one chunk made to agree."""
    def mutate(body: dict) -> None:
        entry = body["tensors"]["b"]
        entry["shape"] = shape
        chunk = entry["chunks"][0]
        chunk.update(shape=shape, offsets=[0] * len(shape), end=chunk["start"] + nbytes)
    return mutate


def _raw_tree(raw: bytes) -> Callable[[dict], bytes]:
    def mutate(body: dict) -> bytes:
        body["tree"] = "__TREE__"
        return json.dumps(body).encode().replace(b'"__TREE__"', raw)
    return mutate


CRAFTED = {
    "json 100000 deep": _raw_tree(_deep_json(100_000)),
    "tree 600 deep": _set(["tree", "step"], _nest(600)),
    "$set of lists": _set(["tree", "meta", "tags"], {"$set": [[1], [2]]}),
    "$set not a list": _set(["tree", "meta", "tags"], {"$set": 5}),
    "$dict key a list": _set(["tree", "meta", "ids"], {"$dict": [[[1, 2], "x"]]}),
    "$dict item not a pair": _set(["tree", "meta", "ids"], {"$dict": [[1, 2, 3]]}),
    "$dict not a list": _set(["tree", "meta", "ids"], {"$dict": {"a": 1}}),
    "$dict key an ndarray": _set(["tree", "meta", "ids"], {"$dict": [[
        {"$ndarray": {"dtype": "<i4", "shape": [1], "data": "AQAAAA=="}}, "x"]]}),
    "$tuple not a list": _set(["tree", "meta", "pair"], {"$tuple": 3}),
    "$size of strings": _set(["tree", "meta", "pair"], {"$size": ["a"]}),
    "$size too large": _set(["tree", "meta", "pair"], {"$size": [2**64]}),
    "$tensor a list": _set(["tree", "w"], {"$tensor": ["w"]}),
    "$tensor unknown": _set(["tree", "w"], {"$tensor": "nope"}),
    "$local not a list": _set(["tree", "step"], {"$local": 3}),
    "$local nested": _set(["tree", "step"], {"$local": [{"$local": [1]}]}),
    "$device garbage": _set(["tree", "step"], {"$device": "xyz:-1"}),
    "$device a dict": _set(["tree", "step"], {"$device": {}}),
    "$dtype not a dtype": _set(["tree", "step"], {"$dtype": "nn"}),
    "$int not hex": _set(["tree", "step"], {"$int": "zz"}),
    "$float a list": _set(["tree", "step"], {"$float": [1]}),
    "$complex nested": _set(["tree", "step"], {"$complex": [{"$complex": [1, 2]}, 1]}),
    "$complex three parts": _set(["tree", "step"], {"$complex": [1, 2, 3]}),
    "$bytes not base64": _set(["tree", "step"], {"$bytes": "!!"}),
    "$ndarray bad shape": _set(["tree", "step"], {"$ndarray": {"dtype": "<i4", "shape": [2**64], "data": ""}}),
    "$ndarray object dtype": _set(["tree", "step"], {"$ndarray": {"dtype": "|O", "shape": [1], "data": ""}}),
    "$npscalar empty": _set(["tree", "step"], {"$npscalar": {"dtype": "<f4", "data": ""}}),
    "unknown tag": _set(["tree", "step"], {"$what": 1}),
    "metadata a list": _set(["metadata"], [1, 2]),
    "metadata pickled": _set(["metadata"], {"x": {"$pickle": "gAQu"}}),
    "metadata rank-local": _set(["metadata"], {"x": {"$local": [1]}}),
    "metrics a tensor": _set(["metrics"], {"x": {"$tensor": "w"}}),
    "metadata deep": _set(["metadata"], {"x": _nest(600)}),
    "shape 2**64 x 0": _shape([2**64, 0], 0),
    "shape 2**62 x 2**62 x 0": _shape([2**62, 2**62, 0], 0),
    "shape 65 dims": _shape([2] + [1] * 64),
    "shape negative": _shape([-2]),
    "shape of floats": _shape([2.0]),
    "shape not a list": _set(["tensors", "b", "shape"], 2),
    "dtype unknown": _set(["tensors", "b", "dtype"], "float99"),
    "dtype quantized": _set(["tensors", "b", "dtype"], "qint32"),
    "dtype a list": _set(["tensors", "b", "dtype"], ["float32"]),
    "chunk past the file": _set(["tensors", "b", "chunks", 0, "end"], 10**12),
    "chunk file a list": _set(["tensors", "b", "chunks", 0, "file"], ["x"]),
    "chunk not an object": _set(["tensors", "b", "chunks", 0], [1]),
    "created too large": _set(["created"], 10**400),
    "files not a list": _set(["files"], 3),
    "tensors a list": _set(["tensors"], [1]),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_manifest_is_a_corrupt_checkpoint(ckpt, case):
    manifest = craft(ckpt, CRAFTED[case])
    assert_refused(ckpt, manifest)


def _raw_value(raw: bytes) -> Callable[[dict], bytes]:
    """``meta.v`` written as the raw JSON ``raw`` (a number Python's json would not write)."""
    def mutate(body: dict) -> bytes:
        body["tree"]["meta"]["v"] = "__V__"
        return json.dumps(body).encode().replace(b'"__V__"', raw)
    return mutate


#: forms docs/format.md §7 forbids that an earlier decoder accepted, each a value it
#: changed silently (finding h): (mutation, the key path the error must name)
NONCANONICAL = {
    "$dtype alias int": (_set(["tree", "meta", "v"], {"$dtype": "int"}), "meta.v"),
    "$dtype alias half": (_set(["tree", "meta", "v"], {"$dtype": "half"}), "meta.v"),
    "$float finite": (_set(["tree", "meta", "v"], {"$float": "1.5"}), "meta.v"),
    "$float Infinity": (_set(["tree", "meta", "v"], {"$float": "Infinity"}), "meta.v"),
    "$complex int parts": (_set(["tree", "meta", "v"], {"$complex": [1, 2]}), "meta.v"),
    "$int small": (_set(["tree", "meta", "v"], {"$int": "0x5"}), "meta.v"),
    "$int binary": (_set(["tree", "meta", "v"], {"$int": "0b" + "1" * 60}), "meta.v"),
    "$int leading zeros": (_set(["tree", "meta", "v"], {"$int": "0x0" + "f" * 15}), "meta.v"),
    "$ndarray shape -1": (_set(["tree", "meta", "v"],
                               {"$ndarray": {"dtype": "<i4", "shape": [-1], "data": "AQAAAAIAAAA="}}), "meta.v"),
    "$ndarray short data": (_set(["tree", "meta", "v"],
                                 {"$ndarray": {"dtype": "<i4", "shape": [3], "data": "AQAAAAIAAAA="}}), "meta.v"),
    "$ndarray dtype alias": (_set(["tree", "meta", "v"],
                                  {"$ndarray": {"dtype": "int32", "shape": [1], "data": "AQAAAA=="}}), "meta.v"),
    "$npscalar two items": (_set(["tree", "meta", "v"], {"$npscalar": {"dtype": "<i4", "data": "AQAAAAIAAAA="}}),
                            "meta.v"),
    "$bytes pad bits": (_set(["tree", "meta", "v"], {"$bytes": "AB=="}), "meta.v"),
    "$device cuda:01": (_set(["tree", "meta", "v"], {"$device": "cuda:01"}), "meta.v"),
    "$odict duplicate keys": (_set(["tree", "meta", "ids"], {"$odict": [["a", 1], ["a", 2]]}), "meta.ids"),
    "$dict keys 1 and true": (_set(["tree", "meta", "ids"], {"$dict": [[1, "x"], [True, "y"]]}), "meta.ids"),
    "$dict duplicate tuple keys": (_set(["tree", "meta", "ids"], {"$dict": [[{"$tuple": [1, 2]}, "x"],
                                                                             [{"$tuple": [1, 2]}, "y"]]}), "meta.ids"),
    "$set 1 and 1.0": (_set(["tree", "meta", "tags"], {"$set": [1, 1.0]}), "meta.tags"),
    "json number 1e999": (_raw_value(b"1e999"), "meta.v"),
    "json literal NaN": (_raw_value(b"NaN"), "meta.v"),
    "json int 2**60": (_set(["tree", "meta", "v"], 2**60), "meta.v"),
}


@pytest.mark.parametrize("case", list(NONCANONICAL))
def test_a_value_in_a_form_the_format_forbids_is_a_corrupt_checkpoint(tmp_path, case):
    """Refused as a corrupt checkpoint naming the manifest and the key path, never
    decoded to some value (``int`` for ``torch.int32``, one of two equal keys, ...)."""
    ckpt = tmp_path / "ck"
    safeckpt.save(_state(), ckpt)
    mutate, key = NONCANONICAL[case]
    manifest = craft(ckpt, mutate)
    with pytest.raises(safeckpt.CorruptCheckpointError) as info:
        safeckpt.load_state(ckpt)
    assert manifest.name in str(info.value) and f"{key!r}" in str(info.value), info.value
    report = safeckpt.verify(ckpt)
    assert not report.ok and f"{key!r}" in report.problems[0]


class _Token:
    """Compared by identity: two of them with the same state pickle alike but are two keys."""

    def __hash__(self) -> int:
        return 1


def test_keys_that_look_alike_but_are_two_keys_save_and_load(tmp_path):
    """The other side of refusing two equal keys: keys Python keeps apart whose encoded
    forms are the same (two NaNs, which equal nothing; two pickles of objects compared by
    identity) are saved, load back as two keys, and verify."""
    nan = float("nan")
    state = {"d": {nan: 1, float("nan"): 2}, "s": {nan, float("nan")}, "t": {(1, nan): 1, (1, float("nan")): 2},
             "c": {complex(nan, 0): 1, complex(nan, 0): 2}, "p": {_Token(): 1, _Token(): 2}}
    safeckpt.save(state, tmp_path / "ck", allow_pickle=True)
    loaded = safeckpt.load_state(tmp_path / "ck", allow_pickle=True)
    assert {k: len(v) for k, v in loaded.items()} == {k: 2 for k in state}
    assert safeckpt.verify(tmp_path / "ck").ok


_FORMAT_1_ONLY = ("shape", "dtype", "chunk", "tensors")  # cases that edit format 1's per-tensor entries


@pytest.mark.parametrize("case", [c for c in CRAFTED if not c.startswith(_FORMAT_1_ONLY)])
def test_a_crafted_format_3_manifest_is_a_corrupt_checkpoint(tmp_path, case):
    """The same hostile trees, values and fields in the manifest a save writes now."""
    ckpt = tmp_path / "ck3"
    safeckpt.save(_state(), ckpt)
    manifest = craft(ckpt, CRAFTED[case])
    assert_refused(ckpt, manifest)


def test_restore_falls_back_past_crafted_checkpoints(tmp_path):
    """steps() and restore() skip a crafted newest step (deep JSON, deep tree, bad
    values) and restore the older good one."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root)
    for step in (100, 200, 300, 400):
        mgr.save(step, _state())
    mgr.close()
    for step, case in ((200, "tree 600 deep"), (300, "$set of lists"), (400, "json 100000 deep")):
        craft(root / f"step-{step:09d}", CRAFTED[case])
    mgr = safeckpt.CheckpointManager(root)
    assert mgr.steps() == [100] and mgr.latest_step() == 100
    target = _state()
    target["w"].zero_()
    with pytest.warns(UserWarning, match="step-000000400"):
        assert mgr.restore(target) == 100
    assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4))
    mgr.close()


def test_a_tree_at_the_depth_limit_saves_and_loads_and_a_deeper_one_is_refused(tmp_path):
    from safeckpt.format.codec import MAX_DEPTH

    deep = _nest(MAX_DEPTH - 1)  # the state dict itself is one level
    safeckpt.save({"x": deep}, tmp_path / "ok")
    assert safeckpt.load_state(tmp_path / "ok") == {"x": deep}
    with pytest.raises(safeckpt.UnsafeObjectError, match="deep"):
        safeckpt.save({"x": _nest(MAX_DEPTH)}, tmp_path / "deep")
    assert not (tmp_path / "deep").exists() or not list((tmp_path / "deep").iterdir())


# --------------------------------------------------------------------------- coverage (item 6)


def _strips(n: int, rows: int) -> list:
    """``rows`` full-width row strips over the top, column strips of the rest below."""
    return ([((i, 0), (1, n)) for i in range(rows)]
            + [((rows, j), (n - rows, 1)) for j in range(n)])


def test_a_mixed_strip_manifest_is_checked_in_bounded_memory_and_time(tmp_path):
    """The issue's bomb: a 3000 x 3000 tensor in 4,500 chunks, 1,500 row strips over
    3,000 column strips. Before, ``verify`` built 9 million grid cells (546 MB, 6.5 s)."""
    n, rows = 3000, 1500
    boxes = _strips(n, rows)
    ckpt = tmp_path / "ck"
    safeckpt.save({"w": torch.zeros(n, n, dtype=torch.uint8)}, ckpt)
    as_format_1(ckpt)

    def many_chunks(body: dict) -> None:
        entry = body["tensors"]["w"]
        (chunk,) = entry["chunks"]
        pos, chunks = chunk["start"], []
        for offsets, shape in boxes:
            size = shape[0] * shape[1]
            chunks.append({"file": chunk["file"], "start": pos, "end": pos + size, "offsets": list(offsets),
                           "shape": list(shape), "checksums": block_checksums(bytes(size))})
            pos += size
        entry["chunks"] = chunks

    manifest = craft(ckpt, many_chunks)
    assert manifest.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        started = time.perf_counter()
        report = safeckpt.verify(ckpt)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ok, report.problems
    assert peak < 64 << 20, f"verify of a 0.5 MB manifest traced {peak >> 20} MiB"
    assert seconds < 30, seconds  # a deadline against a hang, not a speed claim: memory is the bound
    assert torch.equal(safeckpt.load_state(ckpt)["w"], torch.zeros(n, n, dtype=torch.uint8))


def test_the_coverage_check_is_exact_and_linear():
    n = 3000
    boxes = _strips(n, 1500)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        check_coverage("w", (n, n), boxes)
        moved = list(boxes)
        moved[10] = ((1400, 0), (1, n))  # row 1400 twice, row 10 missing: the volumes still add up
        with pytest.raises(PlanError, match=r"overlap.*near \[10, 0\]"):
            check_coverage("w", (n, n), moved)
        moved = list(boxes)
        moved[2000] = ((1500, 7), (1500, 1))  # a column twice, another missing
        with pytest.raises(PlanError, match="overlap"):
            check_coverage("w", (n, n), moved)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20 and seconds < 30, (peak, seconds)  # the deadline only catches a blow-up
    # tilings no grid describes: a pinwheel, and a staircase through 40 dimensions
    check_coverage("p", (3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)),
                                 ((1, 1), (1, 1))])
    d = 40
    stairs = [(tuple([1] * i + [0] * (d - i)), tuple([1] * (i + 1) + [2] * (d - i - 1))) for i in range(d)]
    check_coverage("s", (2,) * d, stairs + [((1,) * d, (1,) * d)])
    with pytest.raises(PlanError):
        check_coverage("s", (2,) * d, stairs + [((0,) * d, (1,) * d)])
    with pytest.raises(PlanError):  # a box leaving the tensor, balanced by a gap
        check_coverage("o", (4,), [((0,), (2,)), ((3,), (2,))])


def test_a_layout_too_irregular_to_check_is_refused_not_slow():
    """Boxes cut in many dimensions with nothing cancelling: the work bound stops it."""
    import random

    rng, d, cuts = random.Random(0), 12, 6
    boxes = []
    for _ in range(2**cuts):  # each box half of the tensor in 6 of 12 dimensions: the volumes add up
        offsets, shape = [0] * d, [2] * d
        for k in rng.sample(range(d), cuts):
            offsets[k], shape[k] = rng.randint(0, 1), 1
        boxes.append((tuple(offsets), tuple(shape)))
    started = time.perf_counter()
    with pytest.raises(PlanError):
        check_coverage("x", (2,) * d, boxes)
    assert time.perf_counter() - started < 30  # without the work bound this runs for hours


# --------------------------------------------------------------------------- safetensors import


def _safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("header", [
    b'{"x":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,0]}}',
    b'{"x":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}}',
    b'{"x":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}}',
    b'{"x":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}}',
    b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}',
    b'{"x":{"dtype":"F32","shape":[2],"data_offsets":"ab"}}',
    b'{"x":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}}',
    b'{"x":[1]}',
    b'{"__metadata__":[1,2]}',
    b'{"__metadata__":{"k":{"deep":1}}}',
    b'{"x":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
], ids=["negative", "negative-2", "overflow", "float-dim", "reversed", "offsets-str", "dtype-list",
        "entry-list", "metadata-list", "metadata-nested", "recursion-bomb"])
def test_a_crafted_safetensors_file_is_refused_on_import(tmp_path, header):
    src = _safetensors(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(safeckpt.CorruptCheckpointError, match="x.safetensors"):
        read_safetensors(str(src))
    with pytest.raises(safeckpt.CorruptCheckpointError, match="x.safetensors"):
        import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- crafted ties (issue 24, item 5)


def _tie(entries: dict, name: str, first: str, **chunk: Any) -> tuple[str, str]:
    """Tie ``name`` to ``first``; ``chunk`` changes ``name``'s one chunk first (to give it
    ``first``'s bytes, so that only its dtype or shape differs)."""
    (own,) = entries[name].chunks
    (theirs,) = entries[first].chunks
    entries[name].chunks = [dataclasses.replace(own, **{k: getattr(theirs, k) for k in chunk.pop("like", ())},
                                                **chunk)]
    entries[name].tied_to = first
    return name, first


TIES = {  # each names (the tied tensor, the tensor it claims to repeat)
    "an int16 tied to a float32": lambda e: _tie(e, "i", "f"),
    "same bytes, another dtype": lambda e: _tie(e, "j", "f", like=("file", "start", "end", "checksums")),
    "same bytes, another shape": lambda e: _tie(e, "m", "f", like=("file", "start", "end", "checksums")),
    "same dtype and shape, other bytes": lambda e: _tie(e, "g", "f"),
}


def _tie_state() -> dict:
    return {"f": torch.arange(4.0), "i": torch.arange(4, dtype=torch.int16) * 3, "g": torch.arange(4.0) + 10,
            "j": torch.arange(4, dtype=torch.int32) - 7, "m": torch.ones(2, 2)}


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("case", list(TIES))
def test_a_tie_to_another_tensor_is_refused_on_every_path(tmp_path, case, version, capsys):
    """A manifest that ties a tensor to one it does not repeat (another dtype, shape or
    bytes) made load_state return the other tensor's values under its name, and verify
    say ok. Every path that resolves ties refuses it, naming the manifest and both tensors:
    load_state, load in place, verify, export, DCP's Reader, and the CLI."""
    from safeckpt.cli import main as cli
    from safeckpt.dcp import Reader

    ckpt, good = tmp_path / "ck", tmp_path / "good"
    safeckpt.save(_tie_state(), ckpt)
    safeckpt.save(_tie_state(), good)
    (path,) = ckpt.glob("manifest-*.json")
    m = decode_manifest(path.read_bytes(), str(path))
    entries = editable(m.tensors)
    name, first = TIES[case](entries)
    path.write_bytes(encode_manifest(dataclasses.replace(m, version=version, tensors=entries)))

    def named(text: str) -> bool:
        return path.name in text and repr(name) in text and repr(first) in text

    template = {k: torch.zeros_like(v) for k, v in _tie_state().items()}
    for call in (lambda: safeckpt.load_state(ckpt), lambda: safeckpt.load_state(ckpt, verify=False),
                 lambda: safeckpt.load(template, ckpt), lambda: safeckpt.load(template, ckpt, verify=False),
                 lambda: safeckpt.export_checkpoint(ckpt, tmp_path / "out.safetensors"),
                 lambda: Reader(str(ckpt)).read_metadata()):
        with pytest.raises(safeckpt.CorruptCheckpointError) as info:
            call()
        assert named(str(info.value)), info.value
    assert not (tmp_path / "out.safetensors").exists()
    report = safeckpt.verify(ckpt)
    assert not report.ok and named(report.problems[0]), report.problems
    capsys.readouterr()
    assert cli(["verify", str(ckpt)]) == 1 and named(capsys.readouterr().out)
    for args in (["show", str(ckpt)], ["diff", str(good), str(ckpt)], ["export", str(ckpt), str(tmp_path / "o")]):
        assert cli(args) == 2, args
        assert named(capsys.readouterr().err), args


def test_a_tie_that_repeats_its_tensor_still_loads_as_one_tensor(tmp_path):
    """The check refuses only false ties: real ones (tied embeddings) load as one tensor
    in formats 2 and 3, and verify says ok."""
    emb = torch.randn(5, 3)
    for version in (2, 3):
        ckpt = tmp_path / f"v{version}"
        safeckpt.save({"emb": emb, "head": emb, "b": torch.ones(3)}, ckpt)
        (path,) = ckpt.glob("manifest-*.json")
        m = decode_manifest(path.read_bytes(), str(path))
        assert m.tensors["head"].tied_to == "emb"
        path.write_bytes(encode_manifest(dataclasses.replace(m, version=version, tensors=editable(m.tensors))))
        got = safeckpt.load_state(ckpt)
        assert got["head"] is got["emb"] and torch.equal(got["emb"], emb)
        assert safeckpt.verify(ckpt).ok


# --------------------------------------------------------------------------- fuzzing

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TAGS = ["$dict", "$odict", "$tuple", "$size", "$set", "$frozenset", "$tensor", "$local", "$int", "$float",
        "$complex", "$bytes", "$bytearray", "$dtype", "$device", "$ndarray", "$npscalar", "$pickle", "$what"]
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                  st.text(max_size=6), st.sampled_from(["w", "b", "float32", "AQAAAA==", "<i4", "|O", "cpu",
                                                        "cuda:1", "0x10", "nan", "inf", "qint8"]))
_NAMES = st.sampled_from(["w", "b", "float32", "int8", "cpu", "cuda:1", "meta:-1", "0x10", "nan", "inf",
                          "AQAAAA==", "<i4", "|O", "<f8", "V8", ""])


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    """Tagged nodes shaped nearly like the codec's, so their arguments are what is wrong."""
    seq = st.lists(inner, max_size=4)
    return st.one_of(
        seq, st.dictionaries(st.one_of(st.text(max_size=4), st.sampled_from(TAGS)), inner, max_size=3),
        st.tuples(st.sampled_from(["$set", "$frozenset", "$tuple", "$size", "$local"]), st.one_of(seq, inner)),
        st.tuples(st.sampled_from(["$dict", "$odict"]),
                  st.one_of(st.lists(st.tuples(inner, inner).map(list), max_size=3), seq, inner)),
        st.tuples(st.sampled_from(["$tensor", "$int", "$float", "$bytes", "$bytearray", "$dtype", "$device",
                                   "$pickle", "$what", "$complex"]), st.one_of(_NAMES, inner, seq)),
        st.tuples(st.sampled_from(["$ndarray", "$npscalar"]),
                  st.fixed_dictionaries({"dtype": st.one_of(_NAMES, inner), "data": st.one_of(_NAMES, inner)},
                                        optional={"shape": st.one_of(st.lists(st.integers(-1, 2**64), max_size=3),
                                                                     inner)})),
    ).map(lambda node: {node[0]: node[1]} if isinstance(node, tuple) else node)


_VALUE = st.recursive(st.one_of(_LEAF, _NAMES, st.integers(0, 900).map(_nest)), _containers, max_leaves=12)
_TREE_PLACES = [["tree"], ["tree", "w"], ["tree", "step"], ["tree", "meta"], ["tree", "meta", "ids"],
                ["tree", "meta", "tags"], ["tree", "meta", "pair"], ["tree", "meta", "ids", "$dict", 0, 0],
                ["tree", "meta", "tags", "$set", 0], ["tree", "meta", "pair", "$tuple", 0]]
_PLACES = _TREE_PLACES * 3 + [["metadata"], ["metrics"], ["tensors"], ["tensors", "b"],
           ["tensors", "b", "shape"], ["tensors", "b", "dtype"], ["tensors", "b", "chunks"],
           ["tensors", "w", "tied_to"], ["files"], ["files", 0], ["world_size"], ["step"], ["seq"],
           ["created"], ["block_size"], ["run_id"], ["save_id"]] + [
    ["tensors", "w", "chunks", 0, f] for f in ("file", "start", "end", "offsets", "shape", "checksums")] + [
    ["files", 0, f] for f in ("name", "size", "header_size", "header_checksum", "rank")]
_FUZZ = settings(max_examples=200, deadline=2000, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _outcome(call: Callable[[], Any]) -> None:
    """A committed load or a CheckpointError; nothing else, and little memory."""
    tracemalloc.start()
    try:
        call()
    except safeckpt.CheckpointError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak >> 20} MiB"


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::UserWarning")
@_FUZZ
@given(data=st.data())
def test_fuzzed_manifests_load_or_raise_a_checkpoint_error(ckpt, data):
    path, body = _body(ckpt)
    original = path.read_bytes()
    try:
        for _ in range(data.draw(st.integers(1, 3))):
            place = data.draw(st.sampled_from(_PLACES))
            try:
                _set(place, data.draw(_VALUE))(body)
            except (KeyError, IndexError, TypeError):
                pass  # an earlier change removed the place
        path.write_bytes(frame(json.dumps(body).encode()))
        _outcome(lambda: safeckpt.load_state(ckpt))
        _outcome(lambda: safeckpt.load(_state(), ckpt, strict=False))
        _outcome(lambda: safeckpt.verify(ckpt))
    finally:
        path.write_bytes(original)


@pytest.mark.timeout(60)
@_FUZZ
@given(header=st.dictionaries(st.one_of(st.text(max_size=4), st.just("__metadata__")), _VALUE, max_size=3),
       entry=st.fixed_dictionaries({"dtype": st.one_of(st.sampled_from(["F32", "U8", "BOOL"]), _VALUE),
                                    "shape": st.one_of(st.lists(st.integers(-3, 2**64), max_size=4), _VALUE),
                                    "data_offsets": st.one_of(st.lists(st.integers(-3, 40), max_size=3), _VALUE)}))
def test_fuzzed_safetensors_headers_read_or_raise_a_checkpoint_error(tmp_path, header, entry):
    header["x"] = entry
    src = _safetensors(tmp_path / "f.safetensors", json.dumps(header).encode(), bytes(32))
    _outcome(lambda: read_safetensors(str(src)))


# --------------------------------------------------------------------------- one form per value

def _b64_variants(data: bytes) -> st.SearchStrategy:
    """Base64 of ``data``, and near misses: padding dropped, a last character changed
    (which may set unused bits), whitespace."""
    text = base64.b64encode(data).decode()
    body = text.rstrip("=")
    changed = [body[:-1] + c + text[len(body):] for c in "ABQgw/" if body]
    return st.sampled_from([text, body, text + "\n", *changed])


_INT_TEXT = st.integers(-2**80, 2**80).flatmap(lambda v: st.sampled_from(
    [hex(v), str(v), f"{v:#X}", f"{v:+d}", "0" + str(abs(v)), hex(v).replace("x", "x0"), bin(v), f"{v:_}"]))
_FLOAT_TEXT = st.sampled_from(["inf", "-inf", "nan", "-nan", "NaN", "Infinity", "1.5", "1e999", "+inf", " inf"])
_NP_DTYPES = st.sampled_from(["<i4", "int32", "=i4", ">i4", "|b1", "?", "<U2", "<U0", "|S0", "|S1", "|O", "<f8",
                              "f8", "<M8[ns]", "|V4", "<c8", "|u1", "u1"])
_PART = st.one_of(st.floats(), st.integers(-3, 3), st.builds(lambda t: {"$float": t}, _FLOAT_TEXT))
_TAGGED = st.one_of(
    st.builds(lambda t: {"$int": t}, st.one_of(_INT_TEXT, st.text(max_size=5))),
    st.builds(lambda t: {"$float": t}, st.one_of(_FLOAT_TEXT, st.floats())),
    st.builds(lambda p: {"$complex": p}, st.lists(_PART, min_size=1, max_size=3)),
    st.builds(lambda t: {"$bytes": t}, st.binary(max_size=7).flatmap(_b64_variants)),
    st.builds(lambda t: {"$dtype": t}, st.sampled_from(["int", "long", "half", "float", "double", "cfloat", "float32",
                                                        "bool", "qint8", "bits16", "uint8", "__name__", "Tensor"])),
    st.builds(lambda t: {"$device": t}, st.sampled_from(["cpu", "cpu:0", "cuda", "cuda:0", "cuda:00", "cuda:1", "CUDA",
                                                         "cuda:-1", "meta", "mps:3", "cuda:0 ", "gpu", ""])),
    st.builds(lambda d, n, b, extra: {"$ndarray": {"dtype": d, "shape": n, "data": b, **extra}}, _NP_DTYPES,
              st.lists(st.integers(-1, 3), max_size=3), st.binary(max_size=24).flatmap(_b64_variants),
              st.sampled_from([{}, {"order": "C"}])),
    st.builds(lambda d, b: {"$npscalar": {"dtype": d, "data": b}}, _NP_DTYPES,
              st.binary(max_size=9).flatmap(_b64_variants)),
)
_KEY = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, 1.0, -0.0, 2.5]),
                 st.sampled_from(["a", "$x"]), _TAGGED.filter(lambda n: list(n) != ["$ndarray"]))
_MAPPING = st.builds(lambda tag, keys: {tag: [[k, i] for i, k in enumerate(keys)]},
                     st.sampled_from(["$dict", "$odict", "$set"]),
                     st.lists(st.one_of(_KEY, st.builds(lambda ks: {"$tuple": ks}, st.lists(_KEY, max_size=2))),
                              max_size=4)).map(lambda n: {"$set": [k for k, _ in n["$set"]]} if "$set" in n else n)


def _accepted(node: Any) -> bool:
    try:
        codec.check_tree({"v": node}, "manifest-000001.json", ())
    except safeckpt.CheckpointError as exc:
        assert isinstance(exc, safeckpt.CorruptCheckpointError) and "'v'" in str(exc), exc
        return False
    return True


def _encoded(value: Any) -> str:
    """The JSON the encoder writes for ``value`` (compared as text: ``1 == 1.0`` in Python)."""
    return _text(codec.encode(value, "v", lambda k, t: pytest.fail("no tensors here"), lambda k, v: v, False))


def _text(node: Any) -> str:
    return json.dumps(node, sort_keys=True)


@_FUZZ
@given(node=st.one_of(_TAGGED, _MAPPING))
def test_a_tagged_value_is_accepted_only_in_the_one_form_its_value_is_written_in(node):
    """docs/format.md §7 gives each value one form. Whatever the checker accepts decodes
    to a value the encoder writes back the same way (``$int`` may also be decimal; a set
    in any order), so no reader changes a value silently; the rest is refused, naming
    the manifest and the key."""
    if not _accepted(node):
        return
    value = codec.decode_value(node, "v")
    again = _encoded(value)
    tag = next(iter(node))
    if tag == "$int":
        assert again == _text(node) or str(value) == node[tag], (node, again)
    elif tag in ("$set", "$dict", "$odict"):
        assert len(value) == len(node[tag]), (node, value)  # no two members are one
    else:
        assert again == _text(node), (node, again)


_PLAIN = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(), st.complex_numbers(),
                   st.binary(max_size=6), st.builds(bytearray, st.binary(max_size=3)),
                   st.sampled_from([torch.float32, torch.bfloat16, torch.qint8, torch.bool, torch.device("cpu"),
                                    torch.device("cuda", 1), np.str_(""), np.bytes_(b""), np.str_("ab"),
                                    np.float32("nan"), np.bool_(True), np.datetime64("2020-01-01", "ns")]),
                   st.builds(lambda n, d: np.arange(n).astype(d).reshape(n, 1), st.integers(0, 3),
                             st.sampled_from(["<i4", ">f8", "|u1", "<c8", "?"])))
_HASHABLE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**60, 2**60), st.floats(),
                                   st.text(max_size=3), st.binary(max_size=3)),
                         lambda inner: st.tuples(inner, inner), max_leaves=4)
_PYTHON = st.recursive(_PLAIN, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.builds(tuple, st.lists(inner, max_size=3)),
    st.dictionaries(_HASHABLE, inner, max_size=3),
    st.builds(collections.OrderedDict, st.lists(st.tuples(_HASHABLE, inner), max_size=3)),
    st.sets(_HASHABLE, max_size=3), st.frozensets(_HASHABLE, max_size=3)), max_leaves=10)


@_FUZZ
@given(value=_PYTHON)
def test_every_value_the_encoder_writes_is_accepted_and_comes_back(value):
    """The other half: the checker refuses nothing the encoder writes (an empty
    ``np.str_`` included), and it decodes to a value written the same way again."""
    node = json.loads(_encoded(value))
    codec.check_tree({"v": node}, "manifest-000001.json", ())
    assert _encoded(codec.decode_value(node, "v")) == _text(node)
