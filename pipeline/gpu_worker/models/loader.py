"""Building a model and streaming its safetensors checkpoint into it, tensor by tensor.

Each file is memory-mapped; a tensor is a view of the mapping, so a rank's
weight loaders read only the rows or columns they keep. Once a tensor is
copied into its parameter, its pages are dropped from the process
(``madvise(MADV_DONTNEED)``; the page cache keeps them), so the host memory
a load takes is the parameters (on a CPU device) plus about one checkpoint
tensor, not a second copy of the model (docs/design.md, "Model families").
Tensor parallel rank 0 also reads every tensor whole, once, for NaN and
infinities, so that each engine checks the whole checkpoint once.
The format is safetensors' documented one: an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then
the data.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from pathlib import Path

import torch

from pipeline.common.config import QuantizationConfig
from pipeline.common.memory import trim_heap
from pipeline.common.model_config import ModelConfig
from pipeline.common.model_files import checkpoint_files, read_safetensors_header
from pipeline.gpu_worker.attention import make_backend
from pipeline.gpu_worker.layers.tp import SINGLE_RANK, TPGroup
from pipeline.gpu_worker.models import model_class
from pipeline.gpu_worker.models.base import CausalLM, CheckpointError
from pipeline.gpu_worker.models.quantized import checkpoint_tensors, prepare_layers

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _entries(path: Path) -> tuple[list[tuple[str, dict, torch.dtype]], int]:
    """A safetensors file's ``(name, header entry, torch dtype)`` in file order, and where its data starts.

    Raises:
        ValueError: as ``read_safetensors_header``; CheckpointError: a dtype the loader does not read.
    """
    header, data_start = read_safetensors_header(path)
    entries = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path.name}: tensor {name} has dtype {info['dtype']}, which is not supported")
        entries.append((name, info, dtype))
    return entries, data_start


def iter_shapes(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each tensor of a safetensors file, in file order, as meta tensors of its
    dtype and shape: the header alone, no data read."""
    for name, info, dtype in _entries(path)[0]:
        yield name, torch.empty(info["shape"], dtype=dtype, device="meta")


def iter_tensors(path: Path, check_finite: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each tensor of a safetensors file, in file order, as views of its mapping.

    A tensor must not be kept past the next step of the iteration: its pages
    are dropped then (it would read them back from the file).

    Raises:
        CheckpointError: with ``check_finite``, a floating-point tensor holds a NaN or an infinity
            (checked as it streams in: one reduction, no allocation).
    """
    entries, data_start = _entries(path)
    page = mmap.PAGESIZE
    with open(path, "rb") as f, contextlib.ExitStack() as stack:
        # A private (copy-on-write) mapping: writable for torch.frombuffer, never written.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        stack.callback(_close, mm)
        for name, info, dtype in entries:
            begin, end = (data_start + o for o in info["data_offsets"])
            shape = info["shape"]
            if end == begin:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            itemsize = torch.empty((), dtype=dtype).element_size()
            if begin % itemsize:  # a misaligned tensor: copy it out of the mapping
                tensor = torch.frombuffer(bytearray(mm[begin:end]), dtype=dtype).view(shape)
            else:
                tensor = torch.frombuffer(mm, dtype=dtype, count=(end - begin) // itemsize, offset=begin).view(shape)
            if check_finite and tensor.is_floating_point() and not _all_finite(tensor):
                raise CheckpointError(f"{path.name}: tensor {name} holds NaN or infinite values")
            yield name, tensor
            del tensor
            start = begin // page * page
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _all_finite(tensor: torch.Tensor) -> bool:
    # min and max propagate NaN and show an infinity; unlike isfinite() they allocate nothing per element.
    lo, hi = torch.aminmax(tensor)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _close(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a caller kept a tensor: the mapping closes with it
        mm.close()


def read_checkpoint(
    model_dir: Path, shapes_only: bool = False, check_finite: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint in ``model_dir``, file by file (see ``iter_tensors``; ``iter_shapes``
    with ``shapes_only``).

    Raises:
        FileNotFoundError: as ``checkpoint_files``.
    """
    for path in checkpoint_files(model_dir):
        yield from iter_shapes(path) if shapes_only else iter_tensors(path, check_finite)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_config(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's normalised config, through transformers (its class defaults fill what config.json omits).

    Raises:
        ValueError: as ``ModelConfig.from_hf``, or transformers refuses the file (one line, naming it).
    """
    import transformers

    try:
        hf = transformers.AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # its own checks raise huggingface_hub's StrictDataclassError, not a ValueError
        why = " ".join(str(e).split())
        raise ValueError(f"{Path(model_dir) / 'config.json'}: transformers refuses it: {why}") from None
    return ModelConfig.from_hf(hf)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "auto",
    tp: TPGroup = SINGLE_RANK,
    max_model_len: int | None = None,
    quantization: QuantizationConfig | None = None,
) -> CausalLM:
    """Build rank ``tp.rank``'s part of the model in ``model_dir`` on ``device`` in ``dtype``, and fill it.

    Args:
        model_dir: a Hugging Face directory: ``config.json`` and safetensors
            weights (a GGUF file is converted to one beforehand).
        dtype: parameter dtype.
        device: where the model runs; parameters are made there and filled
            tensor by tensor from the mapped checkpoint.
        attention_backend: a name for ``make_backend``, built for the rank's heads.
        tp: this rank's group.
        max_model_len: the longest sequence served (see ``CausalLM``).
        quantization: how the linear weights are held (``models.quantized``); None: in ``dtype``.

    Returns:
        The model, parameters without gradients; on the CPU its float linear
        weights are packed for oneDNN, quantized ones for their kernel (``CausalLM.pack_weights``).

    Raises:
        ValueError: an unsupported architecture or config, a ``tp.size``
            that does not fit, or an attention backend that cannot run here.
        CheckpointError: missing, unexpected or misshapen tensors (checked before any is read), or one
            holding NaN or infinite values.
        FileNotFoundError: no safetensors weights (see ``checkpoint_files``).
    """
    config = load_config(model_dir)
    quantization = quantization or QuantizationConfig()
    # Every tensor's shape against the config, from the headers, before a byte is allocated or read: a
    # config whose sizes the file does not have is named by tensor, not an allocation failure.
    with torch.device("meta"):
        meta = model_class(config.architecture)(config, tp, max_model_len)
        prepare_layers(meta, quantization, Path(model_dir))
        shapes = read_checkpoint(Path(model_dir), shapes_only=True)
        meta.load_weights(checkpoint_tensors(meta, quantization, shapes, Path(model_dir), shapes_only=True))
    model = build_model(config, dtype, device, attention_backend, tp, max_model_len)
    prepare_layers(model, quantization, Path(model_dir))
    tensors = read_checkpoint(Path(model_dir), check_finite=tp.rank == 0)
    model.load_weights(checkpoint_tensors(model, quantization, tensors, Path(model_dir)))
    model.pack_weights()
    trim_heap()  # the dense weights and integer codes packing replaced: 160 MiB for SmolLM2's Q4_1 file
    return model


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "auto",
    tp: TPGroup = SINGLE_RANK,
    max_model_len: int | None = None,
) -> CausalLM:
    """Rank ``tp.rank``'s part of the model ``config`` describes, parameters uninitialised (see ``load_model``).

    Raises:
        ValueError: as ``load_model``.
    """
    cls = model_class(config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = cls(config, tp, max_model_len)
    model.attn_backend = make_backend(
        attention_backend,
        device=device,
        dtype=dtype,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        scale=config.attn_scale,
        kinds=model.attention_kinds,
    )
    return model.eval()
