"""The ``safeckpt`` command: list, inspect, verify, clean up, export, import and diff
checkpoints on any storage URL.

Every command takes ``-o/--storage-option KEY=VALUE`` (repeatable) and reads
``$SAFECKPT_STORAGE_OPTIONS`` (a JSON object) for endpoints and credentials. Bad
input is one line on stderr (``safeckpt: error: ...``) and exit status 2; ``verify``
and ``diff`` exit 1 for what they find. ``--debug`` (or ``$SAFECKPT_DEBUG=1``) shows
the traceback instead. See docs/cli.md.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings

import click

from .._version import __version__
from ._common import CliError, debug, one_line, printable, set_debug

__all__ = ["cli", "main"]


# name -> (module, command, one line for `safeckpt --help`); a command's module (and
# torch, which most of them need) is imported only when that command runs
_COMMANDS = {
    "ls": ("listing", "ls_command", "List the checkpoints of a run root with their status."),
    "show": ("listing", "show_command", "Show the tensors, values and metadata of a checkpoint."),
    "verify": ("check", "verify_command", "Read every byte and check every checksum."),
    "gc": ("check", "gc_command", "Remove what interrupted saves left behind."),
    "export": ("convert", "export_command", "Consolidate a checkpoint into safetensors or torch files."),
    "import": ("convert", "import_command", "Bring in a torch.save, safetensors, HF or DCP checkpoint."),
    "diff": ("diff", "diff_command", "Compare two checkpoints tensor by tensor."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module, attr, short_help = _COMMANDS[name]
        command: click.Command = getattr(importlib.import_module(f".{module}", __name__), attr)
        command.short_help = short_help
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="safeckpt", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help="show the traceback of an error (also $SAFECKPT_DEBUG=1)")
def cli(debug: bool) -> None:
    """Crash-safe checkpoints for PyTorch: list, inspect, verify, clean up, export,
    import and compare them, on a local path or any storage URL (s3://, gs://, ...).

    Every command takes -o/--storage-option KEY=VALUE for the storage backend
    (endpoint_url, key, secret, ...) and reads $SAFECKPT_STORAGE_OPTIONS (a JSON
    object). Errors are one line on stderr and exit status 2; verify and diff exit 1
    for what they find."""
    set_debug(debug)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    print(f"safeckpt: warning: {one_line(message)}", file=sys.stderr)


class _InfoLines(logging.Handler):
    """Off a terminal (a job's log, a pipe) there is no progress bar: what safeckpt logs
    at INFO (each exported file) is one ``safeckpt: ...`` line on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"safeckpt: {printable(record.getMessage())}", file=sys.stderr)


# an import is one save, and its result line says what the save's INFO line would (with a
# rate that means nothing for a small, instant save): no INFO lines
_NO_INFO_LINES = {"import"}


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 findings, 2 errors)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        set_debug(True)
    warnings.showwarning = _show_warning
    logger, handler = logging.getLogger("safeckpt"), _InfoLines(logging.INFO)
    level = logger.level
    command = next((a for a in args if not a.startswith("-")), None)
    if not sys.stderr.isatty() and command not in _NO_INFO_LINES:
        logger.addHandler(handler)
        logger.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        return _run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: list[str]) -> int:
    try:
        status = cli.main(args=args, prog_name="safeckpt", standalone_mode=False)
        return status if isinstance(status, int) else 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        print("safeckpt: aborted", file=sys.stderr)
        return 130
    except CliError as exc:
        if debug():
            raise
        print(f"safeckpt: error: {one_line(exc.format_message())}", file=sys.stderr)
        return exc.exit_code
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `safeckpt`: the help, as --help prints it
        click.echo(exc.ctx.get_help())
        return 0
    except click.UsageError as exc:
        command = exc.ctx.command_path if exc.ctx is not None else "safeckpt"
        print(f"safeckpt: error: {one_line(exc.format_message()).rstrip('.')} (see '{command} --help')",
              file=sys.stderr)
        return 2
    except click.ClickException as exc:
        print(f"safeckpt: error: {one_line(exc.format_message())}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        if debug():
            raise
        print("safeckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `safeckpt ls ... | head`
        return 0
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - one clear line, never a traceback; torch's
        if debug():               # CheckpointException (DCP) is a BaseException
            raise
        print(f"safeckpt: error: {_describe(exc)}", file=sys.stderr)
        return 2


def _describe(exc: BaseException) -> str:
    from ..errors import CheckpointError

    if isinstance(exc, (CheckpointError, OSError)):
        return one_line(exc)
    return f"{type(exc).__name__}: {one_line(exc)} (run with --debug for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
