"""Every name safeckpt gives a file or folder on storage, and how each is parsed
(docs/format.md §2): the one place these rules live. Nothing here touches storage
or torch, so any layer may use it."""

from __future__ import annotations

import re
import secrets

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


def replace_temp_name(name: str) -> str:
    """A fresh temporary name for a replacement of ``name`` in the same folder
    (``Storage.open_replace``): hidden, and with a suffix no trainer looks for
    (Lightning lists ``*.ckpt``)."""
    head, _, tail = name.rpartition("/")
    return f"{head}/" * bool(head) + f".{tail}.safeckpt-{secrets.token_hex(6)}.tmp"


def is_replace_temp(name: str, of: str | None = None) -> bool:
    """Whether ``name`` is a temporary file of a replacement of ``of`` (of any file if
    None) in the same folder: garbage once its writer is gone, which safeckpt deletes."""
    target = re.escape(of) if of is not None else ".+"
    return re.fullmatch(rf"\.{target}\.safeckpt-[0-9a-f]{{12}}\.tmp", name) is not None


# A part of a file name in a manifest (§2.5): at most one leading dot, then an ASCII
# letter, digit or underscore, then any of those and ``._+=@,-``. So no part is empty,
# ``.`` or ``..``, and none starts with ``-`` or two dots.
_PART_RE = re.compile(r"\.?[A-Za-z0-9_][A-Za-z0-9._+=@,-]*", re.ASCII)
_PART_CHARS = re.compile(r"[A-Za-z0-9._+=@,-]", re.ASCII)
NAME_RULE = ("a relative path with '/' between its parts, each part made of ASCII letters, digits and "
             "._+=@,-, starting with a letter, digit or '_', optionally after one '.', and not a temporary "
             "file of safeckpt (.<name>.safeckpt-<12 hex digits>.tmp) (docs/format.md §2.5)")


def _part_problem(part: str) -> str | None:
    if _PART_RE.fullmatch(part):
        if part.endswith(".tmp") and is_replace_temp(part):  # garbage safeckpt deletes: never committed
            return f"its part {part!r} is the name of a temporary file of safeckpt"
        return None
    if part in ("", ".", ".."):
        return f"it has an empty, '.' or '..' part ({part!r})"
    odd = sorted({c for c in part if not _PART_CHARS.fullmatch(c)})
    if odd:
        return f"its part {part!r} holds {''.join(odd)!r}"
    return f"its part {part!r} starts with {part[:2] if part.startswith('.') else part[0]!r}"


def name_problem(name: object, siblings: bool = False) -> str | None:
    """Why ``name`` cannot be a file name in a manifest (§2.5), or None when it can: the
    one place this rule lives (readers, ``seal``). With ``siblings`` it may also be
    ``../step-NNNNNNNNN/<file>``, a file of a sibling checkpoint in the same run root
    (§6.3), and nothing further away."""
    if not isinstance(name, str) or not name:
        return "it is not a non-empty string"
    if name.startswith("/"):
        return "it starts with '/' (an absolute path)"
    if "\\" in name:
        return "it holds '\\' (the separator is '/')"
    parts = name.split("/")
    if siblings and parts[0] == ".." and len(parts) == 3:
        if step_of(parts[1]) is None:
            return "it refers to a folder that is not a checkpoint of the run (step-NNNNNNNNN)"
        parts = parts[2:]
    for part in parts:
        why = _part_problem(part)
        if why is not None:
            return why
    return None
