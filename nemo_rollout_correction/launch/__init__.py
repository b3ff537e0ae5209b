"""Launching `nrc train` on many processes: torchrun, Slurm (pyxis containers) and NeMo-Run.

- `settings`: the `launcher:` config section (`config.schema.LauncherConfig`, re-exported) from the composed
  config or from `launcher.*` overrides;
- `entry`: what each rank runs (`Entry`, default `nrc train <overrides>`) and the plain torchrun command;
- `recipe`: the NeMo-Run recipe (LocalExecutor / SlurmExecutor with the torchrun launcher);
- `main`: the command line (`main(argv) -> int`, also `python -m nemo_rollout_correction.launch`);
- `smoke`: a small multi-process job (real collectives and a distributed correction step) to test a launch.

This package sits at the top layer, next to `cli`; nemo-run is imported lazily by `recipe` only.
"""

from nemo_rollout_correction.config.schema import LauncherConfig
from nemo_rollout_correction.launch.entry import Entry, torchrun_command
from nemo_rollout_correction.launch.main import main
from nemo_rollout_correction.launch.settings import settings_from_overrides

__all__ = ["Entry", "LauncherConfig", "main", "settings_from_overrides", "torchrun_command"]
