"""Checkpoints written by earlier format versions load forever.

tests/golden/ holds checkpoints made by released code (tests/golden/make_golden.py says
how and by which code); each is loaded with ``load_state``, ``load`` into a template and
``verify``, and every value is compared with the one its generator built.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt.format.manifest import decode_manifest

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
import make_golden  # noqa: E402


def assert_same(got, want, key: str = "") -> None:
    """Equal values, types, dtypes and shapes, NaN equal to NaN and -0.0 not equal to 0.0."""
    if isinstance(want, safeckpt.RankLocal):
        assert isinstance(got, safeckpt.RankLocal), key
        return assert_same(got.value, want.value, key)
    assert type(got) is type(want), f"{key}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
    elif isinstance(want, dict):
        assert list(got) == list(want), key
        for k in want:
            assert_same(got[k], want[k], f"{key}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), key
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{key}.{i}")
    elif isinstance(want, float):
        assert (math.isnan(got) and math.isnan(want)) or (got == want and math.copysign(1, got) == math.copysign(1, want)), key
    else:
        assert got == want, key


def blank(value):
    """A template of the same structure: tensors zeroed in new memory (ties kept), other values changed."""
    memo: dict[int, torch.Tensor] = {}

    def walk(v):
        if isinstance(v, torch.Tensor):
            return memo.setdefault(id(v), torch.zeros_like(v))
        if isinstance(v, safeckpt.RankLocal):
            return safeckpt.RankLocal(walk(v.value))
        if isinstance(v, dict):
            return type(v)((k, walk(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        return "changed"
    return walk(value)


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    """A copy, so no test can alter the committed files."""
    shutil.copytree(GOLDEN, tmp_path / "golden", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return tmp_path / "golden"


def version_of(folder: Path) -> int:
    (manifest,) = folder.glob("manifest-*.json")
    return decode_manifest(manifest.read_bytes(), str(manifest)).version


def test_v1_loads_verifies_and_round_trips(golden: Path) -> None:
    path = golden / "v1"
    assert version_of(path) == 1
    want = make_golden.golden_state()
    loaded = safeckpt.load_state(str(path))
    assert_same(loaded, make_golden.expected_loaded(want))
    assert loaded["model"]["head"] is loaded["model"]["weight"]  # tied weights come back tied

    template = blank(want)
    tensors_before = template["model"]["weight"], template["view"]
    safeckpt.load(template, str(path))
    assert_same(template, want)
    assert (template["model"]["weight"], template["view"]) == tensors_before  # filled in place
    assert template["model"]["head"] is template["model"]["weight"]

    report = safeckpt.verify(str(path))
    assert report.ok, report.problems
    assert report.bytes_checked == sum(f.stat().st_size for f in path.glob("data-*"))


def test_v2_incremental_steps_load_and_share(golden: Path) -> None:
    root = golden / "v2"
    for step, want in make_golden.incremental_states():
        path = root / f"step-{step:09d}"
        assert version_of(path) == 2
        assert_same(safeckpt.load_state(str(path)), want)
        template = blank(want)
        safeckpt.load(template, str(path))
        assert_same(template, want)
        assert safeckpt.verify(str(path)).ok
    second = (root / "step-000000002" / "manifest-000001.json").read_text()
    assert "../step-000000001/data-" in second  # it really reads chunks of step 1
    with safeckpt.CheckpointManager(str(root), incremental=True, chunk_size=make_golden.CHUNK_SIZE) as mgr:
        assert mgr.steps() == [1, 2]
        step, want = make_golden.incremental_states()[-1]
        template = blank(want)
        assert mgr.restore(template) == step
        assert_same(template, want)


def test_v2_shared_file_missing_is_a_clear_error(golden: Path) -> None:
    """A version-2 checkpoint whose sibling's data is gone is not committed (its file list says so)."""
    root = golden / "v2"
    for f in (root / "step-000000001").glob("data-*"):
        f.unlink()
    with pytest.raises(safeckpt.CorruptCheckpointError):
        safeckpt.load_state(str(root / "step-000000002"))


def test_v3_plain_and_incremental_load_verify_and_round_trip(golden: Path) -> None:
    """Format 3 (tensor tables): the same state as v1 and the same run as v2."""
    path = golden / "v3" / "plain"
    assert version_of(path) == 3
    want = make_golden.golden_state()
    loaded = safeckpt.load_state(str(path))
    assert_same(loaded, make_golden.expected_loaded(want))
    assert loaded["model"]["head"] is loaded["model"]["weight"]
    template = blank(want)
    safeckpt.load(template, str(path))
    assert_same(template, want)
    assert template["model"]["head"] is template["model"]["weight"]
    assert safeckpt.verify(str(path)).ok
    root = golden / "v3" / "run"
    for step, want in make_golden.incremental_states():
        step_path = root / f"step-{step:09d}"
        assert version_of(step_path) == 3
        assert_same(safeckpt.load_state(str(step_path)), want)
        assert safeckpt.verify(str(step_path)).ok
    second = decode_manifest((root / "step-000000002" / "manifest-000001.json").read_bytes(), "m")
    assert any(name.startswith("../step-000000001/data-") for name in second.files)  # shares step 1's chunks
    with safeckpt.CheckpointManager(str(root), incremental=True, chunk_size=make_golden.CHUNK_SIZE) as mgr:
        step, want = make_golden.incremental_states()[-1]
        template = blank(want)
        assert mgr.restore(template) == step
        assert_same(template, want)


def test_v4_transformed_loads_and_verifies(golden: Path) -> None:
    """Format 4 (a DCP save through ZStandard): verify needs no transform code; the
    values come back through load_state and through DCP's own load."""
    path = golden / "v4"
    assert version_of(path) == 4
    assert safeckpt.verify(str(path)).ok
    pytest.importorskip("zstandard", reason="undoing DCP's ZStandard transform needs zstandard")
    import torch.distributed.checkpoint as dcp

    from safeckpt.dcp import Reader

    want = make_golden.transformed_state()
    assert_same(safeckpt.load_state(str(path)), want)
    template = blank(want)
    template["step"] = 0
    dcp.load(template, storage_reader=Reader(str(path)), no_dist=True)
    assert_same(template, want)
