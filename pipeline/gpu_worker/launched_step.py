"""A step whose device work is enqueued, the one copy that brings its results to the host, and their read-back
(docs/design.md, "The worker")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.step_output import MAX_LOGPROBS, NONFINITE, TokenLogprobs
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import Executed, LogprobTensors
from pipeline.gpu_worker.sampling.logprobs import PromptLogprobPlan
from pipeline.gpu_worker.spec.speculation import SampledPositions


class StaleTokenError(RuntimeError):
    """A placeholder resolved to a token-id cache entry that was already consumed."""


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; ``tokens`` and ``stale`` (host tensors) are valid once ``done`` fired,
    times are ``time.monotonic_ns()``."""

    step_id: int
    req_num: np.ndarray  # [S] int64 of the sampled rows
    prepare_start_ns: int
    tokens: torch.Tensor | None = None  # [S] int64 (pinned on CUDA); speculating, as SampledPositions.output_rows reads
    done: object | None = None  # CUDA or simulated event; None on CPU torch: the work already ran
    start_event: torch.cuda.Event | None = None  # CUDA: recorded before the forward
    anchor: tuple[object, int] | None = None  # CUDA: (event, host ns) if launched on an idle device
    stale: torch.Tensor | None = None  # poison mode: [P] int64, 1 where a placeholder read a poisoned entry
    stale_req_indices: np.ndarray | None = None  # [P] the req_index each placeholder (then draft) read
    nonfinite: torch.Tensor | None = None  # [S'] int64 on the host: 1 where a position's logits were not finite
    failed: np.ndarray | None = None  # req_num of the requests that end with an error (None: none)
    failed_why: np.ndarray | None = None  # why each does: an index of step_output.FAILURES
    spec: SampledPositions | None = None  # speculative decoding: the step's sampled positions
    draft_matched: np.ndarray | None = None  # after finish with speculation: [rows] per output row
    proposals: tuple[np.ndarray, np.ndarray] | None = None  # after finish: (req_num [S], next drafts [S, K])
    lp_rows: np.ndarray | None = None  # [L] output rows whose request asked for log-probabilities
    prompt_plan: PromptLogprobPlan | None = None  # the prompt positions whose log-probabilities are computed
    lp_host: torch.Tensor | None = None  # packed log-probabilities (see start_host_copy)
    logprobs: TokenLogprobs | None = None  # index = output row (lp_rows: sampled positions, until finish)
    prompt_logprobs: TokenLogprobs | None = None  # index = request number, with positions
    prepare_end_ns: int = 0
    launch_ns: int = 0
    device_start_ns: int = 0  # on CUDA derived from the events in finish()
    device_end_ns: int = 0
    continues: bool = False  # the descriptor's flag: some row's request ran before this step

    def is_done(self) -> bool:
        return self.done is None or self.done.query()

    def add_stale(self, stale: torch.Tensor, req_indices: np.ndarray) -> None:
        """Poison mode: more stale flags (``[D]`` int64 on the device) and the req_index each input read."""
        if self.stale is not None:
            stale, req_indices = torch.cat([self.stale, stale]), np.concatenate([self.stale_req_indices, req_indices])
        self.stale, self.stale_req_indices = stale, req_indices

    def wait(self) -> None:
        """Block until ``done`` has fired (a CUDA event's or the simulated device's synchronize)."""
        if self.done is not None:
            self.done.synchronize()

    def start_host_copy(self, executed: Executed, ops: DeviceOps) -> None:
        """Start copying tokens, stale and non-finite flags and log-probabilities to the host as one int64 tensor
        (float32 as int32 bit patterns), so one event (``done``) covers all."""
        tokens = executed.tokens
        parts = [tokens] + ([self.stale] if self.stale is not None else [])
        if executed.nonfinite is not None:
            parts.append(executed.nonfinite.long())
        for lp in (executed.logprobs, executed.prompt_logprobs):
            if lp is not None:
                parts.extend(_pack(lp))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        host, done = ops.copy_to_host(out)
        num_sampled = tokens.shape[0]
        self.tokens = host[:num_sampled]
        end = num_sampled
        if self.stale is not None:
            end += self.stale.shape[0]
            self.stale = host[num_sampled:end]
        if executed.nonfinite is not None:
            self.nonfinite = host[end : end + executed.nonfinite.shape[0]]
            end += executed.nonfinite.shape[0]
        self.lp_host = host[end:]
        self.done = executed.done if executed.done is not None else done

    def fail(self, req_nums: np.ndarray, why: int) -> None:
        """End ``req_nums`` with an error (``step_output.FAILURES[why]``), those not failed already."""
        if self.failed is not None:
            req_nums = np.setdiff1d(req_nums, self.failed)
        why = np.full(len(req_nums), why, np.uint8)
        self.failed = req_nums if self.failed is None else np.concatenate([self.failed, req_nums])
        self.failed_why = why if self.failed_why is None else np.concatenate([self.failed_why, why])

    def read_host_copy(self) -> None:
        """Check the poison flags, list requests with non-finite logits (``failed``), unpack log-probabilities and,
        speculating, one output row per token got; call once ``done`` fired.

        Raises:
            StaleTokenError: in poison mode, if a placeholder (or draft) of the step read a consumed entry.
        """
        if self.stale is not None:
            bad = self.stale.numpy().astype(bool)
            if bad.any():
                raise StaleTokenError(
                    f"step {self.step_id}: placeholder for req_indices {self.stale_req_indices[bad].tolist()} "
                    "read a consumed token-id cache entry"
                )
        if self.nonfinite is not None:
            bad = self.nonfinite.numpy().astype(bool)
            if bad.any():  # positions -> sampled rows (speculating, several positions a row) -> requests
                self.fail(np.unique(self.req_num[self.spec.row[bad] if self.spec is not None else bad]), NONFINITE)
        packed, offset = self.lp_host.numpy() if self.lp_host is not None else None, 0
        if self.lp_rows is not None:
            self.logprobs, offset = _unpack(packed, offset, self.lp_rows)
        if self.prompt_plan is not None:
            plan = self.prompt_plan
            self.prompt_logprobs, offset = _unpack(packed, offset, plan.req_num)
            self.prompt_logprobs.pos = plan.pos
        if self.spec is not None:
            self.tokens, self.req_num, self.draft_matched, self.logprobs, self.proposals = self.spec.output_rows(
                self.tokens, self.req_num, self.logprobs
            )


def _pack(lp: LogprobTensors) -> list[torch.Tensor]:
    """One log-probability set as flat int64 tensors: float32 values as their bit patterns."""
    logprob, top_ids, top_logprobs = lp
    return [
        logprob.contiguous().view(torch.int32).long(),
        top_ids.reshape(-1).long(),
        top_logprobs.contiguous().view(torch.int32).reshape(-1).long(),
    ]


def _unpack(packed: np.ndarray, offset: int, index: np.ndarray) -> tuple[TokenLogprobs, int]:
    """Read back one set packed by ``_pack`` at ``offset``; returns it and the offset after it."""
    n, k = len(index), MAX_LOGPROBS
    logprob = packed[offset : offset + n].astype(np.int32).view(np.float32)
    top_ids = packed[offset + n : offset + n + n * k].astype(np.int32).reshape(n, k)
    top_logprobs = packed[offset + n + n * k : offset + n + 2 * n * k].astype(np.int32).view(np.float32).reshape(n, k)
    return TokenLogprobs(index.astype(np.int64), logprob, top_ids, top_logprobs), offset + n + 2 * n * k
