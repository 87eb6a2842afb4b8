"""docs/cli.md is real output: every ``$ command`` in its console blocks is run, in
order, on the demo the page describes (built here the same way every time), and what
it prints must match the page, up to what changes from run to run (times, save ids,
the demo's folder, the S3 server's port). ``SAFECKPT_UPDATE_DOCS=1`` rewrites the page
from the run instead. Every command's ``--json`` output is also checked against the
JSON schema the page documents for it.

The commands run in this process (``safeckpt.cli.main``), which is what makes some 40
of them affordable; the 4-rank checkpoint is saved by 4 real gloo processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import safeckpt
from s3servers import free_ports, moto_server  # noqa: F401
from safeckpt.cli import main

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
SHOWN_ROOT = "/tmp/demo"        # the demo folder as the page shows it
SHOWN_PORT, SHOWN_DEAD_PORT = "5590", "5591"
UPDATE = bool(os.environ.get("SAFECKPT_UPDATE_DOCS"))

pytestmark = pytest.mark.timeout(600)


# --------------------------------------------------------------------------- the demo


def _model_state(step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 16, bias=False), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 100))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(step // 50):
        model(torch.randn(8, 100)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def build_demo(demo: Path) -> None:
    """``run/``: a CheckpointManager root, steps 1000-3000 of a model and its AdamW, step
    2000 then damaged by a flipped byte, and the data of a step-4000 save killed before
    its manifest; ``inc/``: an incremental run whose step 100 is retired; ``tp/``: a
    checkpoint saved by 4 gloo ranks; ``trainer.pt``, ``dcp-ckpt``, ``untrusted.pt``."""
    import torch.distributed.checkpoint as dcp
    from test_cli import BASE_ENV, RANK_WORKER, flip_last_byte, interrupted_save

    run = demo / "run"
    with safeckpt.CheckpointManager(run) as mgr:
        for i, step in enumerate((1000, 2000, 3000)):
            model, optim = _model_state(step)
            mgr.save(step, {"model": model, "optim": optim, "step": step,
                            "data": {"epoch": i + 1, "seen": 8 * step}}, metrics={"loss": round(3.6 - i, 1)},
                     metadata={"run": "demo"})
    flip_last_byte(run / "step-000002000")
    interrupted_save(run / "step-000004000", run / "step-000003000", age_s=7200)

    base = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    with safeckpt.CheckpointManager(demo / "inc", keep_last=2, incremental=True) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, {"base": base, "adapter": torch.full((64, 128), float(step))},
                     metrics={"loss": round(100 / step * 0.5 if step > 100 else 1.0, 3)})

    script = demo / "rank_worker.py"
    script.write_text(RANK_WORKER)
    env = {**BASE_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]), "SAFECKPT_TIMEOUT": "60"}
    p = subprocess.run([sys.executable, str(script), json.dumps([[str(demo / "tp" / "step-000000007"), {}]])],
                       env=env, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    script.unlink()

    model, optim = _model_state(3000)
    trainer = {"model": model.state_dict(), "optimizer": optim.state_dict()}
    torch.save(trainer, demo / "trainer.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(trainer, checkpoint_id=str(demo / "dcp-ckpt"))
    torch.save({"x": _Evil()}, demo / "untrusted.pt")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


# --------------------------------------------------------------------------- the page


def console_blocks(text: str) -> list[tuple[int, int, list[tuple[str, str]]]]:
    """(start, end, [(command, output)]) of every ```console block."""
    out = []
    for m in re.finditer(r"```console\n(.*?)```\n", text, re.S):
        pairs: list[tuple[str, list[str]]] = []
        for line in m.group(1).split("\n")[:-1]:
            if line.startswith("$ "):
                pairs.append((line[2:], []))
            else:
                pairs[-1][1].append(line)
        out.append((m.start(1), m.end(1), [(c, "\n".join(o).strip("\n")) for c, o in pairs]))
    return out


def schemas(text: str) -> dict[str, dict]:
    """The JSON schema of each command, from the page's ``<!-- schema: NAME -->`` blocks."""
    return {m.group(1): json.loads(m.group(2))
            for m in re.finditer(r"<!-- schema: (\w+) -->\n```json\n(.*?)```", text, re.S)}


VARYING = [
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"), "YYYY-MM-DD hh:mm:ss"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00"), "ISO-TIME"),
    (re.compile(r'("created": )\d+(\.\d+)?'), r"\1SECONDS"),
    (re.compile(r"\b[0-9a-f]{20}\b"), "SAVE-ID"),
    (re.compile(r"\bin \d+\.\ds\b"), "in N.Ns"),
    (re.compile(r"\b\d+\.\d{3}s\b"), "N.NNNs"),
    (re.compile(r"\b\d+\.\d\d GB/s\b"), "N.NN GB/s"),
]


def normal(text: str) -> str:
    for pattern, repl in VARYING:
        text = pattern.sub(repl, text)
    return text


class Runner:
    """Runs the page's commands in the demo folder, as the page shows them."""

    def __init__(self, demo: Path, endpoint: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
        self.demo, self.endpoint, self.mp = demo, endpoint, monkeypatch
        self.dead = f"127.0.0.1:{free_ports(1)[0]}"
        self.json_outputs: list[tuple[str, object]] = []

    def _in(self, command: str) -> str:
        if self.endpoint:
            command = command.replace(f"http://127.0.0.1:{SHOWN_PORT}", self.endpoint)
        return command.replace(f"127.0.0.1:{SHOWN_DEAD_PORT}", self.dead)

    def shown(self, text: str) -> str:
        text = text.replace(str(self.demo), SHOWN_ROOT).replace(self.dead, f"127.0.0.1:{SHOWN_DEAD_PORT}")
        if self.endpoint:
            text = text.replace(self.endpoint, f"http://127.0.0.1:{SHOWN_PORT}")
            text = text.replace(self.endpoint.removeprefix("http://"), f"127.0.0.1:{SHOWN_PORT}")
        return text

    def run(self, command: str) -> str:
        args = shlex.split(self._in(command))
        both = io.StringIO()  # what `command 2>&1` shows, in order
        out, err = _Tee(both), _Tee(both)
        code = 0
        shown_warning = warnings.showwarning
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if args[0] == "safeckpt":
                code = main(args[1:])
            elif args[0] == "export":
                name, _, value = args[1].partition("=")
                self.mp.setenv(name, value)
            elif args[0] == "cat":
                print(Path(args[1]).read_text(), end="")
            elif args[:2] == ["python", "-c"]:
                exec(compile(args[2], "<python -c>", "exec"), {})
            else:
                raise AssertionError(f"docs/cli.md runs {args[0]!r}, which this test does not know")
        warnings.showwarning = shown_warning
        if args[0] == "safeckpt" and "--json" in args and code in (0, 1):
            self.json_outputs.append((args[1], json.loads(out.getvalue())))
        text = both.getvalue()
        text = text.rstrip("\n") + (f"\n[exit status {code}]" if code else "")
        return self.shown(text).strip("\n")


class _Tee(io.StringIO):
    """One stream of a command (its stdout or stderr) that also writes into both."""

    def __init__(self, both: io.StringIO) -> None:
        super().__init__()
        self.both = both

    def write(self, text: str) -> int:
        self.both.write(text)
        return super().write(text)


@pytest.fixture(scope="module")
def endpoint(request) -> str | None:
    """The S3 section runs on moto when it is installed (bucket ``ckpts`` holding a copy of tp/)."""
    try:
        return request.getfixturevalue("moto_server").endpoint
    except pytest.skip.Exception:
        return None


@pytest.fixture
def demo_dir():
    """A fresh folder whose path is as long as the page's ``/tmp/demo``, so that tables
    sized to the paths they show come out the same."""
    for _ in range(100):
        path = Path(f"/tmp/d{os.urandom(2).hex()[:3]}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        yield path
        shutil.rmtree(path, ignore_errors=True)
        return
    pytest.skip("no free /tmp/dXXX folder")


def test_cli_md_is_what_the_commands_print(demo_dir, monkeypatch, endpoint):
    demo = demo_dir / "demo" if len(str(demo_dir)) != len(SHOWN_ROOT) else demo_dir
    build_demo(demo)
    monkeypatch.chdir(demo)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("SAFECKPT_STORAGE_OPTIONS", raising=False)
    runner = Runner(demo, endpoint, monkeypatch)
    if endpoint:
        from safeckpt.storage import open as open_storage

        fs = open_storage("s3://ckpts", endpoint_url=endpoint, key="demo", secret="demo")
        with contextlib.suppress(Exception):
            fs.fs.mkdir("ckpts")
        for f in (demo / "tp" / "step-000000007").iterdir():
            fs.child("tp/step-000000007").write_file(f.name, [f.read_bytes()])

    text = DOCS.read_text()
    blocks = console_blocks(text)
    mismatches, new_text, pos = [], [], 0
    for start, end, pairs in blocks:
        rendered = []
        for command, shown in pairs:
            needs_s3 = "s3://" in command or "SAFECKPT_STORAGE_OPTIONS" in command
            got = shown if needs_s3 and not endpoint else runner.run(command)
            if normal(got) != normal(shown):
                mismatches.append(f"$ {command}\n--- docs/cli.md:\n{shown}\n--- now:\n{got}")
            rendered.append(f"$ {command}" + (f"\n{got}" if got else ""))
        new_text += [text[pos:start], "\n\n".join(rendered) + "\n"]
        pos = end
    new_text.append(text[pos:])
    if UPDATE:
        DOCS.write_text("".join(new_text))
        return
    assert not mismatches, (f"{len(mismatches)} example(s) in docs/cli.md no longer match (rewrite them with "
                            "SAFECKPT_UPDATE_DOCS=1):\n\n" + "\n\n".join(mismatches[:6]))

    # every command that has --json: its output on the demo matches its documented schema
    jsonschema = pytest.importorskip("jsonschema")
    documented = schemas(text)
    for command in ("ls", "show", "verify", "gc", "export", "import", "diff"):
        assert command in documented, f"docs/cli.md documents no JSON schema for {command}"
    for args in (["ls", "run", "--json"], ["ls", "inc", "--json"], ["verify", "run", "inc", "--json"],
                 ["gc", "inc", "--dry-run", "--min-age", "0", "--json"], ["show", "inc/step-000000300", "--json"],
                 ["diff", "run/step-000001000", "run/step-000003000", "--verify", "--json"],
                 ["export", "tp/step-000000007", "schema-check", "--json"],
                 ["import", "trainer.pt", "imported/schema-check", "--json"]):
        runner.run("safeckpt " + " ".join(args))
    seen = set()
    for command, output in runner.json_outputs:
        jsonschema.validate(output, documented[command])
        seen.add(command)
    assert seen == set(documented), f"--json never ran for {set(documented) - seen}"


def test_the_readme_use_snippet_runs_twice(tmp_path, monkeypatch):
    """Pasted as written, the README's first example works, and works again."""
    readme = (DOCS.parent.parent / "README.md").read_text()
    use = readme[readme.index("## Use\n"):readme.index("**What a state may hold:**")]
    code = "\n".join(re.findall(r"```python\n(.*?)```", use, re.S))
    monkeypatch.chdir(tmp_path)
    for restored in (None, 900):
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)
        assert namespace["report"].ok and namespace["fut"].result().step is None
        assert namespace["restored"] == restored  # the second run resumes after the last save
        if restored is None:  # (the second run's restore loads the first run's model)
            assert torch.equal(namespace["full"]["model"]["weight"], namespace["model"].weight.detach())
    assert safeckpt.CheckpointManager(tmp_path / "ckpt" / "run").steps() == [700, 800, 900]
