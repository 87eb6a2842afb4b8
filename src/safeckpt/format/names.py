"""Every name safeckpt gives a file or folder on storage, and how each is parsed
(docs/format.md §2): the one place these rules live. Nothing here touches storage
or torch, so any layer may use it."""

from __future__ import annotations

import re

MANIFEST_RE = re.compile(r"manifest-([0-9]{6,})\.json", re.ASCII)
DATA_RE = re.compile(r"data-([0-9a-f]+)-r([0-9]{5,})\.safetensors", re.ASCII)
# a CheckpointManager's checkpoint folder: exactly ``step_folder(step)`` (9 digits, or more
# without a leading zero), so a step has one folder name and a name one step (§2.4)
STEP_RE = re.compile(r"step-([0-9]{9}|[1-9][0-9]{9,})", re.ASCII)
LEASE_RE = re.compile(r"safeckpt-writer-([0-9]{9,})\.json", re.ASCII)
RETIRED = "safeckpt-retired"  # a retired checkpoint folder that still holds shared data


def manifest_name(seq: int) -> str:
    """``manifest-000001.json`` for sequence number 1."""
    return f"manifest-{seq:06d}.json"


def manifest_seq(name: str) -> int | None:
    """The sequence number in a manifest file name, or None for other names."""
    m = MANIFEST_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def data_file_name(save_id: str, rank: int) -> str:
    """``data-<save_id>-r00003.safetensors``: one rank's tensors of one save."""
    return f"data-{save_id}-r{rank:05d}.safetensors"


def step_folder(step: int) -> str:
    """Zero-padded so names sort like numbers: ``step-000000100``."""
    return f"step-{step:09d}"


def step_of(name: str) -> int | None:
    """The step of a step folder's name, or None for any other name (``step-0000000002``,
    ten digits, is not step 2's folder: only ``step_folder(step)`` is)."""
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def lease_name(epoch: int) -> str:
    """``safeckpt-writer-000000001.json``: the writer lease of one epoch (run root)."""
    return f"safeckpt-writer-{epoch:09d}.json"


def is_shared(name: str) -> bool:
    """True for a file of a sibling checkpoint (``../<folder>/<file>``)."""
    return name.startswith("../")


def shared_location(name: str) -> tuple[str, str]:
    """(sibling folder, file name) of a shared file ``../<folder>/<file>``."""
    _, folder, file = name.split("/", 2)
    return folder, file


def root_path(folder: str, name: str) -> str:
    """A file named by the manifest in ``folder``, as a path from the run root."""
    return name[3:] if is_shared(name) else f"{folder}/{name}"
