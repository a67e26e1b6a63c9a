"""The RL update lives in core/update.py: the runtime builds engines and moves data, and asks
the update for everything the algorithm decides (the loss, the KL reference's and the proximal
log-probs, mini-batches). An RL engineer changing the algorithm finds it in core/."""

import re

from import_graph import ROOT

# What only the update does with a training engine or a batch.
ALGORITHM = re.compile(r"\b(compute_logprobs|make_policy_loss|PolicyLoss|prox_logprobs|"
                       r"ref_logprobs)\b|\.train_step\(")


def test_the_runtime_leaves_the_algorithm_to_the_policy_update():
    found = [f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}"
             for path in (ROOT / "runtime").rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if ALGORITHM.search(line)]
    assert not found, "in core/update.py instead:\n" + "\n".join(found)
