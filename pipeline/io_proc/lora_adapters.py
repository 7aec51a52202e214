"""The LoRA adapters io_proc serves, by the name clients put in ``model`` (docs/design.md, "Multi-LoRA").

Each adapter has an id, which the request carries to the scheduler and the
worker; ids are never reused while the server runs, so an adapter unloaded
and loaded again (its weights possibly changed) never shares prefix-cache
blocks with its earlier self. ``--lora-modules`` adapter ``i`` has id ``i + 1``.
"""

from __future__ import annotations

from pipeline.common.config import EngineConfig


class LoraAdapters:
    """Name -> ``(id, path)`` of the adapters served now.

    Args:
        config: its ``lora`` (None: no adapters, ever).
    """

    def __init__(self, config: EngineConfig) -> None:
        modules = config.lora.modules if config.lora is not None else ()
        self.by_name: dict[str, tuple[int, str]] = {m.name: (i, m.path) for i, m in enumerate(modules, start=1)}
        self.names = {i: m.name for i, m in enumerate(modules, start=1)}  # every id given, unloaded ones too
        self._next_id = len(modules) + 1

    def id_of(self, name: str | None) -> int | None:
        """The id of adapter ``name``; None if no adapter has that name."""
        entry = self.by_name.get(name) if name is not None else None
        return entry[0] if entry is not None else None

    def new_id(self) -> int:
        """An id not given before, for an adapter being loaded."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def add(self, name: str, path: str, lora_id: int) -> None:
        """Serve the adapter in ``path`` as ``name`` (replacing one of that name) under ``lora_id`` (``new_id``)."""
        self.by_name[name] = (lora_id, path)
        self.names[lora_id] = name

    def remove(self, name: str) -> None:
        del self.by_name[name]
