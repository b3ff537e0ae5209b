"""Generate docs/configuration.md from the schema and conf/.

    python -m nemo_rollout_correction.config.docgen           # rewrite docs/configuration.md
    python -m nemo_rollout_correction.config.docgen --check   # exit 1 if it is stale

Keys, types, defaults and help come from schema.py (the `help` metadata of each field; for the
`rollout_correction` section, the attribute docstrings of core's RolloutCorrectionConfig), the
group options from the YAML files in conf/.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

from nemo_rollout_correction.config.convert import field_type, type_name
from nemo_rollout_correction.config.loader import available_groups, default_conf_dir, defaults_dict
from nemo_rollout_correction.config.schema import TrainConfig
from nemo_rollout_correction.core.objective_params import ObjectiveParams

__all__ = ["DOC_PATH", "main", "render"]

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_OVERRIDES = """\
## Overrides

`nrc train`, `nrc audit`, `nrc launch` and `nrc config show` take Hydra overrides after the
subcommand. Later overrides win; group selections apply before single keys.

| syntax | example | meaning |
|---|---|---|
| `key=value` | `policy.lr=3e-6` | set one key (it must exist; a typo is an error that suggests the closest key) |
| `group=option` | `rollout_correction=decoupled_geo_rs` | take a section from `conf/<group>/<option>.yaml` |
| `group=option key=value` | `rollout_correction=geo_rs rollout_correction.rollout_is=token` | preset + one field |
| `key=null` | `rollout_correction.rollout_token_veto_threshold=null` | unset an optional key |
| `key='text'` | `run.name='true'` | quote a value that would otherwise read as a bool/number/null |
| `key=[a,b]` | `launcher.container_mounts=[/data:/data,/ckpt:/ckpt]` | a list |
| `key=${other}` | `run.output_dir=/scratch/${run.name}` | interpolate another key |
| `+group=option` | `+rollout_correction=geo_rs` | a group a custom `config.yaml` leaves out of its defaults |

Examples:

```bash
nrc config show model=tiny_llama task=length_target        # print the resolved config
nrc train model=tiny_llama rollout_correction=decoupled_geo_rs policy.lr=3e-6 run.name=geo
nrc train parallelism=tp2_dp2 task.prompts_per_step=16      # 4 processes: TP=2 x DP=2
nrc train task=dataset task.dataset_path=data/prompts.jsonl task.reward_fn=my_pkg.rewards:exact_match
nrc launch launcher=slurm launcher.partition=batch launcher.nodes=2 launcher.container_image=<image>
```

A user config directory (`--config-dir DIR`) is searched before `conf/`: its group files add options
or replace `conf/`'s, and its `config.yaml`, if any, replaces the root (list `nrc_defaults` first
in its defaults list: that entry holds every key at its schema default).

Rules checked across keys (each error names the key, the value and what is allowed):
`rollout.num_samples_per_prompt >= 2` (GRPO groups); the world size `launcher.nodes x
launcher.nproc_per_node` must be a multiple of `policy.tensor_parallel_size x
pipeline_parallel_size x context_parallel_size`, and `task.prompts_per_step x
rollout.num_samples_per_prompt` a multiple of `policy.micro_batch_size x` the data-parallel size;
`task.name=dataset` needs `task.dataset_path`; `rollout.max_new_tokens < rollout.max_model_len`;
the `rollout_correction` section is validated by `RolloutCorrectionConfig` (docs/presets.md).
"""


def _table_order(cls: type) -> list[dataclasses.Field[Any]]:
    """The section's fields in declaration order, except that the shared objective parameters (inherited, so
    dataclasses lists them first) follow the section's own fields, next to `loss_type` that selects them."""
    shared = {f.name for f in dataclasses.fields(ObjectiveParams)}
    fields = list(dataclasses.fields(cls))
    return [f for f in fields if f.name not in shared] + [f for f in fields if f.name in shared]


def _attribute_docs(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal under each annotated attribute of `cls`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


def _root_defaults() -> dict[str, str]:
    root = yaml.safe_load((default_conf_dir() / "config.yaml").read_text())
    out: dict[str, str] = {}
    for entry in root.get("defaults", []):
        if isinstance(entry, dict):
            out.update({str(k): str(v) for k, v in entry.items()})
    return out


def render() -> str:
    """The full text of docs/configuration.md."""
    defaults = defaults_dict()
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m nemo_rollout_correction.config.docgen` from "
        "nemo_rollout_correction/config/schema.py and conf/; do not edit. -->",
        "",
        "The configuration of `nrc train`, `nrc audit` and `nrc launch` is one typed tree "
        "(`nemo_rollout_correction.config.TrainConfig`), composed by Hydra from `conf/` and checked strictly: "
        "an unknown key, a wrong type or a value outside what is allowed is an error naming the dotted key. "
        "Load it in Python with `nemo_rollout_correction.config.load_config([\"key=value\", ...])`.",
        "",
        _OVERRIDES,
        "## Groups",
        "",
        "| group | default | options |",
        "|---|---|---|",
    ]
    chosen = _root_defaults()
    for group, options in available_groups().items():
        lines.append(f"| `{group}` | `{chosen.get(group, '-')}` | {', '.join(f'`{o}`' for o in options)} |")
    lines += ["", "`rollout_correction` options are the presets of docs/presets.md (generated by ci/gen_presets.py); "
              "`parallelism` options set `policy.*_parallel_size` and `launcher.nproc_per_node` together.", ""]
    lines += ["## Keys", ""]
    for section in dataclasses.fields(TrainConfig):
        cls = field_type(TrainConfig, section.name)
        lines += [f"### `{section.name}`", "", section.metadata["help"], ""]
        doc = inspect.getdoc(cls) or ""
        first = doc.split("\n\n")[0].replace("\n", " ")
        if first and section.name != "rollout_correction":
            lines += [first, ""]
        attr_docs: dict[str, str] = {}
        if section.name == "rollout_correction":  # core's class and the section's subclass (`alert`)
            for base in reversed([c for c in cls.__mro__ if hasattr(c, "__dataclass_fields__")]):
                attr_docs.update(_attribute_docs(base))
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in _table_order(cls):
            if not f.init:
                continue
            help_text = f.metadata.get("help") or attr_docs.get(f.name, "")
            tp = field_type(cls, f.name)
            value = defaults[section.name][f.name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a sub-section (`alert`): a row per key
                for sub in dataclasses.fields(tp):
                    cells = [f"`{section.name}.{f.name}.{sub.name}`", f"`{_cell(type_name(field_type(tp, sub.name)))}`",
                             _cell(_default(value[sub.name])), _cell(sub.metadata.get("help", ""))]
                    lines.append(f"| {' | '.join(cells)} |")
                continue
            cells = [f"`{section.name}.{f.name}`", f"`{_cell(type_name(tp))}`", _cell(_default(value)),
                     _cell(help_text)]
            lines.append(f"| {' | '.join(cells)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/configuration.md, or with --check report whether it is current (exit 1 if stale)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.is_file() else ""
        if current != text:
            print(f"{DOC_PATH} is stale; run: python -m nemo_rollout_correction.config.docgen", file=sys.stderr)
            return 1
        print(f"{DOC_PATH} is current")
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
