"""The on-disk delivery journal (tracking/delivery.py): append, ack, pending, reject, compaction, crash leftovers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nemo_rollout_correction.tracking.delivery import Journal


def _metrics(step: int, **values: float) -> dict:
    return {"kind": "metrics", "run_id": "r", "step": step, "timestamp": 1000 + step, "metrics": values}


def test_append_assigns_increasing_seq_and_everything_is_pending(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    stamped = [journal.append(_metrics(s, loss=s / 10)) for s in range(3)]
    assert [r["seq"] for r in stamped] == [1, 2, 3]
    assert [r["step"] for r in journal.pending()] == [0, 1, 2]
    assert all(r["v"] == 1 for r in journal.pending())


def test_ack_is_a_prefix_and_survives_reopen(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for s in range(5):
        journal.append(_metrics(s, loss=1.0))
    journal.ack(3)
    journal.ack(2)  # stale acks never move the mark back
    journal.close()
    reopened = Journal(tmp_path)
    assert reopened.acked == 3
    assert [r["seq"] for r in reopened.pending()] == [4, 5]
    assert reopened.append(_metrics(9, loss=0.0))["seq"] == 6


def test_non_finite_metric_values_round_trip(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append(_metrics(0, nan=float("nan"), inf=float("inf")))
    (record,) = journal.pending()
    assert math.isnan(record["metrics"]["nan"]) and record["metrics"]["inf"] == math.inf


def test_torn_last_line_from_a_crash_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append(_metrics(0, loss=1.0))
    journal.close()
    with (tmp_path / "journal.jsonl").open("a") as f:
        f.write('{"v": 1, "seq": 2, "kind": "metr')  # process died mid-write
    reopened = Journal(tmp_path)
    assert [r["seq"] for r in reopened.pending()] == [1]


def test_reject_moves_the_record_aside_and_acks_it(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    bad = journal.append({"kind": "params", "run_id": "r", "params": {"lr": "2"}})
    journal.append(_metrics(0, loss=1.0))
    journal.reject(bad, "Changing param values is not allowed")
    assert [r["kind"] for r in journal.pending()] == ["metrics"]
    (line,) = (tmp_path / "rejected.jsonl").read_text().splitlines()
    assert json.loads(line)["rejected_reason"].startswith("Changing param")


def test_compact_only_when_everything_is_delivered_and_seq_keeps_growing(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for s in range(4):
        journal.append(_metrics(s, loss=1.0))
    spool = journal.spool_dir_for(5)
    spool.mkdir(parents=True)
    journal.append({"kind": "artifact", "run_id": "r", "local_path": str(spool / "f"), "artifact_path": None})
    journal.ack(4)
    assert not journal.compact()  # seq 5 is still pending
    assert journal.size_bytes() > 0
    journal.ack(5)
    assert journal.compact()
    assert journal.size_bytes() == 0 and journal.pending() == []
    assert not (tmp_path / "spool").exists()
    assert journal.append(_metrics(9, loss=0.0))["seq"] == 6
    journal.close()
    assert [r["seq"] for r in Journal(tmp_path).pending()] == [6]


def test_release_spool_deletes_only_artifact_copies(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    spool = journal.spool_dir_for(1)
    spool.mkdir(parents=True)
    (spool / "plot.png").write_bytes(b"x")
    record = journal.append({"kind": "artifact", "run_id": "r", "local_path": str(spool / "plot.png")})
    journal.release_spool(_metrics(0, a=1.0) | {"seq": 1})
    assert spool.exists()
    journal.release_spool(record)
    assert not spool.exists()


def test_a_closed_journal_ignores_late_acks_and_refuses_appends(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append(_metrics(0, loss=1.0))
    journal.close()
    journal.ack(1)  # a delivery that finished after the tracker gave up: re-sent by the next replay
    assert not journal.compact()
    with pytest.raises(RuntimeError, match="is closed"):
        journal.append(_metrics(1, loss=1.0))
    assert [r["seq"] for r in Journal(tmp_path).pending()] == [1]
