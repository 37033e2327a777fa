"""``records.holdout_comparison``: tuned vs auto on held-out prompts, one round or the median of
alternated rounds (``tune.holdout_rounds``)."""

from specfw.bench.records import BenchRecord, holdout_comparison


def _rec(label, algo, tok_s):
    return BenchRecord(label, algo, {}, "in-process", "mtbench", [40, 4], 8, phase="holdout", tok_s=tok_s)


def test_one_round_compares_the_two_runs():
    line = holdout_comparison([_rec("plain", "none", 50.0), _rec("eagle3 auto", "eagle3", 80.0), _rec("eagle3 tuned topk=1", "eagle3", 88.0)])
    assert "tuned 88.00 tok/s vs auto 80.00 = 1.100x;" in line and "median" not in line and "[topk=1]" in line


def test_alternated_rounds_give_the_median_of_each_rounds_ratio():
    # the machine slows down between rounds: each round's ratio is what counts, not the pooled runs
    recs = [_rec("plain", "none", 50.0)]
    for auto, tuned in ((100.0, 103.0), (80.0, 82.0), (60.0, 63.0)):
        recs += [_rec("eagle3 auto", "eagle3", auto), _rec("eagle3 tuned topk=1", "eagle3", tuned)]
    line = holdout_comparison(recs)
    assert "= 1.030x (median of 3 alternated rounds: 1.030, 1.025, 1.050)" in line
    assert "tuned 82.00 tok/s vs auto 80.00" in line
