"""lm-evaluation-harness scores a multiple-choice task through the server, unchanged.

The test writes a small multiple-choice task (a JSON file of documents and a
task YAML) and runs the ``lm_eval`` command line twice on SmolLM2, fully
offline: with its ``local-completions`` model pointed at the server
(loglikelihoods through ``echo`` + ``logprobs``, prompts as token ids, the
tokenizer from the local model directory), and with its own ``hf`` backend
on the same weights in float32. The run must finish with one result per
(document, choice); each loglikelihood must equal the one computed from the
server's log-probabilities directly and the ``hf`` backend's (1e-3), and the
accuracies must be equal.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.e2e.lm_eval_task import DOCS, run_lm_eval, server_loglikelihoods, server_model_args, write_task

pytest.importorskip("lm_eval")


def test_lm_eval_local_completions_scores_through_the_server(smol_async, smol_dir, tmp_path):
    write_task(tmp_path)
    acc, lls = run_lm_eval(tmp_path, "server", "local-completions", server_model_args(smol_async, smol_dir))
    assert len(lls) == sum(len(doc["choices"]) for doc in DOCS)

    ours = server_loglikelihoods(smol_async, AutoTokenizer.from_pretrained(smol_dir))
    for key, ll in lls.items():
        assert abs(ll - ours[key]) < 1e-3, (key, ll, ours[key])
    best = [max(range(len(doc["choices"])), key=lambda i, d=d: ours[(d, i)]) for d, doc in enumerate(DOCS)]
    assert acc == pytest.approx(sum(b == doc["answer"] for b, doc in zip(best, DOCS)) / len(DOCS))

    hf_acc, hf_lls = run_lm_eval(tmp_path, "hf", "hf", f"pretrained={smol_dir},dtype=float32", "--device", "cpu")
    assert hf_lls.keys() == lls.keys()
    for key, ll in lls.items():
        assert abs(ll - hf_lls[key]) < 1e-3, (key, ll, hf_lls[key])
    assert acc == hf_acc
