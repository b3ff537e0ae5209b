"""The multi-turn reward loads in a fresh process without torch (what a spawned reward worker does)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from nemo_rollout_correction.tasks import env_reward, environments
from nemo_rollout_correction.tasks.builtin import build_task
from nemo_rollout_correction.tasks.prompts import PromptRecord

HEAVY = ("torch", "megatron", "vllm", "transformers", "numpy")


def _fresh_modules(code: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after running `code`."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return {name.split(".")[0] for name in out}


def test_importing_the_light_module_imports_no_torch() -> None:
    loaded = _fresh_modules("import nemo_rollout_correction.tasks.env_reward")
    assert "nemo_rollout_correction" in loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_a_worker_unpickling_the_task_reward_imports_no_torch() -> None:
    # RewardPool sends the function pickled by reference; a worker's pickle.loads imports its module
    task = build_task("arithmetic_feedback", num_prompts=4)
    assert task.reward_fn is env_reward.environment_reward
    payload = pickle.dumps(task.reward_fn)
    loaded = _fresh_modules(f"import pickle; fn = pickle.loads({payload!r}); "
                            "from nemo_rollout_correction.tasks.prompts import PromptRecord as _unused")
    assert not loaded & {"torch", "megatron", "vllm", "transformers"}, sorted(loaded)


def test_one_definition_re_exported_by_environments() -> None:
    assert environments.environment_reward is env_reward.environment_reward
    assert environments.ENV_REWARD_KEY == env_reward.ENV_REWARD_KEY == "env_reward"
    records = [PromptRecord("p", metadata={"env_reward": 0.5})]
    assert env_reward.environment_reward(records=records) == [0.5]


_SCRIPT = '''
import sys
from pathlib import Path
with open(sys.argv[1], "a") as marker:  # every run of this file's top level, the workers' included
    marker.write("ran\\n")


def own_reward(records, **unused):
    return [2.0 * r.metadata["env_reward"] for r in records]


if __name__ == "__main__":
    from nemo_rollout_correction.tasks.prompts import PromptRecord
    from nemo_rollout_correction.tasks.env_reward import environment_reward
    from nemo_rollout_correction.tasks.reward_pool import RewardPool
    fn = own_reward if sys.argv[2] == "own" else environment_reward
    with RewardPool(fn, 1, 60.0, startup_timeout_s=600.0) as pool:
        print(pool(["p"], ["c"], [PromptRecord("p", metadata={"env_reward": 0.25})], [1]))
'''


def test_reward_workers_skip_the_main_script_unless_the_reward_lives_there(tmp_path: Path) -> None:
    # under the `nrc` console script, re-running the main script in a worker imports the whole CLI (torch)
    script = tmp_path / "main_script.py"
    script.write_text(_SCRIPT)
    for which, expected, runs in (("env", "[0.25]", 1), ("own", "[0.5]", 2)):
        marker = tmp_path / f"ran_{which}"
        out = subprocess.run([sys.executable, str(script), str(marker), which], capture_output=True, text=True,
                             timeout=600, env=os.environ.copy())
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == expected
        assert marker.read_text().count("ran") == runs, which  # own: the worker needs the script to unpickle it
