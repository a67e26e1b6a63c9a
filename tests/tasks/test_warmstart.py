"""The shipped warm start loads with plain transformers and already solves some problems."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eddyrl.models.tiny import WARMSTART_DIR
from eddyrl.tasks.arith import ArithTaskConfig, generate_rows, max_response_chars
from eddyrl.tasks.evaluate import evaluate


def test_shipped_warmstart_loads_and_answers_some_held_out_prompts():
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(WARMSTART_DIR)
    model = AutoModelForCausalLM.from_pretrained(WARMSTART_DIR)
    assert model.config.head_dim >= 32
    task = ArithTaskConfig()
    rows = generate_rows(64, 0, "eval", task)
    max_new_tokens = max_response_chars(task) + 1
    accuracy = evaluate(model, tokenizer, rows, max_new_tokens=max_new_tokens, device=torch.device("cpu"))
    assert 0.0 < accuracy < 1.0
