"""`nrc audit`: measure the rollout/trainer mismatch of a model + engine + dtype before a long run.

The audit samples responses with vLLM exactly as training would (same engine options and sampling),
re-scores the same tokens with the Megatron-Core policy (vLLM's temperature/top-k/top-p replayed), and
reports:

- agreement: max and mean |trainer - vLLM| token logprob difference (fp32 engines agree to ~1e-6; a
  larger value means a conversion, tokenizer or sampling-replay problem, not numerics);
- the mismatch metrics of the rollout correction (`rollout_corr/kl`, `k3_kl`, `chi2_token`, `chi2_seq`,
  `ppl_ratio`, token-ratio quantiles, ...), computed as in training (metrics-only, nothing applied);
- per preset: the fraction of tokens it would truncate, reject (rejection sampling, veto, non-finite) and
  keep, and the fraction of sequences it would drop;
- the worst sequences by max |token log ratio|, with their text;
- with `rollout.routing_replay=r3` (MoE): the router agreement (`rollout/router_agreement`) and the mismatch
  with and without replaying the rollout's routing (the same tokens re-scored twice);
- with `policy.lora` (audit/lora.py): the engine's unmerged adapter against the trainer, next to the merged
  control (`W + alpha/r B A` pushed as full weights).

It is the same data path as the trainer (rollout engine -> token ids -> `MegatronPolicy.token_logprobs`),
so a clean audit means the training run starts on-policy up to numerics.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_rollout_correction.audit import probes
from nemo_rollout_correction.audit.data import AuditData, collect, generate, logprob_diff, rescore
from nemo_rollout_correction.audit.lora import format_lora_rows, lora_comparison
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.config import RolloutCorrectionConfig
from nemo_rollout_correction.core.correction import compute_rollout_correction
from nemo_rollout_correction.distributed.groups import ParallelGroups
from nemo_rollout_correction.distributed.runtime import Runtime
from nemo_rollout_correction.harness import metric_names as mn
from nemo_rollout_correction.harness import routing_replay
from nemo_rollout_correction.harness.scoring import sequence_log_ratios
from nemo_rollout_correction.harness.settings import (
    engine_options,
    pad_token_id,
    replay_options,
    sampling_options,
    tokenize_prompt,
)
from nemo_rollout_correction.models.policy import MegatronPolicy
from nemo_rollout_correction.rollout.samples import RolloutBatch
from nemo_rollout_correction.rollout.vllm_engine import VllmRolloutEngine

# Mismatch metrics printed in the summary (all `rollout_corr/*` metrics are in `AuditReport.metrics`).
SUMMARY_METRICS = (
    "kl",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "ppl_ratio",
    "log_ppl_abs_diff",
    "token_ratio_p1",
    "token_ratio_p50",
    "token_ratio_p99",
    "token_log_ratio_min",
    "token_log_ratio_max",
)


@dataclass
class AuditReport:
    """Everything `nrc audit` prints and logs."""

    model: str
    rollout_dtype: str
    num_sequences: int
    num_tokens: int
    max_abs_logprob_diff: float
    mean_abs_logprob_diff: float
    metrics: dict[str, float]
    presets: dict[str, dict[str, float]]
    worst: list[dict[str, Any]]
    seconds: dict[str, float]
    trainer_dtype: str = "float32"
    lm_head_fp32: bool = False
    routing: dict[str, float] = field(default_factory=dict)
    """With routing replay: `router_agreement` and the mismatch with replay (`max_abs_logprob_diff`,
    `mean_abs_logprob_diff`, `kl`, `k3_kl`); the report's other fields are without replay."""
    vocab: dict[str, float] = field(default_factory=dict)
    """Whole distributions on the fixed tokens (audit/probes.py): `top_k`, `num_positions`, `tv_mean`,
    `tv_max`, `kl_mean`, `kl_max` (KL(engine || trainer)), `first_token_tv_mean`, `first_token_kl_mean`,
    `rest_mass_mean`; empty when off or skipped (`notes` says why)."""
    first_token: dict[str, float] = field(default_factory=dict)
    """The sampled-token mismatch of the first response token alone: `max_abs_logprob_diff`,
    `mean_abs_logprob_diff`, `k3_kl`."""
    layers: list[dict[str, Any]] = field(default_factory=list)
    """Per point of the network (`embedding`, `layer_<i>`, `final_norm`): `name`, `max_abs_diff`, `rel_rms_diff`
    between the trainer and a transformers forward in the engine's dtype."""
    parting_layer: str | None = None
    """The first point whose relative RMS difference exceeds 1e-4 (None: the two agree throughout)."""
    lora: dict[str, dict[str, float]] = field(default_factory=dict)
    """With `policy.lora` (audit/lora.py): rows `adapter` (the engine's unmerged adapter) and `merged` (the
    merged-weights control), each `max_abs_logprob_diff`, `mean_abs_logprob_diff`, `kl`, `k3_kl`,
    `mean_abs_adapter_effect`, `num_tokens`; on the first report only."""
    notes: list[str] = field(default_factory=list)

    @property
    def setting(self) -> str:
        """`engine <dtype> / trainer <dtype>[ + fp32 lm_head]`: the compared setting, for tables and logs."""
        head = " + fp32 lm_head" if self.lm_head_fp32 else ""
        return f"engine {self.rollout_dtype} / trainer {self.trainer_dtype}{head}"

    def flat_metrics(self) -> dict[str, float]:
        """Everything numeric, flattened for MLflow (`audit/...` and `rollout_corr/...` keys)."""
        out = {
            "audit/max_abs_logprob_diff": self.max_abs_logprob_diff,
            "audit/mean_abs_logprob_diff": self.mean_abs_logprob_diff,
            "audit/num_sequences": float(self.num_sequences),
            "audit/num_tokens": float(self.num_tokens),
        }
        out.update({f"timing/{k}_s": v for k, v in self.seconds.items()})
        out.update(self.metrics)
        for name, values in self.presets.items():
            out.update({f"audit_preset/{name}/{k}": v for k, v in values.items()})
        out.update({f"audit_r3/{k}": v for k, v in self.routing.items()})
        out.update({f"audit_vocab/{k}": float(v) for k, v in self.vocab.items()})
        out.update({f"audit_first_token/{k}": v for k, v in self.first_token.items()})
        for row, values in self.lora.items():
            out.update({f"audit_lora/{row}/{k}": v for k, v in values.items()})
        for layer in self.layers:
            out[f"audit_layers/{layer['name']}/max_abs_diff"] = layer["max_abs_diff"]
            out[f"audit_layers/{layer['name']}/rel_rms_diff"] = layer["rel_rms_diff"]
        return out


def preset_effects(data: AuditData, presets: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per preset: fractions of response tokens truncated / rejected / kept and of sequences dropped."""
    out: dict[str, dict[str, float]] = {}
    for name in presets:
        cfg = RolloutCorrectionConfig.from_preset(name)
        # Audit rollouts carry no rewards: every sequence is given a negative advantage, so the presets that
        # mask by advantage (OPSM, DPPO-TV low side) show their largest possible effect.
        worst = -torch.ones(data.loss_mask.shape[0], device=data.loss_mask.device)
        m = compute_rollout_correction(data.old_logprobs, data.rollout_logprobs, data.loss_mask, cfg,
                                       advantages=worst).metrics
        if cfg.rollout_is == "token":
            truncated = (mn.optional(m, mn.RC_IS_RATIO_FRACTION_HIGH, 0.0)
                         + mn.optional(m, mn.RC_IS_RATIO_FRACTION_LOW, 0.0))
        elif cfg.rollout_is is not None:
            truncated = (mn.optional(m, mn.RC_IS_SEQ_FRACTION_HIGH, 0.0)
                         + mn.optional(m, mn.RC_IS_SEQ_FRACTION_LOW, 0.0))
        else:
            truncated = 0.0
        valid_seqs = max(float(m[mn.RC_NUM_VALID_SEQS]), 1.0)
        out[name] = {
            "truncated_fraction": float(truncated),
            # absent when the preset has no rejection sampling / no veto: nothing rejected
            "rejected_fraction": mn.optional(m, mn.RC_RS_MASKED_FRACTION, 0.0),
            "veto_fraction": mn.optional(m, mn.RC_VETO_FRACTION, 0.0),
            "kept_token_fraction": float(m[mn.RC_KEPT_TOKEN_FRACTION]),
            "dropped_seq_fraction": 1.0 - float(m[mn.RC_NUM_KEPT_SEQS]) / valid_seqs,
        }
    return out


def worst_sequences(data: AuditData, k: int) -> list[dict[str, Any]]:
    """The k samples with the largest max |token log ratio|."""
    ratios = sequence_log_ratios(data.old_logprobs, data.rollout_logprobs, data.loss_mask, nonfinite="worst")
    worst = ratios.seq_max_abs_log_ratio
    order = torch.argsort(worst, descending=True)[:k]
    rows = []
    for i in order.tolist():
        sample = data.batch.samples[i]
        rows.append(
            {
                "sample": i,
                "prompt_index": sample.prompt_index,
                "response_tokens": len(sample.token_ids),
                "max_abs_log_ratio": float(worst[i]),
                "seq_log_ratio": float(ratios.seq_log_ratio[i]),
                "text": sample.text,
            }
        )
    return rows


def build_report(
    data: AuditData, *, model: str, rollout_dtype: str, presets: Sequence[str], worst: int, seconds: dict[str, float],
    trainer_dtype: str = "float32", lm_head_fp32: bool = False,
) -> AuditReport:
    """Assemble the report from collected data."""
    max_diff, mean_diff = logprob_diff(data)
    metrics = compute_rollout_correction(
        data.old_logprobs, data.rollout_logprobs, data.loss_mask, RolloutCorrectionConfig.from_preset("disabled")
    ).metrics
    return AuditReport(
        model=model,
        rollout_dtype=rollout_dtype,
        num_sequences=len(data.batch.samples),
        num_tokens=int(data.loss_mask.sum()),
        max_abs_logprob_diff=max_diff,
        mean_abs_logprob_diff=mean_diff,
        metrics={k: float(v) for k, v in metrics.items()},
        presets=preset_effects(data, presets),
        worst=worst_sequences(data, worst),
        seconds={**seconds, **data.seconds},
        trainer_dtype=trainer_dtype,
        lm_head_fp32=lm_head_fp32,
    )


def format_report(report: AuditReport) -> str:
    """The human-readable report `nrc audit` prints."""
    lines = [
        f"== nrc audit: {report.model}, {report.setting}: {report.num_sequences} sequences, "
        f"{report.num_tokens} response tokens ==",
        f"trainer vs vLLM token logprobs: max |diff| {report.max_abs_logprob_diff:.3e}, "
        f"mean {report.mean_abs_logprob_diff:.3e}",
        "",
        "mismatch (rollout_corr/*):",
    ]
    for key in SUMMARY_METRICS:
        value = report.metrics.get(f"rollout_corr/{key}")
        if value is not None:
            lines.append(f"  {key:<20} {value: .4e}")
    if report.routing:
        r, k3 = report.routing, report.metrics[mn.RC_K3_KL]
        lines += ["", f"routing replay (R3): router agreement {r['router_agreement']:.4f} "
                      "(trainer's own expert set = the rollout's, per token and MoE layer)",
                  f"  {'':<16} {'max |diff|':>11} {'mean |diff|':>11} {'k3_kl':>11}",
                  f"  {'without replay':<16} {report.max_abs_logprob_diff:>11.3e} "
                  f"{report.mean_abs_logprob_diff:>11.3e} {k3:>11.3e}",
                  f"  {'with replay':<16} {r['max_abs_logprob_diff']:>11.3e} {r['mean_abs_logprob_diff']:>11.3e} "
                  f"{r['k3_kl']:>11.3e}"]
    lines += _probe_lines(report)
    lines += format_lora_rows(report.lora, report.rollout_dtype)
    lines += ["", f"{'preset':<28} {'truncated':>10} {'rejected':>10} {'veto':>8} {'kept':>8} {'seq drop':>9}"]
    for name, v in report.presets.items():
        lines.append(
            f"{name:<28} {v['truncated_fraction']:>10.4f} {v['rejected_fraction']:>10.4f} "
            f"{v['veto_fraction']:>8.4f} {v['kept_token_fraction']:>8.4f} {v['dropped_seq_fraction']:>9.4f}"
        )
    lines += ["", "worst sequences (max |log ratio|):"]
    for row in report.worst:
        text = row["text"].replace("\n", " ")[:80]
        lines.append(
            f"  #{row['sample']:<4} {row['max_abs_log_ratio']:.3e}  seq {row['seq_log_ratio']:+.3e}  "
            f"{row['response_tokens']:>3} tok  {text!r}"
        )
    lines += ["", "timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items())]
    return "\n".join(lines)


def _probe_lines(report: AuditReport) -> list[str]:
    """The report's distribution, first-token and per-layer sections (audit/probes.py)."""
    lines: list[str] = []
    v = report.vocab
    if v:
        support = ("whole vocabulary, exact" if v["top_k"] < 0
                   else f"engine top-{int(v['top_k'])} + sampled token + rest bucket: lower bounds")
        lines += ["", f"whole distributions on the fixed tokens ({support}; raw model distributions, T=1; "
                      f"{int(v['num_positions'])} response positions):",
                  f"  {'':<20} {'TV':>11} {'KL(eng||tr)':>11}",
                  f"  {'mean':<20} {v['tv_mean']:>11.3e} {v['kl_mean']:>11.3e}",
                  f"  {'max':<20} {v['tv_max']:>11.3e} {v['kl_max']:>11.3e}",
                  f"  {'first token, mean':<20} {v['first_token_tv_mean']:>11.3e} {v['first_token_kl_mean']:>11.3e}"]
        if v["top_k"] >= 0:
            lines.append(f"  engine mass outside the listed tokens: {v['rest_mass_mean']:.3e} (mean)")
    f = report.first_token
    if f:
        lines += ["", f"first response token (sampled): max |diff| {f['max_abs_logprob_diff']:.3e}, mean "
                      f"{f['mean_abs_logprob_diff']:.3e}, k3_kl {f['k3_kl']:.3e}"]
    if report.layers:
        lines += ["", f"trainer vs transformers ({report.rollout_dtype}) activations, per layer "
                      f"(where the two sides part: {report.parting_layer or 'nowhere above 1e-4'}):",
                  f"  {'point':<14} {'max |diff|':>11} {'rel RMS':>11}"]
        lines += [f"  {r['name']:<14} {r['max_abs_diff']:>11.3e} {r['rel_rms_diff']:>11.3e}" for r in report.layers]
    lines += [f"note: {n}" for n in report.notes]
    return lines


COMPARISON_METRICS = (mn.RC_KL, mn.RC_K3_KL)


def format_comparison(reports: Sequence[AuditReport]) -> str:
    """The side-by-side table of several settings: engine dtype x trainer dtype x lm_head_fp32.

    Columns: max and mean |trainer - vLLM| token logprob difference and the mismatch KL estimates
    (`rollout_corr/kl`, k1, may be slightly negative at fp32 noise; `rollout_corr/k3_kl`, non-negative).
    """
    header = (f"{'engine':<14} {'trainer':<10} {'lm_head_fp32':<13} {'max |diff|':>11} {'mean |diff|':>11} "
              + " ".join(f"{k.removeprefix('rollout_corr/'):>11}" for k in COMPARISON_METRICS) + f" {'tokens':>7}")
    lines = ["== nrc audit: settings side by side ==", header]
    for r in reports:
        values = " ".join(f"{r.metrics[k]:>11.3e}" for k in COMPARISON_METRICS)
        lines.append(f"{r.rollout_dtype:<14} {r.trainer_dtype:<10} {str(r.lm_head_fp32).lower():<13} "
                     f"{r.max_abs_logprob_diff:>11.3e} {r.mean_abs_logprob_diff:>11.3e} {values} {r.num_tokens:>7}")
    return "\n".join(lines)


def audit_settings(cfg: TrainConfig) -> tuple[list[str], list[tuple[str, bool]]]:
    """(engine dtypes, [(trainer dtype, lm_head_fp32)]) the audit compares, in order, without duplicates.

    Engine dtypes: `audit.engine_dtypes`, else `rollout.dtype` (plus float32/bfloat16 with
    `audit.compare_dtypes`); with `rollout.quantization` each first quantized (`engine_label`: "bfloat16+int8"),
    then unquantized beside it. Trainer settings: `audit.trainer_dtypes` (else `model.dtype`) x `audit.lm_head_fp32`
    (else `policy.lm_head_fp32`); an fp32 LM head under an fp32 trainer is the fp32 trainer itself.
    """
    engines = list(cfg.audit.engine_dtypes) or [cfg.rollout.dtype]
    if cfg.audit.compare_dtypes and not cfg.audit.engine_dtypes:
        engines += [d for d in ("float32", "bfloat16") if d != cfg.rollout.dtype]
    if cfg.rollout.quantization != "none":  # the quantized engines, then the same dtypes unquantized beside them
        engines = [engine_label(d, cfg.rollout.quantization) for d in engines] + engines
    trainers: list[tuple[str, bool]] = []
    for dtype in list(cfg.audit.trainer_dtypes) or [cfg.model.dtype]:
        for head in list(cfg.audit.lm_head_fp32) or [cfg.policy.lm_head_fp32]:
            setting = (dtype, bool(head) and dtype != "float32")
            if setting not in trainers:
                trainers.append(setting)
    return list(dict.fromkeys(engines)), trainers


def engine_label(dtype: str, quantization: str) -> str:
    """How the audit names an engine setting: its dtype, plus `+<quantization>` when quantized ("bfloat16+int8")."""
    return dtype if quantization == "none" else f"{dtype}+{quantization}"


def parse_engine_label(label: str) -> tuple[str, str]:
    """(dtype, quantization) of an `engine_label`."""
    dtype, _, quantization = label.partition("+")
    return dtype, quantization or "none"


def audit_prompts(cfg: TrainConfig, tokenize: Any, num_prompts: int) -> list[list[int]]:
    """Token ids of the first `num_prompts` prompts of the configured task (deterministic)."""
    from nemo_rollout_correction.tasks.builtin import task_from_config

    task = task_from_config(cfg)
    return [tokenize(record.prompt) for record in task.records[:num_prompts]]


def run_audit(
    cfg: TrainConfig, runtime: Runtime, *, presets: Sequence[str] | None = None, log: Any = print
) -> list[AuditReport]:
    """The full audit for `cfg`: one report per engine dtype x trainer setting (`audit_settings`), engines outer.

    Every rank must call it. Each engine starts once and samples once; every trainer setting re-scores the
    same tokens, so the rows of `format_comparison` differ only in the compared setting.
    """
    from transformers import AutoTokenizer

    from nemo_rollout_correction.models.sources import resolve_model_source

    presets = list(presets or RolloutCorrectionConfig.preset_names())
    hf_dir = resolve_model_source(cfg.model.source)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    pad = pad_token_id(tokenizer)
    prompts = audit_prompts(
        cfg, lambda text: tokenize_prompt(tokenizer, text, cfg.task.use_chat_template), cfg.audit.num_prompts
    )
    engine_dtypes, trainer_settings = audit_settings(cfg)
    r3 = cfg.rollout.routing_replay == "r3"
    policies: dict[tuple[str, bool], tuple[MegatronPolicy, float]] = {}
    for dtype, head in trainer_settings:
        start = time.perf_counter()
        policy = MegatronPolicy.from_hf(hf_dir, params_dtype=dtype, seed=cfg.run.seed, routing_replay=r3)
        if head:
            policy.use_fp32_lm_head()
        policies[(dtype, head)] = (policy, time.perf_counter() - start)
    # The probes beyond the sampled tokens (audit/probes.py) need the whole model in one process.
    single = runtime.world_size == 1
    probe_notes = [] if single else [f"distribution and per-layer probes skipped: they need a one-process audit "
                                     f"(this one has {runtime.world_size} ranks)"]
    top_k = cfg.audit.vocab_top_k
    reports = []
    for engine_dtype in engine_dtypes:
        engine = None
        engine_seconds: dict[str, float] = {}
        engine_dists = None
        if runtime.is_main:
            log(f"[nrc audit] starting vLLM ({engine_dtype}) on {hf_dir}")
            # policy.lora: a fresh adapter is zero (B = 0), so these engines measure the base model on a plain
            # engine (vLLM 0.32's prompt logprobs, which the probes read, fail on a LoRA engine on CPU); the
            # unmerged adapter's own mismatch against the merged control: `audit.lora` below (audit/lora.py)
            dtype_of_engine, quantization = parse_engine_label(engine_dtype)
            options = dataclasses.replace(engine_options(cfg, str(hf_dir), dtype_of_engine), lora_rank=0,
                                          quantization=quantization)
            if single and top_k != 0:  # vLLM caps logprobs per position at max_logprobs (default 20)
                options = dataclasses.replace(options, extra={**options.extra,
                                                              "max_logprobs": -1 if top_k < 0 else max(top_k, 20)})
            engine = VllmRolloutEngine(options)
            engine_seconds["engine_start"] = engine.start_seconds
        try:
            batch = generate(engine, prompts, sampling_options(cfg), seed=cfg.run.seed)
            if engine is not None and single and top_k != 0:
                start = time.perf_counter()
                engine_dists = probes.engine_prompt_logprobs(
                    engine, [s.prompt_token_ids + s.token_ids for s in batch.samples], top_k)
                engine_seconds["engine_prompt_logprobs"] = time.perf_counter() - start
        finally:
            if engine is not None:
                engine.shutdown()
        for (dtype, head), (policy, build_seconds) in policies.items():
            if len(trainer_settings) > 1 and runtime.is_main:
                log(f"[nrc audit] re-scoring with the {dtype} trainer{' (fp32 lm_head)' if head else ''}")
            data = rescore(policy, batch, replay_options(cfg), pad_token_id=pad,
                           micro_batch_size=cfg.policy.micro_batch_size, groups=runtime.groups)
            report = build_report(
                data,
                model=cfg.model.source,
                rollout_dtype=engine_dtype,
                presets=presets,
                worst=cfg.audit.worst_sequences,
                seconds={"policy_build": build_seconds, **engine_seconds},
                trainer_dtype=dtype,
                lm_head_fp32=head,
            )
            if r3:
                replayed = rescore(policy, batch, replay_options(cfg), pad_token_id=pad,
                                   micro_batch_size=cfg.policy.micro_batch_size, groups=runtime.groups,
                                   replay_routing=True)
                report.routing = routing_report(policy, replayed, runtime.groups)
            report.first_token = probes.first_token_stats(data.old_logprobs, data.rollout_logprobs,
                                                                data.loss_mask)
            report.notes = list(probe_notes)
            if single:
                run_probes(report, policy, batch, engine_dists, hf_dir, cfg, pad_token_id=pad)
            reports.append(report)
    if cfg.policy.lora.enabled and cfg.audit.lora_compare and reports:
        if single:
            reports[0].lora = lora_comparison(cfg, str(hf_dir), prompts, pad_token_id=pad, log=log)
        else:
            reports[0].notes.append(f"LoRA adapter comparison skipped: it needs a one-process audit (this one has "
                                    f"{runtime.world_size} ranks)")
    return reports


def run_probes(report: AuditReport, policy: MegatronPolicy, batch: RolloutBatch,
               engine_dists: list[list[probes.EnginePosition]] | None, hf_dir: Any, cfg: TrainConfig, *,
               pad_token_id: int) -> None:
    """Fill `report.vocab`, `report.layers` and `report.parting_layer` (one-process audits only)."""
    routing_replay.begin_step(policy)  # the probes run the policy with its own routers
    sequences = [s.prompt_token_ids + s.token_ids for s in batch.samples]
    if engine_dists is not None:
        start = time.perf_counter()
        vocab = probes.trainer_vocab_divergence(
            policy, sequences, engine_dists, [len(s.prompt_token_ids) for s in batch.samples],
            top_k=cfg.audit.vocab_top_k, vocab_size=policy.arch.vocab_size, pad_token_id=pad_token_id,
            micro_batch_size=cfg.policy.micro_batch_size)
        report.vocab = {k: float(v) for k, v in dataclasses.asdict(vocab).items() if not isinstance(v, dict)}
        report.seconds["vocab_probe"] = time.perf_counter() - start
    n = min(cfg.audit.layer_sequences, len(sequences))
    if n > 0:
        start = time.perf_counter()
        rows = sequences[:n]
        ids = torch.full((n, max(len(r) for r in rows)), pad_token_id, dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
        layers = probes.layer_differences(policy, hf_dir, ids, [len(r) for r in rows],
                                                hf_dtype=parse_engine_label(report.rollout_dtype)[0])
        report.layers = [dataclasses.asdict(layer) for layer in layers]
        report.parting_layer = probes.parting_layer(layers)
        report.seconds["layer_probe"] = time.perf_counter() - start


def routing_report(policy: MegatronPolicy, replayed: AuditData, groups: ParallelGroups) -> dict[str, float]:
    """The R3 part of a report from a re-scoring with replayed routing (every rank must call it)."""
    agreement = routing_replay.router_agreement_metrics(policy, groups)
    max_diff, mean_diff = logprob_diff(replayed)
    metrics = compute_rollout_correction(replayed.old_logprobs, replayed.rollout_logprobs, replayed.loss_mask,
                                         RolloutCorrectionConfig.from_preset("disabled")).metrics
    return {
        "router_agreement": agreement.get(routing_replay.ROUTER_AGREEMENT, float("nan")),
        "max_abs_logprob_diff": max_diff,
        "mean_abs_logprob_diff": mean_diff,
        "kl": float(metrics[mn.RC_KL]),
        "k3_kl": float(metrics[mn.RC_K3_KL]),
    }


__all__ = [
    "COMPARISON_METRICS",
    "SUMMARY_METRICS",
    "AuditData",
    "AuditReport",
    "audit_settings",
    "build_report",
    "collect",
    "format_comparison",
    "format_report",
    "generate",
    "logprob_diff",
    "preset_effects",
    "rescore",
    "routing_report",
    "run_audit",
    "run_probes",
    "worst_sequences",
]
