"""The composition of every step the worker ran, for ``pipeline-bench --bound`` replay (docs/design.md, "Measuring the
token gap"); recorded only when ``EngineConfig.step_shapes_file`` is set."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.common.step_protocol import StepInputs


@dataclass
class StepShapes:
    """Rows of many steps, concatenated; step ``i`` owns rows ``row_start[i]:row_start[i + 1]`` (``[N]`` int32
    ``query_lens``/``start_pos``, bool ``sampled``; ``row_start`` int64)."""

    query_lens: np.ndarray
    start_pos: np.ndarray
    sampled: np.ndarray
    row_start: np.ndarray

    @property
    def num_steps(self) -> int:
        """Steps recorded."""
        return len(self.row_start) - 1

    def step(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step ``i``'s ``(query_lens, start_pos, sampled)`` rows."""
        a, b = self.row_start[i], self.row_start[i + 1]
        return self.query_lens[a:b], self.start_pos[a:b], self.sampled[a:b]

    @classmethod
    def load(cls, path: str) -> StepShapes:
        """Read a file written by ``StepShapeRecorder.save``.

        Raises:
            OSError / KeyError: no such file, or not a step-shapes file.
        """
        with np.load(path) as f:
            return cls(f["query_lens"], f["start_pos"], f["sampled"], f["row_start"])


@dataclass
class StepShapeRecorder:
    """Collects each launched step's rows in the worker."""

    _steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    def add(self, inputs: StepInputs) -> None:
        """Record one step (called once per descriptor, in launch order)."""
        sampled = np.zeros(len(inputs.num_scheduled_tokens), dtype=bool)
        sampled[inputs.sample_rows] = True
        self._steps.append((inputs.num_scheduled_tokens.astype(np.int32), inputs.start_pos.astype(np.int32), sampled))

    def save(self, path: str) -> None:
        """Write every recorded step to ``path`` (``.npz``)."""
        q, s, smp = zip(*self._steps) if self._steps else ([np.zeros(0, np.int32)],) * 2 + ([np.zeros(0, bool)],)
        row_start = np.concatenate([[0], np.cumsum([len(x) for x in q[: len(self._steps)]])]).astype(np.int64)
        np.savez(
            path,
            query_lens=np.concatenate(q),
            start_pos=np.concatenate(s),
            sampled=np.concatenate(smp),
            row_start=row_start,
        )
