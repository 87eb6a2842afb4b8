"""The ``safeckpt`` command, every command run as a real subprocess
(``python -m safeckpt ...``): on the local disk, on an S3 server (moto; SeaweedFS for
wrong credentials), and on a checkpoint saved by 4 real gloo ranks.

Starting Python with torch costs seconds, so each test prepares its inputs in this
process, runs its commands as one concurrent batch, and checks the results here
(exports are loaded back with ``safetensors`` / ``torch.load(weights_only=True)``,
imports with ``safeckpt.load_state``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import safeckpt
from s3servers import free_ports, moto_server, s3_bucket, seaweedfs_server  # noqa: F401
from safeckpt.format.folder import read_committed
from safeckpt.interop.export import ExportError, parse_size, plan_shards
from safeckpt.interop.imports import read_dcp, read_safetensors
from safeckpt.storage import open as open_storage

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
BASE_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *sys.path]), "AWS_EC2_METADATA_DISABLED": "true"}
BASE_ENV.pop("SAFECKPT_STORAGE_OPTIONS", None)
BASE_ENV.pop("SAFECKPT_DEBUG", None)

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------- running the command


@dataclass
class Cmd:
    args: tuple[str, ...]
    env: dict | None = None


def cmd(*args: object, env: dict | None = None) -> Cmd:
    return Cmd(tuple(str(a) for a in args), env)


def _run(c: Cmd) -> subprocess.CompletedProcess:
    env = {**BASE_ENV, **(c.env or {})}
    return subprocess.run([sys.executable, "-m", "safeckpt", *c.args], capture_output=True, text=True,
                          env=env, timeout=180, stdin=subprocess.DEVNULL)


def run(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    return _run(cmd(*args, env=env))


def run_all(*cmds: Cmd) -> list[subprocess.CompletedProcess]:
    """Run commands concurrently (each is a fresh interpreter importing torch)."""
    with ThreadPoolExecutor(max(2, min(len(cmds), os.cpu_count() or 2, 8))) as pool:
        return list(pool.map(_run, cmds))


def ok(p: subprocess.CompletedProcess, code: int = 0) -> subprocess.CompletedProcess:
    assert p.returncode == code, f"{p.args}: exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p


def one_error_line(p: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """A failure is exactly one line on stderr, ``safeckpt: error: ...``, and no traceback."""
    ok(p, code)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("safeckpt: error: "), p.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- fixtures


def train_state(step: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(step // 100):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model, "optim": opt, "step": step, "data": {"epoch": step // 100, "tags": ("a", "b")}}


def old_save_id(age_s: float) -> str:
    return f"{int(time.time() - age_s):08x}" + "0" * 12


def interrupted_save(folder: Path, like: Path, age_s: float) -> Path:
    """The data file of a save that was killed before its manifest (no manifest)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = next(like.glob("data-*.safetensors"))
    target = folder / f"data-{old_save_id(age_s)}-r00000.safetensors"
    shutil.copyfile(data, target)
    return target


def flip_last_byte(folder: Path) -> Path:
    data = next(folder.glob("data-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    return data


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """A run root: steps 100 and 300 sound, 200 with a flipped data byte, 400 an
    interrupted save (data, no manifest) from two hours ago."""
    root = tmp_path_factory.mktemp("cli") / "run"
    with safeckpt.CheckpointManager(root) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, train_state(step), metrics={"loss": 1.0 / step}, metadata={"run": "cli-test"})
    flip_last_byte(root / "step-000000200")
    interrupted_save(root / "step-000000400", root / "step-000000300", age_s=7200)
    return root


# The 4-rank save: W in uneven row shards, E (bfloat16) in uneven column shards, a
# replicated bias, plain values and a rank-local value.
RANK_WORKER = r'''
import json, os, sys, traceback
from datetime import timedelta
import torch, torch.distributed as dist
import safeckpt
# torch is imported once; ranks 1-3 are forked from here before anything runs threads
rank, children = 0, []
for r in (1, 2, 3):
    pid = os.fork()
    if pid == 0:
        rank = r
        break
    children.append(pid)
try:
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=90))
    W = torch.arange(160, dtype=torch.float32).reshape(16, 10)
    E = (torch.arange(96, dtype=torch.float32).reshape(16, 6) / 7).to(torch.bfloat16)
    (r0, r1) = [(0, 3), (3, 10), (10, 11), (11, 16)][rank]
    (c0, c1) = [(0, 2), (2, 3), (3, 5), (5, 6)][rank]
    state = {"model": {"w": safeckpt.Shard(W[r0:r1].clone(), [16, 10], [r0, 0]),
                       "e": safeckpt.Shard(E[:, c0:c1].clone(), [16, 6], [0, c0]),
                       "bias": torch.linspace(-1, 1, 10)},
             "opt": {"lr": 0.1, "betas": (0.9, 0.99)}, "step": 7, "pos": safeckpt.RankLocal(rank * 10)}
    for path, options in json.loads(sys.argv[1]):
        safeckpt.save(state, path, storage_options=options, step=7, metrics={"loss": 0.25},
                      metadata={"ranks": 4})
    dist.barrier()
    dist.destroy_process_group()
    code = 0
except BaseException:
    print(f"rank {rank}:", traceback.format_exc(), flush=True)
    code = 1
if rank:
    os._exit(code)
for pid in children:
    code |= os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
sys.exit(code)
'''


def expected_model() -> dict[str, torch.Tensor]:
    return {"model.w": torch.arange(160, dtype=torch.float32).reshape(16, 10),
            "model.e": (torch.arange(96, dtype=torch.float32).reshape(16, 6) / 7).to(torch.bfloat16),
            "model.bias": torch.linspace(-1, 1, 10)}


@dataclass
class Ranks:
    """Where the 4-rank checkpoint was saved: a local run root, and one on S3."""

    local: Path                # run root; the checkpoint is local / "step-000000007"
    s3: str | None = None      # run root URL on moto
    options: dict | None = None

    @property
    def env(self) -> dict:
        """The S3 options as $SAFECKPT_STORAGE_OPTIONS (no retries: errors come fast)."""
        return {"SAFECKPT_STORAGE_OPTIONS": json.dumps(
            {**(self.options or {}), "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 5}})}


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory, request) -> Ranks:
    """One real save by 4 gloo processes (one interpreter imports torch and forks the
    other ranks), into a local run root and, when moto is available, into a bucket."""
    base = tmp_path_factory.mktemp("ranks")
    ranks = Ranks(base / "run")
    targets = [[str(ranks.local / "step-000000007"), {}]]
    try:
        server = request.getfixturevalue("moto_server")
    except pytest.skip.Exception:
        server = None
    if server is not None:
        ranks.s3, ranks.options = f"s3://{s3_bucket(server)}/run", server.options
        targets.append([ranks.s3 + "/step-000000007", server.options])
    script = base / "rank_worker.py"
    script.write_text(RANK_WORKER)
    env = {**BASE_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]), "SAFECKPT_TIMEOUT": "60"}
    p = subprocess.run([sys.executable, str(script), json.dumps(targets)], env=env, capture_output=True,
                       text=True, timeout=150, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-5000:]
    return ranks


# --------------------------------------------------------------------------- basics and bad input


def test_version_and_help():
    version, help_ = run_all(cmd("--version"), cmd("--help"))
    assert ok(version).stdout.strip() == f"safeckpt {safeckpt.__version__}"
    for name in ("ls", "show", "verify", "gc", "export", "import", "diff"):
        assert f"  {name} " in ok(help_).stdout, help_.stdout


def test_verify_exit_codes(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    safeckpt.save({"w": torch.arange(100.0)}, good)
    safeckpt.save({"w": torch.arange(100.0)}, bad)
    data = flip_last_byte(bad)
    ok_run, bad_run, with_missing = run_all(cmd("verify", good), cmd("verify", bad),
                                            cmd("verify", good, tmp_path / "missing", bad))
    assert ok(ok_run).stdout.startswith("committed ") and ok_run.stderr == ""  # no progress bar without a terminal
    ok(bad_run, 1)
    assert "CORRUPT" in bad_run.stdout and "'w'" in bad_run.stdout and data.name in bad_run.stdout
    # a path that names no checkpoint is an error line, after every other path was checked
    one_error_line(with_missing, "no checkpoint", "missing: there is no such folder")
    lines = with_missing.stdout.splitlines()
    assert lines[0].startswith("committed ") and lines[0].split()[1] == str(good), lines
    assert lines[1].startswith("CORRUPT ") and "checked 2 checkpoint folder(s)" in lines[-1], lines


def test_missing_path_is_one_clear_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    missing, not_ckpt, unknown, debug = run_all(
        cmd("verify", tmp_path / "nope"),
        cmd("ls", tmp_path),
        cmd("show", "nosuchproto://bucket/ckpt"),
        cmd("show", "nosuchproto://bucket/ckpt", "--debug"))
    one_error_line(missing, "no checkpoint", "nope")
    one_error_line(not_ckpt, "no checkpoint", "no manifest and no step-NNNNNNNNN folders")
    one_error_line(unknown, "nosuchproto")
    assert debug.returncode != 0 and "Traceback" in debug.stderr  # --debug shows it


# --------------------------------------------------------------------------- a local run root


def test_ls_show_verify_a_run_root(run_root):
    ls, ls_json, show_json, verify = run_all(
        cmd("ls", run_root), cmd("ls", run_root, "--json"), cmd("show", run_root / "step-000000300", "--json"),
        cmd("verify", run_root))

    table = ok(ls).stdout
    for step, status in (("100", "committed"), ("200", "committed"), ("300", "committed"),
                         ("400", "torn save")):
        assert any(line.split()[:1] == [step] and line.rstrip().endswith(status) for line in table.splitlines()), table
    assert "loss=0.01" in table and "4 checkpoint folder(s)" in table
    rows = json.loads(ok(ls_json).stdout)
    assert [(r["step"], r["status"]) for r in rows] == [(100, "committed"), (200, "committed"),
                                                        (300, "committed"), (400, "torn")]
    assert rows[0]["metrics"] == {"loss": 0.01} and rows[0]["world_size"] == 1 and rows[0]["bytes"] > 0
    assert rows[0]["path"].endswith("step-000000100") and rows[0]["metadata"] == {"run": "cli-test"}
    assert rows[3]["bytes"] > 0 and rows[3]["metrics"] == {}

    info = json.loads(ok(show_json).stdout)
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["model.0.weight"] == {"name": "model.0.weight", "dtype": "float32", "shape": [8, 4],
                                         "chunks": 1, "bytes": 128}
    assert info["values"]["step"] == 300 and info["values"]["data.epoch"] == 3
    assert info["values"]["data.tags"] == "('a', 'b')" and info["values"]["optim.param_groups.0.lr"] == 0.001
    assert info["metrics"] == {"loss": 1.0 / 300} and info["metadata"] == {"run": "cli-test"}
    assert info["step"] == 300 and info["world_size"] == 1

    out = ok(verify, 1).stdout
    lines = out.splitlines()
    assert any(line.startswith("committed ") and "step-000000100" in line for line in lines), out
    assert any(line.startswith("CORRUPT") and "step-000000200" in line for line in lines), out
    assert any(line.startswith("torn save ") and "step-000000400" in line for line in lines), out
    problem = next(line for line in lines if line.startswith("  - "))
    assert "step-000000200/data-" in problem and "tensor 'optim.state.3.exp_avg_sq'" in problem
    assert "checked 4 checkpoint folder(s)" in out and out.rstrip().endswith("2 committed, 1 torn, 1 corrupt")


def test_a_folder_of_checkpoints_saved_by_hand(tmp_path):
    """The README's first snippet saves ``ckpt/step-100`` and ``ckpt/step-200`` (no
    manager, no step): ``ls ckpt`` and ``verify ckpt`` cover both, named by their
    folders; commands that work on one checkpoint, and gc (a run root's), say which to
    name instead."""
    state = {"w": torch.arange(6.0), "step": 1}
    safeckpt.save(state, tmp_path / "ckpt" / "step-100")
    safeckpt.save(state, tmp_path / "ckpt" / "best", step=7)
    (tmp_path / "ckpt" / "notes").mkdir()  # a folder that holds no checkpoint is left out
    ls, ls_json, verify, show, gc, export = run_all(
        cmd("ls", tmp_path / "ckpt"), cmd("ls", tmp_path / "ckpt", "--json"), cmd("verify", tmp_path / "ckpt"),
        cmd("show", tmp_path / "ckpt"), cmd("gc", tmp_path / "ckpt"),
        cmd("export", tmp_path / "ckpt", tmp_path / "out.safetensors"))
    table = ok(ls).stdout  # named by their folders, beside the step each saved
    assert table.split()[:2] == ["name", "step"], table
    assert any(line.split()[:2] == ["step-100", "-"] and line.rstrip().endswith("committed")
               for line in table.splitlines())
    assert any(line.split()[:2] == ["best", "7"] for line in table.splitlines()) and "2 checkpoint folder(s)" in table
    rows = json.loads(ok(ls_json).stdout)
    assert [(r["path"].rpartition("/")[2], r["step"], r["status"]) for r in rows] == \
        [("best", 7, "committed"), ("step-100", None, "committed")]
    assert "checked 2 checkpoint folder(s)" in ok(verify).stdout
    for p, doing in ((show, "show"), (export, "export")):
        assert p.returncode == 2 and f"is a folder of 2 checkpoint(s), not one checkpoint; {doing} one of them" \
            in p.stderr, p.stderr
    assert gc.returncode == 2 and "is not a run root" in gc.stderr and "run gc on each of them" in gc.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_gc_dry_run_changes_nothing_and_gc_spares_young_saves(run_root, tmp_path):
    dry, real = tmp_path / "dry", tmp_path / "real"
    for copy in (dry, real):
        shutil.copytree(run_root, copy)
        interrupted_save(copy / "step-000000500", copy / "step-000000300", age_s=5)  # a live save, maybe
    before = sorted(p.relative_to(dry) for p in dry.rglob("*"))
    dry_run, gc_run = run_all(cmd("gc", dry, "--dry-run"), cmd("gc", real))
    assert sorted(p.relative_to(dry) for p in dry.rglob("*")) == before
    assert "would remove 1 file(s)" in ok(dry_run).stdout and "step-000000400/data-" in dry_run.stdout
    assert "step-000000500" not in dry_run.stdout  # younger than --min-age 3600
    assert "removed 1 file(s)" in ok(gc_run).stdout
    assert not (real / "step-000000400").exists()
    assert list((real / "step-000000500").glob("data-*"))
    for step in (100, 300):
        assert safeckpt.load_state(real / f"step-{step:09d}")["step"] == step


def test_diff(run_root):
    a, b = run_root / "step-000000100", run_root / "step-000000300"
    as_json, close = run_all(cmd("diff", a, b, "--json"), cmd("diff", a, b, "--atol", "1000"))
    d = json.loads(ok(as_json, 1).stdout)
    assert d["verified"] and d["not_read"] == 0
    assert d["identical"] is False and not d["added"] and not d["removed"] and not d["changed"]
    w = {x["name"]: x for x in d["differ"]}["model.0.weight"]
    want = (safeckpt.load_state(a)["model"]["0.weight"] - safeckpt.load_state(b)["model"]["0.weight"]).abs().max()
    assert w["differing"] == 32 and abs(w["max_abs_diff"] - float(want)) < 1e-12
    assert {v["name"] for v in d["values"]} == {"step", "data.epoch"}
    assert {(v["name"], v["a"], v["b"]) for v in d["values"]} == {("step", 100, 300), ("data.epoch", 1, 3)}
    assert [i["name"] for i in d["info"]] == ["metrics.loss"]  # reported, but not a difference
    # within --atol: listed as close and counted in the summary (the values still differ)
    lines = ok(close, 1).stdout.splitlines()
    n_close = sum(line.startswith("close ") for line in lines)
    assert n_close == len(d["differ"]) and f", {n_close} close (within --atol 1000), 0 differ, " in lines[-1], lines


# --------------------------------------------------------------------------- import


def test_import_torch_safetensors_hf_and_dcp(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    full = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 5}
    torch.save(full, tmp_path / "plain.pt")
    st.save_file({"a.w": torch.ones(2, 2), "a.b": torch.arange(3, dtype=torch.int32)}, tmp_path / "one.safetensors",
                 metadata={"format": "pt"})
    hf = tmp_path / "hf"
    hf.mkdir()
    st.save_file({"weight": model.weight.detach()}, hf / "model-00001-of-00002.safetensors")
    st.save_file({"bias": model.bias.detach()}, hf / "model-00002-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 32}, "weight_map": {"weight": "model-00001-of-00002.safetensors",
                                                       "bias": "model-00002-of-00002.safetensors"}}))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(full, checkpoint_id=str(tmp_path / "dcp"))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    torch.save({"x": Evil()}, tmp_path / "evil.pt")

    out = tmp_path / "imported"
    runs = run_all(cmd("import", tmp_path / "plain.pt", out / "torch"),
                   cmd("import", tmp_path / "one.safetensors", out / "st"),
                   cmd("import", hf, out / "hf", "--under", "model"),
                   cmd("import", tmp_path / "dcp", out / "dcp", "--metadata", "note=from-dcp"),
                   cmd("import", tmp_path / "evil.pt", out / "evil"))
    for p, fmt in zip(runs[:4], ("torch", "safetensors", "hf", "dcp")):
        assert f"({fmt})" in ok(p).stdout
    one_error_line(runs[4], "evil.pt", "weights_only")
    assert "pwned" not in runs[4].stdout and not (out / "evil").exists()

    for name, key in (("torch", 0), ("dcp", "0")):  # DCP brings dict keys back as strings
        got = safeckpt.load_state(out / name)
        assert torch.equal(got["model"]["weight"], model.weight) and got["step"] == 5
        assert torch.equal(got["optim"]["state"][key]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
        assert got["optim"]["param_groups"][0]["lr"] == 0.001
    fresh = torch.nn.Linear(3, 2)
    safeckpt.load({"model": fresh}, out / "hf")  # --under model: loads straight into a module
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    got = safeckpt.load_state(out / "st")
    assert torch.equal(got["a.b"], torch.arange(3, dtype=torch.int32)) and torch.equal(got["a.w"], torch.ones(2, 2))
    meta = read_committed(open_storage(out / "dcp")).metadata
    assert meta["source_format"] == "dcp" and meta["note"] == "from-dcp" and meta["imported_from"].endswith("dcp")


def test_dcp_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    import pickle

    folder = tmp_path / "dcp"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(safeckpt.UnsafeObjectError, match="not a DCP metadata type"):
        read_dcp(str(folder))
    assert not (tmp_path / "pwned").exists()


def test_export_helpers():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 << 20 and parse_size("100") == 100
    assert parse_size("1.5kb") == 1500
    for bad in ("5XB", "", "-1", "0"):
        with pytest.raises(ExportError):
            parse_size(bad)
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards([], 8) == [[]]


def test_compare_tensors_and_storage_options(monkeypatch):
    from safeckpt.cli._common import storage_options
    from safeckpt.cli.diff import compare_tensors

    nan, inf = float("nan"), float("inf")
    assert compare_tensors(torch.tensor([1.0, nan, 3.0]), torch.tensor([1.0, nan, 3.5])) == (0.5, 1)
    assert compare_tensors(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0])) == (inf, 1)
    assert compare_tensors(torch.tensor([inf, -1.0]), torch.tensor([inf, -1.0])) == (0.0, 0)
    assert compare_tensors(torch.tensor([True, False]), torch.tensor([True, True])) == (1.0, 1)
    assert compare_tensors(torch.tensor([1, 5]), torch.tensor([1, -5])) == (10.0, 1)
    assert compare_tensors(torch.tensor([0.5, 1.0]).to(torch.float8_e4m3fn),
                           torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn)) == (1.0, 1)
    assert compare_tensors(torch.tensor(3.0), torch.tensor(4.0)) == (1.0, 1)
    monkeypatch.setenv("SAFECKPT_STORAGE_OPTIONS", '{"endpoint_url": "http://a", "anon": false}')
    assert storage_options(("secret=123", "anon=true", "client_kwargs.region_name=eu", "config_kwargs={\"x\": 1}")) == {
        "endpoint_url": "http://a", "anon": True, "secret": "123", "client_kwargs": {"region_name": "eu"},
        "config_kwargs": {"x": 1}}


def test_read_safetensors_matches_the_safetensors_library(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {"f": torch.randn(3, 4), "h": torch.randn(5).bfloat16(), "i": torch.arange(7, dtype=torch.int8),
               "e": torch.zeros(0, 3), "b": torch.tensor([True, False])}
    st.save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    got, meta = read_safetensors(str(tmp_path / "x.safetensors"))
    assert meta == {"k": "v"} and set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


# --------------------------------------------------------------------------- 4 ranks, S3


def test_four_rank_checkpoint_local(four_ranks, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    ckpt, want = four_ranks.local / "step-000000007", expected_model()
    show, verify, sharded, torch_out = run_all(
        cmd("show", ckpt), cmd("verify", four_ranks.local),
        cmd("export", ckpt, tmp_path / "sharded", "--max-shard-size", "200B", "--select", "model.", "--strip-prefix"),
        cmd("export", ckpt, tmp_path / "flat.pt", "--format", "torch"))
    out = ok(show).stdout
    w = next(line.split() for line in out.splitlines() if line.startswith("model.w "))
    assert w[1:] == ["float32", "[16,", "10]", "4", "640", "B"], w  # 4 chunks, one per rank
    assert "world size   4" in out and "pos@3" in out
    assert ": 1 committed" in ok(verify).stdout and "(4 file(s)" in verify.stdout

    ok(sharded)  # the Hugging Face layout: shards + index, names without the prefix
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    merged = {}
    for f in files:
        merged.update(st.load_file(tmp_path / "sharded" / f))
    assert set(merged) == set(index["weight_map"]) == {"w", "e", "bias"}
    assert all(torch.equal(merged[k.removeprefix("model.")], v) for k, v in want.items())
    assert "exported 3 tensor(s), 872 B of data, as 3 safetensors file(s)" in sharded.stdout
    ok(torch_out)
    flat = torch.load(tmp_path / "flat.pt", weights_only=True)
    assert set(flat) == set(want) and all(torch.equal(flat[k], want[k]) for k in want)


def _s3(four_ranks: Ranks) -> Ranks:
    if four_ranks.s3 is None:
        pytest.skip("moto is not installed (pip install 'moto[server]')")
    return four_ranks


@pytest.mark.slow  # the same commands as test_four_rank_checkpoint_local, on moto S3 (~20 s)
def test_four_rank_checkpoint_on_s3(four_ranks, tmp_path):
    ranks = _s3(four_ranks)
    st = pytest.importorskip("safetensors.torch")
    env, want = ranks.env, expected_model()
    ckpt = ranks.s3 + "/step-000000007"
    opts = [a for k, v in ranks.options.items() for a in ("-o", f"{k}={v}")]
    bucket = ranks.s3.split("/")[2]
    # the source of an import: a Hugging Face folder in the bucket
    hf_src = open_storage(f"s3://{bucket}/hf-src", **ranks.options)
    hf_src.write_file("model-00001-of-00002.safetensors", [st.save({k: want[k] for k in ("model.w",)})])
    hf_src.write_file("model-00002-of-00002.safetensors", [st.save({k: want[k] for k in ("model.e", "model.bias")})])
    hf_src.write_file("model.safetensors.index.json", [json.dumps({"metadata": {"total_size": 872}, "weight_map": {
        "model.w": "model-00001-of-00002.safetensors", "model.e": "model-00002-of-00002.safetensors",
        "model.bias": "model-00002-of-00002.safetensors"}}).encode()])
    imported = f"s3://{bucket}/imported"

    ls, show, verify, single, diff, gc, missing, to_s3, from_hf = run_all(
        cmd("ls", ranks.s3, "--json", env=env),
        cmd("show", ckpt, "--json", *opts),  # options on the command line instead
        cmd("verify", ranks.s3, "--json", env=env),
        cmd("export", ckpt, tmp_path / "one" / "model.safetensors", env=env),
        cmd("diff", ranks.local / "step-000000007", ckpt, env=env),
        cmd("gc", ranks.s3, "--dry-run", "--min-age", "0", env=env),
        cmd("ls", f"s3://{bucket}-missing/run", env=env),
        cmd("export", ranks.local / "step-000000007", f"s3://{bucket}/exported", "--max-shard-size", "700B", env=env),
        cmd("import", f"s3://{bucket}/hf-src", imported + "/from-hf", "--under", "m", env=env))

    rows = json.loads(ok(ls).stdout)
    assert [(r["step"], r["status"], r["world_size"], r["metrics"]) for r in rows] == [
        (7, "committed", 4, {"loss": 0.25})]
    assert rows[0]["path"] == ckpt and rows[0]["metadata"] == {"ranks": 4}
    info = json.loads(ok(show).stdout)
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["model.w"]["chunks"] == tensors["model.e"]["chunks"] == 4
    assert tensors["model.e"]["dtype"] == "bfloat16"
    assert tensors["model.bias"]["chunks"] == 1 and info["world_size"] == 4 and len(info["files"]) >= 2
    assert info["values"]["opt.betas"] == "(0.9, 0.99)" and info["values"]["pos@2"] == 20
    verdicts = json.loads(ok(verify).stdout)
    assert [(v["path"], v["status"], v["problems"]) for v in verdicts] == [(ckpt, "committed", [])]
    assert verdicts[0]["bytes"] == rows[0]["bytes"]
    assert ok(diff).stdout.splitlines()[-1].startswith("identical: 3 identical tensor(s)")  # 4 ranks local vs S3
    assert "nothing to remove" in ok(gc).stdout
    one_error_line(missing, "does not exist")

    ok(single)
    got = st.load_file(tmp_path / "one" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    ok(to_s3)  # exported into the bucket: the index and its shards are there and load
    exported = open_storage(f"s3://{bucket}/exported", **ranks.options)
    index = json.loads(exported.read("model.safetensors.index.json"))
    merged = {}
    for f in sorted(set(index["weight_map"].values())):
        merged.update(st.load(exported.read(f)))
    assert set(merged) == set(want) and all(torch.equal(merged[k], want[k]) for k in want)
    assert "(hf)" in ok(from_hf).stdout
    got = safeckpt.load_state(imported + "/from-hf", storage_options=ranks.options)
    assert all(torch.equal(got["m"][k], want[k]) for k in want)


def test_unreachable_store_is_one_clear_line():
    port = free_ports(1)[0]  # nothing listens there
    env = {"SAFECKPT_STORAGE_OPTIONS": json.dumps({
        "endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})}
    one_error_line(run("ls", "s3://bucket/run", env=env), "cannot reach the object store")


def test_wrong_credentials_are_one_clear_line(seaweedfs_server):  # noqa: F811
    bucket = s3_bucket(seaweedfs_server)
    p = run("ls", f"s3://{bucket}/run", "-o", f"endpoint_url={seaweedfs_server.endpoint}",
            "-o", f"key={seaweedfs_server.key}", "-o", "secret=wrong-secret",
            "-o", 'config_kwargs={"retries": {"max_attempts": 1}}')
    one_error_line(p, "credentials")


# --------------------------------------------------------------------------- one vocabulary, first contact


def test_every_command_names_a_folder_state_the_same_way(tmp_path):
    """A newer format is a newer format in ls and verify (never counted corrupt, never 0
    bytes); bare ``safeckpt`` prints its help as --help does; ``show --select`` of a
    missing prefix is an error naming what exists; ``diff`` reads both checkpoints first,
    so it finds a copy whose bytes differ under equal checksums (it used to call it
    identical), and ``--no-verify``, which does not read them, says so in its verdict."""
    from test_corruption import future_version

    root = tmp_path / "run"
    for step in (1, 2):
        safeckpt.save({"w": torch.arange(64.0), "step": step}, root / f"step-{step:09d}", step=step)
    future_version(root / "step-000000002")
    (root / "step-000000003").mkdir()
    copy = tmp_path / "copy"
    shutil.copytree(root / "step-000000001", copy)
    data = next(copy.glob("data-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-8:-4] = b"\x01\x02\x03\x04"  # 4 bytes of w's data
    data.write_bytes(bytes(raw))

    ls, ls_json, verify, verify_json, bare, help_, select, diff, diff_verify, diff_unread = run_all(
        cmd("ls", root), cmd("ls", root, "--json"), cmd("verify", root), cmd("verify", root, "--json"),
        cmd(), cmd("--help"), cmd("show", root / "step-000000001", "--select", "nosuch"),
        cmd("diff", root / "step-000000001", copy), cmd("diff", root / "step-000000001", copy, "--verify"),
        cmd("diff", root / "step-000000001", copy, "--no-verify"))

    states = [(r["step"], r["status"]) for r in json.loads(ok(ls_json).stdout)]
    assert states == [(1, "committed"), (2, "newer_format"), (3, "empty")]
    verdicts = json.loads(ok(verify_json, 1).stdout)
    assert [v["status"] for v in verdicts] == ["committed", "newer_format", "empty"]
    assert verdicts[1]["bytes"] > 0 and "upgrade" in verdicts[1]["problems"][0]
    assert "newer format (upgrade safeckpt)" in ok(ls).stdout and "1 newer format, 1 empty" in ls.stdout
    out = ok(verify, 1).stdout
    assert "CORRUPT" not in out and "corrupt" not in out, out
    assert any(line.startswith("newer format ") and "step-000000002" in line for line in out.splitlines()), out
    assert out.rstrip().endswith("1 committed, 1 newer format, 1 empty") and " 0 B " not in out

    assert ok(bare).stdout == ok(help_).stdout and bare.stdout.count("\n") > 10
    one_error_line(select, "nosuch", "names: w, step")

    for found in (ok(diff, 1).stdout, ok(diff_verify, 1).stdout):
        assert found.splitlines()[-1].startswith("different: 1 problem(s)") and data.name in found
        assert "every byte of both read" in found
    unread = ok(diff_unread).stdout.splitlines()
    assert unread[-1] == ("identical: 1 identical tensor(s) (1 by their checksums, bytes not read), 0 differ, "
                          "0 changed, 0 added, 0 removed; 0 value(s) differ"), unread
    assert "--no-verify: their bytes were not read" in unread[-2]


def test_first_contact_messages_from_python(tmp_path):
    """``load_state`` of a file says it is a file (as the CLI does), of a missing path
    that nothing is there, of an empty folder that it is empty; saving over a
    checkpoint saved without a step never says "(step None)"."""
    torch.save({"w": torch.ones(2)}, tmp_path / "trainer.pt")
    with pytest.raises(safeckpt.CheckpointNotFoundError, match="it is a file, not a checkpoint folder"):
        safeckpt.load_state(tmp_path / "trainer.pt")
    with pytest.raises(safeckpt.CheckpointNotFoundError, match="there is no such folder"):
        safeckpt.load_state(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(safeckpt.CheckpointNotFoundError, match="the folder is empty$"):
        safeckpt.load_state(tmp_path / "empty")
    safeckpt.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    with pytest.raises(safeckpt.CheckpointExistsError) as err:
        safeckpt.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert "step None" not in str(err.value) and "overwrite=True" in str(err.value)
    safeckpt.save({"w": torch.ones(2)}, tmp_path / "stepped", step=3)
    with pytest.raises(safeckpt.CheckpointExistsError, match=r"\(step 3\)"):
        safeckpt.save({"w": torch.ones(2)}, tmp_path / "stepped", step=3)


def test_import_of_a_file_that_is_no_checkpoint_says_so(tmp_path):
    """Text, random bytes, and random bytes that open like a pickle: 'not a checkpoint',
    one line, nothing at DEST; never a KeyError or a hint to unpickle it oneself."""
    files = {"notes.txt": b"hello, these are notes\n", "noise.bin": os.urandom(4096),
             "pickle-like.bin": b"\x80\x02" + os.urandom(4096)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    runs = run_all(*(cmd("import", tmp_path / name, tmp_path / f"out-{name}") for name in files))
    for p, name in zip(runs, files):
        line = one_error_line(p, name, "not a checkpoint")
        assert "KeyError" not in line and "load it yourself" not in line, line
        assert not (tmp_path / f"out-{name}").exists()


# --------------------------------------------------------------------------- the first hour (issue 28)


def test_ls_names_checkpoints_that_are_not_step_folders(tmp_path, capsys):
    """Lightning keeps ``last.ckpt`` beside ``epoch=2-step=12.ckpt``, both of step 12:
    where the folders are not the steps' own, ``ls`` names them (escaped); a run root of
    step folders keeps its step column alone."""
    from safeckpt.cli import main

    for name, step in (("last.ckpt", 12), ("epoch=2-step=12.ckpt", 12), ("epoch=1-step=8.ckpt", 8),
                       ("odd\nname", 3)):
        safeckpt.save({"w": torch.ones(2)}, tmp_path / "ckpts" / name, step=step)
    safeckpt.save({"w": torch.ones(2)}, tmp_path / "run" / "step-000000005", step=5)
    assert main(["ls", str(tmp_path / "ckpts")]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["name", "step"]
    assert ["last.ckpt", "12"] in rows and ["epoch=2-step=12.ckpt", "12"] in rows and ["odd\\nname", "3"] in rows
    assert main(["ls", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.split()[:2] == ["step", "time"]


def test_show_lists_the_files_a_seal_covers(tmp_path, capsys):
    """A sealed folder of another tool's files (a Trainer's checkpoint-N) shows those
    files with their sizes and checksum algorithm, not "0 tensor(s)" and a value None."""
    from safeckpt.cli import main

    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 76)
    (folder / "trainer_state.json").write_text('{"global_step": 5}')
    safeckpt.seal(folder)
    assert main(["show", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "2 sealed file(s), 94 B" in out and "tensor(s)" not in out and "None" not in out, out
    rows = [line.split() for line in out.splitlines()]
    assert ["model.safetensors", "76", "B", "xxh3_64"] in rows and ["trainer_state.json", "18", "B", "xxh3_64"] in rows
    assert main(["show", str(folder), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert [(f["name"], f["checksum"].split(":")[0]) for f in files] == [("model.safetensors", "xxh3_64"),
                                                                        ("trainer_state.json", "xxh3_64")]


def test_progress_bars_know_their_total_and_import_logs_no_rate(tmp_path, capsys, monkeypatch):
    """On a terminal the export and import bars show ``done/total`` (not ``done/?``);
    off one, an import prints its result line and no INFO line ("(0.00 GB/s)")."""
    import io
    import re

    from rich.console import Console

    import safeckpt.cli._common as common
    from safeckpt.cli import main

    safeckpt.save({"w": torch.randn(1000, 1000)}, tmp_path / "ckpt")
    torch.save({"w": torch.randn(1000, 1000)}, tmp_path / "trainer.pt")
    assert main(["import", str(tmp_path / "trainer.pt"), str(tmp_path / "imported")]) == 0
    assert capsys.readouterr().err == ""
    terminal = io.StringIO()
    monkeypatch.setattr(common, "progress_console", lambda: Console(file=terminal, force_terminal=True, width=120))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors")]) == 0
    assert main(["import", str(tmp_path / "trainer.pt"), str(tmp_path / "again")]) == 0
    shown = re.findall(r"(exporting|importing)\S* .*?([0-9.]+/[0-9.?]+ (?:MB|bytes))", terminal.getvalue())
    assert {what for what, _ in shown} == {"exporting", "importing"}, terminal.getvalue()
    unknown = [bar for _, bar in shown if re.match(r"[0-9.]*[1-9][0-9.]*/\?", bar)]
    assert not unknown and any(bar.endswith("/4.0 MB") for _, bar in shown), shown


def test_export_into_a_file_is_one_error_line(tmp_path, capsys):
    from safeckpt.cli import main

    safeckpt.save({"w": torch.ones(3)}, tmp_path / "ckpt")
    (tmp_path / "notes").write_text("a file")
    for out, where in (("notes/model", "notes is a file"), ("notes/model.safetensors", "it is a file"),
                       ("notes", "it is a file")):
        assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / out)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("safeckpt: error: cannot export into ") and where in err[0], err
    assert (tmp_path / "notes").read_text() == "a file"


def test_a_missing_fsspec_package_is_named_for_its_scheme():
    """gs:// without gcsfs asks for gcsfs (not safeckpt[s3]), az:// and abfs:// for
    adlfs, s3:// without s3fs for the s3 extra."""
    code = ("import sys\nfor m in ('gcsfs', 'adlfs', 's3fs'): sys.modules[m] = None\n"
            "from safeckpt.cli import main\n"
            "for url in ('gs://b/run', 'az://b/run', 'abfs://b/run', 's3://b/run'): main(['ls', url])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=BASE_ENV, timeout=120)
    lines = p.stderr.splitlines()
    assert len(lines) == 4 and all(line.startswith("safeckpt: error: ") for line in lines), p.stderr
    wanted = ("pip install fsspec gcsfs", "pip install fsspec adlfs", "pip install fsspec adlfs",
              "pip install 'safeckpt[s3]'")
    for line, hint in zip(lines, wanted):
        assert hint in line, (hint, line)
    assert "safeckpt[s3]" not in "".join(lines[:3])


def test_show_of_a_checkpoint_holding_an_int_over_4300_digits(tmp_path, capsys):
    """Python writes no int of more than 4300 decimal digits as text; ``show`` of a
    checkpoint holding one as a value, a dict key and in its metadata writes it in hex
    (and ``--json`` as a hex string) instead of failing."""
    from safeckpt.cli import main

    big = 2 ** 20000 + 1
    safeckpt.save({"n": big, "k": {big: 1}, "t": torch.ones(1)}, tmp_path / "ckpt", metadata={"n": big})
    assert main(["show", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert hex(big)[:40] in out and f"k.{hex(big)[:40]}" in out, out
    assert main(["show", "--json", str(tmp_path / "ckpt")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert hex(big) in json.dumps(shown), shown


# --------------------------------------------------------------------------- paths that are not files or folders


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_import_of_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    """A FIFO no one writes and ``/dev/zero`` (which never ends) as the source of
    ``safeckpt import``: one error line saying what the path is, at once (the import
    used to block forever), and nothing at DEST."""
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    sources = [(fifo, "is a FIFO")] + [(Path("/dev/zero"), "is a character device")] * os.path.exists("/dev/zero")
    runs = [subprocess.Popen([sys.executable, "-m", "safeckpt", "import", str(source), str(tmp_path / "out")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV,
                             stdin=subprocess.DEVNULL) for source, _ in sources]
    for p, (source, what) in zip(runs, sources):
        try:
            stdout, stderr = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in runs:
                q.kill()
            pytest.fail(f"safeckpt import {source} still reading after 60 s")
        one_error_line(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), str(source), what,
                       "imports regular files only")
    assert not (tmp_path / "out").exists()


def test_a_missing_hugging_face_file_is_named_with_where_it_was_listed(tmp_path, capsys):
    """A shard named by the index but not there names the index; a ``model.safetensors``
    that is a link to nothing (a Hugging Face cache whose blob is gone) says so, never
    "listed in None"."""
    from safeckpt.cli import main

    st = pytest.importorskip("safetensors.torch")
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    sharded.mkdir()
    single.mkdir()
    st.save_file({"a": torch.ones(2)}, sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (single / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    for folder, why in ((sharded, "model-00002-of-00002.safetensors is missing (listed in "
                                  "model.safetensors.index.json)"),
                        (single, "model.safetensors is a link to nothing (the folder's weights file")):
        assert main(["import", str(folder), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and why in err[0] and "None" not in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_ls_of_a_fifo_or_a_device_says_what_it_is(tmp_path, capsys):
    """``ls`` (and ``show``, ``verify``) of a FIFO or a device says what it is, not
    "there is no such folder" (a folder's listing leaves such entries out)."""
    from safeckpt.cli import main

    os.mkfifo(tmp_path / "pipe")
    paths = [(tmp_path / "pipe", "it is a FIFO, not a checkpoint folder")]
    paths += [(Path("/dev/null"), "it is a character device, not a checkpoint folder")] * os.path.exists("/dev/null")
    for path, what in paths:
        for command in ("ls", "show", "verify"):
            assert main([command, str(path)]) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith("safeckpt: error: no checkpoint at ") and what in err[0], err
