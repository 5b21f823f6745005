"""Step metrics by name (megatron/training/step_metrics.py) over 3 gloo ranks: each name's
reduced value is the SUM or MAX computed here by hand from every rank's values, whatever order
the ranks list their names in, with several steps in one all-reduce; ranks that report
different names fail on every rank, not only on some."""

import torch

from tests.distributed.harness import run_workers


def rank_values(rank):
    """Step k of rank r: a scalar, a [2, 2] matrix and (with its own insertion order) a
    vector."""
    steps = []
    for k in range(2):
        row = {"b/matrix": torch.arange(4, dtype=torch.float64).reshape(2, 2) * (rank + 1) + k,
               "a/scalar": torch.tensor(10.0 * rank + k, dtype=torch.float64)}
        if rank % 2:
            row = dict(reversed(list(row.items())))
        row["c"] = torch.tensor([rank, -rank, k], dtype=torch.float64)
        steps.append(row)
    return steps


def _reduce(rank, world_size):
    from megatron.training import step_metrics

    sums, maxima = step_metrics.Reducer(step_metrics.SUM), step_metrics.Reducer(step_metrics.MAX)
    # twice: the second call of a layout skips the check
    return {"sum": sums(rank_values(rank)), "max": maxima(rank_values(rank)),
            "again": sums(rank_values(rank))}


def _differ(rank, world_size):
    from megatron.training import step_metrics

    row = {"loss": torch.tensor(1.0, dtype=torch.float64)}
    if rank == 1:  # a producer that reports on one rank only
        row["extra"] = torch.tensor(0.0, dtype=torch.float64)
    if rank == 2:  # the same size, another name
        row = {"lost": torch.tensor(1.0, dtype=torch.float64)}
    out = []
    for reduce in (step_metrics.SUM, step_metrics.MAX):
        try:
            step_metrics.Reducer(reduce)([row])
            out.append("passed")
        except step_metrics.MetricNamesDiffer as e:
            out.append(str(e))
    return out


def test_each_name_is_reduced_as_by_hand():
    world = 3
    got = run_workers(world, _reduce)
    every = [rank_values(r) for r in range(world)]
    for k in range(2):
        for name in ("a/scalar", "b/matrix", "c"):
            values = torch.stack([every[r][k][name] for r in range(world)])
            for result in got:
                assert result["sum"][k][name].shape == every[0][k][name].shape
                assert torch.equal(result["sum"][k][name], values.sum(0)), name
                assert torch.equal(result["again"][k][name], values.sum(0)), name
                assert torch.equal(result["max"][k][name], values.max(0).values), name


def test_ranks_with_other_names_fail_everywhere():
    got = run_workers(3, _differ)
    for per_rank in got:
        assert all("ranks reported different step metrics" in text for text in per_rank), got
