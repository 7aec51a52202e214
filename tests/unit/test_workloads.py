"""pipeline-bench's workloads: deterministic, within their limits, and the rewrite prompts quote their code."""

from __future__ import annotations

from pipeline.bench.workloads import Workload
from pipeline.io_proc.tokenization import load_tokenizer


def test_rewrite_prompts_hold_the_code_to_rewrite(smol_dir):
    tokenizer, _ = load_tokenizer(str(smol_dir))
    work = Workload.rewrite(12, tokenizer, 1024, seed=3)
    assert work.prompts == Workload.rewrite(12, tokenizer, 1024, seed=3).prompts
    assert len(work.prompts) == len(work.output_lens) > 0
    for ids, out in zip(work.prompts, work.output_lens, strict=True):
        text = tokenizer.decode(ids)
        assert text.rstrip().endswith("<|im_start|>assistant")  # a chat turn awaiting the answer
        code = text.split("```python\n", 1)[1].split("\n```", 1)[0]
        assert code.startswith("def ") and 20 <= len(code.splitlines()) <= 80
        assert len(tokenizer.encode(code)) + 64 >= out >= 1 and len(ids) + out <= 1024
    assert Workload.rewrite(12, tokenizer, 1024, seed=4).prompts != work.prompts
