"""torch.distributed.checkpoint with safeckpt.dcp on real gloo ranks, for tests/test_dcp.py.

Scenarios here are added to ``dist_worker.SCENARIOS`` (this module reuses its worker
loop, ``Ctx``, ``compare``, ``caught`` and the FSDP2 model), and ``DcpForkServer``
starts *this* file as the fork server. Each scenario returns observations; the test
judges them. Expected values are pure functions shared with the test process, or
saved by the saving launch next to the checkpoints.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import dist_worker as dw

HERE = Path(__file__).resolve()

KILL_SHAPES = {"k0": (64, 32), "k1": (48, 16), "k2": (40, 8)}  # DTensors row-sharded over the ranks


def kill_full(name: str, version: int):
    import torch
    n = 1
    for s in KILL_SHAPES[name]:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(KILL_SHAPES[name]) * version + int(name[1])


def extras(version: int) -> dict:
    """Non-tensor state: a BytesIO (DCP's convention) and plain values."""
    return {"train": io.BytesIO(b"loader-position:%d" % version), "epoch": 3 * version,
            "info": {"name": f"run-{version}", "betas": (0.9, 0.999), "none": None}}


def _extras_target() -> dict:
    return {"train": io.BytesIO(), "epoch": -1, "info": {"name": "", "betas": (0.0, 0.0), "none": 1}}


def _extras_problems(got: dict, version: int) -> list[str]:
    want = extras(version)
    problems = []
    if not isinstance(got["train"], io.BytesIO) or got["train"].getvalue() != want["train"].getvalue():
        problems.append(f"train: got {got['train']!r}")
    return problems + dw.compare({k: got[k] for k in ("epoch", "info")}, {k: want[k] for k in ("epoch", "info")})


def _fsdp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _fsdp_set(model, opt, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# -- scenarios on 2 ranks -----------------------------------------------------------------


def sc_dcp_fsdp_save(ctx: dw.Ctx) -> dict:
    """FSDP2 model and optimizer through dcp.save with the Writer (and, for comparison,
    DCP's FileSystemWriter), then loaded back on the same ranks."""
    import torch
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    mesh = dw._mesh((ctx.world,))
    model, opt = dw.fsdp_build(mesh, init_optimizer_state=False)
    for step in range(2):
        dw.fsdp_train_step(model, opt, ctx.rank, step)
    state = {**_fsdp_state(model, opt), **extras(1)}
    dcp.save(state, storage_writer=safeckpt.dcp.Writer(str(ctx.root / "fsdp")))
    dcp.save({**_fsdp_state(model, opt), **extras(1)},
             storage_writer=dcp.FileSystemWriter(str(ctx.root / "fsdp_stock")))
    expected = dw.fsdp_full(model, opt)
    if ctx.rank == 0:
        torch.save(expected, ctx.root / "fsdp_expected.pt")
    fresh, fresh_opt = dw.fsdp_build(mesh, init_optimizer_state=False)
    target = {**_fsdp_state(fresh, fresh_opt), **_extras_target()}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(ctx.root / "fsdp")))
    _fsdp_set(fresh, fresh_opt, target)
    return {"problems": dw.compare(dw.fsdp_full(fresh, fresh_opt), expected) + _extras_problems(target, 1),
            "placements": sorted({str(v.placements) for v in state["model"].values()})}


def sc_dcp_resave(ctx: dw.Ctx) -> dict:
    """Three saves into one folder; after each, what the folder holds and what loads."""
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = dw._mesh((ctx.world,))
    path = ctx.root / "resave"
    out = []
    for version in (1, 2, 3):
        state = {name: distribute_tensor(kill_full(name, version), mesh, [Shard(0)]) for name in KILL_SHAPES}
        dcp.save({**state, **extras(version)}, storage_writer=safeckpt.dcp.Writer(str(path)))
        ctx.barrier()
        listing = dw.listing(path)
        target = {name: distribute_tensor(kill_full(name, 0) * 0, mesh, [Shard(0)]) for name in KILL_SHAPES}
        target.update(_extras_target())
        dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(path)))
        problems = [p for n in KILL_SHAPES for p in dw.compare(target[n], kill_full(n, version), n)]
        out.append({"files": sorted(listing), "problems": problems + _extras_problems(target, version)})
        ctx.barrier()
    return {"saves": out}


def sc_dcp_raise(ctx: dw.Ctx) -> dict:
    """Rank 1 runs out of disk in write_data during a re-save: every rank must raise,
    nothing may be committed, the first save must still load."""
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = dw._mesh((ctx.world,))
    path = ctx.root / "step-000000001"  # a name safeckpt gc knows
    state = {name: distribute_tensor(kill_full(name, 1), mesh, [Shard(0)]) for name in KILL_SHAPES}
    dcp.save(state, storage_writer=safeckpt.dcp.Writer(str(path)))
    ctx.barrier()
    before = dw.listing(path)
    storage = dw._local_storage(path, fail_write="enospc" if ctx.rank == 1 else None)
    state2 = {name: distribute_tensor(kill_full(name, 2), mesh, [Shard(0)]) for name in KILL_SHAPES}
    failures: dict = {}
    try:
        dcp.save(state2, storage_writer=safeckpt.dcp.Writer(storage))
        raised = None
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        raised = type(exc).__name__
        failures = {str(r): {"type": type(e).__name__, "message": str(e)}
                    for r, (e, _) in getattr(exc, "failures", {}).items()}
    ctx.barrier()
    after = dw.listing(path)
    target = {name: distribute_tensor(kill_full(name, 0) * 0, mesh, [Shard(0)]) for name in KILL_SHAPES}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(path)))
    return {"raised": raised, "failures": failures, "before": sorted(before), "after": sorted(after),
            "problems": [p for n in KILL_SHAPES for p in dw.compare(target[n], kill_full(n, 1), n)]}


def sc_dcp_async(ctx: dw.Ctx) -> dict:
    """dcp.async_save with the Writer over a separate gloo group, training meanwhile."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    mesh = dw._mesh((ctx.world,))
    model, opt = dw.fsdp_build(mesh, init_optimizer_state=False)
    dw.fsdp_train_step(model, opt, ctx.rank, 0)
    expected = dw.fsdp_full(model, opt)
    group = dist.new_group(backend="gloo")
    t0 = time.monotonic()
    future = dcp.async_save({**_fsdp_state(model, opt), **extras(2)},
                            storage_writer=safeckpt.dcp.Writer(str(ctx.root / "async")), process_group=group)
    blocked = time.monotonic() - t0
    dw.fsdp_train_step(model, opt, ctx.rank, 1)  # training goes on over the default group
    future.result()
    fresh, fresh_opt = dw.fsdp_build(mesh, init_optimizer_state=False)
    target = {**_fsdp_state(fresh, fresh_opt), **_extras_target()}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(ctx.root / "async")))
    _fsdp_set(fresh, fresh_opt, target)
    return {"blocked_s": blocked,
            "problems": dw.compare(dw.fsdp_full(fresh, fresh_opt), expected) + _extras_problems(target, 2)}


def empty_state(version: int, mesh=None) -> dict:
    """Tensors with no elements, as DCP saves them: plain (replicated on every rank) and,
    given a mesh, DTensors whose chunks are all empty, two distinct empty boxes, or one
    rank's chunk empty; with a tensor that has data."""
    import torch
    state = {"e1": torch.empty(0), "e2": torch.empty(0, 3), "e3": torch.empty(2, 0, 4),
             "w": torch.full((3,), float(version))}
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor
        state.update({"s03": distribute_tensor(torch.empty(0, 3), mesh, [Shard(0)]),
                      "s40": distribute_tensor(torch.empty(4, 0), mesh, [Shard(0)]),
                      "s1": distribute_tensor(torch.full((1,), float(version)), mesh, [Shard(0)])})
    return state


class Xor:
    """A stream transform (DCP's StreamTransformExtension protocol) of the tests' own:
    every byte XOR 0x5A, written and read in pieces. Built on first use (torch loads late)."""

    cls = None

    @classmethod
    def make(cls):
        if cls.cls is None:
            import io
            from torch.distributed.checkpoint._extension import StreamTransformExtension

            class XorTransform(StreamTransformExtension):
                @staticmethod
                def registry_name() -> str:
                    return "test.xor"

                @staticmethod
                def from_descriptor(version: str) -> "XorTransform":
                    if version != "1":
                        raise ValueError(f"unknown version {version}")
                    return XorTransform()

                def get_descriptor(self) -> str:
                    return "test.xor/1"

                def transform_to(self, output):
                    class W(io.RawIOBase):
                        def writable(self) -> bool:
                            return True

                        def write(self, b) -> int:
                            output.write(bytes(x ^ 0x5A for x in bytes(b)))
                            return len(memoryview(b))

                        def close(self) -> None:
                            output.close()
                            super().close()
                    return W()

                def transform_from(self, input):
                    class R(io.RawIOBase):
                        def readable(self) -> bool:
                            return True

                        def readinto(self, b) -> int:
                            data = input.read(min(len(b), 1000))  # short reads, as a real stream gives
                            b[:len(data)] = bytes(x ^ 0x5A for x in data)
                            return len(data)
                    return R()

            cls.cls = XorTransform
        return cls.cls()

    @classmethod
    def registry(cls):
        from torch.distributed.checkpoint._extension import ExtensionRegistry
        registry = ExtensionRegistry()
        registry.register(type(cls.make()))
        return registry


def sc_dcp_empty(ctx: dw.Ctx) -> dict:
    """Empty tensors (replicated, and DTensors with empty chunks) through the Writer and
    back, and safeckpt.save with Shard pieces of empty tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    import safeckpt
    import safeckpt.dcp
    mesh = dw._mesh((ctx.world,))
    dcp.save(empty_state(1, mesh), storage_writer=safeckpt.dcp.Writer(str(ctx.root / "empty")))
    target = empty_state(0, mesh)
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(ctx.root / "empty")))
    problems = dw.compare(target, {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                                   for k, v in empty_state(1, mesh).items()})
    shards = {"p": safeckpt.Shard(torch.empty(2, 0), (2 * ctx.world, 0), (2 * ctx.rank, 0)),
              "q": safeckpt.Shard(torch.empty(0, 3), (0, 3), (0, 0)), "w": torch.ones(2)}
    safeckpt.save(shards, str(ctx.root / "empty_shards"))
    back = {"p": safeckpt.Shard(torch.empty(2, 0), (2 * ctx.world, 0), (2 * ctx.rank, 0)),
            "q": safeckpt.Shard(torch.empty(0, 3), (0, 3), (0, 0)), "w": torch.zeros(2)}
    safeckpt.load(back, str(ctx.root / "empty_shards"))
    return {"problems": problems + dw.compare(back["w"], torch.ones(2), "w")}


def sc_dcp_transformed(ctx: dw.Ctx) -> dict:
    """DTensors saved through a stream transform, loaded resharded (each rank decodes the
    streams its new box needs)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = dw._mesh((ctx.world,))
    a, z = kill_full("k0", 1), torch.arange(64 * 48, dtype=torch.int32).reshape(64, 48)
    state = {"a": distribute_tensor(a, mesh, [Shard(0)]), "z": distribute_tensor(z, mesh, [Shard(1)]), "v": 7}
    dcp.save(state, storage_writer=safeckpt.dcp.Writer(str(ctx.root / "xor"), _extensions=[Xor.make()]))
    target = {"a": distribute_tensor(a * 0, mesh, [Replicate()]), "z": distribute_tensor(z * 0, mesh, [Shard(0)]),
              "v": 0}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(ctx.root / "xor"), _extension_registry=Xor.registry()))
    return {"problems": dw.compare(target, {"a": a, "z": z, "v": 7})}


def sc_dcp_fsdp_load(ctx: dw.Ctx) -> dict:
    """The 2-rank FSDP2 checkpoint on this launch's world size, bit-exact."""
    import torch
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    mesh = dw._mesh((ctx.world,))
    model, opt = dw.fsdp_build(mesh, init_optimizer_state=False)
    target = {**_fsdp_state(model, opt), **_extras_target()}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(ctx.root / "fsdp")))
    _fsdp_set(model, opt, target)
    expected = torch.load(ctx.root / "fsdp_expected.pt", weights_only=True)
    return {"problems": dw.compare(dw.fsdp_full(model, opt), expected) + _extras_problems(target, 1)}


# -- 4 ranks: a 2-D mesh ------------------------------------------------------------------


def sc_dcp_2d(ctx: dw.Ctx) -> dict:
    """DTensors on a 2x2 mesh (sharded, partly replicated) and a replicated plain tensor,
    loaded with other placements on the same mesh."""
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = dw._mesh((2, 2))
    state = {"d": distribute_tensor(dw.dt_full("d"), mesh, [Shard(0), Replicate()]),
             "g": distribute_tensor(dw.dt_full("g"), mesh, [Shard(1), Shard(0)]),
             "bias": dw.BIAS()}
    dcp.save(state, storage_writer=safeckpt.dcp.Writer(str(ctx.root / "dt2")))
    target = {"d": distribute_tensor(dw.dt_full("d") * 0, mesh, [Replicate(), Shard(1)]),
              "g": distribute_tensor(dw.dt_full("g") * 0, mesh, [Shard(0), Shard(1)]),
              "bias": dw.BIAS() * 0}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(str(ctx.root / "dt2")))
    return {"problems": dw.compare(target["d"], dw.dt_full("d"), "d") + dw.compare(target["g"], dw.dt_full("g"), "g")
            + dw.compare(target["bias"], dw.BIAS(), "bias")}


def sc_dcp_reshard(ctx: dw.Ctx) -> dict:
    """A 2-D DTensor saved with every placement of a 2x2 mesh, loaded with every other one
    and on a 1-D mesh of the same ranks (DCP's own resharding matrix)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh2, mesh1 = dw._mesh((2, 2)), dw._mesh((ctx.world,))
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    two = [[Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()], [Shard(0), Shard(1)]]
    problems = []
    for i, saved in enumerate(two):
        path = str(ctx.root / f"reshard{i}")
        dcp.save({"t": distribute_tensor(full, mesh2, saved)}, storage_writer=safeckpt.dcp.Writer(path))
        loads = [(mesh2, p) for p in two if p != saved] + [(mesh1, [Shard(0)]), (mesh1, [Replicate()])]
        for mesh, placement in loads:
            target = {"t": distribute_tensor(full * 0, mesh, placement)}
            dcp.load(target, storage_reader=safeckpt.dcp.Reader(path))
            problems += dw.compare(target["t"], full, f"{saved} -> {placement}")
    return {"problems": problems}


def _sharded(spec, full):
    """A ShardedTensor of ``spec`` holding ``full`` (each rank fills its own shards)."""
    from torch.distributed._shard import sharded_tensor
    t = sharded_tensor.zeros(spec, *full.shape, init_rrefs=False)
    for shard in t.local_shards():
        (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[r:r + h, c:c + w])
    return t


def _sharded_problems(t, full, key: str) -> list:
    out = []
    for shard in t.local_shards():
        (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        out += dw.compare(shard.tensor, full[r:r + h, c:c + w], f"{key}@{r},{c}")
    return out


def sc_dcp_sharded_tensor(ctx: dw.Ctx) -> dict:
    """ShardedTensors (torch.distributed._shard), two shards per rank, loaded as another
    sharding (uneven, enumerated) and as a plain tensor; a plain tensor loaded as a
    ShardedTensor."""
    import torch
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
    four = ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"])
    rows = ChunkShardingSpec(dim=1, placements=["rank:0", "rank:1"])
    uneven = EnumerableShardingSpec([ShardMetadata([0, 0], [3, 20], "rank:1"), ShardMetadata([3, 0], [7, 20], "rank:0")])
    full = torch.arange(200, dtype=torch.float32).reshape(10, 20)
    path = str(ctx.root / "sharded_tensor")
    dcp.save({"st": _sharded(four, full), "plain": full + 1}, storage_writer=safeckpt.dcp.Writer(path))
    target = {"st": _sharded(uneven, full * 0), "plain": _sharded(rows, full * 0)}
    dcp.load(target, storage_reader=safeckpt.dcp.Reader(path))
    as_plain = {"st": torch.zeros(10, 20)}
    dcp.load(as_plain, storage_reader=safeckpt.dcp.Reader(path))
    return {"problems": _sharded_problems(target["st"], full, "st") + _sharded_problems(target["plain"], full + 1, "plain")
            + dw.compare(as_plain["st"], full, "st as a plain tensor")}


# -- SIGKILL during a re-save into the same folder ----------------------------------------------


class _KillOnSecondTensor:
    """A DCP planner that SIGKILLs this process when asked for its second tensor:
    FileSystemWriter asks while its data file is open and half written."""

    def __new__(cls):
        from torch.distributed.checkpoint import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            seen = 0

            def resolve_data(self, write_item):
                from torch.distributed.checkpoint.planner import WriteItemType
                if write_item.type != WriteItemType.BYTE_IO:
                    Planner.seen += 1
                    if Planner.seen == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                        time.sleep(60)
                return super().resolve_data(write_item)
        return Planner()


def _kill_mid_write(path: Path):
    """A LocalStorage that SIGKILLs this process half way through writing its data file."""
    from safeckpt.storage import LocalStorage

    class Killing(LocalStorage):
        def write_file(self, name, parts):
            if not name.startswith("data-"):
                return super().write_file(name, parts)

            def some_then_die():  # the header, then half of the data
                for i, part in enumerate(parts):
                    if i == 1:
                        yield memoryview(part)[:len(part) // 2]
                        os.kill(os.getpid(), signal.SIGKILL)
                        time.sleep(60)
                    yield part
            return super().write_file(name, some_then_die())
    return Killing(str(path))


def _killed_resave(ctx: dw.Ctx, which: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    import safeckpt.dcp
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = dw._mesh((ctx.world,))
    path = ctx.root / f"killed_{which}"
    state = {name: distribute_tensor(kill_full(name, 1), mesh, [Shard(0)]) for name in KILL_SHAPES}
    writer = (lambda: dcp.FileSystemWriter(str(path))) if which == "stock" else (lambda: safeckpt.dcp.Writer(str(path)))
    dcp.save(state, storage_writer=writer())
    ctx.barrier()
    (ctx.out / f"first-save-done-rank{ctx.rank}").touch()
    state2 = {name: distribute_tensor(kill_full(name, 2), mesh, [Shard(0)]) for name in KILL_SHAPES}
    ctx.stop = True  # this process dies below
    if which == "stock":
        dcp.save(state2, storage_writer=writer(), planner=_KillOnSecondTensor())
    else:
        dcp.save(state2, storage_writer=safeckpt.dcp.Writer(_kill_mid_write(path)))
    return {"survived": True}


def sc_dcp_kill_stock(ctx: dw.Ctx) -> dict:
    return _killed_resave(ctx, "stock")


def sc_dcp_kill_safe(ctx: dw.Ctx) -> dict:
    return _killed_resave(ctx, "safe")


# -- the trainer drop-ins' FSDP path: Accelerate ---------------------------------------------


def _fsdp_model(kind: str, seed: int):
    """The same small model sharded by FSDP2 (``fully_shard``) or FSDP1, with Adam."""
    import torch
    from torch import nn
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 6))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _full_state(model, opt) -> dict:
    """Full tensors of the model and optimizer (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": dict(msd), "optim": osd["state"], "groups": osd["param_groups"]}


def _accelerator(model, opt):
    """An Accelerator tracking an FSDP model as ``prepare`` does under FSDP (on CPU,
    Accelerate itself falls back to DDP, so the model is registered directly)."""
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    acc._models.append(model)
    acc._optimizers.append(opt)
    return acc


def sc_dcp_accel_save(ctx: dw.Ctx) -> dict:
    import torch
    from safeckpt.integrations import accelerate as sa
    out = {}
    for kind in ("fsdp2", "fsdp1"):
        model, opt = _fsdp_model(kind, 0)
        for step in range(2):
            dw.fsdp_train_step(model, opt, ctx.rank, step)
        acc = _accelerator(model, opt)
        acc.step = 2
        info = sa.save_state(acc, str(ctx.root / f"accel_{kind}"), 2, layout="safeckpt")  # sharded, reshardable
        expected = _full_state(model, opt)
        if ctx.rank == 0:
            torch.save(expected, ctx.root / f"accel_{kind}_expected.pt")
        fresh, fresh_opt = _fsdp_model(kind, 1)
        acc2 = _accelerator(fresh, fresh_opt)
        restored = sa.load_state(acc2, str(ctx.root / f"accel_{kind}"))
        out[kind] = {"restored": restored, "files": sorted(info.files), "step": acc2.step,
                     "problems": dw.compare(_full_state(fresh, fresh_opt), expected)}
    return out


def sc_dcp_accel_load(ctx: dw.Ctx) -> dict:
    import torch
    from safeckpt.integrations import accelerate as sa
    out = {}
    for kind in ("fsdp2", "fsdp1"):
        model, opt = _fsdp_model(kind, 1)
        acc = _accelerator(model, opt)
        restored = sa.load_state(acc, str(ctx.root / f"accel_{kind}"), strict=False)  # RNG: saved by 2 ranks
        expected = torch.load(ctx.root / f"accel_{kind}_expected.pt", weights_only=True)
        out[kind] = {"restored": restored, "problems": dw.compare(_full_state(model, opt), expected)}
    return out


# -- the trainer drop-ins' FSDP path: the Hugging Face Trainer ----------------------------------


def _trainer(model, opt, output_dir: str):
    """A SafeTrainer around an FSDP2 model (on CPU the Trainer would use DDP: the FSDP
    model is handed to it already sharded, as accelerate.prepare leaves it under FSDP)."""
    import logging

    from transformers import TrainingArguments
    from transformers.utils import logging as hf_logging

    from safeckpt.integrations.transformers import SafeTrainer
    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to=[], save_total_limit=2)
    return SafeTrainer(model=model, args=args, optimizers=(opt, None), checkpoint_layout="safeckpt")


def sc_dcp_trainer_save(ctx: dw.Ctx) -> dict:
    import torch
    model, opt = _fsdp_model("fsdp2", 0)
    for step in range(2):
        dw.fsdp_train_step(model, opt, ctx.rank, step)
    trainer = _trainer(model, opt, str(ctx.root / "trainer"))
    trainer.state.global_step = 2
    trainer._save_checkpoint(trainer.model, None)
    expected = _full_state(model, opt)
    if ctx.rank == 0:
        torch.save(expected, ctx.root / "trainer_expected.pt")
    ctx.barrier()
    return {"files": sorted(dw.listing(ctx.root / "trainer" / "checkpoint-2"))}


def sc_dcp_trainer_load(ctx: dw.Ctx) -> dict:
    import torch
    model, opt = _fsdp_model("fsdp2", 1)
    trainer = _trainer(model, opt, str(ctx.root / "trainer"))
    path = str(ctx.root / "trainer" / "checkpoint-2")
    trainer._load_from_checkpoint(path, trainer.model)
    trainer._load_optimizer_and_scheduler(path)
    expected = torch.load(ctx.root / "trainer_expected.pt", weights_only=True)
    return {"problems": dw.compare(_full_state(model, opt), expected)}


dw.SCENARIOS.update({name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("sc_dcp_")})


class DcpForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file (so the ranks know the scenarios above)."""

    def __init__(self, src: str) -> None:
        super().__init__(src, script=HERE)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        dw.serve(heavy=True)
        sys.exit(0)
    sys.exit(dw.main())
