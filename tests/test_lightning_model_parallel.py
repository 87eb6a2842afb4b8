"""Lightning's sharded strategies with safeckpt: ``SafeModelParallelStrategy`` (FSDP2) and
``SafeFSDPStrategy`` (FSDP1, ``state_dict_type="sharded"``).

Real 2-process runs on CPU (gloo), launched the way Lightning launches them (this file
run as a script; Lightning re-runs it for rank 1): a small MLP sharded with
``fully_shard`` in ``configure_model``, Adam, ``ModelCheckpoint(save_top_k=2,
save_last=True)`` saving at every epoch's end. A reference run goes uninterrupted; a
second run SIGKILLs both ranks half way through writing the data of the 3rd save of
``last.ckpt``; a third, fresh run from another random model resumes with
``fit(ckpt_path="last")`` and must end with the reference run's weights and optimizer
state, bit for bit, and the same set of checkpoints.

Lightning's ``FSDPStrategy`` refuses CPU; the FSDP1 runs use the smallest subclass that
lets it run there (``CpuFSDP``: it wraps the module with ``device_id=cpu`` itself). They
take as long again, so they run with ``--slow``; the save and load code they check
beyond the FSDP2 runs is ``SafeFSDPStrategy._load_sharded``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import safeckpt  # noqa: E402

MAX_STEPS = 16
BATCHES_PER_EPOCH = 4  # per rank; every save is at an epoch's end
SEED, OTHER_SEED = 0, 4321

pytestmark = pytest.mark.timeout(400)


# -- the child: one Lightning run on 2 CPU processes -----------------------------------------
def child_main(args: dict) -> None:
    import logging

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from safeckpt.integrations.lightning import SafeFSDPStrategy, SafeModelParallelStrategy
    from safeckpt.storage import LocalStorage

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 1))

        def configure_model(self) -> None:
            if args["strategy"] != "model_parallel":
                return  # FSDP1: the strategy wraps the whole module
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    base = SafeModelParallelStrategy if args["strategy"] == "model_parallel" else SafeFSDPStrategy

    class Killing(base):
        """SIGKILLs every rank half way through its data file of the n-th save to a name."""

        seen = 0

        def _storage(self, path: str):
            name, _, n = args.get("kill_at", "").partition(":")
            if os.path.basename(path) != name or not self.lightning_module.trainer.training:
                return super()._storage(path)
            Killing.seen += 1
            if Killing.seen != int(n):
                return super()._storage(path)

            class Dying(LocalStorage):
                def write_file(self, fname, parts):
                    if not fname.startswith("data-"):
                        return super().write_file(fname, parts)

                    def half():
                        for i, part in enumerate(parts):
                            if i == 1:
                                yield memoryview(part)[:len(part) // 2]
                                os.kill(os.getpid(), signal.SIGKILL)
                            yield part
                    return super().write_file(fname, half())
            return Dying(path)

    class CpuFSDP(Killing):
        """The smallest change that lets Lightning's FSDPStrategy run FSDP1 on CPU: wrap
        the module with ``device_id=cpu`` first (the strategy keeps a wrapped module)."""

        def _setup_model(self, model):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            return super()._setup_model(FSDP(model, device_id=torch.device("cpu"), **self.kwargs))

    class StartStep(Callback):
        start = None

        def on_train_start(self, trainer, module):
            StartStep.start = trainer.global_step

    g = torch.Generator().manual_seed(99)
    x = torch.randn(2 * BATCHES_PER_EPOCH * 4, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    torch.manual_seed(args["seed"])
    model = Net()
    checkpoint = ModelCheckpoint(dirpath=args["dir"], filename="{epoch}-{step}", monitor="train_loss", mode="min",
                                 save_top_k=2, save_last=True, every_n_train_steps=BATCHES_PER_EPOCH,
                                 enable_version_counter=False)
    trainer = pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", devices=2, logger=False,
                         strategy=Killing(data_parallel_size=2, tensor_parallel_size=1)
                         if base is SafeModelParallelStrategy else CpuFSDP(state_dict_type="sharded"),
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checkpoint, StartStep()], default_root_dir=args["dir"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, ckpt_path=args.get("ckpt_path"))
    full, optim = get_state_dict(trainer.strategy.model, trainer.optimizers[0],
                                 options=StateDictOptions(full_state_dict=True))
    if trainer.global_rank == 0 and args.get("out"):
        torch.save({"model": dict(full), "optim": optim["state"], "start": StartStep.start}, args["out"])


def run_child(args: dict, timeout: float = 300.0) -> subprocess.CompletedProcess:
    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, __file__, json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


def same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module", params=["model_parallel", pytest.param("fsdp", marks=pytest.mark.slow)])
def reference(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"{request.param}-ref")
    done = run_child({"dir": str(tmp / "ckpts"), "seed": SEED, "out": str(tmp / "final.pt"),
                      "strategy": request.param})
    assert done.returncode == 0, done.stderr[-4000:]
    return {"dir": tmp / "ckpts", "final": torch.load(tmp / "final.pt", weights_only=True),
            "strategy": request.param}


def test_sharded_checkpoints_are_committed_safeckpt_checkpoints_with_lightning_meta(reference):
    names = set(os.listdir(reference["dir"]))
    assert "last.ckpt" in names and len(names) == 3  # top-2 by loss + last
    for name in names:
        path = reference["dir"] / name
        assert safeckpt.verify(str(path)).ok, name
        files = sorted(os.listdir(path))
        assert len([f for f in files if f.startswith("manifest-")]) == 1, files
        assert len([f for f in files if f.startswith("data-")]) == 2, files  # one per rank, no meta.pt
    state = safeckpt.load_state(str(reference["dir"] / "last.ckpt"))
    assert state["meta"]["global_step"] == MAX_STEPS and state["meta"]["epoch"] == 3
    assert "loops" in state["meta"] and "callbacks" in state["meta"]
    key = "state_dict" if reference["strategy"] == "model_parallel" else "model"  # as Lightning names it
    same(state[key], reference["final"]["model"], key)


def test_killed_mid_save_then_fit_ckpt_last_resumes_bit_exact(reference, tmp_path):
    dirpath = tmp_path / "ckpts"
    killed = run_child({"dir": str(dirpath), "seed": SEED, "kill_at": "last.ckpt:3",
                        "strategy": reference["strategy"]})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    last = dirpath / "last.ckpt"
    assert safeckpt.verify(str(last)).ok
    assert safeckpt.load_state(str(last), keys=["meta"])["meta"]["global_step"] == 8  # the 2nd save, whole
    data = [f for f in os.listdir(last) if f.startswith("data-")]
    assert len({f.split("-")[1] for f in data}) == 2  # step 8's files and the killed save's

    out = tmp_path / "resumed.pt"
    resumed = run_child({"dir": str(dirpath), "seed": OTHER_SEED, "ckpt_path": "last", "out": str(out),
                         "strategy": reference["strategy"]})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    assert got["start"] == 8
    same(got["model"], reference["final"]["model"], "model")
    same(got["optim"], reference["final"]["optim"], "optim")
    assert set(os.listdir(dirpath)) == set(os.listdir(reference["dir"]))
    for name in os.listdir(dirpath):
        assert safeckpt.verify(str(dirpath / name)).ok, name


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
