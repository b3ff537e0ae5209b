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
from default_lane import require

from nemo_rollout_correction.launch import Entry, LauncherConfig, main, settings_from_overrides, torchrun_command
from nemo_rollout_correction.launch.entry import shell_join
from nemo_rollout_correction.launch.main import resolve
from nemo_rollout_correction.launch.settings import settings_for

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
    assert settings == LauncherConfig(name="slurm", nodes=4, nproc_per_node=8, account="acct",
                                      container_mounts=["/lustre/data:/data", "/lustre/runs:/runs:ro"])
    assert settings.world_size == 32
    assert rest == ["rollout_correction=token_tis", "run.num_steps=10"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["launcher.nodes=2"], "launcher.nodes=2 is not allowed: the local launcher runs on one node; use launcher=slurm"),
    (["launcher.name=kubernetes"], "launcher.name='kubernetes' is not allowed: choose one of ['local', 'slurm']"),
    (["launcher.nproc_per_node=0"], "launcher.nproc_per_node=0 is not allowed: must be >= 1"),
    (["launcher.nproc_per_node=two"], "launcher.nproc_per_node='two' is not allowed: must be an integer"),
    (["launcher.gpus=8"], "unknown launcher key 'gpus'"),
    (["launcher.gpus_per_node=-1"], "launcher.gpus_per_node=-1 is not allowed: must be >= 0"),
    (["launcher.gpus_per_node=one"], "launcher.gpus_per_node='one' is not allowed: must be an integer"),
    (["launcher.time=90min"], "launcher.time='90min' is not allowed: use Slurm's format"),
    (["launcher.container_mounts=[/data]"], "launcher.container_mounts[0]='/data' is not allowed"),
])
def test_bad_launcher_overrides_name_the_key_and_the_allowed_values(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        settings_from_overrides(overrides)


def test_composed_launcher_section_rejects_unknown_keys_and_reads_a_config_dir(tmp_path: Path) -> None:
    # The launcher reads nrc train's composed config (one LauncherConfig); a user config dir takes part in it.
    require("hydra", "config")
    with pytest.raises(ValueError, match="gpus"):
        settings_for(["launcher.gpus=8"])
    (tmp_path / "launcher").mkdir()
    (tmp_path / "launcher" / "mine.yaml").write_text("name: slurm\nnodes: 2\ntime: '00:30:00'\n")
    assert settings_for(["launcher=mine"], tmp_path) == LauncherConfig(name="slurm", nodes=2, time="00:30:00")


# --- the torchrun command ----------------------------------------------------------------------------


def test_torchrun_command_single_node_is_standalone_and_runs_nrc_train() -> None:
    cmd = torchrun_command(LauncherConfig(nproc_per_node=2), Entry.train(["rollout_correction=token_tis"]))
    assert cmd == ["torchrun", "--nproc-per-node", "2", "--standalone", "--nnodes", "1",
                   "--no-python", "nrc", "train", "rollout_correction=token_tis"]


def test_torchrun_command_multi_node_uses_c10d_rendezvous_expanded_on_each_node() -> None:
    settings = LauncherConfig(name="slurm", nodes=2, nproc_per_node=8, account="a")
    line = shell_join(torchrun_command(settings, Entry.module(SMOKE, "--output-dir", "/runs/a b")))
    assert line == ("torchrun --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint "
                    "$MASTER_ADDR:$MASTER_PORT --rdzv-id $SLURM_JOB_ID -m " + SMOKE + " --output-dir '/runs/a b'")


def test_cli_composes_the_launcher_section_of_the_train_config() -> None:
    # The parallelism group sets launcher.nproc_per_node in nrc train's config; the launcher follows it.
    require("hydra", "config")
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


def test_cli_config_dir_composes_the_launcher_and_reaches_nrc_train(tmp_path: Path) -> None:
    # `nrc launch --config-dir DIR`, as `nrc train --config-dir DIR`: the launcher section comes from DIR, and
    # every rank's nrc train gets the same directory (absolute: a rank's working directory may differ).
    require("hydra", "config")
    (tmp_path / "launcher").mkdir()
    (tmp_path / "launcher" / "two.yaml").write_text("name: slurm\nnodes: 2\n")
    _, settings, entry = resolve(["--config-dir", str(tmp_path), "launcher=two"])
    assert (settings.name, settings.nodes) == ("slurm", 2)
    assert entry == Entry.train(["--config-dir", str(tmp_path.resolve()), "launcher=two"])
    with pytest.raises(ValueError, match="does not exist"):
        resolve(["--config-dir", str(tmp_path / "missing")])


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
    require("nemo_run", "nemo-run")
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
    require("nemo_run", "nemo-run")
    # 15 rows cannot be split over 2 ranks: the smoke job raises on both ranks.
    proc = _launcher(tmp_path, "launcher.nproc_per_node=2", "--name", "bad", "--no-tail-logs",
                     "--entry-module", SMOKE, "--", "--output-dir", str(tmp_path / "o"), "--batch", "15")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nrc launch: FAILED" in proc.stdout
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("override", "gpus"), [([], 8), (["launcher.gpus_per_node=4"], 4),
                                                (["launcher.gpus_per_node=0"], None)])
def test_slurm_executor_gpus_per_node_defaults_to_one_per_rank_and_0_requests_none(override: list[str],
                                                                                   gpus: int | None) -> None:
    pytest.importorskip("nemo_run", reason="nemo-run==0.11.1 is not installed (pip install nemo-run==0.11.1)")
    from nemo_rollout_correction.launch.recipe import build_executor

    settings, _ = settings_from_overrides(["launcher.name=slurm", "launcher.nproc_per_node=8", *override])
    executor = build_executor(settings)
    assert executor.gpus_per_node == gpus
    assert executor.nproc_per_node() == 8  # torchrun's ranks per node do not depend on the GPU request


def test_nemo_run_slurm_executor_dry_run_renders_the_sbatch_script(tmp_path: Path) -> None:
    require("nemo_run", "nemo-run")
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


@pytest.mark.parametrize("override", [
    "launcher.time=90", "launcher.time=2-00", "launcher.time=01:30:00", "launcher.time=90min", "launcher.time=1h",
    "launcher.container_mounts=[/a:/b]", "launcher.container_mounts=[/a:/b:ro]", "launcher.container_mounts=[/data]",
    "launcher.container_mounts=[:/b]", "launcher.container_mounts=[/a:/b:ro:x]",
])
def test_the_override_parser_and_the_composed_config_apply_the_same_rules(override: str) -> None:
    # One rule per field (LauncherConfig): what Hydra's composition accepts, the no-Hydra override parser accepts.
    require("hydra", "config")

    def accepts(make: Any) -> bool:
        try:
            make()
        except ValueError:
            return False
        return True

    overrides = ["launcher=slurm", override]
    parsed = accepts(lambda: settings_from_overrides(["launcher.name=slurm", override]))
    assert parsed == accepts(lambda: settings_for(overrides))
