"""The bundled config of the cipher task (eddyrl/configs/cipher_tiny.yaml) loads, validates and
names the task, its reward and its shipped warm start; the rest is the default run's."""

from eddyrl.config import load_config
from eddyrl.tasks.cipher import CipherTaskConfig, max_response_chars


def test_bundled_config_names_the_task_and_its_warm_start():
    config = load_config("cipher_tiny")
    assert config.data.task == "cipher"
    assert config.data.reward_fn == "eddyrl.tasks.cipher:reward"
    assert config.model.path == "builtin:cipher_warmstart"
    assert config.model.resolve().endswith("assets/cipher_warmstart")
    assert config.rollout.max_new_tokens > max_response_chars(CipherTaskConfig())
    # everything else is the default run's
    default = load_config()
    for section, key in [("train", "lr"), ("loop", "batch_prompts"), ("rollout", "n_samples"),
                         ("algorithm", "clip_high"), ("rollout", "temperature")]:
        assert getattr(getattr(config, section), key) == getattr(getattr(default, section), key)
