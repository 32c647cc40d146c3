"""examples/train_ddp_ft.py end to end: 4 workers under `kiln launch --on-failure
replace`, rank 2 SIGKILLed mid-run; the survivors shrink in place, a replacement joins
with the state, every rank ends with identical parameters, and the loss curve matches
the fault-free single-process run."""

from __future__ import annotations

import pytest

from examples.train_ddp_ft import main

pytestmark = pytest.mark.timeout(240)


def test_training_survives_kill_9_and_tracks_the_fault_free_run(tmp_path):
    report = main(["--steps", "24", "--kill-step", "8", "--out", str(tmp_path)])
    assert report["ranks_finished"] == 4 and report["identical_parameters"]
    assert report["final_world_size"] == 4 and report["epochs"] == 2  # shrink, then grow
    assert report["max_rel_loss_diff_vs_fault_free"] < 1e-4
    assert report["steps_lost"] == 1  # the step the kill interrupted, redone
    assert 0 <= report["detection_s"] < 2.0 and report["shrink_s"] < 2.0
    assert report["joiner_joined_at_step"] > 8
    assert report["loss_last"] < report["loss_first"] / 3
