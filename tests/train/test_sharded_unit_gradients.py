"""``combine_questions=unit_norm`` sharded (``--shard fsdp``): the ranks take the step's
questions in turn (one rank's loss, the others' zero passes), so each pass leaves every rank
its shards of one question's gradient, whose norm is the all-reduced norm of the shards. Two
sharded ranks match one process as two data-parallel ranks do (test_distributed): the same
ledger and rollouts, weights within lr / 10 (the unit scales' last bits differ with the norm's
order of summation, and AdamW's first steps carry that into the elements where two questions'
gradients nearly cancel); and a checkpoint resumes on one process."""

from __future__ import annotations

from rlvr_fast.cli.main import main

from tests.train.test_distributed import cli, read_jsonl
from tests.train.test_sharding import RUN, assert_same_run

UNIT_NORM = ["combine_questions=unit_norm" if a == "combine_questions=pooled" else a for a in RUN]
LR = 1e-4  # RUN's


def test_two_sharded_ranks_take_unit_gradients_as_one_process_and_resume_on_it(tmp_path):
    assert "lr=1e-4" in RUN and "combine_questions=pooled" in RUN
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    assert main(["train", *UNIT_NORM, "--steps", "3", "--out", str(one)]) == 0
    for out, steps in ((two, 3), (resumed, 2)):
        done = cli("train", "--nproc", "2", "--shard", "fsdp", *UNIT_NORM, "--steps", str(steps),
                   "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
    active = [[q["active"] for q in line["questions"]] for line in read_jsonl(one / "ledger.jsonl")]
    assert any(active[1][:2]) and any(active[1][2:]), "both ranks' questions in one step"
    norms = [q["grad_norm"] for q in read_jsonl(two / "ledger.jsonl")[1]["questions"]]
    assert sum(n is not None for n in norms) == 2, "each contributing question's own norm"
    assert_same_run(one, two, weights_atol=LR / 10)
    assert main(["train", *UNIT_NORM, "--steps", "3", "--out", str(resumed), "--resume"]) == 0
    assert_same_run(one, resumed, weights_atol=LR / 10)
