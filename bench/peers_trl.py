"""The TRL side of bench/peers.py: runs inside the TRL venv that peers.py makes (trl, torch,
transformers; no eddyrl installed there). Not meant to be run by hand.

    python bench/peers_trl.py check --task TASK.json --batch BATCH.json --out DIR
    python bench/peers_trl.py train --task TASK.json --steps N --eval-every E --out DIR

`check`: TRL's own tokenisation of every training prompt the run uses (compared with Eddy's
token ids), then one batch of completions that Eddy's engine generated fed through TRL's
`_generate_and_score_completions` (its reward call, group advantages, masks and token count;
only `_generate_single_turn`, the sampler, is replaced by the given completions) and
`compute_loss`, backward once: writes the loss, the advantages and the gradients.
`train`: `GRPOTrainer.train()` for N optimizer steps on the exported prompts in Eddy's batch
order, with a callback that timestamps every step (on_step_begin / on_step_end) and saves the
model at step 0 and every E steps (save time measured, so it can be left out) for peers.py to
evaluate afterwards with Eddy's own evaluation.

The reward is Eddy's `eddyrl/tasks/reward.py`, loaded from its file (the function, not the
package, so nothing of Eddy is installed here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What `eddy eval` needs beside the weights (the warm start's tokenizer and chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def eddy_reward():
    spec = importlib.util.spec_from_file_location("eddy_arith_reward",
                                                  ROOT / "eddyrl" / "tasks" / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward


def arith_reward_func():
    reward = eddy_reward()

    def arith_reward(prompts, completions, answer, **kwargs):
        return [reward(c[0]["content"] if isinstance(c, list) else c, a)
                for c, a in zip(completions, answer)]

    return arith_reward


def grpo_config(task: dict, out: Path, steps: int):
    import torch
    from trl import GRPOConfig

    s = task["settings"]
    return GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=s["batch_prompts"] * s["n_samples"] // s["micro_batch_size"],
        num_generations=s["n_samples"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=1.0, top_k=0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=s["weight_decay"], adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=s["grad_clip"],
        beta=s["kl_coef"], epsilon=s["clip_low"], epsilon_high=s["clip_high"],
        loss_type="dapo",  # / tokens of the whole generation batch: Eddy's normalisation
        scale_rewards="group", num_iterations=1, mask_truncated_completions=False,
        shuffle_dataset=False,  # Eddy's batch order, exported
        bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float32},
        logging_steps=1, save_strategy="no", report_to="none", seed=s["seed"],
        dataloader_num_workers=0, disable_tqdm=True,
    )


def build_trainer(task: dict, out: Path, steps: int, rows: list[dict], callbacks=()):
    from datasets import Dataset
    from trl import GRPOTrainer

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                  "answer": r["answer"]} for r in rows])
    return GRPOTrainer(model=task["model_path"], reward_funcs=arith_reward_func(),
                       args=grpo_config(task, out, steps), train_dataset=dataset,
                       callbacks=list(callbacks))


def train_rows(task: dict, steps: int) -> list[dict]:
    rows = [row for batch in task["batches"][:steps] for row in batch]
    if len(rows) < steps * task["settings"]["batch_prompts"]:
        raise SystemExit(f"task file has {len(task['batches'])} batches, {steps} steps asked")
    return rows


def versions() -> dict:
    import accelerate
    import datasets
    import torch
    import transformers
    import trl

    return {"trl": trl.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "datasets": datasets.__version__, "python": sys.version.split()[0]}


def cmd_check(ns) -> int:
    import torch
    from safetensors.torch import save_file

    task = json.loads(Path(ns.task).read_text())
    batch = json.loads(Path(ns.batch).read_text())
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(task["settings"]["threads"])
    rows = train_rows(task, ns.steps)
    trainer = build_trainer(task, out, ns.steps, rows)

    # 1. TRL's tokenisation of every prompt of the run against Eddy's ids.
    mismatched, first = 0, None
    for start in range(0, len(rows), 64):
        chunk = rows[start:start + 64]
        ids, _, _ = trainer._tokenize_prompts([[{"role": "user", "content": r["prompt"]}]
                                               for r in chunk])
        for row, got in zip(chunk, ids):
            if list(got) != row["prompt_ids"]:
                mismatched += 1
                first = first or {"prompt": row["prompt"], "eddy": row["prompt_ids"],
                                  "trl": list(got)}

    # 2. One batch: Eddy's completions through TRL's scoring, advantages and loss.
    n = task["settings"]["n_samples"]
    inputs, completions = [], []
    for group in batch["groups"]:
        for tokens in group["completions"]:
            inputs.append({"prompt": [{"role": "user", "content": group["prompt"]}],
                           "answer": group["answer"]})
            completions.append(list(tokens))
    assert len(inputs) % n == 0

    def replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert [list(p) for p in prompt_ids] == [g["prompt_ids"] for g in batch["groups"]
                                                 for _ in range(n)], "prompt ids differ"
        return completions, None

    trainer._generate_single_turn = replay
    model = trainer.model
    model.train()
    scored = trainer._generate_and_score_completions(inputs)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, scored)
    loss.backward()
    grads = {name: p.grad.detach().clone().contiguous() for name, p in model.named_parameters()
             if p.grad is not None}
    save_file(grads, str(out / "trl_grads.safetensors"))
    result = {"versions": versions(), "loss": float(loss.detach()),
              "num_items_in_batch": float(scored["num_items_in_batch"]),
              "advantages": scored["advantages"].tolist(),
              "completion_tokens": int(scored["completion_mask"].sum()),
              "prompts_checked": len(rows), "prompt_ids_mismatched": mismatched,
              "first_mismatch": first,
              "loss_type": trainer.loss_type, "scale_rewards": trainer.scale_rewards,
              "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
              "steps_per_generation": trainer.args.steps_per_generation,
              "generation_batch_size": trainer.args.generation_batch_size}
    (out / "check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "advantages"}))
    return 0


def cmd_train(ns) -> int:
    launched = float(os.environ.get("PEERS_LAUNCH_TIME", time.time()))
    import torch
    from transformers import TrainerCallback

    task = json.loads(Path(ns.task).read_text())
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(task["settings"]["threads"])
    torch.manual_seed(task["settings"]["seed"])
    rows = train_rows(task, ns.steps)
    model_path = Path(task["model_path"])
    record = {"launched": launched, "imported": time.time(), "steps": ns.steps,
              "begin": {}, "end": {}, "saves": [], "logs": []}

    def save(model, step: int) -> None:
        began = time.time()
        target = out / "models" / f"step_{step:06d}"
        model.save_pretrained(target, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (model_path / name).exists():
                shutil.copy2(model_path / name, target)
        record["saves"].append({"step": step, "start": began, "end": time.time(),
                                "path": str(target)})

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            record["train_begin"] = time.time()
            save(model, 0)  # TRL's model as it starts: its initial held-out accuracy

        def on_step_begin(self, args, state, control, **kwargs):
            record["begin"][state.global_step + 1] = time.time()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            record["end"][step] = time.time()
            if step % ns.eval_every == 0 or step == ns.steps:
                save(model, step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            record["logs"].append({"step": state.global_step, **(logs or {})})

    trainer = build_trainer(task, out, ns.steps, rows, callbacks=[Timer()])
    record["trainer_ready"] = time.time()
    trainer.train()
    record["train_end"] = time.time()
    record["versions"] = versions()
    record["threads"] = torch.get_num_threads()
    (out / "trl_record.json").write_text(json.dumps(record, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("check", "train"):
        p = sub.add_parser(name)
        p.add_argument("--task", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--steps", type=int, required=True)
        if name == "check":
            p.add_argument("--batch", required=True)
        else:
            p.add_argument("--eval-every", type=int, default=20)
    ns = parser.parse_args()
    return cmd_check(ns) if ns.cmd == "check" else cmd_train(ns)


if __name__ == "__main__":
    sys.exit(main())
