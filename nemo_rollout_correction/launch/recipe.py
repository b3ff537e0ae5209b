"""The NeMo-Run recipe: an `Entry` under torchrun on a LocalExecutor or a SlurmExecutor.

    settings = LauncherConfig(name="local", nproc_per_node=2)
    result = launch(settings, Entry.train(["rollout_correction=token_tis"]))

- local: `run.LocalExecutor(ntasks_per_node=nproc_per_node, launcher="torchrun")`; NeMo-Run (through
  torchx) starts `torchrun --nnodes 1 --nproc-per-node P ...` on this machine and waits for it.
- slurm: `run.SlurmExecutor(account, partition, time, nodes, ntasks_per_node=1, gpus_per_node=P,
  container_image, container_mounts, launcher="torchrun")`: one srun task per node runs torchrun
  with P ranks inside the pyxis container; rendezvous at the head node. NeMo-Run renders the sbatch
  script from its own template (`#SBATCH` lines, `srun --container-image/--container-mounts/
  --container-workdir`, the head node's IP as the c10d endpoint). With `dryrun=True` the
  sbatch script is rendered under the experiment directory and nothing is submitted.

nemo-run is an optional dependency (`pip install nemo-run==0.11.1`), imported only here and only when
a launch is requested, so `import nemo_rollout_correction.launch` works without it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_rollout_correction.config.schema import LauncherConfig
from nemo_rollout_correction.launch.entry import DEFAULT_RDZV_PORT, Entry

if TYPE_CHECKING:  # only for annotations; the import is lazy at run time
    import nemo_run


def _nemo_run() -> Any:
    """Import nemo_run with an actionable message when it is missing."""
    try:
        import nemo_run as run
    except ImportError as exc:  # optional dependency
        raise ImportError("the NeMo-Run launcher needs nemo-run: pip install nemo-run==0.11.1 "
                          "(see docs/deployment.md)") from exc
    return run


@dataclass(frozen=True)
class LaunchResult:
    """What a launch did.

    experiment_dir: NeMo-Run's directory of the experiment (logs, configs, the sbatch script).
    status: the task's state as NeMo-Run reports it (`SUCCEEDED`, `FAILED`, ...; `DRYRUN`; for a
        detached Slurm job its state at submission, e.g. `SUBMITTED` or `PENDING`).
    sbatch_script: the rendered sbatch script (slurm dry run), else None.
    detached: the launch returned without waiting for the job (Slurm).
    """

    experiment_dir: Path
    status: str
    sbatch_script: str | None = None
    detached: bool = False

    @property
    def succeeded(self) -> bool:
        """True when the task finished successfully, a dry run rendered, or a detached job was accepted."""
        if self.status in ("SUCCEEDED", "DRYRUN"):
            return True
        return self.detached and self.status in ("SUBMITTED", "PENDING", "RUNNING")


def build_script(entry: Entry, env: dict[str, str] | None = None) -> nemo_run.Script:
    """The NeMo-Run `Script` for an entry: `python -m module args` or `executable args`."""
    run = _nemo_run()
    if entry.is_module:
        return run.Script(path=entry.target, args=list(entry.args), entrypoint="python", m=True, env=env or {})
    # An executable: torchrun starts it with --no-python (the entrypoint only has to differ from python).
    return run.Script(path=entry.target, args=list(entry.args), entrypoint=entry.target, env=env or {})


def build_executor(
    settings: LauncherConfig,
    *,
    env: dict[str, str] | None = None,
    job_dir: str | os.PathLike[str] | None = None,
    rdzv_port: int = DEFAULT_RDZV_PORT,
) -> nemo_run.LocalExecutor | nemo_run.SlurmExecutor:
    """A NeMo-Run executor for `settings` with the torchrun launcher.

    env: environment variables for every rank. job_dir: Slurm only, where the sbatch script and logs
    live on the cluster (default: NeMo-Run's experiment directory, which must then be on a file
    system the compute nodes share). Inside the container NeMo-Run mounts the job directory at
    `/nemo_run` and starts in `/nemo_run/code` (NeMo-Run creates the empty `code/` when it packages):
    relative paths of the run (`run.output_dir=runs/...`) land there; pass an absolute path on a
    mounted file system instead.
    """
    run = _nemo_run()
    launcher = run.Torchrun(rdzv_port=rdzv_port)
    if settings.name == "local":
        return run.LocalExecutor(ntasks_per_node=settings.nproc_per_node, nodes=1, launcher=launcher,
                                 env_vars=_local_env(env))
    from nemo_run.core.tunnel.client import LocalTunnel

    return run.SlurmExecutor(
        account=settings.account,  # None: no --account line, sbatch uses the user's default
        # NeMo-Run's default prefix is derived from the account (and fails on None).
        job_name_prefix="nrc-",
        partition=settings.partition,
        time=settings.time,
        nodes=settings.nodes,
        # One srun task per node runs torchrun, which starts nproc_per_node ranks there.
        ntasks_per_node=1,
        # null: one GPU per rank; 0: CPU-only nodes (no --gpus-per-node line).
        gpus_per_node=settings.nproc_per_node if settings.gpus_per_node is None else settings.gpus_per_node or None,
        torchrun_nproc_per_node=settings.nproc_per_node,
        container_image=settings.container_image,
        container_mounts=list(settings.container_mounts),
        exclusive=True,
        launcher=launcher,
        env_vars=dict(env or {}),
        # The code is in the container image (containers/Dockerfile): nothing to package or copy.
        packager=run.Packager(),
        tunnel=LocalTunnel(job_dir=str(job_dir or "")),
    )


def _local_env(env: dict[str, str] | None) -> dict[str, str]:
    """Rank environment for a local launch: `env`, and PATH led by this interpreter's bin directory.

    The local executor runs `torchrun` (and `nrc`) by name; started from a virtual environment that
    is not activated, they would otherwise not be found or come from another installation.
    """
    out = dict(env or {})
    bindir = str(Path(sys.executable).parent)
    path = out.get("PATH", os.environ.get("PATH", ""))
    if bindir not in path.split(os.pathsep):
        out["PATH"] = os.pathsep.join([bindir, path]) if path else bindir
    return out


def _final_status(exp: Any) -> str:
    """The single task's state after `exp.run(detach=False)` waited for it (`SUCCEEDED`, `FAILED`, ...).

    Read from the job that waited, not from `exp.status()`: NeMo-Run does not track the status of
    finished local jobs (it reports RUNNING or UNKNOWN for them).
    """
    (job,) = exp.jobs
    return str(getattr(job.state, "name", job.state)).upper()


def launch(
    settings: LauncherConfig,
    entry: Entry,
    *,
    name: str = "nrc",
    dryrun: bool = False,
    env: dict[str, str] | None = None,
    job_dir: str | os.PathLike[str] | None = None,
    tail_logs: bool = True,
) -> LaunchResult:
    """Run `entry` under torchrun with the executor of `settings` and wait for it.

    NeMo-Run keeps its experiments under `$NEMORUN_HOME` (default `~/.nemo_run`). A local launch
    blocks until the ranks exit; a Slurm launch is detached: it returns once sbatch accepted the job
    (follow it with `nemo experiment logs <id> 0`). dryrun: render and keep the job's files (Slurm:
    the sbatch script) without running anything.
    """
    run = _nemo_run()
    executor = build_executor(settings, env=env, job_dir=job_dir)
    script = build_script(entry)
    with run.Experiment(name, executor=executor, log_level="WARN") as exp:
        exp.add(script, executor=executor, name=name, tail_logs=tail_logs)
        if dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            exp_dir = Path(exp._exp_dir)
            found = sorted(exp_dir.rglob("*_sbatch.sh"))
            text = found[0].read_text() if found else None
            return LaunchResult(exp_dir, "DRYRUN", text)
        # Slurm: submit and return (a job can queue for hours); local: wait for the ranks.
        detach = settings.name == "slurm"
        exp.run(detach=detach, tail_logs=tail_logs and not detach, sequential=True)
    # Without tail_logs NeMo-Run waits for a local job when the `with` block exits: read the state after it.
    return LaunchResult(Path(exp._exp_dir), _final_status(exp), detached=detach)
