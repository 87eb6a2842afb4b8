"""safeckpt underneath torch.distributed.checkpoint: ``safeckpt.dcp.Writer`` / ``Reader``.

Multi-rank behaviour runs on real gloo ranks (tests/helpers/dcp_worker.py, launched
through a fork server as in test_distributed.py): FSDP2 saved on 2 ranks and loaded
on 1, 2 and 3, a 2-D mesh, repeated saves into one folder, a rank failing in
``write_data``, ``dcp.async_save``, and a SIGKILL during a re-save into the same
folder, once with DCP's ``FileSystemWriter`` (which loses the old checkpoint) and once
with the Writer (which keeps it). Single-process behaviour (formats, tools, what is
refused) runs here, in this process.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as stock_dcp_to_torch_save  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: E402

import safeckpt  # noqa: E402
import safeckpt.dcp  # noqa: E402
from safeckpt.cli import main as cli  # noqa: E402
from safeckpt.format.manifest import WRITE_VERSION, decode_manifest  # noqa: E402
import dist_worker as dw  # noqa: E402  (tests/helpers is on sys.path via conftest.py)
import dcp_worker as cw  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
RUN_ENV = {"SAFECKPT_TIMEOUT": "30", "DIST_WORKER_STEP_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    server = cw.DcpForkServer(SRC)
    tmp = tmp_path_factory.mktemp("launches")
    count = [0]

    def run(world: int, scenarios: list[str], root: Path, timeout: float = 150.0) -> dw.Launch:
        count[0] += 1
        return server.launch(world, scenarios, root, tmp / f"launch{count[0]}-{world}ranks",
                             timeout=timeout, env=RUN_ENV)
    yield run
    server.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="module")
def two(launch, root) -> dw.Launch:
    return launch(2, ["dcp_fsdp_save", "dcp_resave", "dcp_raise", "dcp_async", "dcp_empty", "dcp_transformed",
                      "dcp_sharded_tensor"], root)


def no_problems(results: list[dict], what: str) -> None:
    bad = [f"rank {r}: {d['problems']}" for r, d in enumerate(results) if d["problems"]]
    assert not bad, f"{what}:\n  " + "\n  ".join(bad)


def kill_target(version: int = 0) -> dict:
    return {name: cw.kill_full(name, 0) * 0 - 1 for name in cw.KILL_SHAPES}


# --------------------------------------------------------------------------- many ranks


def test_fsdp2_saved_on_2_ranks_loads_back_bit_exactly(two):
    results = two.results("dcp_fsdp_save")
    no_problems(results, "FSDP2 model + optimizer + values through dcp.save/load with safeckpt.dcp")
    assert results[0]["placements"] == ["(Shard(dim=0),)"]


@pytest.mark.parametrize("world", [1, 3])
def test_fsdp2_saved_on_2_ranks_loads_on_another_world_size(launch, root, two, world):
    two.results("dcp_fsdp_save")
    no_problems(launch(world, ["dcp_fsdp_load"], root).results("dcp_fsdp_load"), f"FSDP2 loaded on {world} ranks")


def test_fsdp2_checkpoint_is_an_ordinary_safeckpt_checkpoint(two, root):
    two.results("dcp_fsdp_save")
    path = root / "fsdp"
    assert safeckpt.verify(str(path)).ok
    names = sorted(p.name for p in path.iterdir())
    assert len([n for n in names if n.startswith("manifest-")]) == 1
    assert len([n for n in names if n.startswith("data-")]) == 2  # one file per rank
    state = safeckpt.load_state(str(path))
    expected = torch.load(root / "fsdp_expected.pt", weights_only=True)
    assert dw.compare(state["model"], expected["model"]) == []
    assert state["epoch"] == 3 and state["train"] == b"loader-position:1"  # a BytesIO's bytes
    assert state["info"] == {"name": "run-1", "betas": (0.9, 0.999), "none": None}
    # DCP's Metadata, rebuilt from the manifest, says what DCP's own pickled one says
    ours = safeckpt.dcp.Reader(str(path)).read_metadata()
    stock = dcp.FileSystemReader(str(root / "fsdp_stock")).read_metadata()
    assert ours.planner_data == stock.planner_data
    assert ours.state_dict_metadata.keys() == stock.state_dict_metadata.keys()
    for fqn, md in stock.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(md), fqn
        if hasattr(md, "chunks"):
            assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), fqn
            assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks) == \
                sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks), fqn
    # the same state as DCP's own FileSystemWriter wrote, converted by each tool
    ours, stock = root / "ours.pt", root / "stock.pt"
    safeckpt.dcp.dcp_to_torch_save(str(path), ours)
    stock_dcp_to_torch_save(str(root / "fsdp_stock"), stock)
    a, b = torch.load(ours, weights_only=False), torch.load(stock, weights_only=False)
    a_train, b_train = a.pop("train"), b.pop("train")
    assert a_train.getvalue() == b_train.getvalue()
    assert dw.compare(a, b) == []


def test_repeated_saves_into_one_folder(two):
    for r, data in enumerate(two.results("dcp_resave")):
        ids = set()
        for version, save in enumerate(data["saves"], start=1):
            assert not save["problems"], f"rank {r}, save {version}: {save['problems']}"
            manifests = [n for n in save["files"] if n.startswith("manifest-")]
            datafiles = [n for n in save["files"] if n.startswith("data-")]
            assert manifests == [f"manifest-{version:06d}.json"], save["files"]
            assert len(datafiles) == 2 and len({n.split("-")[1] for n in datafiles}) == 1, save["files"]
            ids.add(datafiles[0].split("-")[1])
        assert len(ids) == 3  # every save wrote new files; the replaced ones are gone


def test_a_rank_failing_in_write_data_aborts_every_rank(two, root):
    results = two.results("dcp_raise")
    for r, data in enumerate(results):
        assert data["raised"] == "CheckpointException", f"rank {r}: {data}"
        assert list(data["failures"]) == ["1"], f"rank {r}: {data['failures']}"
        failure = data["failures"]["1"]
        assert failure["type"] == "StorageError" and failure["message"].startswith("rank 1: "), failure
        assert "the disk is full" in failure["message"] and "nothing was committed" in failure["message"]
        assert not data["problems"], f"rank {r}: the first save no longer loads: {data['problems']}"
    before, after = results[0]["before"], results[0]["after"]
    assert [n for n in after if n.startswith("manifest-")] == [n for n in before if n.startswith("manifest-")]
    assert set(before) <= set(after)
    leftovers = sorted(set(after) - set(before))
    assert all(n.startswith("data-") and n.endswith("-r00000.safetensors") for n in leftovers), leftovers
    # what the failed save left (rank 0's file; rank 1 removed its own) is garbage for gc
    assert cli(["gc", str(root / "step-000000001"), "--min-age", "0"]) == 0
    assert sorted(p.name for p in (root / "step-000000001").iterdir()) == sorted(before)
    assert safeckpt.verify(str(root / "step-000000001")).ok


def test_async_save(two):
    no_problems(two.results("dcp_async"), "dcp.async_save with safeckpt.dcp.Writer")


def test_dtensor_on_a_2d_mesh(launch, root):
    done = launch(4, ["dcp_2d", "dcp_reshard"], root)
    no_problems(done.results("dcp_2d"), "DTensor on a 2x2 mesh")
    no_problems(done.results("dcp_reshard"), "a 2-D DTensor saved with each placement, loaded with every other")
    (name,) = [p for p in (root / "dt2").iterdir() if p.name.startswith("manifest-")]
    manifest = decode_manifest(name.read_bytes(), str(name))
    assert manifest.version == WRITE_VERSION  # DCP saves write the compact tables too
    assert len(manifest.tensors["bias"].chunks) == 1  # replicated: written once
    assert len(manifest.tensors["d"].chunks) == 2     # Shard(0) x Replicate: two distinct boxes
    assert len(manifest.tensors["g"].chunks) == 4
    state = safeckpt.load_state(str(root / "dt2"))
    assert dw.compare(state, {"d": dw.dt_full("d"), "g": dw.dt_full("g"), "bias": dw.BIAS()}) == []


def _manifest(path: Path) -> dict:
    (name,) = [p for p in path.iterdir() if p.name.startswith("manifest-")]
    return json.loads(name.read_bytes())["safeckpt"]


def _killed(launch, root: Path, which: str) -> Path:
    done = launch(2, [f"dcp_kill_{which}"], root, timeout=60)
    assert all(st["signal"] == 9 for st in done.status), done.describe()
    assert all((done.out / f"first-save-done-rank{r}").exists() for r in range(2)), done.describe()
    return root / f"killed_{which}"


def test_sigkill_during_a_resave_loses_the_checkpoint_with_filesystemwriter(launch, root):
    path = _killed(launch, root, "stock")
    target = kill_target()
    try:
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)))
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        assert isinstance(exc, CheckpointException), exc
        return  # the old checkpoint is gone (a half-written data file under the old .metadata)
    mixed = [n for n in cw.KILL_SHAPES if not torch.equal(target[n], cw.kill_full(n, 1))]
    assert mixed, "FileSystemWriter kept the old checkpoint intact: the kill came too late to show the loss"


def test_sigkill_during_a_resave_keeps_the_checkpoint_with_the_writer(launch, root):
    path = _killed(launch, root, "safe")
    target = kill_target()
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(path)))
    assert dw.compare(target, {n: cw.kill_full(n, 1) for n in cw.KILL_SHAPES}) == []
    assert safeckpt.verify(str(path)).ok
    data = sorted(p.name for p in path.iterdir() if p.name.startswith("data-"))
    assert len({n.split("-")[1] for n in data}) == 2  # the old save's files and the killed one's
    assert cli(["gc", str(path), "--min-age", "0"]) == 0
    assert len({p.name.split("-")[1] for p in path.iterdir() if p.name.startswith("data-")}) == 1
    target = kill_target()
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(path)))
    assert dw.compare(target, {n: cw.kill_full(n, 1) for n in cw.KILL_SHAPES}) == []


# --------------------------------------------------------------------------- trainer drop-ins


@pytest.fixture(scope="module")
def accel(launch, root) -> dw.Launch:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    return launch(2, ["dcp_accel_save", "dcp_trainer_save", "dcp_trainer_load"], root)


def test_accelerate_saves_fsdp_models_sharded_and_resumes(accel):
    for r, data in enumerate(accel.results("dcp_accel_save")):
        for kind, res in data.items():
            assert res["restored"] == 2 and res["step"] == 2, (r, kind, res)
            assert not res["problems"], f"rank {r}, {kind}: {res['problems']}"
            assert len([f for f in res["files"] if f.startswith("data-")]) == 2, res["files"]  # each rank its shards


@pytest.mark.parametrize("world", [1, 3])
def test_fsdp_checkpoints_of_accelerate_and_the_trainer_load_on_another_world_size(launch, root, accel, world):
    accel.results("dcp_accel_save")
    accel.results("dcp_trainer_save")
    loaded = launch(world, ["dcp_accel_load", "dcp_trainer_load"], root)
    for r, data in enumerate(loaded.results("dcp_accel_load")):
        for kind, res in data.items():
            assert res["restored"] == 2 and not res["problems"], (r, kind, res)
    no_problems(loaded.results("dcp_trainer_load"), f"SafeTrainer FSDP2 checkpoint loaded on {world} ranks")


def test_trainer_saves_fsdp_models_sharded_and_sealed_with_its_files(accel, root):
    files = accel.results("dcp_trainer_save")[0]["files"]
    assert "trainer_state.json" in files and len([f for f in files if f.startswith("data-")]) == 2, files
    assert safeckpt.verify(str(root / "trainer" / "checkpoint-2")).ok
    no_problems(accel.results("dcp_trainer_load"), "SafeTrainer FSDP2 checkpoint loaded on the same 2 ranks")


# --------------------------------------------------------------------------- one process


def _state() -> dict:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.full((3, 4), 0.5)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]},
            **cw.extras(4)}


def test_an_empty_state_saves_and_loads(tmp_path):
    dcp.save({}, storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c")))
    dcp.load({}, storage_reader=safeckpt.dcp.Reader(str(tmp_path / "c")))
    assert safeckpt.verify(str(tmp_path / "c")).ok and safeckpt.load_state(str(tmp_path / "c")) == {}


def test_empty_planner_load_into_an_empty_dict(tmp_path):
    dcp.save(_state(), storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c")))
    out: dict = {}
    _load_state_dict(out, storage_reader=safeckpt.dcp.Reader(str(tmp_path / "c")),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    want = _state()
    assert out.pop("train").getvalue() == want.pop("train").getvalue()
    assert dw.compare(out, want) == []


def test_values_are_stored_without_pickle(tmp_path):
    dcp.save(_state(), storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c")))
    manifest = _manifest(tmp_path / "c")
    tree = manifest["tree"]
    assert tree["train"] == {"$bytes": "bG9hZGVyLXBvc2l0aW9uOjQ="}  # base64 of the BytesIO's bytes
    assert manifest["dcp"]["bytesio"] == ["train"]
    assert tree["info"] == {"name": "run-4", "betas": {"$tuple": [0.9, 0.999]}, "none": None}
    assert manifest["dcp"]["items"]["optim.param_groups.0.betas"] == ["optim", "param_groups", 0, "betas"]
    assert b"pickle" not in (tmp_path / "c").joinpath(next(p.name for p in (tmp_path / "c").iterdir()
                                                           if p.name.startswith("manifest-"))).read_bytes()


def test_reader_loads_a_checkpoint_made_by_safeckpt_save(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "layers": [torch.ones(2), torch.zeros(1)],
             "step": 9, "blob": b"xyz", "pair": (1, "a")}
    safeckpt.save(state, str(tmp_path / "c"))
    target = {"model": {"w": torch.zeros(2, 3)}, "layers": [torch.zeros(2), torch.ones(1)], "step": 0,
              "blob": b"", "pair": (0, "")}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(tmp_path / "c")))
    assert dw.compare(target, state) == []


def test_cli_ls_show_verify_on_a_writer_checkpoint(tmp_path, capsys):
    path = str(tmp_path / "c")
    dcp.save(_state(), storage_writer=safeckpt.dcp.Writer(path, step=7, metadata={"by": "dcp"}))
    assert cli(["verify", path]) == 0
    assert cli(["show", path]) == 0
    shown = capsys.readouterr().out
    assert "model.w" in shown and "optim.state.w.exp_avg" in shown
    assert cli(["ls", path]) == 0


def test_a_damaged_block_is_found_on_load(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=safeckpt.dcp.Writer(str(path)))
    data = next(p for p in path.iterdir() if p.name.startswith("data-"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=safeckpt.dcp.Reader(str(path)))
    (error, _), = info.value.failures.values()
    assert isinstance(error, safeckpt.CorruptCheckpointError) and "fails its checksum" in str(error)


def test_overwrite_false_refuses_an_existing_checkpoint_in_dcps_words(tmp_path):
    dcp.save({"w": torch.ones(3)}, storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c"), overwrite=False))
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as info:  # as FileSystemWriter says
        dcp.save({"w": torch.zeros(3)}, storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c"), overwrite=False))
    (error, _), = info.value.failures.values()
    assert isinstance(error, safeckpt.CheckpointExistsError) and str(tmp_path / "c") in str(error)
    with pytest.raises(safeckpt.CheckpointExistsError, match="Checkpoint already exists"):  # safeckpt.save alike
        safeckpt.save({"w": torch.zeros(3)}, str(tmp_path / "c"))
    assert torch.equal(safeckpt.load_state(str(tmp_path / "c"))["w"], torch.ones(3))


def test_unsupported_features_raise_a_typed_error_and_write_nothing(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class Transforming(DefaultSavePlanner):
        def transform_object(self, write_item, obj):
            if write_item.type == WriteItemType.BYTE_IO:
                obj = {"wrapped": obj}
            return super().transform_object(write_item, obj)

    with pytest.raises(TypeError, match="StreamTransformExtension"):
        safeckpt.dcp.Writer(str(tmp_path / "x"), _extensions=[object()])
    for state, planner, needle in [({"w": torch.ones(2), "v": 1}, Transforming(), "transform_object"),
                                   ({"w": torch.ones(2), "v": (torch.ones(1), 2)}, None, "a tensor inside")]:
        with pytest.raises(CheckpointException) as info:
            dcp.save(state, storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c")), planner=planner)
        (error, _), = info.value.failures.values()
        assert isinstance(error, safeckpt.UnsupportedFeatureError) and needle in str(error), error
        assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_extra_state_is_committed_with_the_dcp_items(tmp_path):
    path = str(tmp_path / "c")
    meta = {"epoch": 2, "loops": {"fit": {"state_dict": {}, "done": 3}}, "best": torch.tensor(0.25),
            "k": {"/run/epoch=1.ckpt": torch.tensor(1.5)}, "betas": (0.9, 0.99)}
    dcp.save({"model": {"w": torch.ones(4)}}, storage_writer=safeckpt.dcp.Writer(path, extra={"meta": meta}))
    assert safeckpt.verify(path).ok
    meta["best_again"] = meta["best"]  # a tie inside extra comes back as one tensor
    dcp.save({"model": {"w": torch.ones(4)}}, storage_writer=safeckpt.dcp.Writer(path, extra={"meta": meta}))
    got = safeckpt.load_state(path, keys=["meta"])
    assert dw.compare(got, {"meta": meta}) == []  # empty dicts, tensors and tuples as they were
    assert got["meta"]["best_again"] is got["meta"]["best"]
    target = {"model": {"w": torch.zeros(4)}}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(path))  # DCP sees only its own items
    assert torch.equal(target["model"]["w"], torch.ones(4))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"meta": torch.ones(1)}, storage_writer=safeckpt.dcp.Writer(path, extra={"meta": meta}))
    (error, _), = info.value.failures.values()
    assert isinstance(error, safeckpt.UnsupportedFeatureError) and "both hold ['meta']" in str(error)
    assert dw.compare(safeckpt.load_state(path, keys=["meta"]), {"meta": meta}) == []


def test_any_storage_url_and_export(tmp_path):
    pytest.importorskip("fsspec")
    import fsspec
    import safetensors.torch

    url = f"memory://safeckpt-dcp-{id(tmp_path)}/run/last"
    try:
        dcp.save(_state(), storage_writer=safeckpt.dcp.Writer(url))
        target = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}}
        dcp.load(target, storage_reader=safeckpt.dcp.Reader(url))
        assert dw.compare(target, {"model": _state()["model"]}) == []
        assert safeckpt.verify(url).ok
        assert cli(["export", url, str(tmp_path / "model.safetensors")]) == 0
    finally:
        fsspec.filesystem("memory").rm(f"memory://safeckpt-dcp-{id(tmp_path)}", recursive=True)
    exported = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(exported["model.w"], _state()["model"]["w"])


# --------------------------------------------------------------------------- issue 24 (11), issue 25


def _failure(call) -> BaseException:
    """What ``call`` raised: the rank's own error inside DCP's CheckpointException."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        failures = getattr(exc, "failures", None)
        if failures:
            (error, _), = failures.values()
            return error
        return exc
    raise AssertionError("it did not raise")


def test_empty_tensors_on_2_ranks_save_and_load(two, root):
    no_problems(two.results("dcp_empty"), "empty tensors through the Writer, and Shard pieces of empty tensors")
    shapes = {k: tuple(v.shape) for k, v in safeckpt.load_state(str(root / "empty")).items()}
    assert shapes == {"e1": (0,), "e2": (0, 3), "e3": (2, 0, 4), "w": (3,), "s03": (0, 3), "s40": (4, 0), "s1": (1,)}
    assert safeckpt.verify(str(root / "empty")).ok and safeckpt.verify(str(root / "empty_shards")).ok
    assert tuple(safeckpt.load_state(str(root / "empty_shards"))["p"].shape) == (4, 0)


def test_empty_tensors_are_saved_as_filesystemwriter_saves_them(tmp_path):
    dcp.save(cw.empty_state(1), storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c")))
    dcp.save(cw.empty_state(1), storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    target = cw.empty_state(0)
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(tmp_path / "c")))
    assert dw.compare(target, cw.empty_state(1)) == []
    ours = safeckpt.dcp.Reader(str(tmp_path / "c")).read_metadata().state_dict_metadata
    stock = dcp.FileSystemReader(str(tmp_path / "stock")).read_metadata().state_dict_metadata
    assert {k: (v.size, [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]) for k, v in ours.items()} == \
        {k: (v.size, [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]) for k, v in stock.items()}
    assert safeckpt.verify(str(tmp_path / "c")).ok


def test_safeckpt_save_with_shard_pieces_of_empty_tensors(tmp_path):
    whole = {"e": safeckpt.Shard(torch.empty(0, 3), (0, 3), (0, 0)), "f": safeckpt.Shard(torch.empty(0), (0,), (0,))}
    safeckpt.save(whole, str(tmp_path / "c"))
    assert {k: tuple(v.shape) for k, v in safeckpt.load_state(str(tmp_path / "c")).items()} == {"e": (0, 3), "f": (0,)}
    # one piece that is not the whole (empty) tensor: refused before the commit, not committed unreadable
    with pytest.raises(safeckpt.SaveAbortedError, match="only piece"):
        safeckpt.save({"e": safeckpt.Shard(torch.empty(2, 0), (4, 0), (0, 0))}, str(tmp_path / "d"))
    with pytest.raises(safeckpt.CheckpointNotFoundError):
        safeckpt.load_state(str(tmp_path / "d"))


def _nested(v: float) -> dict:
    import collections
    return {"m": {"w": torch.full((2,), v)}, "tl": [torch.ones(1) * v, torch.zeros(2) + v], "ints": [1, 2, 3],
            "tup": (torch.ones(2) * v, 3), "lt": [(torch.ones(1) * v, "a")], "nested": [[torch.ones(1) * v], [1]],
            "ld": [{"x": torch.ones(1) * v}, 4], "ed": {}, "el": [], "lel": [[], 5], "size": torch.Size([2, 3]),
            "od": collections.OrderedDict(a=torch.ones(1) * v), "e0": torch.empty(0, 2), "s": "x", "none": None}


def test_reader_flattens_a_safeckpt_save_checkpoint_as_dcp_does(tmp_path):
    safeckpt.save(_nested(1.0), str(tmp_path / "ours"))
    dcp.save(_nested(1.0), storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    ours = safeckpt.dcp.Reader(str(tmp_path / "ours")).read_metadata()
    stock = dcp.FileSystemReader(str(tmp_path / "stock")).read_metadata()
    assert {k: type(v) for k, v in ours.state_dict_metadata.items()} == \
        {k: type(v) for k, v in stock.state_dict_metadata.items()}  # a tuple of tensors is one value item
    assert ours.planner_data == stock.planner_data
    got, want = _nested(0.0), _nested(0.0)
    dcp.load(got, storage_reader=safeckpt.dcp.Reader(str(tmp_path / "ours")))
    dcp.load(want, storage_reader=dcp.FileSystemReader(str(tmp_path / "stock")))
    assert dw.compare(got, want) == [] and dw.compare(got, _nested(1.0)) == []


def _craft(path: Path, mutate) -> None:
    from safeckpt.format.manifest import frame
    (name,) = [p for p in path.iterdir() if p.name.startswith("manifest-")]
    body = json.loads(name.read_bytes())["safeckpt"]
    mutate(body)
    name.write_bytes(frame(json.dumps(body).encode()))


@pytest.mark.parametrize("case", ["bytesio names an int", "bytesio names a tensor", "path through a tensor"])
def test_a_crafted_dcp_record_is_a_corrupt_checkpoint(tmp_path, case):
    path = tmp_path / "c"
    dcp.save(_state(), storage_writer=safeckpt.dcp.Writer(str(path)))
    key, record = {"bytesio names an int": ("epoch", lambda b: b["dcp"].update(bytesio=["epoch"])),
                   "bytesio names a tensor": ("model.w", lambda b: b["dcp"].update(bytesio=["model.w"])),
                   "path through a tensor": ("epoch", lambda b: b["dcp"]["items"].update(epoch=["model", "w", "x"]))
                   }[case]
    _craft(path, record)
    with pytest.raises(safeckpt.CorruptCheckpointError, match=f"dcp item '{key}'") as info:
        safeckpt.dcp.Reader(str(path)).read_metadata()
    assert str(path) in str(info.value)
    with pytest.raises(safeckpt.CorruptCheckpointError, match=f"dcp item '{key}'"):
        safeckpt.load_state(str(path))
    report = safeckpt.verify(str(path))
    assert not report.ok and any(f"dcp item '{key}'" in p for p in report.problems), report.problems
    # through dcp.load, DCP reports a failed read_metadata in its own words, with safeckpt's message
    assert f"dcp item '{key}'" in str(_failure(lambda: dcp.load(_state(), storage_reader=safeckpt.dcp.Reader(str(path)))))


def _stored(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.iterdir()) if p.name.startswith("data-"))


class _Blob:
    """A stateful object whose state is bytes (DCP saves it as a value item)."""

    def __init__(self, blob: bytes) -> None:
        self.state = {"blob": blob}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_stream_transforms_are_recorded_checked_and_undone(tmp_path):
    path = tmp_path / "c"
    state = {"w": torch.arange(4096.0), "b": torch.ones(3, dtype=torch.bfloat16), "e": torch.empty(0, 2),
             "step": 4, "train": io.BytesIO(b"position")}
    blob = _Blob(b"blob-bytes")
    dcp.save({**state, "blob": blob}, storage_writer=safeckpt.dcp.Writer(str(path), _extensions=[cw.Xor.make()]))
    body = _manifest(path)
    assert body["format_version"] == 4
    assert body["transformed"]["w"]["transforms"] == ["test.xor/1"] and body["transformed"]["w"]["dtype"] == "float32"
    raw = state["w"].numpy().tobytes()
    assert raw[:4096] not in _stored(path) and bytes(x ^ 0x5A for x in raw[:4096]) in _stored(path)
    assert safeckpt.verify(str(path)).ok  # the checksums are of the stored bytes: no transform needed
    target = {"w": torch.zeros(4096), "b": torch.zeros(3, dtype=torch.bfloat16), "e": torch.empty(0, 2), "step": 0,
              "train": io.BytesIO(), "blob": _Blob(b"")}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(path), _extension_registry=cw.Xor.registry()))
    assert target.pop("train").getvalue() == b"position"
    assert target.pop("blob").state == {"blob": b"blob-bytes"}  # loaded in place, through its load_state_dict
    assert dw.compare(target, {k: v for k, v in state.items() if k != "train"}) == []
    # the transform not registered: a typed error that names it and says what to do
    error = _failure(lambda: dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(path))))
    assert isinstance(error, safeckpt.UnsupportedFeatureError) and "test.xor/1" in str(error), repr(error)
    assert "_extension_registry" in str(error) and "tensor '" in str(error)
    with pytest.raises(safeckpt.UnsupportedFeatureError, match="test.xor/1"):
        safeckpt.load_state(str(path))
    # a damaged stored byte is found by verify and on load
    data = next(p for p in path.iterdir() if p.name.startswith("data-"))
    damaged = bytearray(data.read_bytes())
    damaged[-100] ^= 0xFF
    data.write_bytes(bytes(damaged))
    assert not safeckpt.verify(str(path)).ok
    error = _failure(lambda: dcp.load(target, storage_reader=safeckpt.dcp.Reader(
        str(path), _extension_registry=cw.Xor.registry())))
    assert isinstance(error, safeckpt.CorruptCheckpointError) and "fails its checksum" in str(error), repr(error)


def test_zstandard_compresses_and_loads_with_dcps_default_registry(tmp_path):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"z": torch.zeros(1 << 18), "w": torch.arange(1000.0)}
    dcp.save(state, storage_writer=safeckpt.dcp.Writer(str(tmp_path / "c"), _extensions=[ZStandard()]))
    assert len(_stored(tmp_path / "c")) < (1 << 20) // 50  # 1 MiB of zeros, compressed
    assert dw.compare(safeckpt.load_state(str(tmp_path / "c")), state) == []
    target = {"z": torch.ones(1 << 18), "w": torch.zeros(1000)}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(tmp_path / "c")))
    assert dw.compare(target, state) == []
    # two transforms: XOR applied to the data first, then compressed; loading undoes them in reverse
    dcp.save(state, storage_writer=safeckpt.dcp.Writer(str(tmp_path / "d"), _extensions=[ZStandard(), cw.Xor.make()]))
    assert _manifest(tmp_path / "d")["transformed"]["z"]["transforms"] == ["test.xor/1", "stream.zstd/1"]
    assert len(_stored(tmp_path / "d")) < (1 << 20) // 50
    target = {"z": torch.ones(1 << 18), "w": torch.zeros(1000)}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(tmp_path / "d"), _extension_registry=cw.Xor.registry()))
    assert dw.compare(target, state) == []


@pytest.mark.parametrize("case", ["stream decodes short", "not a uint8 table entry", "boxes do not tile"])
def test_a_crafted_transformed_record_is_a_corrupt_checkpoint(tmp_path, case):
    path = tmp_path / "c"
    dcp.save({"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(2)},  # extra's tensors are stored plain
             storage_writer=safeckpt.dcp.Writer(str(path), _extensions=[cw.Xor.make()], extra={"t": torch.ones(2)}))
    mutate = {"stream decodes short": lambda t: t["w"].update(dtype="float64"),
              "not a uint8 table entry": lambda t: t.update(t=t["w"]),
              "boxes do not tile": lambda t: t["w"].update(chunks=[[[0, 0], [4, 8]]])}[case]
    _craft(path, lambda body: mutate(body["transformed"]))
    if case == "stream decodes short":  # the record is well formed; the stream is caught as it is decoded
        assert safeckpt.verify(str(path)).ok
        error = _failure(lambda: dcp.load({"w": torch.zeros(8, 8, dtype=torch.float64), "b": torch.zeros(2)},
                                          storage_reader=safeckpt.dcp.Reader(
                                              str(path), _extension_registry=cw.Xor.registry())))
        assert isinstance(error, safeckpt.CorruptCheckpointError) and "decodes to 256 bytes" in str(error), error
        return
    with pytest.raises(safeckpt.CorruptCheckpointError, match="transformed"):
        safeckpt.dcp.Reader(str(path)).read_metadata()
    assert not safeckpt.verify(str(path)).ok


def test_transformed_dtensors_load_resharded_on_2_ranks(two, root):
    no_problems(two.results("dcp_transformed"), "DTensors through a stream transform, loaded resharded")
    assert safeckpt.verify(str(root / "xor")).ok


def test_sharded_tensors_reshard_and_switch_with_plain_tensors(two):
    no_problems(two.results("dcp_sharded_tensor"), "ShardedTensor saved 2 shards a rank, loaded as others and plain")
