"""Which LoRA adapter each of the worker's adapter slots holds, as the scheduler assigns them.

A running request holds its adapter's slot from admission until it leaves
the running requests (it finishes, is aborted or preempted), so a row's slot
never changes while it has its req_index and travels once, with its new-row
fields. A slot whose adapter no running request uses keeps it (a later
request of that adapter finds it loaded) until another adapter needs a slot:
the one unused longest is given. A request whose adapter finds no slot waits
(``can_admit``); none is refused. The worker applies the steps in order, so
reloading a slot in step N+1 never changes it under a step that still used
its previous adapter (docs/design.md, "Multi-LoRA").
"""

from __future__ import annotations

from collections import OrderedDict


class LoraSlots:
    """Slots ``1 .. max_loras`` (0 is "no adapter").

    Args:
        max_loras: the worker's adapter slots: distinct adapters in one step at most.
    """

    def __init__(self, max_loras: int) -> None:
        self._slot: dict[int, int] = {}  # lora_id -> slot
        self._users: dict[int, int] = {}  # slot -> running requests using it
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))

    def can_admit(self, lora_id: int) -> bool:
        """Whether a request of ``lora_id`` (0: none) can get a slot now."""
        return lora_id == 0 or lora_id in self._slot or bool(self._idle)

    def acquire(self, lora_id: int) -> int:
        """The slot of a request of ``lora_id`` admitted now (0 for none); needs ``can_admit``."""
        if lora_id == 0:
            return 0
        slot = self._slot.get(lora_id)
        if slot is None:
            slot = next(iter(self._idle))
            self._slot = {k: s for k, s in self._slot.items() if s != slot}  # it held an idle adapter
            self._slot[lora_id] = slot
        self._idle.pop(slot, None)
        self._users[slot] = self._users.get(slot, 0) + 1
        return slot

    def release(self, slot: int) -> None:
        """A request holding ``slot`` left the running requests."""
        if slot == 0:
            return
        self._users[slot] -= 1
        if not self._users[slot]:
            del self._users[slot]
            self._idle[slot] = None

    def running_adapters(self) -> list[int]:
        """The adapters some running request uses."""
        return [k for k, s in self._slot.items() if s in self._users]
