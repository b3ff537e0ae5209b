"""Command-line options that every config-composing command shares (`nrc train`, `nrc audit`, `nrc config show`,
`nrc launch`): defined once here, in the layer below both `launch` and `cli`. No Hydra import."""

from __future__ import annotations

import argparse

__all__ = ["add_config_dir_argument"]


def add_config_dir_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--config-dir DIR`: a user config directory searched before the shipped conf/ (docs/configuration.md)."""
    parser.add_argument("--config-dir", metavar="DIR", default=None,
                        help="a config directory searched before the shipped conf/: its config.yaml (if any) "
                             "replaces the root config, its group files add options or replace shipped ones")
