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


def test_shipped_cipher_warmstart_loads_and_enciphers_some_held_out_words():
    from eddyrl.tasks import cipher
    from eddyrl.models.config import ASSETS

    torch.set_num_threads(1)
    path = ASSETS / "cipher_warmstart"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.head_dim >= 32
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id
    task = cipher.CipherTaskConfig()
    rows = cipher.generate_rows(64, 0, "eval", task)
    accuracy = evaluate(model, tokenizer, rows, max_new_tokens=cipher.max_response_chars(task) + 1,
                        device=torch.device("cpu"), reward_fn=cipher.reward)
    assert 0.0 < accuracy < 0.5  # under-trained on purpose: RL has the rest to learn
