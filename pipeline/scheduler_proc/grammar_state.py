"""One constrained request's matcher and the mask for its next output position (docs/design.md, "Structured output")."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy
import numpy as np

from pipeline.common.lazy_grammar import Trigger
from pipeline.common.step_protocol import MASK_BITS

# A row whose masks take this much CPU time or more (a decaying peak, ``GrammarState.cost_s``) is costly: its
# masks are computed one by one on the background thread, and it sits out the steps whose sampling would wait
# for them, unless the step's budget for costly masks has room. The others' masks are computed together,
# one job per step on the mask thread. A JSON schema's masks take microseconds (with a tenth of a millisecond
# to two now and then, for new lexer states), a large anyOf's first few milliseconds, a hostile regex's
# tens of milliseconds; a step's sampling waits for all of its rows' masks.
PACE_MASK_S = 0.0001
# A step's budget for costly masks, in expected CPU seconds: at least this, or ``MASK_SHARE_OF_STEP`` of the
# recent steps' device time (the masks are computed while the step's forward pass runs, so a slow device
# step hides slow masks; a 2 ms step hides few).
COSTLY_MASKS_PER_STEP_S = 0.001
MASK_SHARE_OF_STEP = 0.25


@dataclass
class CompiledGrammar:
    """One grammar, compiled: a matcher that has computed its first mask, to be deep-copied per choice."""

    template: llguidance.LLMatcher | None
    first_mask: np.ndarray | None  # int32 [W], llguidance's own (EOS stands for "may end")
    ends: bool  # the grammar accepts the empty output or has stopped
    nbytes: int  # heap taken by compiling and the first mask
    copy_nbytes: int  # heap one deep copy takes
    mask_s: float  # CPU time of a mask after the first (which builds the lexer)
    forced: tuple[int, ...] = ()  # the tokens it forces at the start (llguidance's fast-forward tokens)
    error: str = ""
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


class GrammarState:
    """The matcher of one constrained request (a choice), and the mask for its next output position.

    Stop ids are allowed exactly when the grammar accepts, so the request finishes with "stop" in the scheduler and
    io_proc alike. ``mask``: int32 ``[ceil(V / 32)]``, bit set = allowed, valid while ``ready``; ``error``: why the
    matcher failed, "" if not; ``forced``: tokens the grammar forces next (docs/design.md, "Jump-forward").
    """

    __slots__ = (
        "req_num",
        "mask",
        "ready",
        "error",
        "_matcher",
        "_pristine",
        "trigger",
        "_stop_ids",
        "cost_s",
        "closed",
        "_tokenizer",
        "_entry",
        "_nbytes",
        "on_background",
        "forced",
        "_consumed",
        "_jump_forward",
    )

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        entry: CompiledGrammar,
        matcher: llguidance.LLMatcher,
        req_num: int,
        stop,
        trigger: Trigger | None = None,
        jump_forward: bool = False,
    ):
        self.req_num, self._tokenizer, self._entry, self.trigger = req_num, tokenizer, entry, trigger
        # With a trigger, ``matcher`` stays pristine; _matcher is None until a mask needs one (the first
        # mask, the compiled grammar's, is that of a pristine matcher).
        self._matcher, self._pristine = (matcher, None) if trigger is None else (None, matcher)
        self._nbytes = entry.copy_nbytes * (1 if trigger is None else 2)
        self._stop_ids = tuple(int(t) for t in stop)
        self.mask = end_mask(entry.first_mask.copy(), entry.ends, tokenizer.eos_token, self._stop_ids)
        self.cost_s = entry.mask_s
        self.ready, self.error, self.closed = True, "", False
        self.on_background = False  # its matcher is at work on the background thread
        self._jump_forward, self._consumed = jump_forward and trigger is None, 0
        self.forced = (0, list(entry.forced) if self._jump_forward else [])

    @property
    def costly(self) -> bool:
        """Its masks take ``PACE_MASK_S`` or more (``cost_s``): its row waits for its mask out of the step."""
        return self.cost_s >= PACE_MASK_S

    def needs_mask(self, in_flight: int) -> bool:
        """Whether the next sampled token needs ``mask``, with ``in_flight`` of the row's tokens not advanced past yet
        (a row that needs one waits for them). Always, without a trigger."""
        return self.trigger is None or self.trigger.needs_mask(in_flight)

    def follow(self, token_id: int) -> tuple[bool, bytes | None, llguidance.LLMatcher | None]:
        """Output ``token_id`` has come: ``(whether a mask job follows, the text tail the job builds a matcher from
        (None: consume ``token_id``), a matcher no longer used)``."""
        if token_id in self._stop_ids or self.error:
            return False, None, None
        trigger = self.trigger
        if trigger is None:
            return True, None, None
        masked = trigger.needs_mask(0)  # this token was sampled under a mask, from the matcher's state
        trigger.feed(token_id)
        if not trigger.needs_mask(0):
            dropped, self._matcher = self._matcher, None  # None unless the text turned away from the trigger
            return False, None, dropped
        if masked and trigger.triggered:
            return True, None, None  # the matcher goes on past the trigger
        return True, trigger.tail(), None  # a fresh matcher, fed the text's tail

    def take_matchers(self) -> list[llguidance.LLMatcher]:
        """Its request has ended: its matchers (to be freed off the scheduler's loop)."""
        self.closed = True
        matchers = [m for m in (self._matcher, self._pristine) if m is not None]
        self._matcher = self._pristine = None
        return matchers

    def compute(self, token_ids: list[int], tail: bytes | None) -> None:  # on a grammar thread
        """Consume ``token_ids``, or with ``tail`` make a matcher from the pristine one fed it; then the next mask. A
        failure sets ``error``."""
        t0 = time.thread_time()  # CPU time: a thread that waits for the GIL or a core is not charged
        m, pristine = self._matcher, self._pristine
        if self.closed or (m is None and pristine is None):  # its request has ended meanwhile
            return
        if tail is not None:
            m = pristine.deep_copy()
            if not all(m.consume_token(t) for t in self._tokenizer.tokenize_bytes(tail)):
                self.error = f"the text before the trigger does not parse: {error_of(m) or 'rejected'}"
                return
            self._matcher = m
        else:
            if m is None:  # a trigger at the output's start: the first mask was the pristine matcher's
                m = self._matcher = pristine.deep_copy()
            for token_id in token_ids:
                if not m.consume_token(token_id):
                    self.error = f"the output left its grammar at token {token_id}: {error_of(m) or 'rejected'}"
                    return
            self._consumed += len(token_ids)
        mask = np.zeros_like(self.mask)
        llguidance.numpy.fill_next_token_bitmask(m, mask.reshape(1, -1), 0)
        if m.is_error():
            self.error = f"the output left its grammar: {error_of(m)}"
            return
        ends = m.is_accepting() or m.is_stopped()
        self.mask = end_mask(mask, ends, self._tokenizer.eos_token, self._stop_ids)
        if self._jump_forward:
            self.forced = (self._consumed, m.compute_ff_tokens())
        # A decaying peak: a slow mask (new lexer states: a JSON schema's take up to half a millisecond now and
        # then) keeps its row out for a mask or two; a grammar whose every mask is slow stays out.
        self.cost_s = max(time.thread_time() - t0, self.cost_s / 4)
        self.ready = True

    def walk(self, drafts: list[int]) -> np.ndarray:  # on the mask thread, once ``ready``
        """The masks of a row verifying ``drafts``: ``[1 + k, W]`` int32, ``mask`` then one after each allowed draft
        (all allowed after a forbidden one); the matcher is rolled back, a failure sets ``error``."""
        out = np.full((1 + len(drafts), len(self.mask)), -1, np.int32)
        out[0] = self.mask
        m = self._matcher
        if m is None or self.closed or self.error:
            return out
        consumed = 0
        for j, d in enumerate(drafts):
            w, b = divmod(d, MASK_BITS)
            if d in self._stop_ids or not (int(out[j, w]) >> b) & 1 or m.try_consume_tokens([d]) != 1:
                break
            consumed += 1
            out[j + 1] = 0
            llguidance.numpy.fill_next_token_bitmask(m, out[j + 1].reshape(1, -1), 0)
            if m.is_error():
                self.error = f"the output left its grammar: {error_of(m)}"
                return out
            end_mask(out[j + 1], m.is_accepting() or m.is_stopped(), self._tokenizer.eos_token, self._stop_ids)
        if consumed and not m.rollback(consumed):
            self.error = f"the grammar could not take back its drafts: {error_of(m) or 'rollback failed'}"
        return out


def end_mask(mask: np.ndarray, ends: bool, eos: int, stop_ids: tuple[int, ...]) -> np.ndarray:
    """``mask`` with the tokenizer's ``eos`` replaced by the request's stop ids, allowed iff the grammar ``ends``."""
    view = mask.view(np.uint32)
    _set_bit(view, eos, False)
    if ends:
        for t in stop_ids:
            _set_bit(view, t, True)
    return mask


def _set_bit(view: np.ndarray, t: int, value: bool) -> None:
    w, b = divmod(t, MASK_BITS)
    bit = np.uint32(1 << b)
    view[w] = view[w] | bit if value else view[w] & ~bit


def error_of(m: llguidance.LLMatcher) -> str:
    """The matcher's error message, without the marker of the parser state it leaves out."""
    return m.get_error().replace("<non-verbose/>", "").strip()
