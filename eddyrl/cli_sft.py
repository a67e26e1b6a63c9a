"""`eddy sft`: its flags and its handler. Two sources share one training loop
(tasks/sft.py): the user's model and file of prompt -> response (`--model DIR --data FILE`,
tasks/sft_user.py), or the bundled tiny model on a bundled task; each source's flags are
refused with the other."""

from __future__ import annotations

import argparse
import json

SFT_EPILOG = """\
examples:
  eddy sft --model ~/models/Qwen3-0.6B --data demos.jsonl --out warm --epochs 2
  eddy sft --model DIR --data demos.parquet --prompt-key question --response-key solution \\
      --max-length 2048 --eval-fraction 0.05 --out warm
  eddy train model.path=warm data.train_path=... data.eval_path=...   RL from the warm start
  eddy sft --out warm                  the bundled tiny model on the arith task

a row: {"prompt": "What is 2 + 3?", "response": "2 + 3 = 5"}; the prompt may be a list of chat
messages. The loss is on the response and the end token only; see docs/sft.md.
"""


def add_sft_parser(sub) -> None:
    """The `sft` sub-command on `eddy`'s sub-parsers."""
    p = sub.add_parser("sft", help="supervised warm start: your Hugging Face model on your "
                       "prompt -> response file (--model DIR --data FILE), or the bundled tiny "
                       "model on its arith, cipher or tool task",
                       description="Supervised fine-tuning before RL.\n\nWith --model and "
                       "--data: your causal LM on your JSON lines / Parquet rows of prompt ->\n"
                       "response, the loss on response tokens only, each prompt rendered as "
                       "RL's rollouts will\nrender it (the model's chat template, or plain "
                       "text without one).\n\nWithout them: the bundled tiny model on a "
                       "bundled task (the defaults reproduce\neddyrl/assets/tiny_warmstart; the "
                       "cipher_warmstart README gives its command).", epilog=SFT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the model and tokenizer are saved (Hugging Face format): a new "
                   "or empty directory, or an earlier eddy sft output")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="optimizer steps, one batch each (default: 1000 on a bundled task; "
                   "with --data, one epoch's worth)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate, warmed up over the first 5%% of the steps, then "
                   "a cosine decay to 0 (default: 3e-3 bundled, 1e-5 with --data)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="rows per optimizer step (default: 32 bundled, 8 with --data)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the row order, the held-out rows and the bundled model's "
                   "initialisation (default: 0)")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop after STEP of the --steps steps (the learning-rate schedule still "
                   "that of --steps): an under-trained warm start")
    p.add_argument("--platform", default="auto",
                   help="the platform to train on: a name `eddy platforms` lists, or auto (the "
                   "first usable one)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: 1 on a bundled task, as the shipped "
                   "warm starts were made; torch's own with --data)")
    g = p.add_argument_group("your model and data")
    g.add_argument("--model", metavar="DIR",
                   help="a Hugging Face causal LM directory (config.json, *.safetensors and "
                   "its tokenizer), or builtin:NAME for a shipped one; needs --data")
    g.add_argument("--data", metavar="FILE",
                   help="the rows to learn from: JSON lines (.jsonl, .json) or Parquet "
                   "(.parquet, pip install 'eddyrl[data]'); needs --model")
    g.add_argument("--prompt-key", metavar="KEY",
                   help="the key of each row's prompt, a string (one user turn) or a list of "
                   "chat messages [{role, content}]; a dotted key (a.b) looks inside objects "
                   "(default: prompt)")
    g.add_argument("--response-key", metavar="KEY",
                   help="the key of each row's response, the text the model learns to write "
                   "(default: response)")
    g.add_argument("--max-length", type=int, metavar="N",
                   help="the longest prompt + response in tokens (default: the model's "
                   "max_position_embeddings)")
    g.add_argument("--overflow", choices=["error", "truncate"],
                   help="a row longer than --max-length: error refuses it naming the row, "
                   "truncate cuts its response's end (default: error)")
    g.add_argument("--epochs", type=int, metavar="E",
                   help="passes over the rows, each in a new seeded order; instead of --steps "
                   "(default: 1)")
    g.add_argument("--eval-fraction", type=float, metavar="F",
                   help="share of the rows held out, not trained on, to report the loss on "
                   "unseen rows before and after (default: 0)")
    g = p.add_argument_group("the bundled tiny model's tasks (no --model)")
    g.add_argument("--task", choices=["arith", "cipher", "tool_add"],
                   help="arith (default): running sums; cipher: enciphered words "
                   "(tasks/cipher.py), every demonstration honest; tool_add: reference "
                   "calculator episodes (tasks/tool_task.py); measure the result with "
                   "`eddy eval OUT tool_add_tiny`")
    g.add_argument("--early-stop-fraction", type=float, metavar="F",
                   help="arith: share of demonstrations that stop one number short (a careless "
                   "habit for RL to unlearn; default: 0.6)")
    g.add_argument("--no-tool-fraction", type=float, metavar="F",
                   help="tool_add: share of demonstrations that answer without the calculator "
                   "(default: 0)")
    g.add_argument("--hidden-size", type=int, metavar="N",
                   help="the tiny Qwen3's width (heads of 32: a multiple of 32; default: 128)")
    g.add_argument("--intermediate-size", type=int, metavar="N",
                   help="its MLP width (default: 3 x --hidden-size)")
    g.add_argument("--layers", type=int, metavar="N", help="its number of layers (default: 4)")
    g.add_argument("--experts", type=int, metavar="N",
                   help="make it a mixture of experts (a Qwen3-MoE, models/tiny_moe.py): N "
                   "experts per layer, 2 routed per token, --intermediate-size then each "
                   "expert's width (default 3 x --hidden-size / 2); eddyrl/assets/moe_warmstart "
                   "was made with 4 (default: dense, no experts)")
    p.set_defaults(func=cmd_sft)


def cmd_sft(ns: argparse.Namespace) -> int:
    from .errors import ConfigError

    # each source's own flags, refused with the other (argparse cannot say "only with")
    bundled = [f for f in ("task", "early_stop_fraction", "no_tool_fraction", "hidden_size",
                           "intermediate_size", "layers", "experts")
               if getattr(ns, f) is not None]
    from_file = [f for f in ("model", "data", "prompt_key", "response_key", "max_length",
                             "overflow", "eval_fraction", "epochs") if getattr(ns, f) is not None]
    if ns.data is not None or ns.model is not None:
        if ns.data is None or ns.model is None:
            raise ConfigError("eddy sft: --model and --data go together (your model on your "
                              "file); without both, it trains the bundled tiny model")
        if bundled:
            raise ConfigError(f"eddy sft: {_flags(bundled)}: for the bundled tiny model's "
                              "tasks only, not with --model and --data")
        return _sft_on_file(ns)
    if from_file:
        raise ConfigError(f"eddy sft: {_flags(from_file)}: for your own model and data "
                          "only, given with --model DIR and --data FILE")
    return _sft_bundled(ns)


def _flags(names: list[str]) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def _or(given, default):
    """A flag's value, or the default of the source it applies to (its parser default is None
    so that a flag given for the wrong source can be told from one not given)."""
    return default if given is None else given


def _sft_device(ns: argparse.Namespace, threads: int | None):
    import torch

    from .hal import get_platform

    platform = get_platform(ns.platform)
    if threads is not None:
        torch.set_num_threads(threads)
    return platform.device(platform.local_rank())


def _sft_bundled(ns: argparse.Namespace) -> int:
    from .errors import ConfigError
    from .models.tiny import TinyModelConfig
    from .models.tiny_moe import TinyMoeConfig
    from .tasks.builtin import BUILTIN_TASKS
    from .tasks.sft import check_stop_at, run_sft

    steps = _or(ns.steps, 1000)
    _, task, _ = BUILTIN_TASKS[_or(ns.task, "arith")]  # the task's default settings, as train's
    try:  # before any work, in the command's own words
        size = (_or(ns.hidden_size, 128), _or(ns.layers, 4), ns.intermediate_size)
        model_config = TinyModelConfig.of_size(*size) if ns.experts is None \
            else TinyMoeConfig.of_size(*size, num_experts=ns.experts)
    except ValueError as error:
        raise ConfigError(f"eddy sft: {error}") from None
    try:
        check_stop_at(ns.stop_at, steps)
    except ValueError as error:
        raise ConfigError(f"eddy sft --stop-at {ns.stop_at} --steps {steps}: {error}") from None
    # the shipped warm starts were made with one thread
    device = _sft_device(ns, _or(ns.threads, 1))
    metrics = run_sft(ns.out, steps=steps, lr=_or(ns.lr, 3e-3),
                      batch_size=_or(ns.batch_size, 32), seed=ns.seed, device=device, task=task,
                      model_config=model_config,
                      early_stop_fraction=_or(ns.early_stop_fraction, 0.6),
                      no_tool_fraction=_or(ns.no_tool_fraction, 0.0), stop_at=ns.stop_at)
    print(json.dumps({**metrics, "out": ns.out}, indent=2, sort_keys=True))
    return 0


def _sft_on_file(ns: argparse.Namespace) -> int:
    from .tasks.sft_data import SftFileConfig
    from .tasks.sft_user import run_sft_on_file, summary_lines

    file = SftFileConfig(prompt_key=_or(ns.prompt_key, "prompt"),
                         response_key=_or(ns.response_key, "response"),
                         max_length=ns.max_length, overflow=_or(ns.overflow, "error"),
                         eval_fraction=_or(ns.eval_fraction, 0.0))
    file.validate()  # before the platform starts
    summary = run_sft_on_file(ns.model, ns.data, ns.out, file=file, lr=_or(ns.lr, 1e-5),
                              batch_size=_or(ns.batch_size, 8), seed=ns.seed,
                              device=_sft_device(ns, ns.threads), steps=ns.steps,
                              epochs=ns.epochs, stop_at=ns.stop_at)
    print("\n".join(summary_lines(summary)))
    return 0
