"""The multi-turn reward loads in a fresh process without torch (what a spawned reward worker does)."""

from __future__ import annotations

import pickle
import subprocess
import sys

from nemo_rollout_correction.trainer import env_reward, environments
from nemo_rollout_correction.trainer.data import PromptRecord
from nemo_rollout_correction.trainer.tasks import build_task

HEAVY = ("torch", "megatron", "vllm", "transformers", "numpy")


def _fresh_modules(code: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after running `code`."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return {name.split(".")[0] for name in out}


def test_importing_the_light_module_imports_no_torch() -> None:
    loaded = _fresh_modules("import nemo_rollout_correction.trainer.env_reward")
    assert "nemo_rollout_correction" in loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_a_worker_unpickling_the_task_reward_imports_no_torch() -> None:
    # RewardPool sends the function pickled by reference; a worker's pickle.loads imports its module
    task = build_task("arithmetic_feedback", num_prompts=4)
    assert task.reward_fn is env_reward.environment_reward
    payload = pickle.dumps(task.reward_fn)
    loaded = _fresh_modules(f"import pickle; fn = pickle.loads({payload!r}); "
                            "from nemo_rollout_correction.trainer.data import PromptRecord as _unused")
    assert not loaded & {"torch", "megatron", "vllm", "transformers"}, sorted(loaded)


def test_one_definition_re_exported_by_environments() -> None:
    assert environments.environment_reward is env_reward.environment_reward
    assert environments.ENV_REWARD_KEY == env_reward.ENV_REWARD_KEY == "env_reward"
    records = [PromptRecord("p", metadata={"env_reward": 0.5})]
    assert env_reward.environment_reward(records=records) == [0.5]
