"""benchmarks/bench_mismatch.py's grid, summary and table logic on synthetic metrics (no run is started).

The runs themselves go through the real `nrc train` in tests/integration/test_bench_mismatch.py (slow).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    path = ROOT / "benchmarks" / "bench_mismatch.py"
    spec = importlib.util.spec_from_file_location("bench_mismatch_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_staleness_axis_is_a_grid_dimension_seed_major(bench: ModuleType) -> None:
    args, extra = bench.parse_args(["--dtypes", "bfloat16", "--corrections", "disabled,bypass_cispo",
                                    "--staleness", "0,4", "--seeds", "2", "--", "policy.lr=1e-4"])
    names = [cell.name for cell in bench.grid(args)]
    assert names == ["bfloat16-k0-disabled-s1", "bfloat16-k0-bypass_cispo-s1", "bfloat16-k4-disabled-s1",
                     "bfloat16-k4-bypass_cispo-s1", "bfloat16-k0-disabled-s2", "bfloat16-k0-bypass_cispo-s2",
                     "bfloat16-k4-disabled-s2", "bfloat16-k4-bypass_cispo-s2"]
    assert extra == ["policy.lr=1e-4"]


def test_without_the_axis_cells_keep_their_names(bench: ModuleType) -> None:
    args, _ = bench.parse_args(["--dtypes", "float32", "--corrections", "token_tis", "--seeds", "1"])
    assert [(c.name, c.staleness) for c in bench.grid(args)] == [("float32-token_tis-s1", None)]


@pytest.mark.parametrize("bad", ["1,x", "-1", "1.5"])
def test_a_bad_staleness_names_the_value(bench: ModuleType, bad: str) -> None:
    with pytest.raises(SystemExit, match=r"--staleness: .* is not an integer >= 0"):
        bench.staleness_values(bad)


def test_summary_and_table_carry_staleness_and_the_largest_grad_norm(bench: ModuleType) -> None:
    def run(rewards: list[float], grad_norms: list[float]) -> list[dict[str, float]]:
        return [{"reward/mean": r, "loss/grad_norm": g, "rollout_corr/k3_kl": 1e-3,
                 "rollout_corr/kept_token_fraction": 1.0} for r, g in zip(rewards, grad_norms, strict=True)]

    cell = bench.Cell
    results = {
        cell("bfloat16", "disabled", 1, 2): run([-1.0, -0.5, 0.0, 0.5], [1.0, 9.0, 1.0, 1.0]),
        cell("bfloat16", "disabled", 2, 2): run([-1.0, -1.0, -1.0, -1.0], [1.0, 1.0, 3.0, 1.0]),
        cell("bfloat16", "disabled", 1, 0): run([-1.0, -1.0, -1.0, -1.0], [2.0, 2.0, 2.0, 2.0]),
    }
    rows = bench.summarize(results, window=2)
    assert [(r["staleness"], r["seeds"], r["steps"]) for r in rows] == [(0, 1, 4), (2, 2, 4)]
    stale2 = rows[1]
    assert stale2["grad_norm_max"] == (6.0, pytest.approx(4.242640687, rel=1e-9))  # mean/std of the runs' 9 and 3
    assert stale2["reward_last"][0] == pytest.approx((0.25 - 1.0) / 2)
    text = bench.table(rows, window=2)
    header, rule, *lines = text.splitlines()
    assert "max_staleness" in header and "largest grad norm" in header
    assert header.count("|") == rule.count("|") == lines[0].count("|")
    assert lines[1].startswith("| bfloat16 | float32 | 2 | disabled | 2 x 4 |")
    assert "6.000 ± 4.243" in lines[1]


def test_splice_keeps_other_markers(bench: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("a\n<!-- bench_mismatch:begin -->\nprecision\n<!-- bench_mismatch:end -->\nb\n")
    bench.splice(page, "staleness table\n", "bench_staleness")
    bench.splice(page, "new precision\n")
    text = page.read_text()
    assert "new precision" in text and "\nprecision\n" not in text
    assert text.endswith("<!-- bench_staleness:begin -->\nstaleness table\n<!-- bench_staleness:end -->\n")


def test_limit_keeps_the_reference_precision_to_its_cells(bench: ModuleType) -> None:
    args, _ = bench.parse_args(["--dtypes", "int8,bfloat16", "--corrections", "disabled,token_tis,seq_is",
                                "--limit", "bfloat16=disabled,token_tis", "--seeds", "1"])
    assert [c.name for c in bench.grid(args)] == ["int8-disabled-s1", "int8-token_tis-s1", "int8-seq_is-s1",
                                                  "bfloat16-disabled-s1", "bfloat16-token_tis-s1"]
    args, _ = bench.parse_args(["--dtypes", "int8", "--limit", "float16=disabled"])
    with pytest.raises(SystemExit, match=r"--limit: 'float16=disabled' is not DTYPE=C1,C2"):
        bench.grid(args)


def test_held_out_reward_is_paired_with_the_same_seeds_uncorrected_run(bench: ModuleType) -> None:
    def run(evals: dict[int, float]) -> list[dict[str, float]]:
        steps: list[dict[str, float]] = [{"reward/mean": 0.0, "loss/grad_norm": 1.0, "rollout_corr/k3_kl": 0.05,
                                          "rollout_corr/kept_token_fraction": 1.0} for _ in range(6)]
        for step, value in evals.items():
            steps[step - 1]["eval/reward_mean"] = value
        return steps

    cell = bench.Cell
    results = {  # evaluations at steps 2, 4, 6; the held-out reward averages the last two
        cell("int8", "disabled", 1): run({2: -9.0, 4: -0.6, 6: -0.4}),   # 1: -0.5
        cell("int8", "disabled", 2): run({2: -9.0, 4: -0.2, 6: -0.2}),   # 2: -0.2
        cell("int8", "token_tis", 1): run({2: 9.0, 4: -0.3, 6: -0.1}),   # 1: -0.2, paired +0.3
        cell("int8", "token_tis", 2): run({2: 9.0, 4: -0.1, 6: -0.1}),   # 2: -0.1, paired +0.1
    }
    rows = {r["correction"]: r for r in bench.summarize(results, window=2, eval_window=2)}
    assert rows["disabled"]["held_out"][0] == pytest.approx(-0.35)
    assert rows["token_tis"]["held_out"][0] == pytest.approx(-0.15)
    assert rows["token_tis"]["held_out_vs_disabled"][0] == pytest.approx(0.2)
    assert rows["token_tis"]["held_out_vs_disabled"][1] == pytest.approx(0.1414, abs=1e-3)  # std of +0.3, +0.1
    text = bench.table(list(rows.values()), window=2, eval_window=2)
    assert "held-out reward, last 2 evals | held-out vs disabled, paired |" in text
    assert "| int8 | float32 | token_tis | 2 x 6 | 0.000 ± 0.000 | 0.000 ± 0.000 | -0.150 ± 0.071 | +0.200 ± 0.141 |" \
        in text.replace("bfloat16+int8", "int8")
