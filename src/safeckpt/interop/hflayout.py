"""What an export needs to write the layout Hugging Face's ``save_pretrained`` writes:
each tied weight once (``from_pretrained`` ties it again), and the model's
``config.json`` when the checkpoint carries it."""

from __future__ import annotations

import json
from typing import Any

from ..format import codec
from ..errors import CheckpointError
from ..format.manifest import Manifest

CONFIG = "config"            # the state key (or metadata key) that holds a model's config
CONFIG_FILE = "config.json"


def tied(manifest: Manifest, names: list[str]) -> dict[str, str]:
    """Among ``names``: each tensor tied to an earlier one -> the name kept (the first,
    as ``save_pretrained`` keeps the input embedding and drops a tied ``lm_head``).
    Format 2 records the tie (``tied_to``); in format 1 a tied tensor has the very same
    chunks as the first (distinct tensors never share bytes there, while format 2 may
    share identical content between tensors that are not tied)."""
    kept: dict[Any, str] = {}
    out: dict[str, str] = {}
    chosen = set(names)
    for name in names:
        entry = manifest.tensors[name]
        if manifest.version >= 2:
            if entry.tied_to in chosen and entry.tied_to != name:
                out[name] = out.get(entry.tied_to, entry.tied_to)
            continue
        key = (entry.dtype, tuple(entry.shape), tuple((c.file, c.start, c.end) for c in entry.chunks))
        if key in kept:
            out[name] = kept[key]
        else:
            kept[key] = name
    return out


def config_json(manifest: Manifest) -> bytes | None:
    """The model config a checkpoint carries, as ``config.json``: a dict of plain values
    saved under the state's top-level key ``config`` (``{"model": model, "config":
    model.config.to_dict()}``), or else under the metadata key ``config``."""
    config = None
    if codec.tag_of(manifest.tree) in ("object", "$dict", "$odict"):
        node = dict(codec.items_of(manifest.tree, "", False)).get(CONFIG)
        if node is not None:
            try:
                config = codec.decode_value(node, CONFIG)
            except CheckpointError:  # holds tensors or pickles: not a config
                config = None
    if not isinstance(config, dict):
        config = manifest.metadata.get(CONFIG)
    if not isinstance(config, dict):
        return None
    try:
        return (json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
    except (TypeError, ValueError):  # not JSON (a tuple key, nan): not a config users expect
        return None
