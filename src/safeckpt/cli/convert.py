"""``safeckpt export`` (to safetensors / torch files) and ``safeckpt import`` (from
torch.save, safetensors, Hugging Face and torch.distributed.checkpoint)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import CheckpointExistsError
from ..interop.export import export_checkpoint
from ..interop.imports import FORMATS, import_checkpoint
from ..storage import open as open_storage
from ._common import (CliError, CountingWrites, parse_value, console, human_bytes, is_url, locate, options_for,
                      print_json, progress_bar, say, storage_option_flag, storage_options, table, text)


@click.command("export")
@click.argument("ckpt")
@click.argument("out")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]), default="safetensors",
              show_default=True, help="safetensors file(s), or torch.save file(s) of a flat name -> tensor dict")
@click.option("--max-shard-size", metavar="SIZE",
              help="split into files of at most SIZE (e.g. 5GB, 500MiB) in the Hugging Face layout: "
                   "model-00001-of-0000N.safetensors + model.safetensors.index.json; OUT is a folder")
@click.option("--select", metavar="PREFIX", help="only tensors whose name starts with PREFIX, e.g. model.")
@click.option("--strip-prefix", is_flag=True, help="remove the --select PREFIX from the exported names")
@click.option("--overwrite", is_flag=True, help="replace existing output files")
@click.option("--no-verify", is_flag=True, help="skip checking the checksums of what is read")
@click.option("--json", "as_json", is_flag=True, help="print what was written as JSON")
@storage_option_flag
def export_command(ckpt: str, out: str, fmt: str, max_shard_size: str | None, select: str | None,
                   strip_prefix: bool, overwrite: bool, no_verify: bool, as_json: bool,
                   storage_option: tuple[str, ...]) -> int:
    """Consolidate a (sharded) checkpoint into standard files that other tools load.

    OUT ending in .safetensors (or .pt/.bin for --format torch) is one file; anything
    else is a folder (model.safetensors or pytorch_model.bin in it, or the sharded
    layout with --max-shard-size). Full tensors are assembled from the checkpoint's
    chunks a batch at a time and streamed out: safetensors output never holds the
    whole model in memory, torch output holds one output file (use --max-shard-size
    for large models). Non-tensor values are not exported."""
    options = storage_options(storage_option)
    source = locate(ckpt, options).one_checkpoint("export")
    with progress_bar("exporting") as bar:
        result = export_checkpoint(source, out, format=fmt, max_shard_size=max_shard_size,
                                   select=select, strip_prefix=strip_prefix,
                                   out_storage_options=options_for(out, options),
                                   overwrite=overwrite, verify=not no_verify,
                                   on_start=bar.total, on_tensor=lambda name, n: bar.advance(n))
    if as_json:
        print_json({"path": result.folder, "format": fmt,
                    "files": [{"name": f.name, "bytes": f.bytes, "tensor_count": f.tensors} for f in result.files],
                    "index": result.index, "config": result.config, "tensor_count": result.tensors,
                    "bytes": result.bytes, "tied": result.tied, "values_left_out": result.skipped_values})
        return 0
    o = console()
    t = table("file", "tensors", "size", right=("tensors", "size"))
    for f in result.files:
        t.add_row(text(f"{result.folder}/{f.name}"), text(f.tensors), text(human_bytes(f.bytes)))
    if result.config:
        t.add_row(text(f"{result.folder}/{result.config}"), text("-"), text("config"))
    if result.index:
        t.add_row(text(f"{result.folder}/{result.index}"), text("-"), text("index"))
    o.print(t)
    say(o, f"exported {result.tensors} tensor(s), {human_bytes(result.bytes)} of data, "
                 f"as {len(result.files)} {fmt} file(s)"
                 + (f"; {len(result.tied)} tied tensor(s) written once ({_tied(result.tied)})" if result.tied else "")
                 + (f"; {result.skipped_values} non-tensor value(s) left out" if result.skipped_values else ""))
    return 0


def _tied(ties: dict[str, str]) -> str:
    shown = [f"{alias} = {kept}" for alias, kept in list(ties.items())[:3]]
    return ", ".join(shown) + (", ..." if len(ties) > 3 else "")


def _metadata(pairs: tuple[str, ...]) -> dict:
    meta = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.UsageError(f"--metadata takes KEY=VALUE, not {pair!r}")
        meta[key] = parse_value(value)
    return meta


def _local_bytes(src: str) -> int | None:
    """The size of a local source (its file, or its folder's files): about what an
    import writes, its progress bar's total. Unknown for a URL (fetched first)."""
    if is_url(src):
        return None
    path = Path(src.removeprefix("file://"))
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) or None


@click.command("import")
@click.argument("src")
@click.argument("dest")
@click.option("--format", "fmt", type=click.Choice(["auto", *FORMATS]), default="auto", show_default=True,
              help="what SRC is: a torch.save file, a .safetensors file, a Hugging Face folder (hf) "
                   "or a torch.distributed.checkpoint folder (dcp)")
@click.option("--under", metavar="KEY", help="nest the imported state under KEY (e.g. model: tensors "
                                              "become model.<name>)")
@click.option("--metadata", "metadata", multiple=True, metavar="KEY=VALUE", help="metadata to record (repeatable)")
@click.option("--overwrite", is_flag=True, help="replace a checkpoint already committed at DEST")
@click.option("--json", "as_json", is_flag=True, help="print the imported checkpoint as JSON")
@storage_option_flag
def import_command(src: str, dest: str, fmt: str, under: str | None, metadata: tuple[str, ...],
                   overwrite: bool, as_json: bool, storage_option: tuple[str, ...]) -> int:
    """Bring a checkpoint of another tool in as a safeckpt checkpoint at DEST.

    SRC is a torch.save file (read with weights_only=True: nothing in it can run), a
    .safetensors file, a Hugging Face folder (model.safetensors.index.json and its
    shards, or one model.safetensors / pytorch_model.bin), or a
    torch.distributed.checkpoint folder; local or a URL."""
    options = storage_options(storage_option)
    target = open_storage(dest, **options_for(dest, options))
    try:
        with progress_bar("importing", _local_bytes(src)) as bar:
            info, detected = import_checkpoint(src, CountingWrites(target, bar.advance),
                                               format=None if fmt == "auto" else fmt, under=under,
                                               overwrite=overwrite, metadata=_metadata(metadata),
                                               src_storage_options=options_for(src, options))
    except CheckpointExistsError as exc:
        raise CliError(f"{exc} (here: --overwrite)") from exc
    if as_json:
        print_json({"source": src, "source_format": detected, "path": info.path, "save_id": info.save_id,
                    "bytes": info.bytes, "file_count": len(info.files)})
        return 0
    say(console(), f"imported {src} ({detected}) as {info.path}: {human_bytes(info.bytes)} in "
                         f"{len(info.files)} file(s), save id {info.save_id}")
    return 0

