"""What every ``safeckpt`` command shares: storage options, output, and reading the
things a command is pointed at (a checkpoint, or a run root of ``step-*`` folders)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import click

from ..errors import CheckpointError, CheckpointNotFoundError, UnsafeObjectError
from ..format.states import CheckpointState
from ..format.names import manifest_seq, step_of
from ..format.text import too_long, value_repr
from ..format.tree import decode_value
from ..storage import Storage, StorageWrapper
from ..storage.local import not_regular
from ..storage import open as open_storage

ENV_OPTIONS = "SAFECKPT_STORAGE_OPTIONS"


class CliError(click.ClickException):
    """Bad input found by a command itself: printed as one line, exit 2."""

    exit_code = 2


# --------------------------------------------------------------------------- storage options


def parse_value(text: str) -> Any:
    """``true``/``false``/``null``, numbers and JSON objects/arrays are parsed; anything
    else stays a string (quote a string that looks like JSON: ``key='"123"'``)."""
    stripped = text.strip()
    if stripped in ("true", "false", "null") or stripped[:1] in ("{", "[", '"'):
        try:
            return json.loads(stripped)
        except ValueError:
            return text
    try:
        return int(stripped)
    except ValueError:
        pass
    try:
        value = float(stripped)
        return value if math.isfinite(value) else text
    except ValueError:
        return text


_ALWAYS_STRINGS = {"key", "secret", "token", "password", "username", "profile", "account_name",
                   "account_key", "sas_token", "endpoint_url"}  # a numeric secret stays a string


def storage_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``$SAFECKPT_STORAGE_OPTIONS`` (a JSON object), then each ``KEY=VALUE`` on top;
    a dotted key sets a nested option (``client_kwargs.region_name=eu-west-1``)."""
    options: dict[str, Any] = {}
    env = os.environ.get(ENV_OPTIONS, "").strip()
    if env:
        try:
            options = json.loads(env)
        except ValueError as exc:
            raise CliError(f"${ENV_OPTIONS} is not valid JSON ({exc})") from exc
        if not isinstance(options, dict):
            raise CliError(f"${ENV_OPTIONS} must be a JSON object, like "
                           '\'{"endpoint_url": "http://127.0.0.1:9000"}\'')
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise click.UsageError(f"--storage-option takes KEY=VALUE, not {pair!r}")
        *parents, leaf = key.strip().split(".")
        node = options
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise click.UsageError(f"--storage-option {key}: {part} is not a nested option")
        node[leaf] = text if leaf in _ALWAYS_STRINGS else parse_value(text)
    return options


def is_url(path: str) -> bool:
    """A storage URL (``s3://``, ``gs://``, ``memory://``...), not a local path."""
    return "://" in path and not path.startswith("file://")


def options_for(path: str, options: dict[str, Any]) -> dict[str, Any]:
    """Storage options go to URLs only: a local path in the same command (``export
    s3://... ./out``) takes none."""
    return options if is_url(path) else {}


def storage_option_flag(fn: Callable) -> Callable:
    """``-o/--storage-option KEY=VALUE`` (repeatable) and ``--debug`` on a command."""
    fn = click.option("--debug", is_flag=True, hidden=True, expose_value=False,
                      callback=lambda ctx, p, v: set_debug(v) if v else None)(fn)
    return click.option(
        "-o", "--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE",
        help=f"an option for the storage backend, e.g. endpoint_url=http://127.0.0.1:9000, key=..., "
             f"secret=... (repeatable; also ${ENV_OPTIONS} as a JSON object)")(fn)


_DEBUG = {"on": bool(os.environ.get("SAFECKPT_DEBUG"))}


def set_debug(on: bool) -> None:
    _DEBUG["on"] = _DEBUG["on"] or on


def debug() -> bool:
    return _DEBUG["on"]


# --------------------------------------------------------------------------- output


class _Plain:
    """Where output is not a terminal: render with rich, then strip the padding rich
    adds at the end of each line (clean for files, pipes and copy-paste)."""

    def __init__(self, console: Any) -> None:
        self._console = console
        self.is_terminal = False

    def print(self, *objects: Any, **kwargs: Any) -> None:
        with self._console.capture() as cap:
            self._console.print(*objects, **kwargs)
        self._console.file.write("\n".join(line.rstrip() for line in cap.get().split("\n")))
        self._console.file.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._console, name)


def console(stderr: bool = False) -> Any:
    """A rich console: no markup (names may contain brackets), no highlighting; wide
    when not a terminal, so piped tables are not squeezed to 80 columns."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(file=stream, markup=False, highlight=False, emoji=False)
    width = int(os.environ.get("COLUMNS", "0") or 0) or 200
    return _Plain(Console(file=stream, markup=False, highlight=False, emoji=False, width=width))


def progress_console() -> Any:
    """The console for progress bars: stderr, disabled by the caller when not a terminal."""
    from rich.console import Console

    return Console(file=sys.stderr, markup=False, highlight=False, emoji=False)


class Bar:
    """What a command tells its progress bar: bytes done, and the total once known."""

    def __init__(self, progress: Any, task: Any) -> None:
        self.progress, self.task = progress, task

    def advance(self, nbytes: int) -> None:
        self.progress.advance(self.task, nbytes)

    def total(self, nbytes: int | None) -> None:
        self.progress.update(self.task, total=nbytes)


@contextlib.contextmanager
def progress_bar(what: str, total: int | None = None) -> Iterator[Bar]:
    """A bytes-done bar on stderr while a long command runs, only on a terminal (off one,
    the INFO log lines say what happened). ``total``: the bytes it will do, when known
    before it starts (``Bar.total`` sets it later); unknown, the bar shows ``?``."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    err = progress_console()
    with Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        yield Bar(progress, progress.add_task(what, total=total))


class CountingWrites(StorageWrapper):
    """A storage that reports every byte written (for a progress bar)."""

    def __init__(self, inner: Storage, advance: Callable[[int], None]) -> None:
        super().__init__(inner)
        self.advance = advance

    def write_file(self, name: str, parts: Iterable[Any]) -> int:
        def counted() -> Iterator[Any]:
            for part in parts:
                yield part
                self.advance(memoryview(part).nbytes)
        return self.inner.write_file(name, counted())


def table(*columns: str, right: tuple[str, ...] = (), title: str | None = None):
    """A plain table (copy-pastes cleanly)."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False,
              show_edge=False, title_style="bold")
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    return t


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(value: Any) -> str:
    """``str(value)`` with control, line-breaking and bidi characters escaped (``\\n``,
    ``\\x1b``): folder, file and tensor names come from storage and manifests, and a
    newline in one must not forge a row of a listing (``--json`` stays exact)."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))


def one_line(exc: "BaseException | str") -> str:
    """An error as one printable line (a message over several lines is joined with ``;``)."""
    text = str(exc).strip() or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return printable("; ".join(lines))


def text(value: Any):
    """A table cell: the value as text, escaped (``printable``)."""
    from rich.text import Text

    return Text(printable(value))


def say(out: Any, line: str) -> None:
    """Print one line of text, escaped (``printable``), never wrapped or interpreted."""
    out.print(text(line), soft_wrap=True)


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str, allow_nan=False))


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value: float = n
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


def when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return _dt.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def iso_time(seconds: float) -> str:
    """A manifest's creation time in ``--json``: ISO 8601, UTC."""
    return _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc).isoformat()


def count_states(states: Any) -> str:
    """``3 committed, 1 torn``: how many folders are in each state, in the states' order
    (committed always shown)."""
    found = list(states)
    return ", ".join(f"{found.count(s)} {s.value.replace('_', ' ')}" for s in CheckpointState
                     if s is CheckpointState.COMMITTED or s in found)


def compact(value: Any, limit: int = 80) -> str:
    """A one-line, bounded repr."""
    if isinstance(value, float):
        out = f"{value:.6g}"
    elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
        out = ", ".join(f"{k}={compact(v, limit)}" for k, v in value.items()) if value else "{}"
    else:
        out = value_repr(value)
    out = " ".join(out.split())
    return out if len(out) <= limit else out[:limit - 3] + "..."


def jsonable(value: Any) -> Any:
    """A decoded value as JSON: plain types as they are (an int too long for decimal
    text in hex), anything else as its repr."""
    if isinstance(value, int) and not isinstance(value, bool) and too_long(value):
        return hex(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: jsonable(v) for k, v in value.items()}
    return value_repr(value)


# --------------------------------------------------------------------------- the tree


PICKLED = "<pickled object: not decoded>"


def decode(node: Any, key: str) -> Any:
    """Decode an encoded value for display; pickled values are never unpickled."""
    try:
        return decode_value(node, key, allow_pickle=False)
    except UnsafeObjectError:
        return PICKLED
    except CheckpointError as exc:
        return f"<undecodable: {exc}>"


# --------------------------------------------------------------------------- targets


@dataclass
class Place:
    """What a path names: a checkpoint, a run root with its step folders, or a folder
    whose sub-folders are checkpoints of other names (``ckpt/best``, ``ckpt/step-100``)."""

    storage: Storage
    kind: str           # "checkpoint", "root" or "folders"
    folders: list[str]  # the checkpoint folders in it (a root's by step), none for a checkpoint

    def checkpoints(self) -> list[Storage]:
        """The checkpoint folders it names: itself, or the folders in it."""
        return [self.storage.child(n) for n in self.folders] if self.folders else [self.storage]

    def one_checkpoint(self, doing: str) -> Storage:
        """The checkpoint a command that works on one needs, or a clear error naming one."""
        if self.kind == "checkpoint":
            return self.storage
        found = self.checkpoints()
        what = "a run root" if self.kind == "root" else "a folder"
        raise CliError(f"{self.storage.url} is {what} of {len(found)} checkpoint(s), not one checkpoint; "
                       f"{doing} one of them, e.g. {found[-1].url}")


def locate(path: str, options: dict[str, Any]) -> Place:
    """Open ``path`` and tell a checkpoint folder from a run root or a folder of
    checkpoints; anything else (a missing path, a folder with none of them) is an error."""
    storage = open_storage(path, **options_for(path, options))
    listing = storage.listdir()
    if _has_manifest(listing):
        return Place(storage, "checkpoint", [])
    steps = sorted((step, name) for name, size in listing.items()
                   if size is None and (step := step_of(name)) is not None)
    if steps:
        return Place(storage, "root", [name for _, name in steps])
    folders = sorted(name for name, size in listing.items() if size is None and _has_manifest(storage.child(name).listdir()))
    if folders:
        return Place(storage, "folders", folders)
    if not listing:
        from ..format.folder import read_committed

        kind = None if is_url(path) else not_regular(path.removeprefix("file://"))
        if kind and kind != "a folder":  # a listing leaves FIFOs and devices out: "no such folder" would be wrong
            raise CheckpointNotFoundError(f"no checkpoint at {storage.url}: it is {kind}, not a checkpoint folder")
        read_committed(storage, listing)  # raises, saying whether it is a file or nothing
    raise CheckpointNotFoundError(
        f"no checkpoint at {storage.url}: it has no manifest and no step-NNNNNNNNN folders, and none of its "
        "folders holds a manifest "
        "(not a safeckpt checkpoint or run root, or a save that never committed)")


def _has_manifest(listing: dict[str, int | None]) -> bool:
    return any(manifest_seq(n) is not None for n, size in listing.items() if size is not None)
