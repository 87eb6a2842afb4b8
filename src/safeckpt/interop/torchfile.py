"""Single ``torch.save`` files that other tools read under a fixed name (Lightning's
``.ckpt``), written and checked safely, byte for byte what ``torch.save`` writes.

- ``write_torch_file``: ``torch.save`` streamed into ``Storage.open_replace``: the
  file replaces the old one atomically and is durable before it is visible, and the
  checkpoint is never serialized into memory first;
- ``check_torch_file``: every field of the archive's zip structure that torch's reader
  uses, and the CRC-32 of every record (``torchzip.check_archive``), before
  ``torch.load`` trusts it;
- ``host_snapshot``: a copy of an object whose tensors live in host memory, for a save
  in the background, which ``torch.save`` writes to exactly the bytes the original
  would have given (the same storages shared, each recorded with its own device).
"""

from __future__ import annotations

import copy
import threading
from typing import IO, Any, Callable

import torch

from ..format.pieces import PieceInfo
from ..protocol.staging import StagingPool
from ..protocol.state import FlatState, Piece
from ..errors import CorruptCheckpointError
from ..storage import Storage
from .torchzip import check_archive, torch_format

_SNAPSHOT_TYPES = (torch.Tensor, torch.nn.Parameter)


def write_torch_file(obj: Any, storage: Storage, name: str,
                     before_commit: Callable[[], None] | None = None) -> int:
    """``torch.save(obj)`` as ``name`` in ``storage``, replacing any file there
    atomically; ``before_commit`` runs once every byte is written, just before the
    new file takes the name. Returns the file's size."""
    with storage.open_replace(name) as out:
        torch.save(obj, out)  # type: ignore[arg-type]  # a writable binary stream is all torch.save needs
        if before_commit is not None:
            before_commit()
    return out.written


def check_torch_file(f: IO[bytes], where: str) -> bool:
    """Check the file a ``torch.save`` wrote (see ``torchzip.check_archive``) and
    rewind it. False if nothing could be checked: a legacy (pre-zip) file, or an
    archive written without CRC-32s. Anything else (an empty file, garbage) raises
    ``CorruptCheckpointError``."""
    head = f.read(32)
    f.seek(0)
    kind = torch_format(head)
    if kind == "zip":
        checked = check_archive(f, where).checked
        f.seek(0)
        return checked
    if kind == "legacy":
        return False  # the legacy format records no checksum
    what = "empty" if not head else "neither a zip archive nor the legacy format"
    raise CorruptCheckpointError(f"{where}: not a torch.save file ({what}); it was torn or changed after it "
                                 "was written")


# -- snapshots for background saves -----------------------------------------------------------

_locations: dict[int, str] = {}  # a snapshot's host storage -> the device its original lives on
_locations_lock = threading.Lock()
_registered = False


def _location_of(storage: Any) -> str | None:
    """A ``torch.serialization`` tagger: the original device of a snapshot's storage
    (any other storage: None, the built-in taggers decide)."""
    return _locations.get(getattr(storage, "_cdata", -1))


def _restore_nothing(storage: Any, location: str) -> None:
    return None


def _register_tagger() -> None:
    global _registered
    with _locations_lock:
        if not _registered:
            torch.serialization.register_package(0, _location_of, _restore_nothing)
            _registered = True


class HostSnapshot:
    """An object whose tensors were copied to host memory (``host_snapshot``); pass
    ``value`` to ``torch.save`` and call ``release()`` once it is written."""

    def __init__(self, value: Any, storages: list[int]) -> None:
        self.value = value
        self._storages = storages

    def release(self) -> None:
        with _locations_lock:
            for key in self._storages:
                _locations.pop(key, None)
        self._storages = []


def _snapshottable(t: torch.Tensor) -> bool:
    """A tensor ``torch.save`` writes as its storage plus a view: type, layout and
    flags that a view of a host copy reproduces exactly."""
    return (type(t) in _SNAPSHOT_TYPES and t.layout == torch.strided and not t.is_quantized
            and t.device.type != "meta" and not t.is_conj() and not t.is_neg() and not t.__dict__
            and (t.is_leaf or not t.requires_grad))


def _tensors(obj: Any, out: dict[int, torch.Tensor], seen: set[int]) -> None:
    """The tensors reachable through dicts, lists and tuples of ``obj`` (anything else
    is deep-copied as it is, tensors inside it cloned where they live)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if _snapshottable(obj):
            out[id(obj)] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out, seen)


def host_snapshot(obj: Any, pool: StagingPool) -> HostSnapshot:
    """A deep copy of ``obj`` taken now, its tensors views of host copies of their
    storages (made in ``pool``'s reusable buffers, pinned for GPU tensors, one
    synchronization), so the caller may change the originals at once. ``torch.save``
    of the copy writes the bytes it would have written for ``obj``: each storage once,
    whole, under the device it lives on. Raises what ``copy.deepcopy`` raises for a
    value it cannot copy."""
    found: dict[int, torch.Tensor] = {}
    _tensors(obj, found, set())
    storages: dict[int, tuple[str, torch.Tensor, str]] = {}  # original storage -> (name, bytes, location)
    for t in found.values():
        storage = t.untyped_storage()
        if storage._cdata not in storages:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            storages[storage._cdata] = (f"storage{len(storages)}", whole, torch.serialization.location_tag(storage))
    flat = FlatState(None, {name: Piece(whole, PieceInfo(name, "replicated", "uint8", tuple(whole.shape), (0,),
                                                         tuple(whole.shape), whole.numel()))
                            for name, whole, _ in storages.values()})
    copies = pool.snapshot(flat).pieces
    host = {key: copies[name].tensor.untyped_storage() for key, (name, _, _) in storages.items()}
    memo: dict[int, Any] = {}
    for key, t in found.items():
        view = torch.empty(0, dtype=t.dtype).set_(host[t.untyped_storage()._cdata], t.storage_offset(),
                                                 t.size(), t.stride())
        memo[key] = torch.nn.Parameter(view, requires_grad=t.requires_grad) if type(t) is torch.nn.Parameter \
            else view.requires_grad_(t.requires_grad)
    value = copy.deepcopy(obj, memo)
    _register_tagger()
    tagged = [host[key]._cdata for key in storages]
    with _locations_lock:
        for key, (_, _, location) in storages.items():
            _locations[host[key]._cdata] = location
    return HostSnapshot(value, tagged)
