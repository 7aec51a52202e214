"""The benchmark's workloads: each multi-turn turn resends the conversation, replies included, in a closed
loop; a fixed workload sends everything at once; the rewrite prompts are deterministic and quote their code."""

from __future__ import annotations

import asyncio

from pipeline.bench.drivers import play
from pipeline.bench.workloads import MultiTurn, Workload
from pipeline.io_proc.tokenization import load_tokenizer


def test_each_turn_resends_the_conversation_with_the_replies():
    work = MultiTurn.synth(num_users=3, num_turns=3, system_len=20, message_len=4, output_len=5, seed=1)
    sent: list[tuple[int, list[int]]] = []
    open_turns: dict[int, int] = {}  # user (by seed) -> turns in flight, at most one per user

    async def send(prompt, max_tokens, seed):
        user = seed // work.num_turns
        assert open_turns.get(user, 0) == 0, "a user sent its next turn before the reply to the previous one"
        open_turns[user] = 1
        sent.append((seed, prompt))
        await asyncio.sleep(0.001 * (seed % 3))
        open_turns[user] = 0
        assert max_tokens == 5
        return seed, [100 + seed] * max_tokens  # the reply: its own tokens

    played = asyncio.run(play(work, send))
    assert [turn for _, turn in played] == [0, 1, 2] * 3
    prompts = dict(sent)
    for u in range(3):
        m = work.messages[u]
        reply = [[100 + u * 3 + t] * 5 for t in range(3)]
        assert prompts[u * 3] == work.system + m[0]
        assert prompts[u * 3 + 1] == work.system + m[0] + reply[0] + m[1]
        assert prompts[u * 3 + 2] == work.system + m[0] + reply[0] + m[1] + reply[1] + m[2]
        assert all(len(x) == 4 for x in m)
    assert work.max_len == 20 + 12 + 15
    assert len({tuple(p[:20]) for p in prompts.values()}) == 1, "every user shares the system prompt"


def test_a_fixed_workload_sends_everything_at_once():
    work = Workload.fixed(batch_size=4, input_len=3, output_len=2, seed=0)
    started = []

    async def send(prompt, max_tokens, seed):
        started.append(seed)
        await asyncio.sleep(0.01)
        assert len(started) == 4, "every request is in flight before any finishes"
        return seed, []

    assert [x for x, _ in asyncio.run(play(work, send))] == [0, 1, 2, 3]


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
