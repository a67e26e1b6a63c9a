"""The embedded tiny policy: a character-level tokenizer and a small Qwen3 built locally.

Nothing here touches a model hub. The tokenizer is one token per character so that any
arithmetic trace round-trips exactly (spaces included), and the model is a real
`Qwen3ForCausalLM`, so every engine that serves Qwen3 can serve it unchanged.
"""

from __future__ import annotations

import dataclasses
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from .config import ASSETS

PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
UNKNOWN_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, END_OF_TEXT, UNKNOWN_TOKEN)

# The shipped SFT warm start; `eddyrl/assets/tiny_warmstart/README.md` says how it was made.
WARMSTART_DIR = ASSETS / "tiny_warmstart"

# Longest prompt plus response the tiny policy is built for.
MAX_POSITIONS = 256

# Lower-case letters cover prompts and chat roles; the punctuation leaves room for other
# small synthetic tasks without retraining the tokenizer.
CHARACTERS = tuple(string.digits + string.ascii_lowercase + " \n+-*=#:.,?()")

# Qwen-style chat layout. Newlines are emitted inside expressions because `{%-` would
# strip a literal newline that precedes it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelConfig:
    """The shape of the embedded policy; ~0.8M parameters, a few MB in fp32.

    head_dim is 32 because the vLLM CPU attention backend rejects smaller heads.
    """

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = MAX_POSITIONS
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    @classmethod
    def of_size(cls, hidden_size: int = 128, num_hidden_layers: int = 4,
                intermediate_size: int | None = None) -> "TinyModelConfig":
        """A policy `hidden_size` wide (heads of 32, as many as fit) and `num_hidden_layers`
        deep, its MLP `intermediate_size` wide (default 3 x hidden_size); the defaults are the
        shipped tiny_warmstart's shape."""
        if hidden_size < 32 or hidden_size % 32:
            raise ValueError(f"hidden size {hidden_size}: must be a positive multiple of 32 "
                             "(heads of 32)")
        if num_hidden_layers < 1:
            raise ValueError(f"layers {num_hidden_layers}: must be >= 1")
        if intermediate_size is not None and intermediate_size < 1:
            raise ValueError(f"intermediate size {intermediate_size}: must be >= 1")
        heads = hidden_size // 32
        return cls(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                   intermediate_size=intermediate_size or 3 * hidden_size,
                   num_attention_heads=heads, num_key_value_heads=heads)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A one-token-per-character tokenizer with a Qwen-like chat template."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN_TOKEN))
    # `[\s\S]` rather than `.`: the Oniguruma `.` does not match a newline.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNKNOWN_TOKEN,
        additional_special_tokens=[IM_START, END_OF_TEXT],
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    config: TinyModelConfig = TinyModelConfig(),
) -> Qwen3ForCausalLM:
    """A freshly initialised fp32 Qwen3 sized by `config`, with ids taken from `tokenizer`."""
    return build_with_tokenizer(Qwen3ForCausalLM, Qwen3Config, tokenizer, seed,
                                **dataclasses.asdict(config))


def build_with_tokenizer(model_class, config_class, tokenizer: PreTrainedTokenizerFast,
                         seed: int, **shape):
    """A freshly initialised fp32 `model_class` of `config_class(**shape)`, its vocabulary and
    special ids (config and generation config alike) those of `tokenizer`, no BOS: what the
    embedded models (this one, tiny_moe.py) share."""
    model_config = config_class(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                                dtype="float32", **shape)
    torch.manual_seed(seed)
    model = model_class(model_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model
