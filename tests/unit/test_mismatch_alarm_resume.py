"""The mismatch alarm's learnt state across a checkpoint (trainer/mismatch_alert.py `state_dict`/`load_state_dict`).

The lag references (the run's least lag-L k3 over earlier steps), their step counts and the firing-step tags are saved
in the checkpoint's `meta.json` (JSON) and restored on resume: a run interrupted after any step and resumed fires on
the same steps, with the same messages, tags and final state, as the uninterrupted run. Without the restore it
would re-learn its references from the resume on and fire elsewhere (checked here too, so the test can fail).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from lag_metrics import lagged

from nemo_rollout_correction.config.mismatch_alert import MismatchAlertConfig
from nemo_rollout_correction.trainer.mismatch_alert import ALERT_METRIC, MismatchAlarm

CFG = {"factor_over_floor": 10, "lag_reference_steps": 3}


def new_alarm(log: list[str]) -> MismatchAlarm:
    return MismatchAlarm(MismatchAlertConfig(**CFG), engine_dtype="float32", trainer_dtype="float32",
                         family="dense", log=log.append)


class Tags:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def on_alert(self, step: int, tags: dict[str, str]) -> None:
        self.tags.update(tags)




# A lost sync under async rollouts (k = 2): tokens labelled one and two versions old really grow older, so their k3
# climbs; steps 2-4 measure the lag-1 and lag-2 references (1e-2 and 2e-2 at step 2), steps 5-8 fire on both.
STEPS = [lagged({0: 1e-13}, dlogp=1e-6)] + [lagged({0: 1e-12, 1: 1e-2 * (s - 1) ** 2, 2: 3e-2 * (s - 2) ** 2 + 2e-2})
                                for s in range(2, 9)]


def run(alarm: MismatchAlarm, observer: Tags, first: int, last: int) -> list[float]:
    fired = []
    for step in range(first, last + 1):
        metrics = dict(STEPS[step - 1])
        alarm.check_step(step, metrics, observer)
        fired.append(metrics[ALERT_METRIC])
    return fired


def straight() -> tuple[list[float], list[str], dict[str, str], dict[str, Any]]:
    log: list[str] = []
    observer = Tags()
    alarm = new_alarm(log)
    fired = run(alarm, observer, 1, len(STEPS))
    return fired, log, observer.tags, alarm.state_dict()


@pytest.mark.parametrize("split", range(1, len(STEPS)))
def test_a_resumed_alarm_fires_as_the_uninterrupted_one(split: int) -> None:
    fired, log, tags, state = straight()
    assert fired == [0.0] * 4 + [2.0] * 4  # the split before or after the references are learnt

    log_a: list[str] = []
    first = new_alarm(log_a)
    observer = Tags()
    fired_a = run(first, observer, 1, split)
    saved = json.loads(json.dumps(first.state_dict()))  # as meta.json stores it (trainer/grpo.py save_checkpoint)
    log_b: list[str] = []
    resumed = new_alarm(log_b)
    resumed.load_state_dict(saved)
    observer_b = Tags()
    observer_b.tags = dict(observer.tags)  # the MLflow run keeps its tags across the resume
    fired_b = run(resumed, observer_b, split + 1, len(STEPS))

    assert fired_a + fired_b == fired
    assert log_a + log_b == log
    assert observer_b.tags == tags
    assert resumed.state_dict() == state


def test_without_the_restore_a_resumed_alarm_fires_elsewhere() -> None:
    """What the checkpoint prevents: a fresh alarm after step 3 re-learns the references from steps 4-6."""
    fired, _, _, _ = straight()
    log: list[str] = []
    first = new_alarm(log)
    run(first, Tags(), 1, 3)
    fresh = new_alarm(log)
    assert run(fresh, Tags(), 4, len(STEPS)) != fired[3:]


def test_the_state_is_json_data_with_the_lag_references() -> None:
    _, _, _, state = straight()
    assert json.loads(json.dumps(state)) == state
    assert state["lag_reference"] == {"1": pytest.approx(1e-2), "2": pytest.approx(2e-2)}
    assert state["lag_reference_step"] == {"1": 2, "2": 2}
    assert state["lag_steps"] == {"1": 7, "2": 7}
    assert state["first_step"] is not None and state["num_steps"] >= 1


def test_a_malformed_state_is_refused_naming_what_is_wrong() -> None:
    alarm = new_alarm([])
    with pytest.raises(ValueError, match=r"malformed.*KeyError.*lag_reference_step"):
        alarm.load_state_dict({"lag_reference": {"1": 0.1}})
    with pytest.raises(ValueError, match=r"inconsistent: lag references for \[1\], their steps for \[\]"):
        alarm.load_state_dict({"lag_reference": {"1": 0.1}, "lag_reference_step": {}, "lag_steps": {"1": 1},
                               "first_step": None, "num_steps": 0})
