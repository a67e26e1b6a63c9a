"""A multi-turn episode through the real `hf` engine and the tiny model: each turn resumes
from the transcript's exact tokens (`resume_ids`), and the behaviour log-probs of every model
token, in every turn, equal a single forward pass over prompt + transcript (what the trainer
computes) — so appending environment tokens introduces no drift."""

import asyncio

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.envs import Environment, Reply, Turn, run_episode
from eddyrl.hal import get_platform

TURN_TOKENS = 6  # the random tiny model rarely stops by itself: cap each turn


class ThreeTurns(Environment):
    async def respond(self, action):
        if self.turns == 3:
            return Reply(done=True, reward=1.0)
        return Reply(text="result:12\n", tool="calculator")


def test_turns_resume_exactly_and_logprobs_align(tiny_model_dir):
    from eddyrl.engines.inference.hf import HFInferenceEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=5)
    prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "add 1 2"}],
                                                    add_generation_prompt=True,
                                                    return_dict=False))
    requests = []

    async def generate_turn(transcript):
        sampling = SamplingParams(max_new_tokens=len(transcript) + TURN_TOKENS,
                                  stop_token_ids=(tokenizer.eos_token_id,))
        request = GenerationRequest(f"turn-{len(requests)}", prompt_ids, sampling,
                                    resume_ids=list(transcript.token_ids),
                                    resume_logprobs=list(transcript.logprobs),
                                    resume_versions=list(transcript.versions))
        requests.append(request)
        results = [r async for r in engine.generate([request])]
        final = results[-1]
        assert final.token_ids[:len(transcript)] == transcript.token_ids
        new = slice(len(transcript), None)
        # a per-turn cap of this test, not the episode's budget: the turn just ends
        return Turn(final.token_ids[new], final.logprobs[new], final.versions[new], "stop")

    env = ThreeTurns(tokenizer=tokenizer, prompt="add 1 2", answer="3")
    episode = asyncio.run(run_episode(env, generate_turn, tokenizer.decode, max_tokens=100))
    t = episode.transcript
    assert (episode.ended_by, episode.reward, len(t.turn_spans)) == ("env", 1.0, 3)
    observation = tokenizer.encode("result:12\n", add_special_tokens=False)
    for (_, end), (start, _) in zip(t.turn_spans, t.turn_spans[1:]):
        assert t.token_ids[end:start] == observation and set(t.loss_mask[end:start]) == {0}

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + t.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    trained = logp.gather(1, torch.tensor(t.token_ids)[:, None])[:, 0]
    mask = torch.tensor(t.loss_mask, dtype=torch.bool)
    diff = (trained - torch.tensor(t.logprobs))[mask].abs()
    assert int(mask.sum()) >= 3  # every turn generated something
    assert diff.max().item() < 1e-4, f"max |engine - forward| = {diff.max().item():.2e}"
