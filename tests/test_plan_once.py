"""Plan once: a save whose layout equals the job's previous save reuses its plan
(``protocol/plancache.py``), on real gloo ranks.

Four ranks save the same layout again and again through a manager: rank 0 plans
(``assign_writes``) once, later saves only compare the ranks' plan ids. Then the layout
changes on ONE rank only (its rank-local tensor grows): every rank plans again, together,
and the checkpoint is right. A plain value that differs on one rank and a replicated
tensor resized on one rank make every rank fall back, and the full planning refuses the
save, naming the key and the rank. Plain ``save`` calls into another folder root plan
again. Every committed checkpoint is loaded back and compared. The table a kept plan
refills is checked against a fresh build, ties and all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.format.compact import Checksums, ChunkColumns, TableBuilder  # noqa: E402
from safeckpt.protocol.plancache import fill_locals, split_locals, tree_digest  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def plan_once(tmp_path_factory):
    import share_dist_worker as sw

    root = tmp_path_factory.mktemp("plans")
    server = sw.ShareForkServer(SRC)
    try:
        run = server.launch(4, ["plan_once"], root, root / "out", timeout=150,
                            env={"SAFECKPT_TIMEOUT": "30", "DIST_WORKER_STEP_TIMEOUT": "60"})
    finally:
        server.close()
    return run.results("plan_once")


def committed(res: list[dict], where: str, key: str) -> None:
    for r, d in enumerate(res):
        got = d[where][key]
        assert not got["raised"], f"rank {r}, {where} {key}: {got['raised']}: {got['message']}"
        assert got["problems"] == [], f"rank {r}, {where} {key}: loaded wrong: {got['problems']}"


def test_an_unchanged_layout_is_planned_once(plan_once):
    for step in ("1", "2", "3"):
        committed(plan_once, "saves", step)
    # [planned, reused, assign_writes calls on this rank]: rank 0 planned the first save only
    assert [d["saves"]["3"]["plans"] for d in plan_once] == [[1, 2, 1], [1, 2, 0], [1, 2, 0], [1, 2, 0]]


def test_a_layout_changed_on_one_rank_makes_every_rank_plan_again(plan_once):
    committed(plan_once, "saves", "4")
    committed(plan_once, "saves", "5")
    assert [d["saves"]["4"]["plans"][:2] for d in plan_once] == [[2, 2]] * 4, "step 4: rank 2's tensor grew"
    assert [d["saves"]["5"]["plans"][:2] for d in plan_once] == [[2, 3]] * 4, "step 5 reuses step 4's plan"
    assert plan_once[0]["saves"]["5"]["plans"][2] == 2


def test_a_value_or_shape_differing_on_one_rank_falls_back_and_is_refused(plan_once):
    for r, d in enumerate(plan_once):
        differ, resize = d["saves"]["6"], d["saves"]["7"]
        assert differ["raised"] == "SaveAbortedError" and "'opt.lr'" in differ["message"] \
            and "rank(s) [1]" in differ["message"], (r, differ)
        assert resize["raised"] == "SaveAbortedError" and "'w'" in resize["message"] \
            and "rank 3" in resize["message"], (r, resize)
        assert differ["plans"][:2] == [3, 3] and resize["plans"][:2] == [4, 3], (r, differ["plans"], resize["plans"])
    committed(plan_once, "saves", "8")
    assert [d["saves"]["8"]["plans"][:2] for d in plan_once] == [[4, 4]] * 4, "the kept plan of step 4 again"


def test_plain_saves_reuse_within_one_folder_root(plan_once):
    for name in ("p1/a", "p1/b", "p2/c"):
        committed(plan_once, "plain", name)
    counts = [[d["plain"][n]["plans"] for n in ("p1/a", "p1/b", "p2/c")] for d in plan_once]
    for r, (a, b, c) in enumerate(counts):
        assert b == [a[0], a[1] + 1] and c == [b[0] + 1, b[1]], (r, counts[r])


# --------------------------------------------------------------------------- pure parts


def test_rank_local_values_travel_apart_from_the_tree():
    tree = {"a": {"$local": {"x": 1}}, "b": [1, {"$local": [2]}], "c": {"$tensor": "c"}}
    blank, values = split_locals(tree)
    assert values == [{"x": 1}, [2]] and blank["a"] == {"$local": None}
    merged = fill_locals(blank, [values, [{"x": 5}, [6]]])
    assert merged == {"a": {"$local": [{"x": 1}, {"x": 5}]}, "b": [1, {"$local": [[2], [6]]}],
                      "c": {"$tensor": "c"}}
    assert tree_digest(blank) == tree_digest(split_locals({**tree, "a": {"$local": 9}})[0])
    assert tree_digest(blank) != tree_digest({**blank, "c": 3})


def _columns(files: list[str], file: list[int], tensor: list[int], start: list[int], sums: list[str]) -> ChunkColumns:
    n = len(file)
    a = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return ChunkColumns(files, a(file), a(tensor), a(start), a(start) + 8, Checksums.parse([[s] for s in sums]),
                        a([1] * n), a([0] * n), a([2] * n))


def test_a_refilled_table_equals_a_fresh_build():
    """Chunks added out of tensor order, with a tie: the kept table refilled with a new
    save's byte ranges and checksums encodes exactly as a table built from scratch."""
    def build(start: list[int], sums: list[str]):
        b = TableBuilder()
        for name in ("x", "y", "z"):
            b.tensor(name, "float32", (2,))
        b.add(_columns(["f0", "f1"], [0, 1, 0, 1], [2, 0, 1, 0], start, sums))
        b.alias("t", "y")
        return b, b.build(["f0", "f1"], 1 << 24)

    first_sums = [f"xxh3_64:{i:016x}" for i in range(4)]
    builder, kept = build([0, 0, 8, 8], first_sums)
    start, sums = [16, 24, 32, 40], [f"xxh3_64:{i + 100:016x}" for i in range(4)]
    _, fresh = build(start, sums)
    rows = builder.source
    new = Checksums.parse([[s] for s in sums])
    refilled = kept.refill(["f0", "f1"], np.asarray(start)[rows], np.full(len(rows), 8), new.take(rows))
    assert refilled.encode() == fresh.encode()
    assert kept.encode() != fresh.encode()


def test_the_table_is_written_as_json_writes_its_stored_form():
    """The manifest's table goes in as parts, unscanned: byte for byte what json.dumps
    of its stored form writes (names that need escaping included)."""
    import json

    _, table = _build_table('a"\\é\u2028')
    joined = b"".join(table.encode_parts())
    assert joined == json.dumps(table.encode(), separators=(",", ":")).encode()


def _build_table(name: str):
    b = TableBuilder()
    b.tensor(name, "float32", (2,))
    b.add(_columns(["f0"], [0], [0], [0], ["xxh3_64:00000000000000ff"]))
    return b, b.build(["f0"], 1 << 24)
