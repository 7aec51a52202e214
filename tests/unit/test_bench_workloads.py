"""The benchmark's multi-turn workload: each turn resends the conversation, replies included, in a closed loop."""

from __future__ import annotations

import asyncio

from pipeline.bench.drivers import play
from pipeline.bench.workloads import MultiTurn, Workload


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
