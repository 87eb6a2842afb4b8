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


def test_warnings_have_kinds_and_point_at_the_callers_line(tmp_path):
    """A skipped manifest warns with its own class (a UserWarning, so old filters keep
    working) and names this file, not a line inside safeckpt."""
    import warnings

    import pytest
    import torch

    ck = tmp_path / "ck"
    safeckpt.save({"w": torch.zeros(2)}, ck)
    (ck / "manifest-000002.json").write_bytes(b"torn")
    with pytest.warns(safeckpt.SkippedCheckpointWarning) as record:
        safeckpt.load_state(ck)
    assert issubclass(safeckpt.SkippedCheckpointWarning, UserWarning)
    assert record[0].filename == __file__, record[0].filename
    with warnings.catch_warnings():
        warnings.simplefilter("error", safeckpt.SafeckptWarning)
        with pytest.raises(safeckpt.SkippedCheckpointWarning):
            safeckpt.load_state(ck)


def test_the_package_logger_has_a_null_handler():
    import logging

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("safeckpt").handlers)
