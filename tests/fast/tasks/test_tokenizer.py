"""The character tokenizer must round-trip every trace exactly and lay out chats like Qwen."""

from transformers import AutoTokenizer

from eddyrl.models.tiny import build_tokenizer


def test_round_trip_keeps_spaces_and_newlines():
    tokenizer = build_tokenizer()
    for text in ["add 3 5 8", "3 8 16 = 16", "  two  spaces \n newline ", ""]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert len(ids) == len(text)  # one token per character


def test_chat_template_is_qwen_like():
    tokenizer = build_tokenizer()
    messages = [{"role": "user", "content": "add 1 2"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nadd 1 2<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_padding():
    tokenizer = build_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    batch = tokenizer(["add 1 2", "add 1"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][1][0] == tokenizer.pad_token_id  # left padding for generation


def test_saved_tokenizer_reloads_identically(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nadd 9 9<|im_end|>\n"
    assert reloaded.decode(reloaded.encode(text, add_special_tokens=False)) == text
    assert reloaded.eos_token == "<|im_end|>"
