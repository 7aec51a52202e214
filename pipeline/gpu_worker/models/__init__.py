"""The model families' code; which class serves an architecture is its row in ``common.families``.

A family's module is imported when a model of it is loaded.
"""

from __future__ import annotations

import importlib

from pipeline.common.families import family


def model_class(architecture: str) -> type:
    """The family class serving ``architecture`` (its module imported now).

    Raises:
        ValueError: ``architecture`` is not supported (the message lists those that are).
    """
    row = family(architecture)
    return getattr(importlib.import_module(f"{__name__}.{row.module}"), row.cls)
