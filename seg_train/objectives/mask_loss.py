"""EoMT's training loss (Mask2Former's: Hungarian matching of queries to masks, then class and mask terms) in
TensorFlow ops, traceable inside the train step (no host round trip, no numpy at run time). Held to Hugging
Face transformers' EomtLoss / EomtHungarianMatcher (scripts/reference_eomt_loss.py, tests/test_eomt_loss.py).

Targets (`EomtLossOptions.task`):
  semantic   each image's label map gives one binary mask per class present, in ascending class order, in the
             first `num_valid` of G = num_classes slots (`semantic_targets`);
  panoptic   each image's segment labels (data/segments.py: class * 1000 + instance) give one mask per segment
             value present: one per thing instance (instance 1..998) and one per stuff class (instance 0), in
             ascending value order (`segment_targets`); a mask's class is its value // 1000;
  instance   the same, thing instances only: stuff pixels (instance 0) are every mask's background.
Dense masks are never built: a mask's value at a point is read from the label map directly (`_sample_labels`:
the label equal to the slot's value, a class or a segment value), which equals bilinear sampling of the binary
mask.

Per prediction layer (a list of (class_logits [b, Q, K+1], mask_logits [b, Q, h, w]), the final one last; each
layer matched on its own, as the reference's deep supervision does):
  matching   cost = class_weight * (-softmax prob of the target class) + mask_weight * sigmoid BCE
             + dice_weight * dice, the mask costs on one set of `num_points` uniform random points per image
             shared by every query and mask; no gradient; NaN / inf costs become float32 max (the reference's
             nan_to_num).
  class      softmax cross-entropy of every query, unmatched queries' target the no-object class K, weighted
             `no_object_weight` (the other classes 1).
  mask, dice on each matched (query, mask) pair's own points: int(num_points * oversample_ratio) uniform points,
             the int(num_points * importance_sample_ratio) most uncertain of them (smallest |logit| of the
             prediction), plus the rest of num_points uniform; BCE as its mean over the points, dice as
             1 - (2 sum(p t) + 1) / (sum p + sum t + 1), p the sigmoid, t the target.
Point sampling: bilinear, align_corners=False, zero padding (torch's grid_sample as the reference's
point_sample uses it): a point (x, y) in [0, 1]^2 reads pixel coordinates (x W - 0.5, y H - 0.5) of an H x W
grid; prediction logits and label maps are sampled at the same normalised points.

Ignored pixels: the reference has no mask there (every class's target is 0). Here a point LANDS ON an ignored
pixel when a label pixel with a positive bilinear weight in its footprint (the up to 4 pixels interpolated) is
ignored; such a point counts in neither the BCE (mean over the other points), the dice sums nor the matching
costs. With no ignored pixel the numbers are the reference's. Ignored: `ignore_label` (semantic); class
`ignore_label` (unlabelled) or instance 999 (a crowd region) for panoptic and instance targets. The EoMT
authors' data sets drop crowd segments from the targets, so their crowd pixels are every mask's background
(target 0) instead: the two differ only at points on crowd and unlabelled pixels.

Randomness is keyed: seeds int32 [b, 2], one per sample; each draw is stateless (Philox) from that sample's
seed folded with the layer index and the purpose (MATCHING, LOSS), so a sample's points do not depend on the
tower, its batch position or its neighbours. `random_points=False` samples no points at random: every pixel
centre of the prediction grid, for matching and for both mask terms (importance sampling off).

Returned (`eomt_loss_terms`): per layer, numerators and denominators, float32 [L] each:
  class_sum, class_weight   sum over queries of weight x CE, and the sum of the weights
  mask_sum, dice_sum        sums over the matched masks of the per-mask BCE and dice
  mask_count                the number of target masks
Sum each over towers (or batch halves), then `losses_from_terms`: loss_cross_entropy = class_sum /
class_weight, loss_mask = mask_sum / max(mask_count, 1), loss_dice = dice_sum / max(mask_count, 1), the
reference's loss_cross_entropy, loss_mask, loss_dice of layer l on one process for the whole batch (its
max(num_masks, 1) included); its total is the sum over layers of class_weight * loss_cross_entropy +
mask_weight * loss_mask + dice_weight * loss_dice. The denominators carry no gradient.

Slots are compacted: the matching and the loss points use only the first G' = max over the batch of
num_valid slots (at least 1), so a batch's cost grows with the classes (segments) its images hold, not with K
(ADE20K's images hold about ten of its 150 classes; COCO's up to about a hundred segments): b * G' *
(int(3.0 P) + P - int(0.75 P)) points per layer at the defaults (P = num_points). Segments beyond the
queries' count Q in an image (ascending values, so the highest values) are left out: the matcher needs
Q >= masks. A slot's points do not depend on G': each sample's draw is one Philox stream and slot g reads
its own stretch of it (stateless draws of a larger shape start with those of a smaller one), so a tower whose
images hold fewer classes draws the same points for its slots as the whole batch would, and 1 tower = N towers.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from seg_train.data.segments import CROWD, INSTANCE_BASE
from seg_train.models.stochastic import per_row
from seg_train.objectives.matching import batched_linear_sum_assignment

MATCHING, LOSS = 0, 1  # the purposes folded into a sample's seed
_FLOAT32_MAX = 3.4028234663852886e38
# The labels `_sample_table` reads in place of the padding around a label map and of an ignored pixel: no slot
# holds either value (slots hold classes and segment values, >= 0, or -1 in padding), labels are >= 0.
_OUTSIDE, _IGNORED = -INSTANCE_BASE, -2 * INSTANCE_BASE


@dataclasses.dataclass(frozen=True)
class EomtLossOptions:
    """The loss's parameters; the defaults are the reference's (EomtConfig)."""
    num_classes: int
    ignore_label: int = 255
    class_weight: float = 2.0        # matching cost and loss weight of the class term
    mask_weight: float = 5.0         # ... of the sigmoid BCE
    dice_weight: float = 5.0         # ... of the dice
    no_object_weight: float = 0.1    # the no-object class's weight in the cross-entropy (eos_coef)
    num_points: int = 12544
    oversample_ratio: float = 3.0
    importance_sample_ratio: float = 0.75
    random_points: bool = True       # False: every pixel centre of the prediction grid, no draw
    task: str = "semantic"           # the targets (module doc): semantic, panoptic or instance


def semantic_targets(labels, num_classes: int):
    """The classes present in each label map [b, H, W]: (classes int32 [b, G], num_valid int32 [b]), G =
    num_classes; the first num_valid[i] slots hold image i's present classes ascending (the reference's
    torch.unique order), the rest the absent classes (padding). Labels outside [0, num_classes) (the
    ignore label among them) belong to no class."""
    labels = tf.cast(labels, tf.int32)
    flat = tf.reshape(labels, [tf.shape(labels)[0], -1])
    flat = tf.where((flat >= 0) & (flat < num_classes), flat, num_classes)
    counts = tf.math.bincount(flat, minlength=num_classes + 1, maxlength=num_classes + 1, axis=-1)
    present = counts[:, :num_classes] > 0
    k = tf.range(num_classes)
    classes = tf.argsort(tf.where(present, k, k + num_classes), axis=-1, stable=True)
    return tf.cast(classes, tf.int32), tf.reduce_sum(tf.cast(present, tf.int32), axis=-1)


TASKS = ("semantic", "panoptic", "instance")


def segment_targets(labels, num_classes: int, ignore_label: int, things_only: bool = False,
                    max_segments: int | None = None):
    """The segments present in each segment-label map [b, H, W] (data/segments.py): (values int32 [b, G'],
    classes int32 [b, G'], num_valid int32 [b]), G' = max(num_valid) (at least 1). The first num_valid[i] slots
    hold image i's segment values ascending, the rest -1 (no pixel has it) and class 0.

    A segment is a value whose class is in [0, num_classes) and whose instance is not CROWD; with
    `things_only` also not 0 (stuff). `max_segments`: at most this many per image (the first ones)."""
    labels = tf.cast(labels, tf.int32)
    b = tf.shape(labels)[0]
    flat = tf.reshape(labels, [b, -1])
    cls, inst = flat // INSTANCE_BASE, flat % INSTANCE_BASE
    valid = (cls >= 0) & (cls < num_classes) & (inst != CROWD)
    if things_only:
        valid &= inst > 0
    absent = tf.int32.max
    ordered = tf.sort(tf.where(valid, flat, absent), axis=-1)
    first = tf.concat([tf.ones([b, 1], tf.bool), ordered[:, 1:] != ordered[:, :-1]], 1) & (ordered != absent)
    where = tf.where(first)  # row-major: each image's first occurrences, ascending
    ragged = tf.RaggedTensor.from_value_rowids(tf.gather_nd(ordered, where), where[:, 0], nrows=tf.cast(b, tf.int64))
    values = ragged.to_tensor(default_value=-1)
    num_valid = tf.cast(ragged.row_lengths(), tf.int32)
    if max_segments is not None:
        values, num_valid = values[:, :max_segments], tf.minimum(num_valid, max_segments)
    values = tf.pad(values, [[0, 0], [0, tf.maximum(1 - tf.shape(values)[1], 0)]], constant_values=-1)
    classes = tf.where(values >= 0, values // INSTANCE_BASE, 0)
    return values, classes, num_valid


def targets_of(labels, opts: "EomtLossOptions", max_segments: int | None = None):
    """(values, classes, num_valid) of `labels` for opts.task: semantic_targets (values = classes, all K slots)
    or segment_targets."""
    if opts.task == "semantic":
        classes, num_valid = semantic_targets(labels, opts.num_classes)
        return classes, classes, num_valid
    if opts.task not in TASKS:
        raise ValueError(f"EomtLossOptions.task {opts.task!r}: expected one of {', '.join(TASKS)}")
    return segment_targets(labels, opts.num_classes, opts.ignore_label, opts.task == "instance", max_segments)


def target_masks(labels, classes, num_valid):
    """Dense binary masks float32 [b, G, H, W] of the slots (zeros in padding slots); for inspection and
    tests, the loss never builds them."""
    labels = tf.cast(labels, tf.int32)
    g = tf.shape(classes)[1]
    valid = tf.range(g)[tf.newaxis, :] < num_valid[:, tf.newaxis]
    hit = tf.equal(labels[:, tf.newaxis], classes[:, :, tf.newaxis, tf.newaxis])
    return tf.cast(hit & valid[:, :, tf.newaxis, tf.newaxis], tf.float32)


def grid_points(height: int, width: int):
    """Every pixel centre of a height x width grid as normalised points float32 [height * width, 2] (x, y),
    row-major."""
    ys = (tf.range(height, dtype=tf.float32) + 0.5) / height
    xs = (tf.range(width, dtype=tf.float32) + 0.5) / width
    y, x = tf.meshgrid(ys, xs, indexing="ij")
    return tf.reshape(tf.stack([x, y], -1), [-1, 2])


def _padded_corners(x, y, height, width):
    """Bilinear footprint (align_corners=False) of points with normalised coordinates x, y [...] in [0, 1] on a
    height x width grid padded with one zero pixel on every side ((height + 2) x (width + 2), `_padded`): the 4
    corners as (flat index int32 [...], weight float32 [...]) pairs, top left, top right, bottom left, bottom
    right. Every corner lies inside the padded grid, so the zero padding takes no masks (index and weight
    masked per corner cost as much as the gathers they fed). The corners stay 4 tensors: stacked on a last axis
    of 4 ([..., 4]) they would cost an element-wise interleave (Pack) and 4 strided slices back out."""
    x = x * tf.cast(width, tf.float32) - 0.5
    y = y * tf.cast(height, tf.float32) - 0.5
    x0, y0 = tf.floor(x), tf.floor(y)
    fx, fy = x - x0, y - y0
    stride = width + 2
    top_left = (tf.cast(y0, tf.int32) + 1) * stride + tf.cast(x0, tf.int32) + 1
    out = []
    for dy, wy in ((0, 1.0 - fy), (stride, fy)):
        for dx, wx in ((0, 1.0 - fx), (1, fx)):
            out.append((top_left + (dy + dx), wy * wx))
    return out


def _padded(logits):
    """logits [b, R, h, w] -> [b, R, (h + 2) (w + 2)]: one zero pixel on every side, flattened."""
    shape = tf.shape(logits)
    padded = tf.pad(logits, [[0, 0], [0, 0], [1, 1], [1, 1]])
    return tf.reshape(padded, [shape[0], shape[1], (shape[2] + 2) * (shape[3] + 2)])


def _sample_shared(logits, x, y):
    """Bilinear samples float32 [b, N, R] of logits [b, R, h, w] at points x, y [b, N] shared by the rows,
    point-major; for the matching's costs (its gradient is never taken there).

    tf.image.crop_and_resize with one box of size zero per point: its single sample is the box's centre, read
    bilinearly from every channel at once. The logits are put pixel-major with one zero pixel on every side
    ([b, h + 2, w + 2, R]), so that the zero padding is the reference's (a point within half a pixel of the border
    mixes in zeros) and every point lies inside the image the op reads (outside it, crop_and_resize gives its
    extrapolation value for the whole sample instead). The op maps a normalised c to c * (size - 1); the padded
    grid's pixel coordinate of x is x * w - 0.5 + 1, hence x' = (x * w + 0.5) / (w + 1). One fused kernel over the
    points, where 4 corner gathers of [b, N, R] and the weighted sum cost 2.5-3x the CPU time at the matching's
    shapes (docs/PERFORMANCE.md, "EoMT's matching: the points sampled in one op"); the same values to float32
    round-off of the coordinates."""
    shape = tf.shape(logits)
    h, w = tf.cast(shape[2], tf.float32), tf.cast(shape[3], tf.float32)
    table = tf.pad(tf.transpose(logits, [0, 2, 3, 1]), [[0, 0], [1, 1], [1, 1], [0, 0]])
    ys, xs = (y * h + 0.5) / (h + 1.0), (x * w + 0.5) / (w + 1.0)
    boxes = tf.reshape(tf.stack([ys, xs, ys, xs], axis=-1), [-1, 4])
    n = tf.shape(x)[1]
    image = tf.repeat(tf.range(shape[0]), n)
    samples = tf.image.crop_and_resize(table, boxes, image, [1, 1], method="bilinear")  # [b N, 1, 1, R]
    return tf.reshape(samples, [shape[0], n, shape[1]])


def _sample_rows(logits, x, y):
    """Bilinear samples float32 [b, R, N] of logits [b, R, h, w] at points x, y [b, R, N] (each row its own)."""
    flat = _padded(logits)
    out = 0.0
    for index, weight in _padded_corners(x, y, tf.shape(logits)[2], tf.shape(logits)[3]):
        out += tf.gather(flat, index, axis=2, batch_dims=2) * weight
    return out


def _sample_logits(logits, points):
    """Bilinear samples float32 [b, R, N] of logits [b, R, h, w] at points [b, N, 2] (shared by the rows) or
    [b, R, N, 2] (each row its own), in [0, 1]."""
    x, y = points[..., 0], points[..., 1]
    if points.shape.rank == 3:
        return tf.transpose(_sample_shared(logits, x, y), [0, 2, 1])
    return _sample_rows(logits, x, y)


def _label_table(labels, ignore_label: int, segments: bool):
    """(table int32 [b, (H + 2) (W + 2)], H, W): the label maps [b, H, W] as `_sample_table` reads them, built
    once for every layer's points: ignored pixels (module doc) relabelled _IGNORED, one _OUTSIDE pixel of
    padding on every side (so that every corner of a point in [0, 1] lies inside, `_padded_corners`),
    flattened."""
    labels = tf.cast(labels, tf.int32)
    if segments:
        off = tf.equal(labels // INSTANCE_BASE, ignore_label) | tf.equal(labels % INSTANCE_BASE, CROWD)
    else:
        off = tf.equal(labels, ignore_label)
    padded = tf.pad(tf.where(off, _IGNORED, labels), [[0, 0], [1, 1], [1, 1]], constant_values=_OUTSIDE)
    shape = tf.shape(labels)
    return tf.reshape(padded, [shape[0], -1]), shape[1], shape[2]


def _sample_table(table, classes, num_valid, x, y):
    """The slots' target masks sampled bilinearly (as the dense binary masks would be) at points x, y [b, N]
    (shared) or [b, G, N] (per slot), from a `_label_table`: (targets float32 [b, G, N], kept float32 [b, N] or
    [b, G, N]: 0 where the point lands on an ignored pixel, module doc). `classes`: each slot's label value (a
    class, or a segment value)."""
    flat, h, w = table
    shared = x.shape.rank == 2
    value = classes[:, :, tf.newaxis]
    targets, ignored = 0.0, None
    for index, weight in _padded_corners(x, y, h, w):
        corner = tf.gather(flat, index, batch_dims=1)  # the corner's label, [b, (G,) N]
        off = tf.equal(corner, _IGNORED) & (weight > 0.0)  # a corner of weight 0 is no part of the point
        ignored = off if ignored is None else ignored | off
        if shared:
            corner, weight = corner[:, tf.newaxis], weight[:, tf.newaxis]  # [b, 1, N]
        targets += tf.where(tf.equal(corner, value), weight, 0.0)
    slot_valid = tf.range(tf.shape(classes)[1])[tf.newaxis, :] < num_valid[:, tf.newaxis]
    targets *= tf.cast(slot_valid, tf.float32)[:, :, tf.newaxis]
    return targets, 1.0 - tf.cast(ignored, tf.float32)


def _sample_labels(labels, classes, num_valid, points, ignore_label: int, segments: bool = False):
    """`_sample_table` of the label maps [b, H, W] at points [b, N, 2] (shared) or [b, G, N, 2] (per slot) in
    [0, 1]; `segments`: segment labels."""
    return _sample_table(_label_table(labels, ignore_label, segments), classes, num_valid, points[..., 0],
                         points[..., 1])


def _layer_seeds(seeds, layer):
    """int32 [b, 2]: each row's seed folded with the layer index (what `_draw` folds first)."""
    return per_row(lambda seed: tf.random.experimental.stateless_fold_in(seed, layer, alg="philox"), seeds, None)


def _draw(seeds, layer: int | None, purpose: int, shape):
    """U[0, 1) of shape [b, *shape], row i from seeds[i] folded with (layer, purpose); Philox, stateless. The
    leading entry of `shape` may be a tensor (the compacted slot count): a larger one extends the stream.
    layer None: the seeds are `_layer_seeds`' already."""
    def one(seed):
        if layer is not None:
            seed = tf.random.experimental.stateless_fold_in(seed, layer, alg="philox")
        seed = tf.random.experimental.stateless_fold_in(seed, purpose, alg="philox")
        return tf.random.stateless_uniform(shape, seed, alg="philox")
    return per_row(one, seeds, shape)


def _match(class_logits, mask_logits, table, values, classes, num_valid, points, opts: EomtLossOptions):
    """The reference matcher's assignment: (row_of_col [b, G], col_of_row [b, Q]) of
    batched_linear_sum_assignment on its cost, points [b, N, 2] shared by an image's queries and masks; `values`
    the slots' label values, `classes` their classes."""
    class_logits, mask_logits = tf.stop_gradient(class_logits), tf.stop_gradient(mask_logits)
    probs = tf.nn.softmax(class_logits, axis=-1)
    cost_class = -tf.gather(probs, classes, axis=2, batch_dims=1)  # [b, Q, G]
    x, y = points[..., 0], points[..., 1]
    pred = _sample_shared(mask_logits, x, y)  # [b, N, Q]
    target, kept = _sample_table(table, values, num_valid, x, y)  # [b, G, N], [b, N]
    n = tf.maximum(tf.reduce_sum(kept, -1), 1.0)[:, tf.newaxis, tf.newaxis]  # [b, 1, 1]
    t = target * kept[:, tf.newaxis, :]
    kept = kept[:, tf.newaxis, :]  # [b, 1, N]
    # The reference's BCE cost, softplus(-x) @ t + softplus(x) @ (1 - t) over the points, written with
    # softplus(-x) = softplus(x) - x as sum(softplus(x)) - x @ t: one softplus over the [N, Q] samples instead of
    # two, one product with the targets instead of two (the same sums but for round-off).
    cost_mask = (tf.matmul(kept, tf.nn.softplus(pred)) - tf.matmul(t, pred)) / n  # [b, G, Q]
    p = tf.sigmoid(pred)
    numerator = 2.0 * tf.matmul(t, p)  # [b, G, Q]
    denominator = tf.matmul(kept, p) + tf.reduce_sum(t, -1)[:, :, tf.newaxis]
    cost_dice = 1.0 - (numerator + 1.0) / (denominator + 1.0)
    cost_points = tf.transpose(opts.mask_weight * cost_mask + opts.dice_weight * cost_dice, [0, 2, 1])
    cost = cost_points + opts.class_weight * cost_class
    cost = tf.where(tf.math.is_finite(cost), cost, _FLOAT32_MAX)
    return batched_linear_sum_assignment(cost, num_valid)


def _top_k_indices(u, k: int, stride: int = 8):
    """The indices int32 [R, k] of the k largest values of each row of u float32 [R, S] (S static), ties to the
    lower index: tf.math.top_k(u, k).indices as a set, in ascending order.

    top_k's CPU kernel pushes every value through a heap of k (TopN), about as dear as all the loss's point
    sampling when k is a quarter of S (`_loss_points`). Here the k-th largest value theta is found from two small
    sorts and the set is read off by comparisons: theta lies, but for a chance of about 1e-9 per row, between two
    order statistics of the strided sample u[:, ::stride] (6 standard deviations of a sample's rank either side of
    its k / stride-th), so it is the (k - above)-th largest of the values between them (the candidates; above:
    the values over the bracket); then the set is every value > theta and the first of those = theta. A row whose
    bracket misses theta sends the whole call to top_k itself. Below 2048 values, top_k itself."""
    size = u.shape[-1]

    def top_k():  # ascending like the rest, so that which way a row went leaves no trace in the loss's sums
        return tf.sort(tf.math.top_k(u, k, sorted=False).indices, axis=-1)

    if size < 2048 or k >= size:
        return top_k()
    sample = tf.sort(u[:, ::stride], axis=-1, direction="DESCENDING")
    margin = int(6.0 * (k * (stride - 1)) ** 0.5 / stride) + 8
    high = sample[:, max(k // stride - margin, 0), tf.newaxis]
    low = sample[:, min(k // stride + margin, sample.shape[-1] - 1), tf.newaxis]
    above = u > high
    between = (u >= low) & ~above
    n_above = tf.reduce_sum(tf.cast(above, tf.int32), -1)
    bracketed = tf.reduce_all((n_above < k) & (n_above + tf.reduce_sum(tf.cast(between, tf.int32), -1) >= k))
    rows = tf.shape(u)[0]

    def from_theta():
        where = tf.where(between)
        candidates = tf.RaggedTensor.from_value_rowids(tf.gather_nd(u, where), where[:, 0],
                                                       nrows=tf.cast(rows, tf.int64))
        ordered = tf.sort(candidates.to_tensor(default_value=float("-inf")), axis=-1, direction="DESCENDING")
        theta = tf.gather(ordered, k - n_above - 1, batch_dims=1)[:, tf.newaxis]
        greater, equal = u > theta, tf.equal(u, theta)
        ties = k - tf.reduce_sum(tf.cast(greater, tf.int32), -1, keepdims=True)  # how many = theta are kept
        # Usually exactly `ties` values equal theta (a cumulative sum over every row is dear: only then).
        keep = tf.cond(tf.reduce_all(tf.equal(tf.reduce_sum(tf.cast(equal, tf.int32), -1, keepdims=True), ties)),
                       lambda: greater | equal,
                       lambda: greater | (equal & (tf.cumsum(tf.cast(equal, tf.int32), axis=-1) <= ties)))
        return tf.reshape(tf.cast(tf.where(keep)[:, 1], tf.int32), [rows, k])

    return tf.cond(bracketed, from_theta, top_k)


def _loss_points(pred, seeds, layer: int | None, opts: EomtLossOptions):
    """Each slot's points as (x, y), each [b, G, num_points]: the most uncertain of the oversampled ones, then
    uniform ones (the reference's sample_points_using_uncertainty). pred: the slots' matched logits [b, G, h, w]."""
    g = tf.shape(pred)[1]
    sampled = int(opts.num_points * opts.oversample_ratio)
    uncertain = int(opts.importance_sample_ratio * opts.num_points)
    uniform = opts.num_points - uncertain
    draws = _draw(seeds, layer, LOSS, [g, sampled + uniform, 2])
    x, y = draws[..., 0], draws[..., 1]  # the coordinates apart once, not per use ([..., 2] slices are strided)
    uncertainty = -tf.abs(_sample_rows(tf.stop_gradient(pred), x[:, :, :sampled], y[:, :, :sampled]))
    top = _top_k_indices(tf.reshape(uncertainty, [-1, sampled]), uncertain)
    top = tf.reshape(top, [tf.shape(pred)[0], g, uncertain])
    return tuple(tf.concat([tf.gather(c[:, :, :sampled], top, axis=2, batch_dims=2), c[:, :, sampled:]], axis=2)
                 for c in (x, y))


def _layer_terms(class_logits, mask_logits, table, values, classes, num_valid, seeds, layer: int | None,
                 opts: EomtLossOptions):
    """One prediction layer's (class_sum, class_weight, mask_sum, dice_sum, mask_count) and its matching; `layer`
    None: the seeds are `_layer_seeds`' already."""
    class_logits = tf.cast(class_logits, tf.float32)
    mask_logits = tf.cast(mask_logits, tf.float32)
    b = tf.shape(mask_logits)[0]
    h, w = mask_logits.shape[2], mask_logits.shape[3]
    if opts.random_points:
        match_points = _draw(seeds, layer, MATCHING, [opts.num_points, 2])
    else:
        grid = grid_points(h, w)
        match_points = tf.broadcast_to(grid, [b, h * w, 2])
    with tf.name_scope("match"):
        row_of_col, col_of_row = _match(class_logits, mask_logits, table, values, classes, num_valid,
                                        match_points, opts)

    # Class term: every query, the matched ones their mask's class, the others no-object (class K).
    k = opts.num_classes
    matched_class = tf.gather(classes, tf.maximum(col_of_row, 0), batch_dims=1)
    target = tf.where(col_of_row >= 0, matched_class, k)
    weight = tf.where(target == k, opts.no_object_weight, 1.0)
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=target, logits=class_logits)
    class_sum = tf.reduce_sum(weight * ce)
    class_weight = tf.reduce_sum(weight)

    # Mask terms: each slot's matched query, padding slots weighted 0.
    slot_valid = tf.cast(tf.range(tf.shape(classes)[1])[tf.newaxis, :] < num_valid[:, tf.newaxis], tf.float32)
    pred = tf.gather(mask_logits, tf.maximum(row_of_col, 0), batch_dims=1)  # [b, G, h, w]
    g = tf.shape(classes)[1]
    if opts.random_points:
        with tf.name_scope("points"):
            x, y = _loss_points(pred, seeds, layer, opts)
    else:
        grid = tf.broadcast_to(grid_points(h, w), [b, g, h * w, 2])
        x, y = grid[..., 0], grid[..., 1]
    logits = _sample_rows(pred, x, y)  # [b, G, N]
    target, kept = _sample_table(table, values, num_valid, x, y)
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=target, logits=logits) * kept
    bce = tf.reduce_sum(bce, -1) / tf.maximum(tf.reduce_sum(kept, -1), 1.0)
    p = tf.sigmoid(logits) * kept
    t = target * kept
    dice = 1.0 - (2.0 * tf.reduce_sum(p * t, -1) + 1.0) / (tf.reduce_sum(p, -1) + tf.reduce_sum(t, -1) + 1.0)
    mask_sum = tf.reduce_sum(bce * slot_valid)
    dice_sum = tf.reduce_sum(dice * slot_valid)
    mask_count = tf.cast(tf.reduce_sum(num_valid), tf.float32)
    return (class_sum, class_weight, mask_sum, dice_sum, mask_count), row_of_col


TERMS = ("class_sum", "class_weight", "mask_sum", "dice_sum", "mask_count")


def eomt_loss_terms(predictions, labels, seeds, opts: EomtLossOptions, return_matches: bool = False):
    """The loss's numerators and denominators per layer (module doc).

    predictions: a list of (class_logits [b, Q, K+1], mask_logits [b, Q, h, w]), the final layer last; h, w
      static; semantic: Q >= K (every class may be present: the target slots are K, the matcher needs Q >= K).
    labels: int [b, H, W] (any resolution): class ids (semantic) or segment labels (panoptic, instance). seeds:
      int32 [b, 2], one per sample (unused with random_points=False).
    Returns {name: float32 [L]} for the names in TERMS; with return_matches, also the matched query of
    every target slot per layer, int32 [L, b, G] (-1 in padding slots; slots as `semantic_targets`, G = K, or
    as `segment_targets`, G = G').
    """
    semantic = opts.task == "semantic"
    queries = None
    for class_logits, mask_logits in predictions:
        q, k1 = class_logits.shape[1], class_logits.shape[2]
        queries = q
        if (k1 is not None and k1 != opts.num_classes + 1) or (semantic and q is not None and q < opts.num_classes):
            least = f"queries >= {opts.num_classes}" if semantic else "queries"
            raise ValueError(f"eomt_loss_terms: class logits of shape {class_logits.shape} for {opts.num_classes} "
                             f"classes; expected [batch, {least}, {opts.num_classes + 1}]")
    values, classes, num_valid = targets_of(labels, opts, max_segments=queries)
    if semantic:
        # Only the slots some image of the batch fills (module doc); at least one, so no shape is empty.
        compact = tf.maximum(tf.reduce_max(num_valid), 1)
        classes = values = classes[:, :compact]
    table = _label_table(labels, opts.ignore_label, not semantic)
    per_layer, matches = [], []
    traced = tf.inside_function() and len(predictions) > 1
    if traced:
        # The layers' predictions have one shape, so inside a trace (the train step's) their loss is one function
        # traced once and called per layer: the graph holds the loss and its gradient once instead of once per
        # layer (about a third of EoMT's train-step graph otherwise: docs/PERFORMANCE.md, "EoMT's start-up"). Not
        # inlined. The layer index reaches it folded into the seeds (the same draws): a constant argument would
        # make Grappler specialise, and so optimise, the function once per layer.
        layer_terms = tf.function(_layer_terms, autograph=False, reduce_retracing=True,
                                  experimental_attributes={"_noinline": True})
    for layer, (class_logits, mask_logits) in enumerate(predictions):
        if traced:
            terms, row_of_col = layer_terms(class_logits, mask_logits, table, values, classes, num_valid,
                                            _layer_seeds(seeds, layer), None, opts)
        else:
            terms, row_of_col = _layer_terms(class_logits, mask_logits, table, values, classes, num_valid, seeds,
                                             layer, opts)
        per_layer.append(terms)
        if semantic:
            # Back to all K slots for the caller: -1 in the slots compacted away, as in any padding slot.
            row_of_col = tf.pad(row_of_col, [[0, 0], [0, opts.num_classes - compact]], constant_values=-1)
        matches.append(row_of_col)
    out = {name: tf.stack([t[i] for t in per_layer]) for i, name in enumerate(TERMS)}
    return (out, tf.stack(matches)) if return_matches else out


def losses_from_terms(terms, opts: EomtLossOptions):
    """The reference's numbers from (summed) terms: {"loss_cross_entropy", "loss_mask", "loss_dice"}: [L]
    each (unweighted, as EomtLoss returns them), and "loss": the weighted total over layers (a scalar)."""
    count = tf.maximum(terms["mask_count"], 1.0)
    out = {"loss_cross_entropy": terms["class_sum"] / terms["class_weight"],
           "loss_mask": terms["mask_sum"] / count,
           "loss_dice": terms["dice_sum"] / count}
    out["loss"] = tf.reduce_sum(opts.class_weight * out["loss_cross_entropy"] + opts.mask_weight * out["loss_mask"]
                                + opts.dice_weight * out["loss_dice"])
    return out
