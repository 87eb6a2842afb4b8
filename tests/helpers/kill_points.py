"""Kill points the trainer integrations' children share: a file a tool writes with
``torch.save`` left torn by a SIGKILL half way through it."""

from __future__ import annotations

from typing import Any, Callable

import torch


def die_writing(suffix: str, die: Callable[[], Any]) -> None:
    """From now on, ``torch.save`` to a path ending in ``suffix`` writes the first
    kilobyte of zeros there and calls ``die()`` (which SIGKILLs the process)."""
    real = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if str(f).endswith(suffix):
            with open(f, "wb") as half:
                half.write(b"\0" * 1024)
            die()
        return real(obj, f, *args, **kwargs)
    torch.save = save
