"""Planning as pure functions: box geometry, byte runs, write assignment, coverage."""

import pytest
import torch

from safeckpt.format.pieces import PieceColumns
from safeckpt.format.plan import PieceInfo, PlanError, assign_writes, byte_runs, check_coverage, overlap


def _piece(name, kind="replicated", offsets=(0,), shape=(4,), global_shape=(4,), nbytes=16):
    return PieceInfo(name, kind, "float32", tuple(global_shape), tuple(offsets), tuple(shape), nbytes)


def _assign(per_rank: list[list[PieceInfo]]) -> list[list[PieceInfo]]:
    """``assign_writes`` on the ranks' columns: what each rank writes, in order."""
    plan = assign_writes([PieceColumns.of(pieces) for pieces in per_rank])
    return [[plan.pieces.info(j) for j in plan.rows[plan.at[r]:plan.at[r + 1]].tolist()]
            for r in range(len(per_rank))]


def test_overlap_of_boxes():
    assert overlap(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert overlap(((0, 0), (2, 2)), ((2, 0), (2, 2))) is None


@pytest.mark.parametrize("shape,sub", [
    ((6, 5), ((1, 0), (3, 5))),      # full rows: one run
    ((6, 5), ((1, 2), (3, 2))),      # a column block: a run per row
    ((3, 4, 5), ((1, 1, 0), (2, 2, 5))),
    ((7,), ((2,), (3,))),
    ((), ((), ())),
])
def test_byte_runs_read_exactly_the_sub_box(shape, sub):
    t = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32).reshape(shape)
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    got = b"".join(raw[a:a + n] for a, n in byte_runs(shape, sub, 4))
    offsets, sub_shape = sub
    expect = t[tuple(slice(o, o + s) for o, s in zip(offsets, sub_shape))].contiguous()
    assert got == expect.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_replicated_pieces_are_written_once_and_balanced_by_bytes():
    pieces = [_piece(f"t{i}", nbytes=n) for i, n in enumerate([100, 90, 50, 40, 10, 10])]
    out = _assign([list(pieces) for _ in range(3)])
    written = sorted(p.name for rank in out for p in rank)
    assert written == sorted(p.name for p in pieces)
    loads = [sum(p.nbytes for p in rank) for rank in out]
    assert max(loads) - min(loads) <= 50


def test_a_shard_is_written_by_its_holder_and_duplicates_once():
    a = _piece("w", "shard", (0,), (2,))
    b = _piece("w", "shard", (2,), (2,))
    out = _assign([[a], [b], [b]])  # ranks 1 and 2 hold the same box (Replicate)
    assert out[0] == [a] and len(out[1]) + len(out[2]) == 1


def test_inconsistent_pieces_and_missing_replicas_are_plan_errors():
    with pytest.raises(PlanError, match="rank 1"):
        _assign([[_piece("w")], [_piece("w", global_shape=(5,), shape=(5,))]])
    with pytest.raises(PlanError, match="missing on rank"):
        _assign([[_piece("w")], []])


@pytest.mark.parametrize("boxes", [
    [((0, 0), (2, 4)), ((2, 0), (2, 4))],                      # rows
    [((0, 0), (4, 1)), ((0, 1), (4, 3))],                      # uneven columns
    [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 4))],    # mixed
])
def test_tilings_are_accepted(boxes):
    check_coverage("w", (4, 4), boxes)


@pytest.mark.parametrize("boxes,problem", [
    ([((0, 0), (2, 4))], "cover"),                             # a gap
    ([((0, 0), (3, 4)), ((2, 0), (2, 4))], "cover"),           # too much
    ([((0, 0), (2, 4)), ((0, 0), (2, 4))], "overlap"),         # twice the same rows
])
def test_gaps_and_overlaps_are_refused(boxes, problem):
    with pytest.raises(PlanError):
        check_coverage("w", (4, 4), boxes)


def test_an_overlap_far_apart_balanced_by_a_gap_is_found():
    """Many pieces (more than a pairwise check could afford): one box is moved onto
    another far away in sort order, leaving a gap of the same size."""
    boxes = [((i, 0), (1, 8)) for i in range(71)]
    boxes[60] = ((2, 0), (1, 8))  # duplicates row 2, row 60 is missing: volumes still add up
    with pytest.raises(PlanError, match="overlap"):
        check_coverage("w", (71, 8), boxes)
    grid = [((r, c), (2, 2)) for r in range(0, 20, 2) for c in range(0, 20, 2)]
    check_coverage("w", (20, 20), grid)  # a 10 x 10 grid of blocks tiles exactly


def test_rank_local_values_cannot_nest(tmp_path):
    import safeckpt
    with pytest.raises(safeckpt.UnsafeObjectError, match="nested"):
        safeckpt.save({"a": safeckpt.RankLocal({"b": safeckpt.RankLocal(1)})}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def _batch(tensors: list[list[tuple[tuple[int, ...], tuple[int, ...]]]]):
    """(tensor index, offsets, extents) arrays of boxes given per tensor."""
    import numpy as np
    rows = [(i, o, s) for i, boxes in enumerate(tensors) for o, s in boxes]
    return (np.asarray([i for i, _, _ in rows], dtype=np.int64), np.asarray([o for _, o, _ in rows], dtype=np.int64),
            np.asarray([s for _, _, s in rows], dtype=np.int64))


def test_check_tilings_decides_many_tensors_at_once():
    """Grids of every tensor in one batch; a non-grid tiling passes through the corner-sum
    check; an overlap, a gap or a box outside names its tensor."""
    from safeckpt.format.plan import check_tilings, grid_tensors
    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    rows = [((r, 0), (1, 6)) for r in range(4)]
    pinwheel = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))]
    t, o, s = _batch([grid, rows, pinwheel])
    assert grid_tensors(t, o, s, 3).tolist() == [True, True, False]
    check_tilings(["g", "r", "p"], [(4, 6), (4, 6), (3, 3)], t, o, s)
    shifted = grid[:3] + [((2, 2), (2, 3))]  # one cell moved left: overlap and a gap, volumes add up
    t, o, s = _batch([grid, shifted])
    with pytest.raises(PlanError, match="'bad'.*overlap"):
        check_tilings(["ok", "bad"], [(4, 6), (4, 6)], t, o, s)
    t, o, s = _batch([rows[:3]])
    with pytest.raises(PlanError, match="cover 18 of 24"):
        check_tilings(["gap"], [(4, 6)], t, o, s)
    t, o, s = _batch([rows[:3] + [((3, 1), (1, 6))]])
    with pytest.raises(PlanError, match="outside"):
        check_tilings(["out"], [(4, 6)], t, o, s)
    t, o, s = _batch([[((0, 0), (2, 6)), ((0, 0), (2, 6)), ((2, 0), (0, 6))]])  # the same box twice
    with pytest.raises(PlanError):
        check_tilings(["twice"], [(4, 6)], t, o, s)


# -- the planner over columns (what rank 0 receives) ---------------------------------------


def _reference_assign(per_rank: list[list[PieceInfo]]) -> list[list[PieceInfo]]:
    """The writer rule, one piece at a time, as a test oracle for the vectorized planner:
    rank-local pieces by their owner; a box one rank holds by that rank; boxes several
    ranks hold largest first (then by name, offsets, shape) onto the least-loaded holder,
    the lowest rank on a tie. Each rank: local pieces, own boxes, then given boxes."""
    out: list[list[PieceInfo]] = [[] for _ in per_rank]
    load = [0] * len(per_rank)
    holders: dict[tuple, list] = {}
    for rank, pieces in enumerate(per_rank):
        for p in pieces:
            if p.kind == "local":
                out[rank].append(p)
                load[rank] += p.nbytes
            else:
                holders.setdefault((p.name, p.offsets, p.shape), [p]).append(rank)
    shared = []
    for key, (p, *ranks) in holders.items():
        if len(ranks) == 1:
            out[ranks[0]].append(p)
            load[ranks[0]] += p.nbytes
        else:
            shared.append(key)
    for key in sorted(shared, key=lambda k: (-holders[k][0].nbytes, k)):
        p, *ranks = holders[key]
        rank = min(ranks, key=lambda r: (load[r], r))
        out[rank].append(p)
        load[rank] += p.nbytes
    return out


def _random_job(seed: int) -> list[list[PieceInfo]]:
    """Valid layouts of every kind: replicated, row-sharded with replicas (HSDP), rank-
    local, 0-d and empty tensors, ranks holding nothing, pieces in any order."""
    import random
    rng = random.Random(seed)
    world = rng.choice([2, 3, 5, 8])
    per_rank: list[list[PieceInfo]] = [[] for _ in range(world)]
    for t in range(rng.randint(0, 10)):
        kind = rng.choice(["replicated", "shard", "local"])
        ndim = rng.choice([0, 1, 2, 3]) if kind != "shard" else rng.choice([1, 2, 3])
        dtype = rng.choice(["float32", "bfloat16"])
        if kind == "replicated":
            shape = tuple(rng.randint(0, 4) for _ in range(ndim))
            nbytes = rng.choice([0, 8, 8, 64])  # ties: the lowest rank wins
            for pieces in per_rank:
                pieces.append(PieceInfo(f"r{t}", kind, dtype, shape, (0,) * ndim, shape, nbytes))
        elif kind == "local":
            for rank, pieces in enumerate(per_rank):
                if rng.random() < 0.6:
                    shape = tuple(rng.randint(0, 4) for _ in range(ndim))
                    pieces.append(PieceInfo(f"l{t}@{rank}", kind, dtype, shape, (0,) * ndim, shape, 4))
        else:
            parts = rng.randint(1, world)
            rest = tuple(rng.randint(1, 3) for _ in range(ndim - 1))
            shape = (2 * parts,) + rest
            for i in range(parts):
                box = (2,) + rest
                holders = rng.sample(range(world), rng.randint(1, world // parts or 1))
                for rank in holders:
                    if all(p.name != f"s{t}" for p in per_rank[rank]):
                        per_rank[rank].append(PieceInfo(f"s{t}", kind, dtype, shape, (2 * i,) + (0,) * (ndim - 1),
                                                        box, 8 * (i % 3)))
    if rng.random() < 0.3:
        per_rank[rng.randrange(world)] = [p for p in per_rank[0] if p.kind == "local"]  # a rank with (almost) nothing
        per_rank = [[p for p in pieces if p.kind != "replicated"] for pieces in per_rank]
    for pieces in per_rank:
        rng.shuffle(pieces)
    return per_rank


@pytest.mark.parametrize("seed", range(60))
def test_the_vectorized_planner_follows_the_writer_rule(seed):
    per_rank = _random_job(seed)
    assert _assign(per_rank) == _reference_assign(per_rank)


def test_edge_layouts_are_planned_exactly():
    """0-d and empty tensors, a tensor only one rank holds, replicated and sharded
    tensors together, a rank with no pieces, pieces of different ranks (numbers of
    dimensions) on one rank."""
    scalar = PieceInfo("scalar", "replicated", "int64", (), (), (), 8)
    empty = PieceInfo("empty", "replicated", "float32", (0, 5), (0, 0), (0, 5), 0)
    lone = PieceInfo("lone", "shard", "float32", (3,), (0,), (3,), 12)
    halves = [PieceInfo("w", "shard", "float32", (4, 2, 2), (2 * r, 0, 0), (2, 2, 2), 32) for r in range(2)]
    per_rank = [[scalar, empty, halves[0], lone], [halves[1], scalar, empty], []]
    with pytest.raises(PlanError, match=r"'scalar'.*missing on rank\(s\) \[2\]"):
        _assign(per_rank)
    per_rank[2] = [empty, scalar]
    out = _assign(per_rank)
    assert out == _reference_assign(per_rank)
    assert out[0][:2] == [halves[0], lone] and out[1][0] == halves[1]  # own boxes before given ones
    assert sorted(p.name for rank in out for p in rank) == ["empty", "lone", "scalar", "w", "w"]
    assert _assign([[]]) == [[]] and _assign([[], []]) == [[], []]
    assert _assign([[scalar, lone]]) == [[scalar, lone]]  # one process writes what it holds


def test_ranks_that_disagree_are_named():
    a = PieceInfo("w", "shard", "float32", (4, 4), (0, 0), (2, 4), 32)
    b = a._replace(offsets=(2, 0))
    with pytest.raises(PlanError, match=r"'w': rank 2 has shard bfloat16 \[4, 4\], another rank shard float32"):
        _assign([[a], [b], [b._replace(dtype="bfloat16")]])
    with pytest.raises(PlanError, match=r"'w': rank 1 has shard float32 \[4, 4, 1\]"):
        _assign([[a], [b._replace(global_shape=(4, 4, 1), offsets=(2, 0, 0), shape=(2, 4, 1))]])
    with pytest.raises(PlanError, match=r"'w': rank 1 has replicated"):
        _assign([[a], [a._replace(kind="replicated")]])


def test_shards_that_do_not_tile_are_refused_after_planning():
    from safeckpt.format.plan import check_shards
    row = [PieceInfo("w", "shard", "float32", (4, 3), (r, 0), (1, 3), 12) for r in range(4)]
    check_shards(assign_writes([PieceColumns.of([p]) for p in row]))
    gap = assign_writes([PieceColumns.of([p]) for p in row[:3]])
    with pytest.raises(PlanError, match="'w': the pieces cover 9 of 12"):
        check_shards(gap)
    twice = assign_writes([PieceColumns.of([p]) for p in row[:3] + [row[2]._replace(offsets=(1, 0))]])
    with pytest.raises(PlanError, match="'w': the pieces cover 9 of 12"):  # the same box twice is written once
        check_shards(twice)
    moved = assign_writes([PieceColumns.of([p]) for p in row[:3] + [row[3]._replace(offsets=(4, 0))]])
    with pytest.raises(PlanError, match="outside"):
        check_shards(moved)
    scalar = PieceInfo("s", "shard", "float32", (), (), (), 4)  # a 0-d shard is the whole tensor
    check_shards(assign_writes([PieceColumns.of([scalar]), PieceColumns.of([scalar])]))


def test_piece_columns_give_back_their_pieces():
    pieces = [PieceInfo("a", "replicated", "float32", (), (), (), 4),
              PieceInfo("b", "shard", "bfloat16", (4, 6, 2), (2, 0, 0), (2, 6, 2), 48),
              PieceInfo("c@1", "local", "int8", (0,), (0,), (0,), 0)]
    cols = PieceColumns.of(pieces)
    assert cols.infos() == pieces and cols.offsets.shape == (3, 3)
    assert PieceColumns.of([]).infos() == []


def test_rank_0_builds_the_table_from_the_reports_the_ranks_send():
    """Each rank sends its written pieces as columns (``Report.compact``); rank 0 puts the
    plan's boxes and the reports' bytes together, and refuses a report that does not
    match what the rank was given."""
    from safeckpt.errors import SaveAbortedError
    from safeckpt.format.compact import TableBuilder
    from safeckpt.format.manifest import FileEntry
    from safeckpt.protocol.commit import Report, SaveRun
    from safeckpt.protocol.datafile import WrittenPiece
    halves = [PieceInfo("w", "shard", "float32", (4, 2), (2 * r, 0), (2, 2), 16) for r in range(2)]
    scalar = PieceInfo("s", "replicated", "int64", (), (), (), 8)
    plan = assign_writes([PieceColumns.of([halves[0], scalar]), PieceColumns.of([scalar, halves[1]]),
                          PieceColumns.of([scalar])])
    assert [plan.names(r) for r in range(3)] == [["w"], ["w"], ["s"]]  # the replicated one: the least loaded
    digest = "xxh3_64:" + "ab" * 8
    reports = [Report(FileEntry("f0", 80, 0, 64, digest), [WrittenPiece("w", 64, 80, [digest])]).compact(),
               Report(FileEntry("f1", 80, 1, 64, digest), [WrittenPiece("w", 64, 80, [digest])]).compact(),
               Report(FileEntry("f2", 72, 2, 64, digest), [WrittenPiece("s", 64, 72, [digest])]).compact()]
    table = TableBuilder()
    SaveRun._add_pieces(plan, reports, table)
    built = table.build(["f0", "f1", "f2"], 1 << 24)
    assert [(c.file, c.start, c.offsets) for c in built["w"].chunks] == [("f0", 64, [0, 0]), ("f1", 64, [2, 0])]
    assert built["s"].chunks[0].file == "f2" and built["s"].chunks[0].shape == []
    assert built["s"].chunks[0].checksums == [digest]
    reports[1] = Report(FileEntry("f1", 64, 1, 64, digest), []).compact()
    with pytest.raises(SaveAbortedError, match="rank 1 reported other pieces than the 1"):
        SaveRun._add_pieces(plan, reports, TableBuilder())


def test_the_grid_check_decides_alike_in_any_row_order():
    """Rows in tensor order (a decoded table) skip the sort; any other order sorts."""
    import numpy as np
    from safeckpt.format.plan import grid_tensors
    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    rows = [((r, 0), (1, 6)) for r in range(4)]
    pinwheel = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))]
    shifted = grid[:3] + [((2, 2), (2, 3))]
    t, o, s = _batch([grid, rows, pinwheel, shifted, [((0, 0), (0, 6))]])
    assert grid_tensors(t, o, s, 5).tolist() == [True, True, False, False, True]
    rng = np.random.default_rng(5)
    for _ in range(20):
        perm = rng.permutation(len(t))
        assert grid_tensors(t[perm], o[perm], s[perm], 5).tolist() == [True, True, False, False, True]


def test_empty_tensors_are_tiled_by_any_boxes_inside_them():
    # DCP writes one empty chunk for an empty tensor; a sharded one has empty boxes on each rank
    for shape, boxes in [((0,), [((0,), (0,))]), ((0, 3), [((0, 0), (0, 3))]), ((2, 0, 4), [((0, 0, 0), (2, 0, 4))]),
                         ((4, 0), [((0, 0), (2, 0)), ((2, 0), (2, 0))]), ((3,), [((0,), (3,)), ((3,), (0,))])]:
        check_coverage("t", shape, boxes)
    with pytest.raises(PlanError, match="only piece"):  # a manifest's single chunk is the whole tensor
        check_coverage("t", (4, 0), [((0, 0), (2, 0))])
    with pytest.raises(PlanError, match="outside"):
        check_coverage("t", (0, 3), [((1, 0), (0, 3)), ((0, 0), (0, 3))])
