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
