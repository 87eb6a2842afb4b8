"""Stream transforms (DCP's ``_extensions``: compression, encryption) applied to a
chunk's bytes on save and undone on load.

The transforms are DCP's ``StreamTransformExtension`` objects; a manifest names them by
their descriptors (``"stream.zstd/1"``), and loading looks the descriptors up in a DCP
``ExtensionRegistry`` (DCP's default one knows ZStandard; others must be registered).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import IO, Any, cast

from ..errors import CorruptCheckpointError, UnsupportedFeatureError


class _KeepOpen(io.RawIOBase):
    """The sink a transform writes into: a transform closes what it wraps when it is
    closed (to flush its last bytes), which must not discard the bytes gathered here."""

    def __init__(self, out: io.BytesIO) -> None:
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.out.write(b)


def encode(extensions: Sequence[Any], data: memoryview | bytes) -> tuple[bytes, list[str]]:
    """``data`` through ``extensions`` (the first wraps the storage, the last receives the
    data, as DCP applies them): the stored bytes and the descriptors in the order the
    transforms were applied."""
    out = io.BytesIO()
    stream: IO[bytes] = cast(IO[bytes], _KeepOpen(out))
    for ex in extensions:
        stream = ex.transform_to(stream)
    stream.write(data)
    stream.close()
    return out.getvalue(), [ex.get_descriptor() for ex in reversed(extensions)]


def default_registry() -> Any:
    """DCP's registry of stream transforms, as its ``FileSystemReader`` uses by default."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    return ExtensionRegistry()


def decode(descriptors: list[str], stored: memoryview, out: memoryview, registry: Any, where: str) -> None:
    """Undo ``descriptors`` (last applied first) on ``stored`` into ``out``, which the
    decoded bytes must fill exactly; never reads past that many (a stream that claims
    more is refused, not inflated)."""
    try:
        extensions = registry.from_descriptor_list(descriptors)
    except Exception as exc:  # an unknown name, a version it does not know, a missing module
        raise UnsupportedFeatureError(
            f"{where} is stored through the stream transform(s) {descriptors}, which cannot be undone here "
            f"({type(exc).__name__}: {exc}); install what the transform needs, or register it in a "
            "torch.distributed.checkpoint ExtensionRegistry and load with "
            "safeckpt.dcp.Reader(path, _extension_registry=registry)") from exc
    stream: IO[bytes] = io.BytesIO(stored)
    try:
        for ex in reversed(extensions):
            stream = ex.transform_from(stream)
        got = _read_up_to(stream, out)
        extra = stream.read(1)
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: its stored stream does not decode through {descriptors} "
                                     f"({type(exc).__name__}: {exc})") from exc
    if got != len(out) or extra:
        raise CorruptCheckpointError(f"{where}: its stored stream decodes to {got}{'+' if extra else ''} bytes "
                                     f"through {descriptors}, not the {len(out)} its shape holds")


def _read_up_to(stream: IO[bytes], out: memoryview) -> int:
    """Fill ``out`` from ``stream`` (which may return short reads) until it ends."""
    got = 0
    while got < len(out):
        part = stream.read(len(out) - got)
        if not part:
            break
        out[got:got + len(part)] = part
        got += len(part)
    return got
