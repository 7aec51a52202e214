"""Names of full KV blocks for prefix caching (docs/design.md, "Prefix caching").

Block ``i`` of a token sequence is named ``sha256(name of block i-1 ‖ its
token ids as native int32)`` cut to ``HASH_BYTES``; block 0's parent is
a root name made of everything else that changes a block's keys and values
(the model, its dtype, and the LoRA adapter: ``adapter_root``). A name thus stands for the block's tokens and every
token before them. The scheduler and io_proc compute the same names, io_proc
to route a request to the engine that holds its prefix.

SHA-256 rather than a faster non-cryptographic hash: prompts come from
clients, and one who could make two prefixes collide would read another's
cached keys and values (as vLLM argues for its default). A 16-token block
costs about 0.7 us on this project's CPU (SHA extensions).
"""

from __future__ import annotations

from array import array
from hashlib import sha256

HASH_BYTES = 16  # 128 bits: a collision takes ~2^64 work


def root_hash(*keys: str) -> bytes:
    """The parent name of every sequence's first block, from what changes a block's content."""
    return sha256("\0".join(keys).encode()).digest()[:HASH_BYTES]


def adapter_root(root: bytes, lora_id: int) -> bytes:
    """The root of a request that runs with LoRA adapter ``lora_id``: ``root`` itself for the base model.

    Adapter ids are never reused while the server runs, so two adapters, or
    an adapter unloaded and loaded again, never share a block.
    """
    return root if lora_id == 0 else sha256(root + b"lora" + lora_id.to_bytes(8, "little")).digest()[:HASH_BYTES]


def hash_blocks(tokens: array, block_size: int, parent: bytes, start: int = 0, stop: int | None = None) -> list[bytes]:
    """Names of full blocks ``start .. stop-1`` of ``tokens`` (int32, ``array("i")``).

    Args:
        parent: the name of block ``start - 1`` (the root for ``start`` 0).
        stop: default every full block of ``tokens``.
    """
    if stop is None:
        stop = len(tokens) // block_size
    view = memoryview(tokens).cast("B")
    width = block_size * tokens.itemsize
    out = []
    for i in range(start, stop):
        parent = sha256(parent + view[i * width : (i + 1) * width]).digest()[:HASH_BYTES]
        out.append(parent)
    return out
