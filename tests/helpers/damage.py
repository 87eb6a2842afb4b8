"""A damaged file of a sealed folder, which ``safeckpt.verify`` must find."""

from __future__ import annotations

from pathlib import Path

import safeckpt


def assert_a_flipped_byte_is_found(folder: Path, name: str) -> None:
    """Flip one bit in the middle of ``folder/name``; verify must name that file."""
    path = folder / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    report = safeckpt.verify(folder)
    assert not report.ok and any(name in p for p in report.problems), report.problems
