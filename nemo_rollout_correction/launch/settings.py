"""The `launcher:` configuration section and the `launcher.<field>=<value>` overrides that set it.

`nrc train`'s config (`config.schema.LauncherConfig`, Hydra group `conf/launcher/`) is the source of
truth when the config layer is installed: `settings_for(overrides)` composes it, so `launcher=slurm`
and the `parallelism=...` groups (which set `launcher.nproc_per_node`) work as in `nrc train`. Without
Hydra the `launcher.<field>=<value>` overrides are parsed here directly.

Fields (plan/CONFIG_SPEC.md, issue 6):

| field | default | meaning |
|---|---|---|
| `name` | `local` | `local` (LocalExecutor: torchrun here) or `slurm` (SlurmExecutor: sbatch, srun, pyxis) |
| `nodes` | 1 | nodes of the job (local: must be 1) |
| `nproc_per_node` | 1 | torchrun processes per node (GPUs per node on a GPU cluster) |
| `container_image` | null | Slurm: the image pyxis/enroot starts on every node (`--container-image`) |
| `partition` | null | Slurm partition |
| `account` | null | Slurm account; null uses the user's default |
| `time` | `01:00:00` | Slurm time limit, `[D-]HH:MM:SS` |
| `container_mounts` | `[]` | Slurm: `src:dst[:flags]` bind mounts (`--container-mounts`) |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from nemo_rollout_correction.config.schema import SLURM_TIME, LauncherName, is_container_mount

LAUNCHER_NAMES: tuple[str, ...] = get_args(LauncherName)
PREFIX = "launcher."


@dataclass(frozen=True)
class LauncherSettings:
    """Where and how many processes `nrc train` runs with (the `launcher:` section)."""

    name: LauncherName = field(default="local", metadata={"help": "local (torchrun here) or slurm (sbatch + pyxis)"})
    nodes: int = field(default=1, metadata={"help": "number of nodes (local: 1)"})
    nproc_per_node: int = field(default=1, metadata={"help": "torchrun processes per node (GPUs per node)"})
    container_image: str | None = field(default=None, metadata={"help": "Slurm: container image for pyxis"})
    partition: str | None = field(default=None, metadata={"help": "Slurm partition"})
    account: str | None = field(default=None, metadata={"help": "Slurm account; null = the user's default"})
    time: str = field(default="01:00:00", metadata={"help": "Slurm time limit [D-]HH:MM:SS"})
    container_mounts: tuple[str, ...] = field(default=(), metadata={"help": "Slurm: src:dst[:flags] mounts"})

    def __post_init__(self) -> None:
        if self.name not in LAUNCHER_NAMES:
            raise ValueError(f"launcher.name={self.name!r} is not allowed; choose one of {list(LAUNCHER_NAMES)}")
        for key in ("nodes", "nproc_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"launcher.{key}={value!r} must be an integer >= 1")
        if self.name == "local" and self.nodes != 1:
            raise ValueError(f"launcher.nodes={self.nodes} needs launcher.name=slurm; the local executor runs on "
                             "one node (use launcher.nproc_per_node for more processes)")
        if not SLURM_TIME.match(self.time):  # the same rules as nrc train's config (config/schema.py)
            raise ValueError(f"launcher.time={self.time!r} must look like HH:MM:SS or D-HH:MM:SS "
                             "(or another Slurm --time format: M, M:S, D-H, D-H:M)")
        object.__setattr__(self, "container_mounts", tuple(self.container_mounts))
        for mount in self.container_mounts:
            if not is_container_mount(mount):
                raise ValueError(f"launcher.container_mounts entry {mount!r} must be src:dst or src:dst:flags")

    @property
    def world_size(self) -> int:
        """Total processes: nodes x nproc_per_node."""
        return self.nodes * self.nproc_per_node

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> LauncherSettings:
        """Build from the `launcher:` section of a composed config (a dict or an OmegaConf DictConfig)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown launcher key(s) {unknown}; allowed: {sorted(known)}")
        values = dict(section)
        if values.get("container_mounts") is not None:
            values["container_mounts"] = tuple(values["container_mounts"])
        elif "container_mounts" in values:
            values["container_mounts"] = ()
        return cls(**values)


def _parse_value(key: str, raw: str, kind: str) -> Any:
    """Parse one override value for the field `key` whose annotation is `kind`."""
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"launcher.{key}={raw!r} must be an integer") from None
    if "tuple" in kind:
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return tuple(item.strip().strip("'\"") for item in text.split(",") if item.strip())
    if "None" in kind and raw.strip().lower() in ("null", "none", "~"):
        return None
    return raw


def split_overrides(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """Separate `launcher.<field>=<value>` overrides from the ones meant for `nrc train`.

    Returns (launcher field values, the remaining overrides in order). Lists use Hydra's syntax:
    `launcher.container_mounts=[/data:/data,/ckpt:/ckpt]`.
    """
    kinds = {f.name: str(f.type) for f in dataclasses.fields(LauncherSettings)}
    picked: dict[str, Any] = {}
    rest: list[str] = []
    for item in overrides:
        if not item.startswith(PREFIX):
            rest.append(item)
            continue
        key, sep, raw = item[len(PREFIX):].partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must be launcher.<field>=<value>")
        if key not in kinds:
            raise ValueError(f"unknown launcher key {key!r} in {item!r}; allowed: {sorted(kinds)}")
        picked[key] = _parse_value(key, raw, kinds[key])
    return picked, rest


def settings_from_overrides(overrides: Sequence[str], base: LauncherSettings | None = None
                            ) -> tuple[LauncherSettings, list[str]]:
    """Apply the `launcher.*` overrides to `base` (default: the defaults); return it and the other overrides."""
    picked, rest = split_overrides(overrides)
    return dataclasses.replace(base or LauncherSettings(), **picked), rest


def settings_for(overrides: Sequence[str]) -> LauncherSettings:
    """The launcher settings of `nrc train <overrides>`: the composed config's `launcher:` section.

    Composes the whole `nrc train` config (so a bad train override fails here, before a job is
    submitted) when the config layer (Hydra) is installed; otherwise parses `launcher.*` overrides.
    Raises ValueError (the config layer's ConfigError) naming the bad key.
    """
    try:
        from nemo_rollout_correction.config.loader import load_config
    except ImportError:  # the `config` extra (hydra-core) is not installed
        return settings_from_overrides(overrides)[0]
    cfg = load_config(list(overrides))
    return LauncherSettings.from_mapping(dataclasses.asdict(cfg.launcher))


def is_launcher_override(item: str) -> bool:
    """`launcher.<field>=...`, `launcher=<option>` (the Hydra group) or a `parallelism=<option>` choice."""
    return item.startswith((PREFIX, "launcher=", "parallelism=", "+launcher", "~launcher"))
