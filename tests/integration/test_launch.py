"""The launcher: `launcher.*` settings, the torchrun command, and real NeMo-Run launches.

The local executor is exercised for real: NeMo-Run (through torchx) starts torchrun with 2 CPU ranks
of `nemo_rollout_correction.launch.smoke`, which joins a gloo group, all-reduces, runs a distributed
rollout-correction step and compares it with one process. The Slurm executor cannot run here (no
Slurm); its NeMo-Run dry run renders the real sbatch script, which is checked line by line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_rollout_correction.launch import Entry, LauncherSettings, main, settings_from_overrides, torchrun_command
from nemo_rollout_correction.launch.entry import shell_join
from nemo_rollout_correction.launch.main import resolve

pytestmark = pytest.mark.integration

SMOKE = "nemo_rollout_correction.launch.smoke"


def _launcher(tmp_path: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    """`python -m nemo_rollout_correction.launch ...` with NeMo-Run's home inside tmp_path."""
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemorun")}
    return subprocess.run([sys.executable, "-m", "nemo_rollout_correction.launch", *args], capture_output=True,
                          text=True, timeout=timeout, check=False, env=env, cwd=tmp_path)


# --- settings and overrides -------------------------------------------------------------------------


def test_overrides_split_launcher_keys_from_trainer_keys() -> None:
    settings, rest = settings_from_overrides([
        "launcher.name=slurm", "launcher.nodes=4", "launcher.nproc_per_node=8", "launcher.account=acct",
        "launcher.container_mounts=[/lustre/data:/data,/lustre/runs:/runs:ro]", "launcher.partition=null",
        "rollout_correction=token_tis", "run.num_steps=10",
    ])
    assert settings == LauncherSettings(name="slurm", nodes=4, nproc_per_node=8, account="acct",
                                        container_mounts=("/lustre/data:/data", "/lustre/runs:/runs:ro"))
    assert settings.world_size == 32
    assert rest == ["rollout_correction=token_tis", "run.num_steps=10"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["launcher.nodes=2"], "launcher.nodes=2 needs launcher.name=slurm"),
    (["launcher.name=kubernetes"], "launcher.name='kubernetes' is not allowed; choose one of ['local', 'slurm']"),
    (["launcher.nproc_per_node=0"], "launcher.nproc_per_node=0 must be an integer >= 1"),
    (["launcher.nproc_per_node=two"], "launcher.nproc_per_node='two' must be an integer"),
    (["launcher.gpus=8"], "unknown launcher key 'gpus'"),
    (["launcher.time=90min"], "launcher.time='90min' must look like HH:MM:SS"),
    (["launcher.container_mounts=[/data]"], "entry '/data' must be src:dst"),
])
def test_bad_launcher_overrides_name_the_key_and_the_allowed_values(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        settings_from_overrides(overrides)


def test_from_mapping_reads_the_config_section_and_rejects_unknown_keys() -> None:
    section = {"name": "local", "nodes": 1, "nproc_per_node": 2, "container_image": None, "partition": None,
               "account": None, "time": "00:30:00", "container_mounts": []}
    assert LauncherSettings.from_mapping(section) == LauncherSettings(nproc_per_node=2, time="00:30:00")
    with pytest.raises(ValueError, match=r"unknown launcher key\(s\) \['gpus'\]"):
        LauncherSettings.from_mapping({"gpus": 8})


def test_launcher_settings_have_the_fields_of_the_train_config_launcher_section() -> None:
    # One launcher section: nrc train's schema (config layer) and the launcher's settings must not drift.
    pytest.importorskip("hydra", reason="the config extra (hydra-core) is not installed")
    import dataclasses

    from nemo_rollout_correction.config.schema import LauncherConfig

    theirs = {f.name: f.default for f in dataclasses.fields(LauncherConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(LauncherSettings)}
    assert set(theirs) == set(ours)
    assert {k: v for k, v in theirs.items() if k != "container_mounts"} == \
        {k: v for k, v in ours.items() if k != "container_mounts"}


# --- the torchrun command ----------------------------------------------------------------------------


def test_torchrun_command_single_node_is_standalone_and_runs_nrc_train() -> None:
    cmd = torchrun_command(LauncherSettings(nproc_per_node=2), Entry.train(["rollout_correction=token_tis"]))
    assert cmd == ["torchrun", "--nproc-per-node", "2", "--standalone", "--nnodes", "1",
                   "--no-python", "nrc", "train", "rollout_correction=token_tis"]


def test_torchrun_command_multi_node_uses_c10d_rendezvous_expanded_on_each_node() -> None:
    settings = LauncherSettings(name="slurm", nodes=2, nproc_per_node=8, account="a")
    line = shell_join(torchrun_command(settings, Entry.module(SMOKE, "--output-dir", "/runs/a b")))
    assert line == ("torchrun --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint "
                    "$MASTER_ADDR:$MASTER_PORT --rdzv-id $SLURM_JOB_ID -m " + SMOKE + " --output-dir '/runs/a b'")


def test_cli_composes_the_launcher_section_of_the_train_config() -> None:
    # The parallelism group sets launcher.nproc_per_node in nrc train's config; the launcher follows it.
    pytest.importorskip("hydra", reason="the config extra (hydra-core) is not installed")
    # 4 ranks: 16 rollouts per step must split into microbatches of 4 on each data-parallel rank.
    overrides = ["parallelism=dp2", "launcher=slurm", "launcher.nodes=2", "policy.micro_batch_size=4"]
    _, settings, entry = resolve(overrides)
    assert (settings.name, settings.nodes, settings.nproc_per_node, settings.account) == ("slurm", 2, 2, None)
    assert entry.args == ("train", *overrides)


def test_cli_routes_overrides_and_entry_arguments() -> None:
    _, settings, entry = resolve(["launcher.nproc_per_node=2", "rollout_correction=seq_mis"])
    # nrc train receives every override (its config records the launcher section too).
    assert entry == Entry.train(["launcher.nproc_per_node=2", "rollout_correction=seq_mis"])
    _, settings, entry = resolve(["launcher.nproc_per_node=2", "--entry-module", SMOKE, "--", "--output-dir", "x"])
    assert settings.nproc_per_node == 2
    assert entry == Entry.module(SMOKE, "--output-dir", "x")
    with pytest.raises(ValueError, match="need --entry or --entry-module"):
        resolve(["--", "--output-dir", "x"])


def test_cli_print_torchrun_and_bad_input_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launcher.nproc_per_node=4", "policy.micro_batch_size=4", "run.num_steps=3", "--print-torchrun"]) == 0
    assert capsys.readouterr().out.strip() == ("torchrun --nproc-per-node 4 --standalone --nnodes 1 --no-python "
                                               "nrc train launcher.nproc_per_node=4 policy.micro_batch_size=4 "
                                               "run.num_steps=3")
    assert main(["launcher.nodes=3"]) == 2  # composed through nrc train's config: its message
    err = capsys.readouterr().err
    assert err.startswith("nrc launch: ") and "launcher.nodes=3" in err and "slurm" in err
    assert main(["rollout_correction.rollout_is_threshold=-1", "--print-torchrun"]) == 2  # a bad train key fails here
    assert "rollout_is_threshold" in capsys.readouterr().err
    assert main(["--env", "NOVALUE", "--print-torchrun"]) == 2
    assert "--env 'NOVALUE' must be KEY=VALUE" in capsys.readouterr().err


# --- NeMo-Run: the real local executor and the Slurm dry run ------------------------------------------


@pytest.mark.distributed
def test_nemo_run_local_executor_runs_two_cpu_ranks_for_real(tmp_path: Path) -> None:
    pytest.importorskip("nemo_run", reason="nemo-run==0.11.1 is not installed (pip install nemo-run==0.11.1)")
    out = tmp_path / "smoke"
    proc = _launcher(tmp_path, "launcher.nproc_per_node=2", "--name", "smoke", "--no-tail-logs",
                     "--entry-module", SMOKE, "--", "--output-dir", str(out), "--preset", "decoupled_geo_rs")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nrc launch: SUCCEEDED" in proc.stdout
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(r["rank"] for r in records) == [0, 1]
    assert {r["world_size"] for r in records} == {2}
    assert records[0]["pid"] != records[1]["pid"]  # two processes, not one
    for r in records:
        assert r["backend"] == "gloo"
        assert r["ranks_sum"] == 1.0  # the all-reduce of 0 + 1 reached both ranks
        assert r["max_rel_diff"] <= 1e-5 and r["keys_only_in_one"] == []
        # Each rank saw half the rows, and the step's denominator is the global kept-token count.
        assert r["num_global_tokens"] == r["reference_num_kept_tokens"]
    assert records[0]["rows"] == [0, 8] and records[1]["rows"] == [8, 16]
    local = sum(r["num_local_tokens"] for r in records)
    assert records[0]["metrics"]["rollout_corr/num_valid_tokens"] == local
    # The geometric rejection of this preset removed sequences on both ranks' rows (so the global
    # denominator is not a local count), and both ranks agree on the reduced metrics.
    assert 0 < records[0]["metrics"]["rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction"] < 1
    assert records[0]["num_global_tokens"] < local
    assert records[0]["metrics"] == records[1]["metrics"]


@pytest.mark.slow
@pytest.mark.distributed
def test_nemo_run_local_executor_reports_a_failing_job(tmp_path: Path) -> None:
    pytest.importorskip("nemo_run", reason="nemo-run==0.11.1 is not installed (pip install nemo-run==0.11.1)")
    # 15 rows cannot be split over 2 ranks: the smoke job raises on both ranks.
    proc = _launcher(tmp_path, "launcher.nproc_per_node=2", "--name", "bad", "--no-tail-logs",
                     "--entry-module", SMOKE, "--", "--output-dir", str(tmp_path / "o"), "--batch", "15")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nrc launch: FAILED" in proc.stdout
    assert not (tmp_path / "o").exists()


def test_nemo_run_slurm_executor_dry_run_renders_the_sbatch_script(tmp_path: Path) -> None:
    pytest.importorskip("nemo_run", reason="nemo-run==0.11.1 is not installed (pip install nemo-run==0.11.1)")
    proc = _launcher(
        tmp_path, "launcher=slurm", "launcher.nodes=2", "launcher.nproc_per_node=8", "launcher.account=acct",
        "launcher.partition=batch", "launcher.time=02:30:00", "launcher.container_image=nvcr.io/acme/nrc:0.1.0",
        "launcher.container_mounts=[/lustre/data:/data]", "rollout_correction=token_tis",
        "run.output_dir=/data/runs/tis", "task.prompts_per_step=32", "--name", "grpo", "--dry-run",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for line in ("#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --time=02:30:00"):
        assert line in out, line
    (srun,) = [line for line in out.splitlines() if line.startswith("srun ")]
    assert "--container-image nvcr.io/acme/nrc:0.1.0" in srun
    exp_dir = Path(out.split("nrc launch: DRYRUN (experiment directory ")[1].split(")")[0])
    assert exp_dir.is_relative_to(tmp_path / "nemorun")
    # The user's mounts, plus NeMo-Run's job directory at /nemo_run, where the container starts in code/.
    assert f"--container-mounts /lustre/data:/data,{exp_dir}/grpo:/nemo_run " in srun
    assert "--container-workdir /nemo_run/code" in srun
    assert (exp_dir / "grpo" / "code").is_dir()
    tail = srun[srun.index(" torchrun "):]
    for flag in ("--rdzv-backend c10d", "--rdzv-endpoint $head_node_ip:29500", "--nnodes 2", "--nproc-per-node 8",
                 "--node-rank $SLURM_NODEID"):
        assert flag in tail, flag
    assert tail.endswith("--no-python nrc train launcher=slurm launcher.nodes=2 launcher.nproc_per_node=8 "
                         "launcher.account=acct launcher.partition=batch launcher.time=02:30:00 "
                         "launcher.container_image=nvcr.io/acme/nrc:0.1.0 "
                         "'launcher.container_mounts=[/lustre/data:/data]' rollout_correction=token_tis "
                         "run.output_dir=/data/runs/tis task.prompts_per_step=32")


@pytest.mark.parametrize(("field", "value"), [
    ("time", "90"), ("time", "2-00"), ("time", "01:30:00"), ("time", "90min"), ("time", "1h"),
    ("container_mounts", ("/a:/b",)), ("container_mounts", ("/a:/b:ro",)), ("container_mounts", ("/data",)),
    ("container_mounts", (":/b",)), ("container_mounts", ("/a:/b:ro:x",)),
])
def test_launcher_settings_and_the_train_config_apply_the_same_rules(field: str, value: Any) -> None:
    # One rule per field (config/schema.py): what nrc train's config accepts, the launcher accepts, and back.
    from nemo_rollout_correction.config.schema import ConfigError, LauncherConfig

    def accepts(make: Any) -> bool:
        try:
            make()
        except (ValueError, ConfigError):
            return False
        return True

    config_value = list(value) if field == "container_mounts" else value
    assert accepts(lambda: LauncherSettings(name="slurm", **{field: value})) == \
        accepts(lambda: LauncherConfig(name="slurm", **{field: config_value}))
