"""What every launched process runs (the entry) and the plain torchrun command line around it.

The default entry is `nrc train <overrides>`. Any other command can be launched instead, e.g. the
smoke job (`python -m nemo_rollout_correction.launch.smoke`), which is what the tests launch until
the trainer lands: `Entry.module("nemo_rollout_correction.launch.smoke", "--output-dir", "out")`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from nemo_rollout_correction.config.schema import LauncherConfig

DEFAULT_RDZV_PORT = 29500


@dataclass(frozen=True)
class Entry:
    """A command for each rank: a Python module (`python -m`) or an executable on PATH.

    target: the module name (`is_module`) or the executable (`nrc`, a script path).
    args: its arguments.
    """

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False

    def __post_init__(self) -> None:
        if not self.target or any(c.isspace() for c in self.target):
            raise ValueError(f"entry target {self.target!r} must be one module or executable name without spaces")
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))

    @classmethod
    def module(cls, name: str, *args: str) -> Entry:
        """`python -m <name> <args>`."""
        return cls(name, tuple(args), is_module=True)

    @classmethod
    def executable(cls, name: str, *args: str) -> Entry:
        """`<name> <args>` (torchrun runs it with `--no-python`)."""
        return cls(name, tuple(args), is_module=False)

    @classmethod
    def train(cls, overrides: Sequence[str] = ()) -> Entry:
        """`nrc train <overrides>`: the GRPO trainer with Hydra-style `key=value` overrides."""
        return cls.executable("nrc", "train", *overrides)

    def torchrun_tail(self) -> list[str]:
        """The part of a torchrun command line after its own options."""
        head = ["-m", self.target] if self.is_module else ["--no-python", self.target]
        return [*head, *self.args]


def torchrun_command(
    settings: LauncherConfig,
    entry: Entry,
    *,
    rdzv_endpoint: str = "$MASTER_ADDR:$MASTER_PORT",
    rdzv_id: str = "$SLURM_JOB_ID",
    node_rank: str | None = None,
) -> list[str]:
    """The torchrun argv that starts `settings.nproc_per_node` ranks of `entry` on one node.

    Single node: a standalone rendezvous on a free local port. Several nodes: the c10d rendezvous
    at `rdzv_endpoint` (shell variables are left for the node's shell to expand: run the same
    command on every node, e.g. under `srun`), with `rdzv_id` naming the job.
    """
    cmd = ["torchrun", "--nproc-per-node", str(settings.nproc_per_node)]
    if settings.nodes == 1:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        cmd += ["--nnodes", str(settings.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
        if node_rank is not None:
            cmd += ["--node-rank", node_rank]
    return cmd + entry.torchrun_tail()


def shell_join(argv: Sequence[str]) -> str:
    """Quote argv for a shell, leaving `$VAR` references to be expanded by that shell."""
    return " ".join(a if _is_var_ref(a) else shlex.quote(a) for a in argv)


def _is_var_ref(arg: str) -> bool:
    """True for `$NAME` or `$NAME:$OTHER` style arguments (only variable references and colons)."""
    return all(part.startswith("$") and part[1:].replace("_", "").isalnum() for part in arg.split(":"))
