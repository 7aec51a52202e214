"""The worker's side of multi-LoRA: adapters in host memory, which slot each req_index uses, and each
step's slots loaded and set before its forward pass (docs/design.md, "Multi-LoRA")."""

from __future__ import annotations

import logging

import numpy as np

from pipeline.common.config import LoraConfig
from pipeline.common.instance_files import lora_adapter_file
from pipeline.common.lora_checkpoint import LoraError, read_weights, save_weights
from pipeline.common.step_protocol import StepInputs
from pipeline.gpu_worker.lora.adapter import LoraAdapter, load_prepared
from pipeline.gpu_worker.lora.layers import LoraSlots

logger = logging.getLogger(__name__)


class LoraWorker:
    """Applies the adapter fields of each step descriptor to a model wrapped with ``LoraSlots``.

    Args:
        model: the loaded model; its projections are wrapped now.
        config: ``--enable-lora``'s settings; its ``modules`` are read now (adapter ids 1, 2, ...).
        max_num_seqs: req_index rows.
        ipc_dir: where each adapter's prepared copy lies (``instance_files.lora_adapter_file``): io_proc
            writes those of adapters loaded at run time, this those of ``--lora-modules``.

    Raises:
        LoraError: a ``--lora-modules`` adapter that does not fit the model (the message names it).
    """

    def __init__(self, model, config: LoraConfig, max_num_seqs: int, ipc_dir: str) -> None:
        self.slots = LoraSlots(model, config.max_loras, config.max_lora_rank)
        self.device = next(model.parameters()).device
        self.ipc_dir, self.max_adapters = ipc_dir, config.max_cpu_loras
        self.adapters: dict[int, LoraAdapter] = {}  # in host memory, least recently used first
        for i, m in enumerate(config.modules, start=1):  # checked now: a bad one stops the start-up
            try:
                weights = read_weights(m.path, model.config, config.max_lora_rank)
            except LoraError as e:
                raise LoraError(f"--lora-modules {m.name}: {e}") from None
            save_weights(weights, lora_adapter_file(ipc_dir, i))  # read back once out of host memory
            if i <= self.max_adapters:
                self.adapters[i] = LoraAdapter.of(weights)
        self.row_slot = np.zeros(max_num_seqs, np.int64)  # per req_index
        self.held = [0] * (config.max_loras + 1)  # the adapter id in each slot

    @property
    def active(self) -> bool:
        """Whether the step being launched has rows with an adapter (no CUDA graph serves it)."""
        return self.slots.batch.slots is not None

    def prepare(self, x: StepInputs) -> np.ndarray | None:
        """Before step ``x``'s forward: its new rows' slots recorded, any slot the scheduler gave another
        adapter reloaded, and the step's token slots set.

        Returns:
            The requests (req_num) of new rows whose adapter could not be read, or None: their rows run
            without an adapter, and the step's output ends them with an error.
        """
        if not len(x.new_rows):
            self.slots.batch.set_rows(self.row_slot[x.req_index], x.num_scheduled_tokens, self.device)
            return None
        bad = np.zeros(len(x.new_rows), bool)
        for slot, lora_id in set(zip(x.lora_slot.tolist(), x.lora_id.tolist(), strict=True)):
            if slot and self.held[slot] != lora_id:
                try:
                    adapter = self._adapter(lora_id)
                except (OSError, ValueError) as e:
                    logger.error("LoRA adapter %d cannot be read (%s): its requests fail", lora_id, e)
                    adapter = None
                    bad |= x.lora_id == lora_id
                self.slots.load(slot, adapter)
                self.held[slot] = lora_id if adapter is not None else 0
        self.row_slot[x.req_index[x.new_rows]] = np.where(bad, 0, x.lora_slot)
        self.slots.batch.set_rows(self.row_slot[x.req_index], x.num_scheduled_tokens, self.device)
        return x.req_num[x.new_rows][bad] if bad.any() else None

    def _adapter(self, lora_id: int) -> LoraAdapter:
        """Adapter ``lora_id`` from host memory, or copied now from its prepared copy (the least recently
        used one out past ``max_cpu_loras``).

        Raises:
            OSError, ValueError: the prepared copy is gone or damaged.
        """
        adapter = self.adapters.pop(lora_id, None)
        if adapter is None:
            # Read, converted and checked already (at start-up, or by io_proc before it served the name).
            adapter = load_prepared(lora_adapter_file(self.ipc_dir, lora_id))
            if len(self.adapters) >= self.max_adapters:
                del self.adapters[next(iter(self.adapters))]
        self.adapters[lora_id] = adapter
        return adapter
