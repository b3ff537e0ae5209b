"""`nrc audit --multi-turn`: what re-tokenizing the chat text of multi-turn trajectories would cost this model.

A trainer that re-tokenizes a conversation's chat text scores token ids the engine did not sample (merges across
turn boundaries, chat-template whitespace, special tokens), so part of the mismatch it measures and corrects is
self-inflicted. This audit generates multi-turn trajectories token in / token out on the real engine (the
configured task's environment, else the `arithmetic_feedback` environment on the task's prompts), renders each
as chat messages (user prompt, assistant turns as the engine decoded them, user observations), tokenizes it
again with the model's chat template, and counts the token-in/token-out ids that an optimal in-order alignment
with the re-tokenized ids leaves unmatched (`multi_turn.retokenization_drift`). Engine only: no trainer is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.harness.settings import engine_options, sampling_options, tokenize_prompt
from nemo_rollout_correction.rollout.multi_turn import retokenization_drift
from nemo_rollout_correction.rollout.multi_turn_loop import (
    chat_context_renderer,
    chat_observation_encoder,
    run_multi_turn,
)
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine
from nemo_rollout_correction.tasks.environments import arithmetic_feedback_env, retokenized_chat_ids

__all__ = ["MultiTurnDriftReport", "format_multi_turn_report", "run_multi_turn_audit"]


@dataclass
class MultiTurnDriftReport:
    """Re-tokenization drift of one model's multi-turn trajectories.

    trajectories: measured trajectories (a rewritten history, which has no single transcript, is skipped);
    turns_mean: policy turns per trajectory; tokens: token-in/token-out ids (prompt + turns + observations, all
    trajectories); differing: of those, the ids the re-tokenized text does not hold in order; extra: ids of the
    re-tokenized text left unmatched by that alignment (the engine never sampled them there: a template's own
    whitespace or special tokens, other merges); exact_frac: trajectories whose re-tokenized ids equal the
    token-in/token-out ids;
    examples: up to 3 trajectories' first differing position, as decoded text around it.
    """

    model: str
    environment: str
    trajectories: int
    turns_mean: float
    tokens: int
    differing: int
    extra: int
    exact_frac: float
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def differing_frac(self) -> float:
        """The fraction of token-in/token-out ids that re-tokenizing changes."""
        return self.differing / max(self.tokens, 1)


def run_multi_turn_audit(cfg: TrainConfig, *, max_turns: int | None = None, log: Any = print) -> MultiTurnDriftReport:
    """Generate `audit.num_prompts` x `rollout.num_samples_per_prompt` trajectories of up to `max_turns` turns
    (default `rollout.max_turns` when above 1, else 3) with the configured model, engine and sampling, and measure
    their re-tokenization drift (module docstring)."""
    from transformers import AutoTokenizer

    from nemo_rollout_correction.models.sources import resolve_model_source
    from nemo_rollout_correction.tasks.builtin import task_from_config

    hf_dir = resolve_model_source(cfg.model.source)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    task = task_from_config(cfg)
    env = task.environment if task.environment is not None else arithmetic_feedback_env
    turns = max_turns or (cfg.rollout.max_turns if cfg.rollout.max_turns > 1 else 3)
    records = task.records[:cfg.audit.num_prompts]
    prompts = [tokenize_prompt(tokenizer, r.prompt, cfg.task.use_chat_template) for r in records]
    log(f"[nrc audit] multi-turn: starting vLLM ({cfg.rollout.dtype}) on {hf_dir}")
    engine = VllmRolloutEngine(engine_options(cfg, str(hf_dir)))
    try:
        result = run_multi_turn(engine, prompts, records, sampling_options(cfg), env,
                                encode=chat_observation_encoder(tokenizer),
                                decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
                                max_turns=turns, max_model_len=cfg.rollout.max_model_len, seed=cfg.run.seed,
                                render=chat_context_renderer(tokenizer))
    finally:
        engine.shutdown()
    batch, states = result.batch, result.states
    differing = total = exact = measured = extra = 0
    turn_count = 0
    examples: list[dict[str, Any]] = []
    for sample, state in zip(batch.samples, states, strict=True):
        if sample.segments:  # a rewritten history has no single transcript to re-tokenize
            continue
        measured, turn_count = measured + 1, turn_count + len(state.turn_texts)
        tito = list(sample.prompt_token_ids) + list(sample.token_ids)
        again = retokenized_chat_ids(tokenizer, state.record.prompt, state.turn_texts, state.observations)
        d, t = retokenization_drift(tito, again)
        differing, total, exact = differing + d, total + t, exact + (tito == again)
        extra += len(again) - (t - d)  # the aligned ids are matched on both sides
        if tito != again and len(examples) < 3:
            pairs = enumerate(zip(tito, again, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(len(tito), len(again)))
            window = slice(max(at - 4, 0), at + 4)
            examples.append({"position": at, "token_in_token_out": tokenizer.decode(tito[window]),
                             "re_tokenized": tokenizer.decode(again[window])})
    n = max(measured, 1)
    return MultiTurnDriftReport(model=str(cfg.model.source), environment=getattr(env, "__name__", repr(env)),
                                trajectories=measured, turns_mean=turn_count / n, extra=extra,
                                tokens=total, differing=differing, exact_frac=exact / n, examples=examples)


def format_multi_turn_report(report: MultiTurnDriftReport) -> str:
    """The report as text."""
    lines = [f"multi-turn re-tokenization drift: {report.model} ({report.environment})",
             f"  trajectories {report.trajectories}, policy turns per trajectory {report.turns_mean:.2f}",
             f"  token ids differing after re-tokenizing the chat text: {report.differing} / {report.tokens} "
             f"({100 * report.differing_frac:.2f}%)",
             f"  re-tokenized ids the engine did not sample there: {report.extra}",
             f"  trajectories re-tokenized exactly: {100 * report.exact_frac:.1f}%"]
    for example in report.examples:
        lines.append(f"  first difference at id {example['position']}: token in/out "
                     f"{example['token_in_token_out']!r} vs re-tokenized {example['re_tokenized']!r}")
    return "\n".join(lines)
