"""Named constants the processes share, and one integer helper."""

from __future__ import annotations

# How long a blocking wait (ring semaphore, zmq poll) lasts before a loop looks
# at its stop flag again: the bound on how late a process notices a shutdown.
POLL_INTERVAL_S = 0.2

# Token ids the simulated device emits and the benchmark draws prompts from:
# ordinary words in SmolLM2's vocabulary, so detokenized text looks like text.
SIM_WORD_ID_RANGE = (1000, 9000)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the blocks that ``a`` tokens need at ``b`` per block."""
    return -(-a // b)
