"""A sample custom reward for ``examples/tasks/capitals.jsonl`` (see docs/tasks.md).

Use it with::

    nrc train task.name=dataset task.dataset_path=examples/tasks/capitals.jsonl \
        task.reward_fn=examples/tasks/custom_reward.py:contains_answer

(or ``task.reward_fn=my_package.my_module:contains_answer`` once the file is importable).
"""

from __future__ import annotations

from typing import Any


def contains_answer(
    prompts: list[str],
    completions: list[str],
    records: list[Any],
    completion_token_counts: list[int],
    **kwargs: Any,
) -> list[float]:
    """1.0 if the reference answer appears in the completion (case-insensitive), minus a small length cost.

    All arguments are ``[num_completions]`` lists; ``records[i].answer`` is the reference. The
    length cost (0.005 per token beyond 16, so -0.08 at 32 tokens) nudges the policy towards short,
    direct answers without outweighing correctness (it exceeds 1.0 only past 216 tokens).
    """
    rewards = []
    for completion, record, num_tokens in zip(completions, records, completion_token_counts, strict=True):
        correct = record.answer is not None and record.answer.lower() in completion.lower()
        rewards.append((1.0 if correct else 0.0) - 0.005 * max(num_tokens - 16, 0))
    return rewards
