"""Minimum-cost assignment of predicted queries to ground-truth masks, in TensorFlow ops only, so it runs
inside a traced train step (tf.function, strategy.run) without a host round trip.

The shortest-augmenting-path Hungarian method with dual potentials (Crouse), as in
scipy.optimize.linear_sum_assignment: cost [Q, G], Q >= G, one Dijkstra search per column. Float64
inside, so the minimum is exact for float32 costs; non-finite costs in a valid column raise.
"""

import tensorflow as tf

_SPEC = (tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None], tf.bool))


def _check_shape(cost):
    """ValueError for a cost that is not [Q, G] with Q >= G, when the shape is known while tracing."""
    if cost.shape.rank != 2:
        raise ValueError(f"linear_sum_assignment: cost must be [queries, masks], got shape {cost.shape}")
    q, g = cost.shape
    if q is not None and g is not None and g > q:
        raise ValueError(f"linear_sum_assignment: cost of shape [{q}, {g}] has more masks (columns) than "
                         f"queries (rows); expected queries >= masks")


def linear_sum_assignment(cost, valid=None):
    """The minimum-total-cost assignment of the valid columns of `cost` [Q, G] to distinct rows.

    valid: bool [G] (None: every column); invalid columns are left unmatched and cost nothing.
    Returns (row_of_col int32 [G]: the row matched to each column, -1 for invalid columns;
             col_of_row int32 [Q]: the column matched to each row, -1 for unmatched rows).
    """
    cost = tf.convert_to_tensor(cost, tf.float32)
    _check_shape(cost)
    if valid is None:
        valid = tf.ones([tf.shape(cost)[1]], tf.bool)
    return _assign(cost, tf.convert_to_tensor(valid, tf.bool))


def batched_linear_sum_assignment(cost, num_valid):
    """linear_sum_assignment for every image: cost [B, Q, G], num_valid int [B] (the first num_valid[b]
    columns of image b are its masks, the rest padding). Returns row_of_col [B, G], col_of_row [B, Q]."""
    cost = tf.convert_to_tensor(cost, tf.float32)
    if cost.shape.rank != 3:
        raise ValueError(f"batched_linear_sum_assignment: cost must be [batch, queries, masks], got {cost.shape}")
    _check_shape(cost[0])
    g = tf.shape(cost)[2]
    valid = tf.range(g)[tf.newaxis, :] < tf.cast(num_valid, tf.int32)[:, tf.newaxis]
    return tf.map_fn(lambda args: _assign(args[0], args[1]), (cost, valid),
                     fn_output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32)))


@tf.function(input_signature=_SPEC, autograph=False)
def _assign(cost, valid):
    q, g = tf.shape(cost)[0], tf.shape(cost)[1]
    with tf.control_dependencies([tf.debugging.assert_greater_equal(
            q, g, message="linear_sum_assignment: more masks (columns) than queries (rows)")]):
        c = tf.cast(tf.where(valid[tf.newaxis, :], cost, 0.0), tf.float64)
    c = tf.debugging.check_numerics(c, "linear_sum_assignment: non-finite cost in a valid column")
    ct = tf.transpose(c)  # [G, Q]: one row per column to assign
    rows_q = tf.range(q)
    rows_g = tf.range(g)
    inf = tf.constant(float("inf"), tf.float64)

    def assign_column(k, u, v, row_of_col, col_of_row):
        # Dijkstra from column k over the rows on the reduced costs; stops at the first free row (the sink).
        def search_cond(i, min_val, sink, dist, path, seen_cols, seen_rows):
            return sink < 0

        def search_body(i, min_val, sink, dist, path, seen_cols, seen_rows):
            seen_cols = seen_cols | tf.equal(rows_g, i)
            reduced = min_val + ct[i] - u[i] - v
            closer = ~seen_rows & (reduced < dist)
            path = tf.where(closer, i, path)
            dist = tf.where(closer, reduced, dist)
            open_dist = tf.where(seen_rows, inf, dist)
            min_val = tf.reduce_min(open_dist)
            nearest = tf.equal(open_dist, min_val)
            # Prefer a free row among equally near ones, else ties walk through every matched row.
            nearest_free = nearest & (col_of_row < 0)
            nearest = tf.where(tf.reduce_any(nearest_free), nearest_free, nearest)
            j = tf.cast(tf.argmax(tf.cast(nearest, tf.int32)), tf.int32)
            seen_rows = seen_rows | tf.equal(rows_q, j)
            free = col_of_row[j] < 0
            return (tf.where(free, i, col_of_row[j]), min_val, tf.where(free, j, -1), dist, path,
                    seen_cols, seen_rows)

        _, min_val, sink, dist, path, seen_cols, seen_rows = tf.while_loop(
            search_cond, search_body,
            (k, tf.constant(0.0, tf.float64), tf.constant(-1), tf.fill([q], inf), tf.fill([q], -1),
             tf.zeros([g], tf.bool), tf.zeros([q], tf.bool)))

        # Potentials: keep the reduced costs non-negative and zero along the matched pairs.
        others = seen_cols & tf.not_equal(rows_g, k)
        dist_of_match = tf.gather(dist, tf.maximum(row_of_col, 0))
        u = u + tf.where(others, min_val - dist_of_match, 0.0) + tf.where(tf.equal(rows_g, k), min_val, 0.0)
        v = v - tf.where(seen_rows, min_val - dist, 0.0)

        # Augment: walk the path back from the sink to column k, flipping matched and unmatched pairs.
        def flip_cond(j, done, row_of_col, col_of_row):
            return ~done

        def flip_body(j, done, row_of_col, col_of_row):
            i = path[j]
            col_of_row = tf.where(tf.equal(rows_q, j), i, col_of_row)
            previous = row_of_col[i]
            row_of_col = tf.where(tf.equal(rows_g, i), j, row_of_col)
            done = tf.equal(i, k)
            return previous, done, row_of_col, col_of_row

        _, _, row_of_col, col_of_row = tf.while_loop(
            flip_cond, flip_body, (sink, tf.constant(False), row_of_col, col_of_row))
        return u, v, row_of_col, col_of_row

    def outer_body(k, u, v, row_of_col, col_of_row):
        u, v, row_of_col, col_of_row = tf.cond(
            valid[k], lambda: assign_column(k, u, v, row_of_col, col_of_row),
            lambda: (u, v, row_of_col, col_of_row))
        return k + 1, u, v, row_of_col, col_of_row

    _, _, _, row_of_col, col_of_row = tf.while_loop(
        lambda k, *_: k < g, outer_body,
        (tf.constant(0), tf.zeros([g], tf.float64), tf.zeros([q], tf.float64), tf.fill([g], -1), tf.fill([q], -1)))
    return row_of_col, col_of_row
