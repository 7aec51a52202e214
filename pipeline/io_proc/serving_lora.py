"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's bodies and answers;
docs/design.md, "Multi-LoRA").

A load checks the adapter against the base model and reads it (400 naming
the cause), on a thread off the event loop; writes its prepared copy (float32
``A`` and scaled ``B``) into the instance's private directory, and only then
serves its name. The worker copies the prepared copy into host memory when a
step first uses the adapter, and into the slot the scheduler gives it: no
checkpoint is parsed or converted on the worker's step loop, and the user's
files may change or go once the load has answered.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pipeline.common.config import EngineConfig
from pipeline.common.instance_files import lora_adapter_file
from pipeline.io_proc.lora_adapters import LoraAdapters
from pipeline.io_proc.openai.protocol import APIError, OpenAIBaseModel


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's body of ``/v1/load_lora_adapter``; ``load_inplace`` replaces an adapter of that name."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's body of ``/v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: int | None = None


class LoraServing:
    """The two endpoints over ``adapters`` (shared with the other endpoints).

    Args:
        config: its ``lora`` (not None) and base model.
        adapters: the served adapters.
    """

    def __init__(self, config: EngineConfig, adapters: LoraAdapters) -> None:
        from pipeline.common.model_files import read_model_config

        self._config, self._adapters = config, adapters
        self._model = read_model_config(Path(config.model))

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """Serve the adapter; returns vLLM's success text.

        Raises:
            APIError: 400 for an empty name or path, the base model's name, a name already served (without
                ``load_inplace``), or an adapter that does not fit or cannot be read.
        """
        from pipeline.common.lora_checkpoint import LoraError

        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise APIError.bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self._config.served_model_name:
            raise APIError.bad_request(f"The lora adapter '{name}' conflicts with a served base model.")
        self._check_new(name, req.load_inplace)
        lora_id = self._adapters.new_id()
        try:
            await asyncio.to_thread(self._prepare, path, lora_id)
        except LoraError as e:
            raise APIError.bad_request(f"LoRA adapter '{name}' cannot be loaded: {e}", param="lora_path") from None
        self._check_new(name, req.load_inplace)  # another load of the name may have answered meanwhile
        self._adapters.add(name, path, lora_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _check_new(self, name: str, inplace: bool) -> None:
        if name in self._adapters.by_name and not inplace:
            raise APIError.bad_request(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True."
            )

    def _prepare(self, path: str, lora_id: int) -> None:
        """Read and check the adapter in ``path``, and write its prepared copy for id ``lora_id`` (a thread).

        Raises:
            LoraError: it does not fit the base model, or cannot be read or written.
        """
        from pipeline.common.lora_checkpoint import LoraError, read_weights, save_weights

        weights = read_weights(path, self._model, self._config.lora.max_lora_rank)
        try:
            save_weights(weights, lora_adapter_file(self._config.ipc_dir, lora_id))
        except OSError as e:
            raise LoraError(f"its copy for the worker cannot be written: {e}") from None

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the adapter (requests already running with it finish with it).

        Raises:
            APIError: 400 for an empty name, 404 for a name not served.
        """
        if not req.lora_name:
            raise APIError.bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
        if req.lora_name not in self._adapters.by_name:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", type="not_found_error")
        self._adapters.remove(req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
