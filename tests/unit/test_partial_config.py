"""`rollout.partial_max_tokens_per_step`: its range and the combinations partial rollouts refuse (config/schema.py)."""

from __future__ import annotations

import pytest

from nemo_rollout_correction.config import ConfigError
from nemo_rollout_correction.config.loader import load_config

ON = "rollout.partial_max_tokens_per_step=6"


def test_off_by_default_and_accepted_with_the_token_level_presets() -> None:
    assert load_config([]).rollout.partial_max_tokens_per_step == 0
    for preset in ("token_tis", "seq_is", "geo_rs", "bypass_ppo_clip"):
        overrides = [ON, "rollout.max_new_tokens=16", f"rollout_correction={preset}"]
        assert load_config(overrides).rollout.partial_max_tokens_per_step == 6
    # loglinear pi_old with one update per step: alpha = 1, exact for tokens of any version
    cfg = load_config([ON, "rollout_correction.old_logprob_source=loglinear"])
    assert cfg.rollout_correction.old_logprob_source == "loglinear"
    # DAPO composes (its refills generate whole responses)
    assert load_config([ON, "grpo.dynamic_sampling=true"]).grpo.dynamic_sampling
    # async rollouts compose with one engine (the pool lives in its worker: trainer/partial_rollouts.py)
    assert load_config([ON, "rollout.max_staleness=1"]).rollout.max_staleness == 1
    assert load_config([ON, "rollout.max_staleness=2", "rollout.placement=rank0"]).rollout.max_staleness == 2


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["rollout.partial_max_tokens_per_step=-1"], "rollout.partial_max_tokens_per_step=-1 is not allowed: must be >= 0"),
    (["rollout.partial_max_tokens_per_step=48"], "must be < rollout.max_new_tokens (48)"),
    ([ON, "rollout.max_staleness=1", "rollout.placement=per_dp_group"],
     "with async rollouts the carried-over pool lives in the worker of the one engine"),
    ([ON, "rollout.routing_replay=r3"], "rollout.routing_replay=r3: a continued response is re-prefilled"),
    ([ON, "rollout.record_dir=/tmp/rec"], "recorded rollouts replay whole engine calls"),
    ([ON, "rollout.source=replay:/tmp/rec"], "recorded rollouts replay whole engine calls"),
    ([ON, "rollout_correction.old_logprob_source=loglinear", "grpo.ppo_epochs=2"],
     "old_logprob_source=loglinear and grpo.num_mini_batches x grpo.ppo_epochs = 2 updates per step"),
    ([ON, "rollout_correction.old_logprob_source=loglinear", "grpo.num_mini_batches=2", "policy.micro_batch_size=4"],
     "= 2 updates per step"),
])
def test_refused_combinations_name_the_keys(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert fragment in str(info.value)
