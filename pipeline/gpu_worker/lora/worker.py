"""The worker's side of multi-LoRA: adapters in host memory, which slot each req_index uses, and each
step's slots loaded and set before its forward pass (docs/design.md, "Multi-LoRA")."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.common.config import LoraConfig
from pipeline.common.instance_files import lora_adapter_file
from pipeline.common.lora_checkpoint import LoraError
from pipeline.common.step_protocol import StepInputs
from pipeline.gpu_worker.lora.adapter import LoraAdapter, read_adapter
from pipeline.gpu_worker.lora.layers import LoraSlots


class LoraWorker:
    """Applies the adapter fields of each step descriptor to a model wrapped with ``LoraSlots``.

    Args:
        model: the loaded model; its projections are wrapped now.
        config: ``--enable-lora``'s settings; its ``modules`` are read now (adapter ids 1, 2, ...).
        max_num_seqs: req_index rows.
        ipc_dir: where io_proc records the directory of each adapter loaded at run time
            (``instance_files.lora_adapter_file``).

    Raises:
        LoraError: a ``--lora-modules`` adapter that does not fit the model (the message names it).
    """

    def __init__(self, model, config: LoraConfig, max_num_seqs: int, ipc_dir: str) -> None:
        self.slots = LoraSlots(model, config.max_loras, config.max_lora_rank)
        self.device = next(model.parameters()).device
        self.model_config, self.max_rank, self.ipc_dir = model.config, config.max_lora_rank, ipc_dir
        self.max_adapters = config.max_cpu_loras
        self.static_paths = {i: m.path for i, m in enumerate(config.modules, start=1)}
        self.adapters: dict[int, LoraAdapter] = {}  # in host memory, least recently used first
        for i, m in enumerate(config.modules, start=1):  # checked now: a bad one stops the start-up
            try:
                adapter = read_adapter(m.path, model.config, config.max_lora_rank)
            except LoraError as e:
                raise LoraError(f"--lora-modules {m.name}: {e}") from None
            if i <= self.max_adapters:
                self.adapters[i] = adapter
        self.row_slot = np.zeros(max_num_seqs, np.int64)  # per req_index
        self.held = [0] * (config.max_loras + 1)  # the adapter id in each slot

    @property
    def active(self) -> bool:
        """Whether the step being launched has rows with an adapter (no CUDA graph serves it)."""
        return self.slots.batch.slots is not None

    def prepare(self, x: StepInputs) -> None:
        """Before step ``x``'s forward: its new rows' slots recorded, any slot the scheduler gave another
        adapter reloaded, and the step's token slots set."""
        if len(x.new_rows):
            self.row_slot[x.req_index[x.new_rows]] = x.lora_slot
            for slot, lora_id in zip(x.lora_slot.tolist(), x.lora_id.tolist(), strict=True):
                if slot and self.held[slot] != lora_id:
                    self.slots.load(slot, self._adapter(lora_id))
                    self.held[slot] = lora_id
        self.slots.batch.set_rows(self.row_slot[x.req_index], x.num_scheduled_tokens, self.device)

    def _adapter(self, lora_id: int) -> LoraAdapter:
        """Adapter ``lora_id`` from host memory, or read now from its directory (the least recently used
        one out past ``max_cpu_loras``)."""
        adapter = self.adapters.pop(lora_id, None)
        if adapter is None:
            # Checked against the model already: at start-up, or by io_proc before it served the name.
            path = self.static_paths.get(lora_id) or Path(lora_adapter_file(self.ipc_dir, lora_id)).read_text()
            adapter = read_adapter(path, self.model_config, self.max_rank)
            if len(self.adapters) >= self.max_adapters:
                del self.adapters[next(iter(self.adapters))]
        self.adapters[lora_id] = adapter
        return adapter
