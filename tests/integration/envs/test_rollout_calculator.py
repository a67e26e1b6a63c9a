"""The real CalculatorEnv driven by the rollout, end to end on the tiny model: `prepare` builds
the tool task's episodes from config (the calculator's stop token added to the engine's), and a
tiny model taught the tool syntax on four prompts (a few seconds of SFT) calls the calculator,
reads its result and answers, token-in/token-out. (The tool task's settings checked at load:
test_tool_task_config.py.)"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eddyrl.config import load_config
from eddyrl.core.batching import build_train_batch
from eddyrl.core.requests import Purpose
from eddyrl.build import build_controller
from eddyrl.protocol import SamplingParams
from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.envs.calculator import TINY_SYNTAX, CalculatorEnv
from eddyrl.tasks.tool_task import demonstration
from eddyrl.hal import get_platform
from eddyrl.launch import prepare
from eddyrl.runtime.inprocess import InProcessRuntime
from eddyrl.tasks.arith import parse_prompt
from eddyrl.tasks.prompts import PromptSet

TOOL_TASK = ["data.task=tool_add", "env.name=calculator", "env.options.syntax=tiny",
             "data.train_size=20", "data.eval_size=4", "rollout.max_new_tokens=40"]
ROWS = [{"prompt": f"add {a} {b}", "answer": str(a + b)} for a, b in
        [(1, 2), (3, 4), (5, 2), (6, 1)]]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The tiny model after 100 SFT steps on the four reference episodes of ROWS."""
    from eddyrl.models.tiny import build_tiny_model, build_tokenizer
    from eddyrl.tasks.sft import tool_demonstration_batch

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    batch = tool_demonstration_batch(tokenizer, ROWS, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("tool_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_prepare_builds_the_tool_task_with_calculator_episodes(tiny_model_dir, tmp_path):
    run = prepare(load_config(overrides=TOOL_TASK), tiny_model_dir, tmp_path)
    tokenizer, train_set, settings = run.tokenizer, run.train_set, run.settings
    hash_id = tokenizer.convert_tokens_to_ids("#")
    assert settings.sampling.stop_token_ids == (tokenizer.eos_token_id, hash_id)
    env = settings.env(prompt="add 1 2", answer="3")
    assert isinstance(env, CalculatorEnv) and env.syntax == TINY_SYNTAX
    assert env.limits.max_turns == 4  # env.max_turns default
    assert all(max(parse_prompt(p.prompt)) >= 1000 for p in train_set.prompts)  # tool rows
    # no environment: single-turn, exactly as before
    plain = prepare(load_config(), tiny_model_dir, tmp_path / "plain").settings
    assert plain.env is None and plain.sampling.stop_token_ids == (tokenizer.eos_token_id,)


def test_calculator_episodes_on_a_tiny_model_that_knows_the_syntax(tool_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    run = prepare(load_config(overrides=TOOL_TASK), tool_model_dir, tmp_path)
    settings, reward = run.settings, run.reward
    prompts = PromptSet.from_rows(ROWS, "rows", tokenizer, 64, "error")
    engine = HFInferenceEngine(tool_model_dir, get_platform("cpu"), seed=0)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    controller = build_controller(settings, InProcessRuntime(engine), prompts, prompts, decode,
                            reward)
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0,
                            stop_token_ids=settings.sampling.stop_token_ids)

    async def scenario():
        evaluation = await controller.evaluate()
        groups = controller._new_groups(prompts.prompts)
        await controller.rollout.generate_now(groups, 1, greedy, Purpose.EVAL)
        return evaluation, groups

    evaluation, groups = asyncio.run(scenario())
    assert evaluation["eval_accuracy"] == 1.0
    assert evaluation["eval_env/calls/calculator/success"] == 4
    assert evaluation["eval_env/turns"] == 8 and evaluation["eval_env/ended_by/env"] == 4
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for group in groups:
        (call, call_text), (result, result_text), (answer, answer_text) = \
            [(enc(text), text) for _, text in demonstration(group.prompt)]
        t = group.trajectories[0]
        # the calculator's own answer, appended as its tokens; the model copied it
        assert t.result.token_ids == call + result + answer + [tokenizer.eos_token_id]
        assert t.result.loss_mask == [1] * len(call) + [0] * len(result) + \
            [1] * (len(answer) + 1)
        assert t.reward == 1.0 and set(t.result.versions) == {0}

    batch = build_train_batch(groups, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:].bool()
    # greedy: the engine reports log-probs at temperature 1, as the trainer computes them
    assert (logp - batch.old_logprobs[:, 1:])[mask].abs().max().item() < 1e-4


@pytest.mark.slow
def test_eddy_train_runs_calculator_episodes_on_ray(tool_model_dir, tmp_path):
    """`eddy train` on the tool task through Ray, asynchronous (K = 1): episodes cross the
    worker boundary with their loss masks, the trainer's log-probs agree with the engine's on
    every generated token, environment statistics reach the metrics, and every group is
    accounted for."""
    import json

    from eddyrl.core.ledger import Ledger
    from eddyrl.launch import train

    config = load_config(overrides=[
        *TOOL_TASK, f"model.path={tool_model_dir}", f"run_dir={tmp_path}", "platform=cpu",
        "loop.steps=3", "loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
        "window.max_staleness=1", "algorithm.dynamic_sampling=false",
        "cluster.threads_per_worker=1"])
    summary = json.loads(train(config).read_text())
    assert summary["steps"] == 3
    steps = [json.loads(line) for line in
             (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert sum(m["env/calls/calculator/success"] + m.get("env/calls/calculator/failure", 0)
               for m in steps) > 0
    for m in steps:
        assert m["mismatch_abs_max"] < 1e-4
        # observations are in the rows but not among the generated (trained) tokens
        assert m["gen_tokens"] < m["response_len_mean"] * m["groups_generated"] * 4
    assert summary["env"]["episodes"] >= 3 * 4 * 4 and summary["env"]["errors"] == 0
    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    trained = {i: n for i, n in ledger.fresh_train_counts_by_prompt(0).items() if n}
    assert len(trained) == 12 and set(trained.values()) == {1}  # each group trained once
