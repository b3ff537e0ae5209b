"""The documentation site builds with `mkdocs build --strict`: no broken internal link or anchor.

mkdocs.yml turns broken links, missing anchors and pages missing from the nav into warnings and
`strict` makes warnings errors. Pages listed in the nav that are still being written
(`PAGES_IN_PROGRESS`) are left out of the built nav while they are missing; any other missing nav
page fails the test, so a typo in mkdocs.yml cannot hide.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from default_lane import require_tool

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Nav pages other work is still writing; drop an entry here once its page exists.
PAGES_IN_PROGRESS = {"training.md"}


def _mkdocs() -> list[str]:
    return [require_tool("mkdocs")]


def _nav_pages(nav: Any) -> list[str]:
    """Every page path in a mkdocs nav (nested lists of {title: page-or-list})."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def _existing_nav(nav: Any) -> Any:
    """The nav without pages that do not exist (and without sections left empty)."""
    if isinstance(nav, str):
        return nav if (DOCS / nav).is_file() else None
    if isinstance(nav, list):
        kept = [x for x in (_existing_nav(item) for item in nav) if x]
        return kept or None
    if isinstance(nav, dict):
        kept = {k: v for k, v in ((k, _existing_nav(v)) for k, v in nav.items()) if v}
        return kept or None
    return nav


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists_or_is_in_progress() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    missing = {p for p in pages if not (DOCS / p).is_file()}
    assert missing <= PAGES_IN_PROGRESS, f"nav pages without a file: {sorted(missing - PAGES_IN_PROGRESS)}"
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk <= set(pages), f"pages missing from mkdocs.yml's nav: {sorted(on_disk - set(pages))}"
    assert len(pages) == len(set(pages)), "a page is listed twice in the nav"


def test_mkdocs_build_strict_has_no_broken_links_or_anchors(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["nav"] = _existing_nav(config["nav"])
    config["docs_dir"] = str(DOCS)
    config["site_dir"] = str(tmp_path / "site")
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = subprocess.run([*_mkdocs(), "build", "--strict", "--config-file", str(cfg)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("*.html")}
    for page in _nav_pages(config["nav"]):
        assert page.removesuffix(".md") + ".html" in built, page


def test_strict_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The validation settings really catch a broken link and a broken anchor (the check can fail)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[ok](other.md#real-heading) [bad](nowhere.md) "
                                   "[bad anchor](other.md#nope)\n")
    (docs / "other.md").write_text("# Other\n\n## Real heading\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), site_dir=str(tmp_path / "site"), nav=["index.md", "other.md"])
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = subprocess.run([*_mkdocs(), "build", "--strict", "--config-file", str(cfg)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "nowhere.md" in proc.stderr and "#nope" in proc.stderr
    assert "#real-heading" not in proc.stderr


def _emitted_metric_keys() -> set[str]:
    """Every `rollout_corr/*` key the core emits over all presets plus mask, batch-norm and RS variants."""
    import torch

    from nemo_rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 16, generator=gen) * 3
    rollout = old + torch.randn(4, 16, generator=gen) * 0.05
    mask = torch.ones(4, 16, dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])  # OPSM and DPPO-TV read them; other configs ignore them
    configs = [RolloutCorrectionConfig.from_preset(n) for n in RolloutCorrectionConfig.preset_names()]
    configs.append(RolloutCorrectionConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_batch_normalize=True,
                                           rollout_rs="token_k1,seq_mean_k1,seq_sum_k1,seq_mean_k3",
                                           rollout_rs_threshold="0.5_2.0,0.5_2.0,0.5_2.0,0.01"))
    keys: set[str] = set()
    for cfg in configs:
        keys |= set(compute_rollout_correction(old, rollout, mask, cfg, advantages=advantages).metrics)
    return keys


def test_metric_names_in_the_guides_are_real_metric_keys() -> None:
    """Troubleshooting, quickstart and migration name metrics exactly as the code emits them."""
    import re

    emitted = _emitted_metric_keys()
    for page in ("troubleshooting.md", "quickstart.md", "migration.md"):
        names = set(re.findall(r"rollout_corr/[a-z0-9_]+(?![a-z0-9_<*])", (DOCS / page).read_text()))
        names = {n for n in names if not n.endswith("_")}  # prefixes such as rollout_corr/rollout_rs_<c>_...
        assert names, page
        unknown = sorted(names - emitted)
        assert not unknown, f"{page} names metrics the code does not emit: {unknown}"
