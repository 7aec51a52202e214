"""io_proc's output reader: a request whose output processing raises ends alone, with an error; the others go on."""

from __future__ import annotations

from pipeline.common.messages import SamplingParams
from pipeline.common.step_output import DecodedOutput
from pipeline.io_proc.detokenizer import OutputProcessor
from pipeline.io_proc.output_reader import OutputReader
from pipeline.io_proc.request_metrics import RequestMetrics
from pipeline.io_proc.request_state import RequestState, StepTime
from tests.unit.test_stop_strings import EOS, ByteDetokenizer


class Broken(ByteDetokenizer):
    def push(self, token_id: int) -> str:
        raise UnicodeError("a broken detokenizer")


class _Loop:
    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def test_a_failing_request_ends_with_an_error_and_the_others_go_on():
    params = SamplingParams(max_tokens=2, stop_token_ids=(EOS,))
    states = {
        num: RequestState(num, 1, OutputProcessor(detok(), params, [], incremental=True), True, False, params, [1])
        for num, detok in ((1, Broken), (2, ByteDetokenizer))
    }
    aborts, delivered = [], []
    reader = OutputReader(
        None,
        dict(states),
        lambda num, ns: aborts.append((num, ns)),
        lambda _, out: delivered.extend(out),
        RequestMetrics(64),
    )
    reader._loop = _Loop()
    reader.process_step(DecodedOutput(0, [1, 2], [ord("h"), ord("i")], time_ns=1), StepTime(0, 0.0, 1))
    reader.process_step(DecodedOutput(1, [1, 2], [ord("o"), ord("!")], time_ns=2), StepTime(1, 0.0, 2))
    (failed,) = [s for s, _, finish, _ in delivered if finish == "error"]
    assert failed is states[1] and failed.error == "internal error while producing the output: UnicodeError"
    assert aborts == [(1, 0)]  # the scheduler drops it too, as aborted, not finished
    assert [(text, finish) for s, text, finish, _ in delivered if s is states[2]] == [("i", None), ("!", "length")]
