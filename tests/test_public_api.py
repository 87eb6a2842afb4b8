"""The public API: what ``safeckpt.__all__`` lists exists, and every signature's type
hints resolve (``typing.get_type_hints``), so type checkers and IDEs can read them."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import safeckpt
import safeckpt.storage
import safeckpt.testing


def _hinted(obj):
    return [obj.__init__] + [m for _, m in inspect.getmembers(obj, inspect.isfunction)] if inspect.isclass(obj) else [obj]


def test_everything_in_all_exists_and_its_hints_resolve():
    for module in (safeckpt, safeckpt.storage, safeckpt.testing):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                for fn in _hinted(obj):
                    typing.get_type_hints(fn)


def test_the_package_says_it_is_typed():
    assert (Path(safeckpt.__file__).parent / "py.typed").exists()
