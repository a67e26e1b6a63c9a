"""The workload remembers each prompt's solve rate (a seeded draw, asked for by every response
of a group): the remembered rate is the prompt's own, whatever order prompts are asked in, so
`correct` answers as a workload that draws every time."""

import random

from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.sim.workload import Workload, WorkloadConfig


def _request(prompt_key: int, index: int) -> GenerationRequest:
    return GenerationRequest(f"p{prompt_key}-{index}", [0, 0, prompt_key],
                             SamplingParams(max_new_tokens=100))


def test_solve_rates_are_per_prompt_and_independent_of_the_order_asked():
    config = WorkloadConfig(prompts=64)
    requests = [_request(key, i) for key in range(64) for i in range(8)]
    shuffled = list(requests)
    random.Random(1).shuffle(shuffled)
    in_order, out_of_order = Workload(config, seed=3), Workload(config, seed=3)
    answers = {r.request_id: in_order.correct(r) for r in requests}
    assert {r.request_id: out_of_order.correct(r) for r in shuffled} == answers
    rates = [Workload(config, seed=3).solve_rate(key) for key in range(64)]  # drawn afresh
    assert [in_order.solve_rate(key) for key in range(64)] == rates
    assert len(set(rates)) == 64  # one rate per prompt, not one for all
    assert 0.2 < sum(answers.values()) / len(answers) < 0.8  # Beta(2, 2): about half right
