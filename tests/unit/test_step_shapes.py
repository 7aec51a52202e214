"""The worker's step-shape record: what it saves is what pipeline-bench --bound replays."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pipeline.gpu_worker.step_shapes import StepShapeRecorder, StepShapes


def test_round_trip(tmp_path):
    rows = [
        (np.array([64, 1, 1]), np.array([0, 30, 7]), np.array([0, 1, 2])),
        (np.array([1]), np.array([64]), np.array([], dtype=np.int64)),
        (np.array([17, 1]), np.array([64, 65]), np.array([1])),
    ]
    rec = StepShapeRecorder()
    for q, s, sample in rows:
        rec.add(SimpleNamespace(num_scheduled_tokens=q, start_pos=s, sample_rows=sample))
    rec.save(str(tmp_path / "s.npz"))
    shapes = StepShapes.load(str(tmp_path / "s.npz"))
    assert shapes.num_steps == 3
    for i, (q, s, sample) in enumerate(rows):
        got_q, got_s, got_sampled = shapes.step(i)
        assert got_q.tolist() == q.tolist() and got_s.tolist() == s.tolist()
        assert np.flatnonzero(got_sampled).tolist() == sample.tolist()


def test_no_steps(tmp_path):
    StepShapeRecorder().save(str(tmp_path / "s.npz"))
    assert StepShapes.load(str(tmp_path / "s.npz")).num_steps == 0
