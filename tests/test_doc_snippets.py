"""Every ```python block of README.md and docs/*.md runs as written, twice in one folder
(a reader who pastes it, then pastes it again), and the figures docs/format.md shows
are what its code writes.

Each block runs in a fresh process with the venv's python, in a folder of its own,
then again in the folder the first run left (``tests/helpers/snippet_runner.py``: one
process imports torch once and forks a child per run, several at a time). A block that
starts with ``>>>`` is a doctest: its outputs must match too. A block cannot run alone
only when the page says so, in an HTML comment on the line(s) just above its fence
(docs/testing.md, "The docs' own examples"):

    <!-- snippet: skip (needs an S3 bucket) -->        not run: a server, a GPU, several processes
    <!-- snippet: fragment (a model and a Trainer) --> not run: lines of a larger program
    <!-- snippet: continues -->                       runs after the page's previous python block
    <!-- snippet: name worked-example -->             a name other blocks can run first ...
    <!-- snippet: after worked-example -->            ... with this

The test of a block that is not run reports the reason as its skip.
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from safeckpt.format.checksum import checksum
from safeckpt.format.manifest import FORMAT_VERSION, WRITE_VERSION, decode_manifest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNER = Path(__file__).resolve().parent / "helpers" / "snippet_runner.py"
FORMAT_MD = ROOT / "docs" / "format.md"
UPDATE = bool(os.environ.get("SAFECKPT_UPDATE_DOCS"))

FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"^[ \t]*<!-- snippet: (.*?) -->[ \t]*$")
DIRECTIVES = {"skip": re.compile(r"(skip|fragment) \((.+)\)"), "continues": re.compile(r"continues"),
              "name": re.compile(r"name ([\w.-]+)"), "after": re.compile(r"after ([\w.-]+)")}


@dataclass
class Block:
    """One ```python block of a page and what its markers say."""

    page: str          # relative to the repository
    line: int          # of its first line of code
    code: str
    not_run: str = ""  # "skip: reason" or "fragment: reason"
    continues: bool = False
    name: str = ""
    after: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def mark(self, marker: str) -> None:
        for kind, pattern in DIRECTIVES.items():
            m = pattern.fullmatch(marker.strip())
            if m is None:
                continue
            if kind == "skip":
                self.not_run = f"{m.group(1)}: {m.group(2)}"
            elif kind == "continues":
                self.continues = True
            elif kind == "name":
                self.name = m.group(1)
            else:
                self.after.append(m.group(1))
            return
        self.errors.append(f"unknown snippet marker {marker!r} (docs/testing.md lists them)")


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    lines = text.split("\n")
    blocks = []
    for m in FENCE.finditer(text):
        fence = text.count("\n", 0, m.start())  # the fence's line, counted from 0
        indent = m.group(1)
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in m.group(2).split("\n"))
        block = Block(str(page.relative_to(ROOT)), fence + 2, code)
        above = fence - 1
        while above >= 0 and (marker := MARKER.match(lines[above])):
            block.mark(marker.group(1))
            above -= 1
        blocks.append(block)
    return blocks


def all_blocks() -> list[Block]:
    blocks = [b for page in PAGES for b in page_blocks(page)]
    names = [b.name for b in blocks if b.name]
    for b in blocks:
        if b.name and names.count(b.name) > 1:
            b.errors.append(f"the snippet name {b.name!r} is given to more than one block")
        b.errors += [f"runs after {n!r}, which no block is named" for n in b.after if n not in names]
    return blocks


BLOCKS = all_blocks()
BY_ID = {b.id: b for b in BLOCKS}


def chain(block: Block, seen: tuple[str, ...] = ()) -> tuple[list[Block], str]:
    """The blocks to run for ``block``, in order (the ones it continues or runs after,
    then itself), or the reason it is not run."""
    if block.not_run:
        return [], block.not_run
    if block.id in seen:
        return [], f"runs after itself ({' -> '.join(seen)})"
    page = [b for b in BLOCKS if b.page == block.page]
    before = []
    if block.continues:
        at = page.index(block)
        if at == 0:
            return [], "continues, but is the first python block of its page"
        before.append(page[at - 1])
    before += [b for name in block.after for b in BLOCKS if b.name == name]
    parts: list[Block] = []
    for dep in before:
        dep_parts, reason = chain(dep, (*seen, block.id))
        if reason:
            return [], f"runs after {dep.id}, which is not run ({reason})"
        parts += [p for p in dep_parts if p not in parts]
    return parts + [block], ""


class Runs:
    """Every runnable block run twice (one runner process for all): ``results[id]`` is
    the list of runs, ``folders[id]`` where they ran (``+ ".first"``: as the first left it)."""

    def __init__(self, base: Path) -> None:
        self.folders: dict[str, Path] = {}
        jobs = []
        for i, block in enumerate(BLOCKS):
            parts, reason = chain(block)
            if reason or block.errors:
                continue
            folder = self.folders[block.id] = base / f"{i:02d}-{Path(block.page).stem}-{block.line}"
            folder.mkdir()
            jobs.append({"id": block.id, "folder": str(folder),
                         "parts": [{"file": p.page, "line": p.line, "code": p.code} for p in parts]})
        logs = base / "logs"
        logs.mkdir()
        spec = base / "jobs.json"
        spec.write_text(json.dumps({"jobs": jobs, "parallel": max(2, min(4, os.cpu_count() or 2)),
                                    "timeout": 240, "logs": str(logs)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(RUNNER.parent), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, str(RUNNER), str(spec)], capture_output=True, text=True, env=env,
                              timeout=900, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"the snippet runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        self.results = {r["id"]: r["runs"] for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("snippets"))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_block_runs_twice_in_one_folder(block, runs):
    assert not block.errors, f"{block.id}: " + "; ".join(block.errors)
    parts, reason = chain(block)
    if reason:
        pytest.skip(reason)
    first, *again = runs.results[block.id]
    pasted = " (after " + ", ".join(p.id for p in parts[:-1]) + ")" if len(parts) > 1 else ""
    assert first["ok"], f"{block.id}{pasted} fails as written:\n{first['output'][-5000:]}"
    assert again and again[0]["ok"], (f"{block.id}{pasted} runs once, then fails when run again in the same "
                                      f"folder:\n{again[0]['output'][-5000:]}")


def test_every_python_block_of_the_pages_is_found():
    """A fence the pattern above missed would be a block no test runs."""
    for page in PAGES:
        text = page.read_text()
        found = len(page_blocks(page))
        assert found == len(re.findall(r"^[ \t]*```python[ \t]*$", text, re.M)), page
    assert sum(b.page == "README.md" for b in BLOCKS) >= 5 and len(BLOCKS) >= 20


def test_the_examples_say_to_run_the_venvs_commands():
    """The examples' headers say how to run them, with the venv's python and torchrun
    (README: they are not on the PATH)."""
    bare = []
    for example in sorted((ROOT / "examples").glob("*.py")):
        doc = example.read_text().split('"""')[1]
        bare += [f"{example.name}: {line.strip()}" for line in doc.splitlines()
                 if re.match(r"\s+(python|torchrun)\s", line)]
    assert not bare, "use .venv/bin/python and .venv/bin/torchrun:\n" + "\n".join(bare)


# --------------------------------------------------------------------------- docs/format.md, §11

SHOWN = re.compile(r"<!-- worked example: (\w+) -->\n```(\w*)\n(.*?)```\n", re.S)


def _ints(packed: str) -> list[int]:
    return np.frombuffer(zlib.decompress(base64.b64decode(packed)), "<i8").tolist()


def worked_example(run: Path) -> dict[str, str]:
    """Each figure block of §11, rendered from the files the example wrote in ``run``."""
    step = run / "step-000000003"
    (lease,) = run.glob("safeckpt-writer-*.json")
    (manifest,) = step.glob("manifest-*.json")
    (data,) = step.glob("data-*.safetensors")
    rows = [("run/", None), (f"  {lease.name}", lease), (f"  {step.name}/", None),
            *((f"    {f.name}", f) for f in sorted(step.iterdir()))]
    width = max(len(name) for name, _ in rows) + 5
    files = "\n".join(name if f is None else f"{name:<{width}}{f.stat().st_size:>4} bytes" for name, f in rows)
    raw = manifest.read_bytes()
    body = json.loads(raw[12:-40])
    table = body["tensors"]
    digests = base64.b64decode(table["digests"])
    columns = "\n".join(f"{name:<10}{_ints(packed)}" for name, packed in table["columns"].items())
    columns += "\ndigests   " + " ".join(f"{table['algorithms'][0]}:{digests[i:i + 8].hex()}"
                                       for i in range(0, len(digests), 8))
    blob = data.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = blob[8:8 + n].decode()
    padding = len(header) - len(header.rstrip(" "))
    layout = [f"{'[0, 8)':<13}{blob[:8].hex(' ')}   N = {n}",
              f"{f'[8, {8 + n})':<13}the header: {n - padding} bytes of JSON, {padding} spaces of padding"]
    cols = {k: _ints(v) for k, v in table["columns"].items()}
    for name, d, start, length in zip(table["names"], cols["dtype"], cols["start"], cols["length"]):  # one chunk each
        dtype = table["dtypes"][d]
        layout.append(f"{f'[{start}, {start + length})':<13}{name}: {length // np.dtype(dtype).itemsize} x {dtype}")
    return {"files": files, "lease": lease.read_text(), "manifest": raw.decode().rstrip("\n"),
            "body": json.dumps(body, indent=4), "columns": columns, "data": "\n".join(layout), "header": header}


VARYING = [  # what differs from run to run: ids, the lease's owner, times, what checksums them
    (re.compile(r"\b[0-9a-f]{20}\b"), "SAVE-ID"),
    (re.compile(r'("run_id": ?")[0-9a-f]{16}"'), r'\1RUN-ID"'),
    (re.compile(r'("token": ?")[0-9a-f]{32}"'), r'\1TOKEN"'),
    (re.compile(r'("host": ?")[^"]*"'), r'\1HOST"'),
    (re.compile(r'("pid": ?)\d+'), r"\1PID"),
    (re.compile(r'("safeckpt_writer":")\d{10}@[0-9a-f]{16}"'), r'\1WRITER"'),
    (re.compile(r'("hostname": ?")[^"]*"'), r'\1HOSTNAME"'),
    (re.compile(r'("created": ?)[0-9.e+]+'), r"\1TIME"),
    (re.compile(r'("(?:header_)?checksum": ?")xxh3_64:[0-9a-f]{16}"'), r'\1CHECKSUM"'),
    (re.compile(r'("(?:dtype|ndim|chunks|tied|shape|file|start|length|algorithm|offsets|box)": ?")'
                r'[A-Za-z0-9+/=]+"'), r'\1PACKED"'),  # zlib builds may deflate differently
    (re.compile(r"((?:safeckpt-writer|manifest)-\d+\.json) +\d+ bytes"), r"\1 N bytes"),  # ids and times in them
]


def normal(text: str) -> str:
    for pattern, repl in VARYING:
        text = pattern.sub(repl, text)
    return text


def test_format_md_worked_example_shows_what_its_code_writes(runs):
    """§11's files, sizes, lease, manifest, table columns and data file are those the
    example wrote, up to what changes from run to run; and the page agrees with
    itself where those enter (sizes, checksums)."""
    (block,) = [b for b in BLOCKS if b.name == "worked-example"]
    assert runs.results[block.id][0]["ok"], runs.results[block.id][0]["output"]
    made = worked_example(runs.folders[block.id].with_name(runs.folders[block.id].name + ".first") / "run")
    text = FORMAT_MD.read_text()
    if UPDATE:
        FORMAT_MD.write_text(SHOWN.sub(lambda m: f"<!-- worked example: {m.group(1)} -->\n```{m.group(2)}\n"
                                                 f"{made[m.group(1)]}\n```\n", text))
        return
    shown = {m.group(1): m.group(3).rstrip("\n") for m in SHOWN.finditer(text)}
    assert shown.keys() == made.keys(), shown.keys()
    differ = [f"--- docs/format.md:\n{shown[k]}\n--- the example writes:\n{made[k]}"
              for k in made if normal(shown[k]) != normal(made[k])]
    assert not differ, "docs/format.md §11 no longer shows what its example writes (SAFECKPT_UPDATE_DOCS=1 " \
                       "rewrites it):\n" + "\n".join(differ)

    # the shown manifest is a valid one (frame, checksum), its body the one pretty-printed,
    # its size and the lease's the ones listed, the header the one its checksum names
    stored = (shown["manifest"] + "\n").encode()
    m = decode_manifest(stored, "docs/format.md")
    assert m.version == WRITE_VERSION and json.dumps(json.loads(stored[12:-40]), indent=4) == shown["body"]
    sizes = dict(re.findall(r"(\S+) +(\d+) bytes", shown["files"]))
    assert int(sizes[next(n for n in sizes if n.startswith("manifest-"))]) == len(stored)
    assert int(sizes[next(n for n in sizes if n.startswith("safeckpt-writer-"))]) == len(shown["lease"].encode())
    (data,) = m.files.values()
    assert int(sizes[data.name]) == data.size and data.name.startswith(f"data-{m.save_id}-")
    header = shown["header"].encode()
    assert checksum(struct.pack("<Q", len(header)) + header) == data.header_checksum
    assert f'"safeckpt_save_id":"{m.save_id}"' in shown["header"]


def test_format_md_names_the_versions_this_safeckpt_reads_and_writes():
    text = " ".join(FORMAT_MD.read_text().split())
    assert f"currently **{FORMAT_VERSION}**" in text and f"it now writes version {WRITE_VERSION} " in text
    assert "The manager writes version 1 unless" not in text
