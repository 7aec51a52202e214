"""The scheduler's writer of StepDescriptors (fields: ``step_protocol.DESCRIPTOR``)."""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from pipeline.common.messages import SamplingParams
from pipeline.common.records import Record
from pipeline.common.step_protocol import DESCRIPTOR, DRAFT_TOKEN_ID, StepDescriptor


class DescriptorBuilder:
    """Collects one step's rows in descriptor order, then ``write``s them into a ring entry; reused across steps
    (``clear``). ``record``'s ``sampling`` group is copied from the same-named ``SamplingParams`` attributes."""

    def __init__(self, record: Record = DESCRIPTOR) -> None:
        self._h = record.header_index
        self._sampling_names = tuple(f.name for f in record.group("sampling").fields)
        self._sampling_values = attrgetter(*self._sampling_names)
        self._req_num: list[int] = []
        self._req_index: list[int] = []
        self._num_tokens: list[int] = []
        self._start_pos: list[int] = []
        self._do_sample: list[bool] = []
        self._is_new: list[bool] = []
        self._num_prompt_logprobs: list[int] = []
        self._next_prompt_token: list[int] = []
        self._num_drafts: list[int] = []
        self._num_rejected: list[int] = []
        self._new: list[tuple[int, SamplingParams, int, tuple[int, int]]] = []
        self._token_ids: list[int] = []
        self._new_blocks: list[tuple[int, int, int]] = []
        self._new_block_arrays: list[np.ndarray] = []  # [3, k] int: req_index, column, block (from add_blocks)
        self._num_array_blocks = 0
        self._masks: list[int] = []  # rows that sample under a grammar

    def __len__(self) -> int:
        """Rows added since the last ``clear``."""
        return len(self._req_num)

    @property
    def num_blocks(self) -> int:
        """Block-table entries added since the last ``clear``."""
        return len(self._new_blocks) + self._num_array_blocks

    def clear(self) -> None:
        for lst in (
            self._req_num,
            self._req_index,
            self._num_tokens,
            self._start_pos,
            self._do_sample,
            self._is_new,
            self._num_prompt_logprobs,
            self._next_prompt_token,
            self._num_drafts,
            self._num_rejected,
            self._new,
            self._token_ids,
            self._new_blocks,
            self._new_block_arrays,
            self._masks,
        ):
            lst.clear()
        self._num_array_blocks = 0

    def add_row(
        self,
        req_num: int,
        req_index: int,
        start_pos: int,
        token_ids: list[int],
        do_sample: bool,
        new_params: SamplingParams | None,
        num_prompt_logprobs: int = 0,
        next_prompt_token: int = -1,
        prompt_len: int = 0,
        masked: bool = False,
        num_drafts: int = 0,
        num_rejected: int = 0,
        lora: tuple[int, int] = (0, 0),
    ) -> None:
        """Schedule ``token_ids`` (real or ``PLACEHOLDER_TOKEN_ID``, at least one; positions ``start_pos...``) of
        ``req_num`` at row ``req_index``.

        ``new_params``: only on a request's first row at ``req_index``; ``masked``: its mask follows in ``TokenMasks``;
        ``num_drafts``: the last ones are ``DRAFT_TOKEN_ID`` drafts (needs ``do_sample``);
        ``lora``: with ``new_params``, ``(lora_slot, lora_id)``, the adapter slot the row uses and the adapter it
        holds (``(0, 0)``: none).
        """
        if masked:
            self._masks.append(len(self._req_num))
        if new_params is not None:
            self._new.append((len(self._req_num), new_params, prompt_len, lora))
        self._req_num.append(req_num)
        self._req_index.append(req_index)
        self._num_tokens.append(len(token_ids))
        self._start_pos.append(start_pos)
        self._do_sample.append(do_sample)
        self._is_new.append(new_params is not None)
        self._num_prompt_logprobs.append(num_prompt_logprobs)
        self._next_prompt_token.append(next_prompt_token)
        self._num_drafts.append(num_drafts)
        self._num_rejected.append(num_rejected)
        self._token_ids.extend(token_ids)

    def add_block(self, req_index: int, column: int, block_id: int) -> None:
        """Set ``block_table[req_index, column] = block_id`` before the step runs."""
        self._new_blocks.append((req_index, column, block_id))

    def add_blocks(self, req_indices: np.ndarray, columns: np.ndarray, block_ids: np.ndarray) -> None:
        """Set ``block_table[req_indices[j], columns[j]] = block_ids[j]`` for every ``j`` (int arrays ``[k]``)."""
        self._new_block_arrays.append(np.stack([req_indices, columns, block_ids]))
        self._num_array_blocks += len(block_ids)

    def write(
        self,
        desc: StepDescriptor,
        step_id: int,
        decode: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
        continues: bool = False,
        decode_rejected: np.ndarray | None = None,
        decode_drafts: np.ndarray | None = None,
    ) -> int:
        """Write the collected rows into ``desc`` as step ``step_id``; returns its number of tokens.

        ``decode``: ``(req_num, req_index, start_pos, token_ids)`` int arrays ``[D]``, the steady rows, written first;
        ``decode_rejected``/``decode_drafts``: ``[D]`` (None: 0 / none).
        """
        d = 0 if decode is None else len(decode[0])
        td = d if decode_drafts is None else d + int(decode_drafts.sum())  # the decode rows' tokens
        n, t, b = d + len(self._req_num), td + len(self._token_ids), self.num_blocks
        h, H = desc.header, self._h
        h[H["step_id"]], h[H["num_reqs"]], h[H["num_tokens"]], h[H["num_new_blocks"]] = step_id, n, t, b
        h[H["num_masked_rows"]], h[H["continues"]] = len(self._masks), continues
        if self._masks:
            desc.mask_row[: len(self._masks)] = np.asarray(self._masks) + d
        if d:
            desc.req_num[:d], desc.req_index[:d], desc.start_pos[:d] = decode[:3]
            if decode_drafts is None:
                desc.token_ids[:d] = decode[3]
                desc.num_scheduled_tokens[:d] = 1
                desc.num_draft_tokens[:d] = 0
            else:
                q = decode_drafts + 1
                desc.token_ids[:td] = DRAFT_TOKEN_ID
                desc.token_ids[np.cumsum(q) - q] = decode[3]
                desc.num_scheduled_tokens[:d] = q
                desc.num_draft_tokens[:d] = decode_drafts
            desc.num_rejected[:d] = 0 if decode_rejected is None else decode_rejected
            desc.do_sample[:d] = 1
            desc.is_new[:d] = 0
            desc.num_prompt_logprobs[:d] = 0
            desc.next_prompt_token[:d] = -1
        desc.req_num[d:n] = self._req_num
        desc.req_index[d:n] = self._req_index
        desc.num_scheduled_tokens[d:n] = self._num_tokens
        desc.start_pos[d:n] = self._start_pos
        desc.do_sample[d:n] = self._do_sample
        desc.is_new[d:n] = self._is_new
        desc.num_prompt_logprobs[d:n] = self._num_prompt_logprobs
        desc.next_prompt_token[d:n] = self._next_prompt_token
        desc.num_draft_tokens[d:n] = self._num_drafts
        desc.num_rejected[d:n] = self._num_rejected
        if self._new:
            self._write_new_rows(desc, d)
        desc.token_ids[td:t] = self._token_ids
        if b:
            parts = self._new_block_arrays + ([np.asarray(self._new_blocks).T] if self._new_blocks else [])
            desc.nb_req_index[:b], desc.nb_index[:b], desc.nb_block[:b] = np.concatenate(parts, axis=1)
        return t

    def _write_new_rows(self, desc: StepDescriptor, d: int) -> None:
        """The parameters of the rows new at their req_index: the ``sampling`` group by name, then the rest."""
        columns = [getattr(desc, name) for name in self._sampling_names]
        get = self._sampling_values
        for i, p, prompt_len, lora in self._new:
            i += d
            for column, v in zip(columns, get(p)):
                column[i] = v
            desc.prompt_len[i] = prompt_len
            desc.lora_slot[i], desc.lora_id[i] = lora
            nb = desc.num_logit_bias[i] = len(p.logit_bias)
            if nb:
                ids, values = zip(*p.logit_bias)
                desc.logit_bias_ids[i, :nb], desc.logit_bias_values[i, :nb] = ids, values
            # Only min_tokens needs the stop ids on the worker, and only if they stop the request.
            stop = p.stop_token_ids if p.min_tokens > 0 and not p.ignore_eos else ()
            desc.num_stop_ids[i] = len(stop)
            desc.stop_ids[i, : len(stop)] = stop
