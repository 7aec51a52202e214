"""Applying a StepOutput to the scheduler's requests (docs/design.md, "Outputs"); a ``Scheduler`` mixin, for plain
attribute lookups on the per-token path."""

from __future__ import annotations

import time

import numpy as np

from pipeline.common.messages import check_finish
from pipeline.scheduler_proc.prefix_cache import num_final_tokens
from pipeline.scheduler_proc.request import Request


class SchedulerOutputsMixin:
    """``Scheduler.process_output`` and what it calls."""

    def process_output(
        self,
        step_id: int,
        req_nums: np.ndarray | list[int],
        token_ids: np.ndarray | list[int],
        time_ns: int = 0,
        draft_matched: np.ndarray | None = None,
        device_ns: int = 0,
        proposals: tuple[list[int], np.ndarray] | None = None,
    ) -> list[int]:
        """Apply StepOutput ``step_id`` (``req_nums``/``token_ids``: ``[rows]``): append tokens, finish requests,
        release frees.

        Tokens of finished or aborted requests are dropped. ``time_ns`` 0 means now; ``device_ns`` sizes the costly-mask
        budget; ``proposals`` (``(req_nums, drafts [D, K])``) are checked by constrained rows' next masks. Returns the
        finished ``req_num``.

        Raises:
            RuntimeError: as ``SteadyRows.apply_output``.
        """
        finished: list[int] = []
        if device_ns > 0:  # a moving average over about four steps
            s = device_ns * 1e-9
            self.step_device_s = s if not self.step_device_s else self.step_device_s + (s - self.step_device_s) / 4
        self._output_ns = time_ns or time.monotonic_ns()
        self._output_step = step_id
        req_nums, token_ids = np.asarray(req_nums, np.int64), np.asarray(token_ids, np.int64)
        if proposals is not None and self.masks_drafts and self.num_grammar_requests:
            for r, drafts in zip(*proposals):
                if (req := self.requests.get(r)) is not None and req.grammar is not None:
                    req.proposed_drafts = drafts
        d, left, ended, verified = self.steady.apply_output(step_id, req_nums, token_ids)
        for r, n, tokens in left:
            if (req := self.requests.get(r)) is not None and n > 1:  # it verified drafts: a run of tokens
                self.drafts.apply_run(req, n, tokens, finished)
            elif req is not None:
                self._apply_token(req, tokens[0], finished)
        if ended:
            finished.extend(req.req_num for req in ended)
            self._remove_ended(ended)
        self.steady.flush(step_id)
        if self.drafts is None:
            for r, t in zip(req_nums[d:].tolist(), token_ids[d:].tolist()):
                if (req := self.requests.get(r)) is not None:
                    self._apply_token(req, t, finished)
        else:
            self.drafts.apply_output(
                step_id, device_ns, d, verified, req_nums, token_ids, draft_matched, self.requests, finished
            )
        for req in self._finish_after.pop(step_id, ()):
            if self.requests.get(req.req_num) is req:
                finished.append(req.req_num)
                self._observe_finish(req, self._output_ns)
                self._remove(req, ended=True)
        self._name_ended(step_id)
        self.pool.step_completed(step_id)
        self._last_output_step = self.masks.applied_step = step_id
        if self.masks_drafts and len(self.masks):
            self.start_walks()
        return finished

    def _apply_token(self, req: Request, t: int, finished: list[int]) -> bool:
        """Append ``t`` to ``req``; remove it and list it in ``finished`` if it ends (then True)."""
        if not req.first_token_ns:
            req.first_token_ns = self._output_ns
        steady = self.steady.holds(req)
        if steady:  # from a row it had before joining
            ends = self.steady.receive(req, t)
        else:
            req.num_placeholders -= 1
            req.output_token_ids.append(t)
            ends = check_finish(t, len(req.output_token_ids), req.params) is not None
        if ends:
            finished.append(req.req_num)
            self._observe_finish(req, self._output_ns)
            self._remove(req, ended=True)
        elif not steady:  # a steady row names its blocks when it leaves
            self.prefix.name_final(req, num_final_tokens(req))
            if req.grammar is not None:  # never steady
                # On a grammar thread; a failure ends the request (GrammarManager.failed).
                self.grammars.advance(req.grammar, t, awaited=req.num_placeholders > 0)
        return ends

    def _observe_finish(self, req: Request, end_ns: int) -> None:
        """Observe the phases of ``req``, which finished at ``end_ns`` (vLLM's intervals: queued -> first scheduled ->
        first token -> last token; docs/design.md, "Metrics")."""
        if not req.scheduled_ns:
            return
        first = req.first_token_ns or end_ns  # a prefill-only request (max_tokens 0) ends at its last chunk
        self.queue_time.observe((req.scheduled_ns - req.queued_ns) * 1e-9)
        self.prefill_time.observe((first - req.scheduled_ns) * 1e-9)
        self.decode_time.observe((end_ns - first) * 1e-9)
        self.inference_time.observe((end_ns - req.scheduled_ns) * 1e-9)

    def _remove_ended(self, reqs: list[Request]) -> None:
        """``_remove`` for steady rows that ended in this output (already released), in one pass over ``running``."""
        for req in reqs:
            self._observe_finish(req, self._output_ns)
            del self.requests[req.req_num]
            self._release_lora(req)
            self._free_ended(req)
        self.running = [r for r in self.running if r.req_index >= 0]  # a running request has a req_index
