"""The in-graph Hungarian matcher (seg_train/objectives/matching.py) held to scipy.optimize.linear_sum_assignment.

Wrong answers this catches: a non-optimal assignment (a wrong potential update, the Dijkstra taking a row that
is not the nearest, the augmenting path not walked back to its column), padded columns taking queries from
the real masks, rows matched twice, and a result that changes when traced with a dynamic number of masks or
run on each tower of a MirroredStrategy."""

import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import linear_sum_assignment as scipy_lsa

from seg_train.objectives.matching import batched_linear_sum_assignment, linear_sum_assignment

SHAPES = [(1, 1), (3, 1), (7, 7), (12, 5), (30, 30), (64, 17), (100, 100), (100, 60), (200, 150), (150, 150)]


def costs(kind, q, g, seed):
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.random((q, g)).astype(np.float32)
    if kind == "integer":  # few distinct values: many optimal assignments
        return rng.integers(0, 8, (q, g)).astype(np.float32)
    return (10.0 ** rng.uniform(-4, 6, (q, g))).astype(np.float32)  # ten decades


def check_assignment(cost, row_of_col, col_of_row, valid=None):
    """A valid matching of the valid columns; returns its total cost in float64."""
    q, g = cost.shape
    valid = np.ones(g, bool) if valid is None else np.asarray(valid)
    assert row_of_col.shape == (g,) and col_of_row.shape == (q,)
    assert np.all(row_of_col[~valid] == -1)
    rows = row_of_col[valid]
    assert np.all((rows >= 0) & (rows < q)) and len(set(rows.tolist())) == len(rows)
    for j in np.flatnonzero(valid):
        assert col_of_row[row_of_col[j]] == j
    assert np.sum(col_of_row >= 0) == valid.sum()
    return cost.astype(np.float64)[rows, np.flatnonzero(valid)].sum()


def scipy_total(cost):
    rows, cols = scipy_lsa(cost.astype(np.float64))
    return cost.astype(np.float64)[rows, cols].sum()


@pytest.mark.parametrize("q,g", SHAPES)
def test_unique_optimum_is_scipys_assignment(q, g):
    cost = costs("uniform", q, g, seed=q * 1000 + g)
    row_of_col, col_of_row = (t.numpy() for t in linear_sum_assignment(cost))
    check_assignment(cost, row_of_col, col_of_row)
    rows, cols = scipy_lsa(cost.astype(np.float64))
    np.testing.assert_array_equal(row_of_col[cols], rows)


@pytest.mark.parametrize("kind", ["integer", "range"])
@pytest.mark.parametrize("q,g", SHAPES[2:])
def test_ties_and_dynamic_range_reach_scipys_total(kind, q, g):
    cost = costs(kind, q, g, seed=q * 1000 + g + 7)
    if kind == "integer" and q > g:
        cost[: q - g] += 8  # the extra rows dearer, so ties are not all at zero
    total = check_assignment(cost, *(t.numpy() for t in linear_sum_assignment(cost)))
    assert total == pytest.approx(scipy_total(cost), rel=1e-12, abs=0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_long_augmenting_paths(sign):
    # cost i * j: every new column displaces the matched ones, each search walks through all of them
    cost = sign * np.outer(np.arange(60), np.arange(40)).astype(np.float32) / 7
    total = check_assignment(cost, *(t.numpy() for t in linear_sum_assignment(cost)))
    assert total == pytest.approx(scipy_total(cost), rel=1e-12, abs=0)


def test_all_equal_costs_any_permutation():
    cost = np.full((40, 25), 3.0, np.float32)
    assert check_assignment(cost, *(t.numpy() for t in linear_sum_assignment(cost))) == 75.0


def test_no_valid_column_matches_nothing():
    cost = costs("uniform", 10, 4, seed=1)
    row_of_col, col_of_row = linear_sum_assignment(cost, np.zeros(4, bool))
    np.testing.assert_array_equal(row_of_col, [-1] * 4)
    np.testing.assert_array_equal(col_of_row, [-1] * 10)
    row_of_col, col_of_row = linear_sum_assignment(np.zeros((5, 0), np.float32))
    assert row_of_col.shape == (0,) and np.all(col_of_row.numpy() == -1)


def test_padded_columns_ignored():
    rng = np.random.default_rng(3)
    cost = costs("uniform", 60, 40, seed=2)
    valid = rng.random(40) < 0.5
    cost[:, ~valid] = -100.0 * rng.random((60, (~valid).sum()))  # cheaper than any real mask
    cost[0, np.flatnonzero(~valid)[0]] = np.nan  # never read
    row_of_col, col_of_row = (t.numpy() for t in linear_sum_assignment(cost, valid))
    check_assignment(cost, row_of_col, col_of_row, valid)
    rows, cols = scipy_lsa(cost[:, valid].astype(np.float64))
    np.testing.assert_array_equal(row_of_col[np.flatnonzero(valid)][cols], rows)


def test_more_columns_than_rows_refused():
    with pytest.raises(ValueError, match="more masks"):
        linear_sum_assignment(np.zeros((3, 4), np.float32))
    dynamic = tf.function(linear_sum_assignment, input_signature=[tf.TensorSpec([None, None], tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="more masks"):
        dynamic(tf.zeros([3, 4]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_cost_refused(bad):
    cost = costs("uniform", 6, 4, seed=4)
    cost[2, 1] = bad
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        linear_sum_assignment(cost)


def batch(seed, b=4, q=50, g=30):
    rng = np.random.default_rng(seed)
    cost = rng.random((b, q, g)).astype(np.float32)
    num_valid = np.array([g, 0, 1, 17][:b], np.int32)
    return cost, num_valid


def check_batch(cost, num_valid, row_of_col, col_of_row):
    for b, n in enumerate(num_valid):
        valid = np.arange(cost.shape[2]) < n
        check_assignment(cost[b], row_of_col[b], col_of_row[b], valid)
        rows, cols = scipy_lsa(cost[b, :, :n].astype(np.float64))
        np.testing.assert_array_equal(row_of_col[b, :n][cols], rows)


def test_batched_traced_with_dynamic_valid_counts():
    cost, num_valid = batch(5)
    traced = tf.function(batched_linear_sum_assignment,
                         input_signature=[tf.TensorSpec([None, 50, 30], tf.float32), tf.TensorSpec([None], tf.int32)])
    row_of_col, col_of_row = traced(cost, num_valid)
    assert row_of_col.shape == (4, 30) and col_of_row.shape == (4, 50)
    check_batch(cost, num_valid, row_of_col.numpy(), col_of_row.numpy())
    row_of_col, col_of_row = traced(cost[::-1].copy(), num_valid[::-1].copy())  # the same trace, other counts
    check_batch(cost[::-1], num_valid[::-1], row_of_col.numpy(), col_of_row.numpy())


def test_inside_mirrored_strategy_run():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    cost, num_valid = batch(6)
    per_replica_cost, per_replica_valid = tf.constant(cost.reshape(2, 2, 50, 30)), tf.constant(num_valid.reshape(2, 2))

    @tf.function
    def step():
        def tower():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            return batched_linear_sum_assignment(per_replica_cost[r], per_replica_valid[r])

        out = strategy.run(tower)
        return [strategy.experimental_local_results(t) for t in out]

    row_of_col, col_of_row = step()
    check_batch(cost, num_valid, np.concatenate(row_of_col), np.concatenate(col_of_row))
