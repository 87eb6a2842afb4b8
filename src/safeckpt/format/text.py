"""Values as text, for names, messages and the command line, for ints of any size.

Python refuses to write an int of more than ``sys.get_int_max_str_digits()`` decimal
digits (4300 unless changed) as text, and with it ``str``, ``repr``, f-strings and
``json.dumps`` of anything that holds one. safeckpt stores such ints exactly (the codec
writes them in hex, which has no limit) and must still name them in a key's dotted
name, in an error and in ``safeckpt show``: there they are written in hex too, and
nothing changes the process-wide limit.
"""

from __future__ import annotations

from typing import Any


def key_text(key: Any) -> str:
    """``str(key)`` of a dict key, as a part of a dotted name; an int too long for
    decimal text is written in hex (``0x...``), inside a tuple key too."""
    try:
        return str(key)
    except ValueError:
        return _hex_ints(key)


def value_repr(value: Any) -> str:
    """``repr(value)``, with every int too long for decimal text in hex, inside lists,
    tuples, dicts and sets too."""
    try:
        return repr(value)
    except ValueError:
        return _hex_ints(value)


def too_long(value: int) -> bool:
    """Whether ``str(value)`` of this int is refused (more digits than Python writes)."""
    try:
        str(value)
    except ValueError:
        return True
    return False


def _hex_ints(value: Any) -> str:
    """The repr of a value ``repr`` refused because it holds an int too long for decimal text."""
    if isinstance(value, int):
        return hex(value)
    if isinstance(value, tuple):
        return f"({value_repr(value[0])},)" if len(value) == 1 else f"({', '.join(map(value_repr, value))})"
    if isinstance(value, list):
        return f"[{', '.join(map(value_repr, value))}]"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({{{', '.join(map(value_repr, value))}}})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{value_repr(k)}: {value_repr(v)}" for k, v in value.items()) + "}"
    return f"<{type(value).__name__} holding an int too long to write>"
