"""EoMT's loss (seg_train/objectives/mask_loss.py) held to Hugging Face transformers' EomtLoss / EomtHungarianMatcher
(tests/fixtures/eomt_loss.npz, written by scripts/reference_eomt_loss.py), and to numpy by hand where the
reference has nothing to say (ignored pixels, tower splits, keyed draws).

Tolerances: full-grid mode is deterministic, so each term per layer is held to rtol 1e-5 (float32 sums of
256 points against torch's); with random points each term's mean over SEEDS samples is held within Z standard
errors of the reference's mean over its runs (standard error from the reference's per-run deviation)."""

import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import linear_sum_assignment

from seg_train.objectives import mask_loss as E

FIXTURE = "tests/fixtures/eomt_loss.npz"
REF_TERMS = ("loss_cross_entropy", "loss_mask", "loss_dice")  # the fixture's term order
SEEDS = 64
Z = 4.0


def fixture():
    f = np.load(FIXTURE)
    preds = [(f["class_logits"][i], f["mask_logits"][i]) for i in range(f["class_logits"].shape[0])]
    return f, preds, f["labels"].astype(np.int32)


def numbers(terms, opts):
    out = E.losses_from_terms(terms, opts)
    return np.stack([out[t].numpy() for t in REF_TERMS]), float(out["loss"])


def seeds_for(rows, salt=0):
    return np.stack([np.arange(rows), np.full(rows, salt)], 1).astype(np.int32)


def test_grid_matches_are_the_references():
    """Full-grid mode: each layer's matched (query, mask) pairs are the reference matcher's. Fails for a cost
    weight changed (the class cost at weight 1), the class cost on log-probabilities, targets in another order
    than ascending class."""
    f, preds, labels = fixture()
    opts = E.EomtLossOptions(num_classes=5, random_points=False)
    _, matches = E.eomt_loss_terms(preds, labels, seeds_for(2), opts, return_matches=True)
    np.testing.assert_array_equal(matches.numpy(), f["grid_matches"])
    np.testing.assert_array_equal(E.semantic_targets(labels, 5)[1].numpy(), f["num_valid"])


def test_grid_terms_are_the_references():
    """Full-grid mode: each term of each layer within rtol 1e-5 of EomtLoss's, the weighted total too. Fails for
    a no-object weight other than 0.1, the class CE averaged without its weights, a dice without +1, mask
    terms divided by the query count, bilinear targets sampled align_corners=True."""
    f, preds, labels = fixture()
    opts = E.EomtLossOptions(num_classes=5, random_points=False)
    got, total = numbers(E.eomt_loss_terms(preds, labels, seeds_for(2), opts), opts)
    np.testing.assert_allclose(got, f["grid_terms"], rtol=1e-5)
    ref_total = np.sum(np.array([2.0, 5.0, 5.0])[:, None] * f["grid_terms"])
    np.testing.assert_allclose(total, ref_total, rtol=1e-5)


@pytest.mark.slow
def test_random_sampling_agrees_with_the_reference_in_distribution():
    """The reference's own sampling on (uniform matching points, importance-sampled loss points): each term's
    mean over SEEDS seeds within Z standard errors of the reference's mean over its runs. Fails for no
    oversampling, another importance ratio, the most certain points taken instead of the uncertain ones."""
    f, preds, labels = fixture()
    opts = E.EomtLossOptions(num_classes=5, num_points=int(f["random_points"]))
    b = labels.shape[0]
    # SEEDS copies of the batch, each sample its own seed: the summed terms are the mean over the copies
    # (the weight and mask counts are the same in every copy).
    tiled = [(np.tile(c, (SEEDS, 1, 1)), np.tile(m, (SEEDS, 1, 1, 1))) for c, m in preds]
    got, _ = numbers(E.eomt_loss_terms(tiled, np.tile(labels, (SEEDS, 1, 1)), seeds_for(b * SEEDS, 5), opts), opts)
    se = f["random_std"] * np.sqrt(1.0 / SEEDS + 1.0 / int(f["random_reps"]))
    z = (got - f["random_mean"]) / se
    assert np.all(np.abs(z) < Z), f"z-scores [term, layer]:\n{z}\nours {got}\nreference {f['random_mean']}"


def test_targets_none_every_and_some_classes_present():
    """semantic_targets and target_masks by hand: an all-ignored image has no mask, an image of every class
    has all K, a mixed one its classes ascending, padding slots empty. Fails for padding slots counted, the
    ignore label taken for a class, slots in first-seen order instead of ascending."""
    k = 4
    labels = np.full((3, 6, 6), 255, np.int32)
    labels[1] = np.arange(36).reshape(6, 6) % k
    labels[2, :3] = 3
    labels[2, 3:, :2] = 1
    classes, num_valid = (t.numpy() for t in E.semantic_targets(labels, k))
    np.testing.assert_array_equal(num_valid, [0, 4, 2])
    np.testing.assert_array_equal(classes[1], [0, 1, 2, 3])
    np.testing.assert_array_equal(classes[2, :2], [1, 3])
    masks = E.target_masks(labels, classes, num_valid).numpy()
    assert masks.shape == (3, k, 6, 6)
    want = np.zeros_like(masks)
    for i in range(3):
        for g in range(num_valid[i]):
            want[i, g] = labels[i] == classes[i, g]
    np.testing.assert_array_equal(masks, want)

    opts = E.EomtLossOptions(num_classes=k, random_points=False)
    rng = np.random.default_rng(0)
    preds = [(rng.normal(size=(3, 5, k + 1)).astype(np.float32), rng.normal(size=(3, 5, 3, 3)).astype(np.float32))]
    # No mask at all: every query's target is no-object, the mask terms are 0 and divide to 0, not NaN.
    single = [(c[:1], m[:1]) for c, m in preds]
    terms = {n: v.numpy()[0] for n, v in E.eomt_loss_terms(single, labels[:1], seeds_for(1), opts).items()}
    logits = preds[0][0][0].astype(np.float64)
    ce = np.log(np.exp(logits).sum(-1)) - logits[:, k]
    np.testing.assert_allclose(terms["class_sum"], 0.1 * ce.sum(), rtol=1e-5)
    np.testing.assert_allclose(terms["class_weight"], 0.1 * 5, rtol=1e-6)
    assert terms["mask_sum"] == terms["dice_sum"] == terms["mask_count"] == 0.0
    out = E.losses_from_terms({n: tf.constant([v]) for n, v in terms.items()}, opts)
    assert float(out["loss_mask"][0]) == float(out["loss_dice"][0]) == 0.0


def _grid_terms_by_hand(class_logits, mask_logits, labels, k, ignore=255):
    """Full-grid mode with labels at twice the prediction's resolution, in numpy: every grid point's bilinear
    footprint is its 2 x 2 label block (weights 1/4); a point whose block holds an ignored pixel is dropped."""
    b, q, h, w = mask_logits.shape
    blocks = labels.reshape(b, h, 2, w, 2).transpose(0, 1, 3, 2, 4).reshape(b, h * w, 4)
    out = dict(class_sum=0.0, class_weight=0.0, mask_sum=0.0, dice_sum=0.0, mask_count=0.0)
    matches = np.full((b, k), -1)
    for i in range(b):
        present = np.unique(labels[i][labels[i] != ignore])
        kept = ~np.any(blocks[i] == ignore, -1)
        x = mask_logits[i].reshape(q, -1).astype(np.float64)[:, kept]
        t = np.stack([np.mean(blocks[i] == c, -1) for c in present]).reshape(len(present), -1)[:, kept]
        n = max(kept.sum(), 1)
        sp_pos, sp_neg = np.logaddexp(0, -x), np.logaddexp(0, x)
        p = 1 / (1 + np.exp(-x))
        cost_bce = (sp_pos @ t.T + sp_neg @ (1 - t).T) / n
        cost_dice = 1 - (2 * p @ t.T + 1) / (p.sum(-1)[:, None] + t.sum(-1)[None, :] + 1)
        z = class_logits[i].astype(np.float64)
        prob = np.exp(z - z.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        cost = 5 * cost_bce + 2 * -prob[:, present] + 5 * cost_dice
        rows, cols = linear_sum_assignment(cost)
        matches[i, cols] = rows
        target = np.full(q, k)
        target[rows] = present[cols]
        weight = np.where(target == k, 0.1, 1.0)
        ce = np.log(np.exp(z).sum(-1)) - z[np.arange(q), target]
        out["class_sum"] += np.sum(weight * ce)
        out["class_weight"] += weight.sum()
        for r, c in zip(rows, cols):
            out["mask_sum"] += np.mean(sp_pos[r] * t[c] + sp_neg[r] * (1 - t[c]))
            out["dice_sum"] += 1 - (2 * np.sum(p[r] * t[c]) + 1) / (p[r].sum() + t[c].sum() + 1)
        out["mask_count"] += len(present)
    return out, matches


def _ignore_case(seed=3):
    rng = np.random.default_rng(seed)
    b, q, k, h, w = 2, 6, 4, 8, 8
    labels = rng.integers(0, k, (b, 4, 4)).repeat(4, 1).repeat(4, 2).astype(np.int32)
    labels[0, :5] = 255                              # a band, straddling grid blocks
    labels[1, rng.random((16, 16)) < 0.1] = 255      # scattered pixels
    class_logits = rng.normal(0, 1.5, (b, q, k + 1)).astype(np.float32)
    mask_logits = rng.normal(0, 2, (b, q, h, w)).astype(np.float32)
    return class_logits, mask_logits, labels, k


def test_ignored_points_count_in_no_term_by_hand():
    """Full grid, labels at twice the resolution with ignored pixels: the matching and every term equal numpy's
    with each point whose 2 x 2 label footprint holds an ignored pixel dropped; moving the logits at those
    points changes nothing. Fails for ignored points counted in the BCE
    (as background of every mask), in the dice sums, in the matching costs, or the BCE mean taken over all
    points instead of the kept ones."""
    class_logits, mask_logits, labels, k = _ignore_case()
    opts = E.EomtLossOptions(num_classes=k, random_points=False)
    terms, matches = E.eomt_loss_terms([(class_logits, mask_logits)], labels, seeds_for(2), opts,
                                       return_matches=True)
    want, want_matches = _grid_terms_by_hand(class_logits, mask_logits, labels, k)
    np.testing.assert_array_equal(matches.numpy()[0], want_matches)
    for name, value in want.items():
        np.testing.assert_allclose(terms[name].numpy()[0], value, rtol=1e-5, err_msg=name)

    # The logits where a footprint touches an ignored pixel do not matter.
    blocks = labels.reshape(2, 8, 2, 8, 2).transpose(0, 1, 3, 2, 4).reshape(2, 8, 8, 4)
    dropped = np.any(blocks == 255, -1)
    assert dropped[0].sum() > 0 and dropped[1].sum() > 0 and not dropped.all()
    moved = np.where(dropped[:, None], mask_logits + 7.0, mask_logits)
    again = E.eomt_loss_terms([(class_logits, moved)], labels, seeds_for(2), opts)
    for name in E.TERMS:
        np.testing.assert_allclose(again[name].numpy(), terms[name].numpy(), rtol=1e-6, err_msg=name)


def _bilinear_zero_padded(img, x, y):
    """torch.grid_sample(align_corners=False, padding zeros) of img [H, W] at normalised x, y in numpy."""
    hgt, wid = img.shape
    px, py = x * wid - 0.5, y * hgt - 0.5
    x0, y0 = np.floor(px).astype(int), np.floor(py).astype(int)
    out = np.zeros_like(px, dtype=np.float64)
    for dx in (0, 1):
        for dy in (0, 1):
            xi, yi = x0 + dx, y0 + dy
            wgt = (1 - np.abs(px - xi)) * (1 - np.abs(py - yi))
            inside = (xi >= 0) & (xi < wid) & (yi >= 0) & (yi < hgt)
            out += np.where(inside, wgt * img[np.clip(yi, 0, hgt - 1), np.clip(xi, 0, wid - 1)], 0.0)
    return out


def test_point_sampling_is_bilinear_with_zero_padding():
    """Logits and targets at random points (borders included) equal grid_sample's bilinear, align_corners=False,
    zero-padded values in numpy; targets are the dense masks sampled so. Fails for align_corners=True, edge
    clamping instead of zeros, x and y swapped."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 3, 5, 7)).astype(np.float32)
    points = rng.random((2, 40, 2)).astype(np.float32)
    points[:, :4] = [[0.0, 0.0], [1.0, 1.0], [0.01, 0.99], [0.99, 0.02]]
    got = E._sample_logits(logits, tf.constant(points)).numpy()
    for i in range(2):
        for r in range(3):
            np.testing.assert_allclose(got[i, r], _bilinear_zero_padded(logits[i, r], *points[i].T), atol=1e-5)
    labels = rng.integers(0, 3, (2, 9, 11)).astype(np.int32)
    classes, num_valid = E.semantic_targets(labels, 3)
    targets, kept = E._sample_labels(labels, classes, num_valid, tf.constant(points), 255)
    dense = E.target_masks(labels, classes, num_valid).numpy()
    for i in range(2):
        for g in range(3):
            np.testing.assert_allclose(targets.numpy()[i, g], _bilinear_zero_padded(dense[i, g], *points[i].T),
                                       atol=1e-5)
    assert np.all(kept.numpy() == 1.0)


def test_halves_summed_are_the_whole_batch():
    """Tower invariance: the terms of a batch's two halves (each sample with its own seed), summed, equal the
    whole batch's, with random points on. The first half's images hold 2 of the 5 classes, the second's up to 5,
    so each half compacts to its own slot count (module doc). Fails for draws keyed by batch position, batch size
    or the compacted slot count, terms returned as per-tower means, a mask count of one half."""
    rng = np.random.default_rng(2)
    b, q, k = 4, 6, 5
    labels = rng.integers(0, k, (b, 4, 4))
    labels[:2] = rng.integers(0, 2, (2, 4, 4))
    labels = labels.repeat(4, 1).repeat(4, 2).astype(np.int32)
    counts = [len(np.unique(x)) for x in labels]
    assert max(counts[:2]) == 2 and max(counts[2:]) >= 4
    preds = [(rng.normal(size=(b, q, k + 1)).astype(np.float32), rng.normal(size=(b, q, 8, 8)).astype(np.float32))
             for _ in range(2)]
    seeds = rng.integers(0, 2**31 - 1, (b, 2)).astype(np.int32)
    opts = E.EomtLossOptions(num_classes=k, num_points=50)
    whole = E.eomt_loss_terms(preds, labels, seeds, opts)
    halves = [E.eomt_loss_terms([(c[s], m[s]) for c, m in preds], labels[s], seeds[s], opts)
              for s in (slice(0, 2), slice(2, 4))]
    for name in E.TERMS:
        np.testing.assert_allclose(halves[0][name].numpy() + halves[1][name].numpy(), whole[name].numpy(),
                                   rtol=1e-5, err_msg=name)
    # The reversed batch: the same sums (a sample's draws do not follow its position).
    rev = E.eomt_loss_terms([(c[::-1], m[::-1]) for c, m in preds], labels[::-1], seeds[::-1], opts)
    for name in E.TERMS:
        np.testing.assert_allclose(rev[name].numpy(), whole[name].numpy(), rtol=1e-5, err_msg=name)


def test_uncertain_points_are_top_ks_set():
    """The loss points' selection (_top_k_indices, a bracket of the k-th value from a strided sample) picks
    tf.math.top_k's set, in ascending order: on rows of the loss's kind (-|logit|), on rows full of ties (rounded
    values, one row all equal: the first ties by index), and on rows whose strided sample misleads the bracket
    (handed to top_k). Fails for ties kept from the last index, the values equal to the k-th dropped or all
    kept, a bracket used without its check, top_k's own order after the hand-over."""
    rng = np.random.default_rng(5)
    size, k = 8000, 2000
    rows = [-np.abs(rng.normal(0, 3, (3, size))), np.round(rng.normal(0, 1, (3, size)), 1), np.zeros((1, size))]
    misleading = rng.normal(0, 1, (2, size))
    misleading[:, ::8] = 10.0  # the sample sees only these: its bracket holds size / 8 < k values
    rows.append(misleading)
    for u in rows:
        u = tf.constant(u.astype(np.float32))
        got = E._top_k_indices(u, k).numpy()
        np.testing.assert_array_equal(got, np.sort(tf.math.top_k(u, k, sorted=False).indices.numpy(), -1))


def test_draws_are_keyed_by_sample_layer_and_purpose():
    """Same seeds, same points; a row's points do not depend on its neighbours or position; another layer or
    purpose draws other points. Fails for a global RNG, draws of the whole batch from one seed, the layer
    or the purpose not folded into the seed."""
    seeds = np.array([[1, 2], [3, 4], [5, 6]], np.int32)
    a = E._draw(seeds, 0, E.MATCHING, [10, 2]).numpy()
    np.testing.assert_array_equal(a, E._draw(seeds, 0, E.MATCHING, [10, 2]).numpy())
    alone = E._draw(seeds[1:2], 0, E.MATCHING, [10, 2]).numpy()
    np.testing.assert_array_equal(a[1], alone[0])
    np.testing.assert_array_equal(a[::-1], E._draw(seeds[::-1], 0, E.MATCHING, [10, 2]).numpy())
    assert not np.allclose(a, E._draw(seeds, 1, E.MATCHING, [10, 2]).numpy())
    assert not np.allclose(a, E._draw(seeds, 0, E.LOSS, [10, 2]).numpy())
    assert not np.allclose(a[0], a[1])


@pytest.mark.slow
def test_traced_equals_eager_and_gradients_reach_the_logits():
    """Inside a tf.function (the train step's way) the terms and their gradients equal eager ones, on three
    prediction layers (traced, the layers share one function called per layer); the gradient reaches both
    logits, none flows through the matching. Fails for a host round trip (numpy) at run time, a Python-side
    branch on tensor values, and for the traced per-layer function drawing one layer's points for every layer
    (a layer index frozen into its trace)."""
    class_logits, mask_logits, labels, k = _ignore_case()
    opts = E.EomtLossOptions(num_classes=k, num_points=64)
    seeds = seeds_for(2, 9)
    scales = (1.0, 0.5, 2.0)

    def loss_and_grads(c, m):
        with tf.GradientTape() as tape:
            tape.watch([c, m])
            terms = E.eomt_loss_terms([(c * s, m * s) for s in scales], labels, seeds, opts)
            loss = E.losses_from_terms(terms, opts)["loss"]
        return terms, tape.gradient(loss, [c, m])

    c, m = tf.constant(class_logits), tf.constant(mask_logits)
    eager, (gc, gm) = loss_and_grads(c, m)
    traced, (tc, tm) = tf.function(loss_and_grads, autograph=False)(c, m)
    for name in E.TERMS:
        np.testing.assert_allclose(traced[name].numpy(), eager[name].numpy(), rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(tc.numpy(), gc.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(tm.numpy(), gm.numpy(), rtol=1e-5, atol=1e-7)
    assert np.all(np.isfinite(gc.numpy())) and np.any(gc.numpy() != 0)
    assert np.all(np.isfinite(gm.numpy())) and np.any(gm.numpy() != 0)


# ---- panoptic and instance targets (segment labels: class * 1000 + instance) --------------------------------
SEGMENTS_FIXTURE = "tests/fixtures/eomt_loss_segments.npz"


def _segment_fixture(task):
    f = np.load(SEGMENTS_FIXTURE)
    preds = [(f["class_logits"][i], f["mask_logits"][i]) for i in range(f["class_logits"].shape[0])]
    return f, preds, f["labels"]


def test_segment_targets_by_hand():
    """segment_targets on hand-made segment labels: one slot per thing instance and per stuff class present,
    ascending values; crowd (999), unlabelled (class 255) and out-of-range classes make no slot; the instance
    task keeps thing instances only; an image without a segment has none; the cap keeps the first values.
    Fails for segments keyed by class alone (two instances of a class one mask), by instance alone (instance 1
    of two classes one mask), crowd regions made targets, stuff kept as an instance target."""
    k = 4
    labels = np.full((3, 5, 6), 255000, np.int32)
    labels[0, :2] = 0                   # stuff class 0
    labels[0, 2, :3] = 1001             # class 1, instance 1
    labels[0, 2, 3:] = 1002             # class 1, instance 2
    labels[0, 3, :3] = 3001             # class 3, instance 1 (same instance number, other class)
    labels[0, 3, 3:] = 3999             # crowd of class 3
    labels[0, 4, :2] = 2000             # stuff class 2
    labels[0, 4, 2] = 255007            # unlabelled, whatever its instance
    labels[0, 4, 3:] = 7001             # class 7 >= K: no segment
    labels[2] = 1999                    # all crowd
    values, classes, num_valid = (t.numpy() for t in E.segment_targets(labels, k, 255))
    np.testing.assert_array_equal(num_valid, [5, 0, 0])
    np.testing.assert_array_equal(values[0], [0, 1001, 1002, 2000, 3001])
    np.testing.assert_array_equal(classes[0], [0, 1, 1, 2, 3])
    assert np.all(values[1:] == -1)
    values, classes, num_valid = (t.numpy() for t in E.segment_targets(labels, k, 255, things_only=True))
    np.testing.assert_array_equal(num_valid, [3, 0, 0])
    np.testing.assert_array_equal(values[0, :3], [1001, 1002, 3001])
    np.testing.assert_array_equal(classes[0, :3], [1, 1, 3])
    values, _, num_valid = (t.numpy() for t in E.segment_targets(labels, k, 255, max_segments=2))
    np.testing.assert_array_equal(num_valid, [2, 0, 0])
    np.testing.assert_array_equal(values[0], [0, 1001])
    # No segment anywhere: one empty slot, so no shape is empty.
    values, _, num_valid = (t.numpy() for t in E.segment_targets(labels[1:], k, 255))
    assert values.shape == (2, 1) and np.all(values == -1) and np.all(num_valid == 0)


@pytest.mark.parametrize("task", ["panoptic", "instance"])
def test_segment_grid_matches_and_terms_are_the_references(task):
    """Full-grid mode on segment labels: the matched (query, mask) pairs and each term of each layer are
    transformers' EomtLoss's on the EoMT authors' targets (one mask per segment value, class = value // 1000;
    instance: things only, stuff as background), within rtol 1e-5. Fails for targets per class instead of per
    segment (the semantic targets), the instance task training stuff masks or ignoring stuff pixels, a mask's class
    taken from the instance part."""
    f, preds, labels = _segment_fixture(task)
    opts = E.EomtLossOptions(num_classes=5, random_points=False, task=task)
    terms, matches = E.eomt_loss_terms(preds, labels, seeds_for(2), opts, return_matches=True)
    num_valid = f[f"{task}_num_valid"]
    _, _, ours = E.targets_of(labels, opts)
    np.testing.assert_array_equal(ours.numpy(), num_valid)
    g = int(num_valid.max())
    np.testing.assert_array_equal(matches.numpy(), f[f"{task}_grid_matches"][:, :, :g])
    got, total = numbers(terms, opts)
    np.testing.assert_allclose(got, f[f"{task}_grid_terms"], rtol=1e-5)
    np.testing.assert_allclose(total, np.sum(np.array([2.0, 5.0, 5.0])[:, None] * f[f"{task}_grid_terms"]),
                               rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["panoptic", "instance"])
def test_segment_random_sampling_agrees_with_the_reference_in_distribution(task):
    """The reference's own sampling on segment targets: each term's mean over SEEDS seeds within Z standard errors
    of the reference's mean over its runs. Fails for points drawn per class rather than per segment slot, or the
    same points for every slot of an image."""
    f, preds, labels = _segment_fixture(task)
    opts = E.EomtLossOptions(num_classes=5, num_points=int(f["random_points"]), task=task)
    b = labels.shape[0]
    tiled = [(np.tile(c, (SEEDS, 1, 1)), np.tile(m, (SEEDS, 1, 1, 1))) for c, m in preds]
    got, _ = numbers(E.eomt_loss_terms(tiled, np.tile(labels, (SEEDS, 1, 1)), seeds_for(b * SEEDS, 5), opts), opts)
    se = f[f"{task}_random_std"] * np.sqrt(1.0 / SEEDS + 1.0 / int(f["random_reps"]))
    z = (got - f[f"{task}_random_mean"]) / se
    assert np.all(np.abs(z) < Z), f"z-scores [term, layer]:\n{z}\nours {got}\nreference {f[f'{task}_random_mean']}"


def _segment_grid_by_hand(class_logits, mask_logits, labels, k, things_only):
    """Full-grid mode on segment labels at twice the prediction's resolution, in numpy (as _grid_terms_by_hand):
    a point whose 2 x 2 label block holds an unlabelled (class 255) or crowd (instance 999) pixel is dropped."""
    b, q, h, w = mask_logits.shape
    blocks = labels.reshape(b, h, 2, w, 2).transpose(0, 1, 3, 2, 4).reshape(b, h * w, 4)
    out = dict(class_sum=0.0, class_weight=0.0, mask_sum=0.0, dice_sum=0.0, mask_count=0.0)
    for i in range(b):
        v = labels[i]
        segment = (v // 1000 < k) & (v % 1000 != 999) & ((v % 1000 > 0) if things_only else True)
        present = np.unique(v[segment])
        kept = ~np.any((blocks[i] // 1000 == 255) | (blocks[i] % 1000 == 999), -1)
        x = mask_logits[i].reshape(q, -1).astype(np.float64)[:, kept]
        t = np.stack([np.mean(blocks[i] == s, -1) for s in present]).reshape(len(present), -1)[:, kept]
        n = max(kept.sum(), 1)
        sp_pos, sp_neg = np.logaddexp(0, -x), np.logaddexp(0, x)
        p = 1 / (1 + np.exp(-x))
        z = class_logits[i].astype(np.float64)
        prob = np.exp(z - z.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        cost = 5 * (sp_pos @ t.T + sp_neg @ (1 - t).T) / n + 2 * -prob[:, present // 1000] \
            + 5 * (1 - (2 * p @ t.T + 1) / (p.sum(-1)[:, None] + t.sum(-1)[None, :] + 1))
        rows, cols = linear_sum_assignment(cost)
        target = np.full(q, k)
        target[rows] = present[cols] // 1000
        weight = np.where(target == k, 0.1, 1.0)
        ce = np.log(np.exp(z).sum(-1)) - z[np.arange(q), target]
        out["class_sum"] += np.sum(weight * ce)
        out["class_weight"] += weight.sum()
        for r, c in zip(rows, cols):
            out["mask_sum"] += np.mean(sp_pos[r] * t[c] + sp_neg[r] * (1 - t[c]))
            out["dice_sum"] += 1 - (2 * np.sum(p[r] * t[c]) + 1) / (p[r].sum() + t[c].sum() + 1)
        out["mask_count"] += len(present)
    return out


@pytest.mark.parametrize("task", ["panoptic", "instance"])
def test_crowd_and_unlabelled_points_count_in_no_term_by_hand(task):
    """Full grid, segment labels at twice the resolution with crowd regions (a whole block and a band straddling
    blocks) and unlabelled pixels: every term equals numpy's with the points touching them dropped and crowd made
    no target; moving the logits there changes nothing. Fails for crowd points counted as background of every mask
    (the EoMT authors' crowd handling), crowd regions made targets, unlabelled pixels taken for segments."""
    rng = np.random.default_rng(5)
    b, q, k, h, w = 2, 8, 4, 8, 8
    classes = rng.integers(0, k, (b, 4, 4))
    instances = np.where(classes >= 2, rng.integers(1, 4, (b, 4, 4)), 0)  # classes 2, 3 things, 0, 1 stuff
    labels = (classes * 1000 + instances).repeat(4, 1).repeat(4, 2).astype(np.int32)
    labels[0, 4:8, 4:8] = 2999                      # a crowd block
    labels[0, 9:12] = 3999                          # a crowd band across grid blocks
    labels[1, rng.random((16, 16)) < 0.1] = 255000  # scattered unlabelled pixels
    class_logits = rng.normal(0, 1.5, (b, q, k + 1)).astype(np.float32)
    mask_logits = rng.normal(0, 2, (b, q, h, w)).astype(np.float32)
    opts = E.EomtLossOptions(num_classes=k, random_points=False, task=task)
    terms = E.eomt_loss_terms([(class_logits, mask_logits)], labels, seeds_for(2), opts)
    want = _segment_grid_by_hand(class_logits, mask_logits, labels, k, task == "instance")
    for name, value in want.items():
        np.testing.assert_allclose(terms[name].numpy()[0], value, rtol=1e-5, err_msg=name)
    blocks = labels.reshape(2, 8, 2, 8, 2).transpose(0, 1, 3, 2, 4).reshape(2, 8, 8, 4)
    dropped = np.any((blocks // 1000 == 255) | (blocks % 1000 == 999), -1)
    assert dropped[0].sum() > 0 and dropped[1].sum() > 0 and not dropped.all()
    moved = np.where(dropped[:, None], mask_logits + 7.0, mask_logits)
    again = E.eomt_loss_terms([(class_logits, moved)], labels, seeds_for(2), opts)
    for name in E.TERMS:
        np.testing.assert_allclose(again[name].numpy(), terms[name].numpy(), rtol=1e-6, err_msg=name)


def test_segment_halves_summed_are_the_whole_batch():
    """Tower invariance on panoptic targets with random points: the terms of a batch's two halves, summed, equal
    the whole batch's, the halves holding 2 and up to 9 segments per image (each its own compacted slot count).
    Fails for draws keyed by the batch's slot count or position, a mask count of one half."""
    rng = np.random.default_rng(8)
    b, q, k = 4, 10, 3
    classes = rng.integers(0, k, (b, 4, 4))
    labels = (classes * 1000 + np.where(classes > 0, rng.integers(1, 4, (b, 4, 4)), 0))
    labels[:2] = rng.integers(0, 2, (2, 4, 4)) * 1001
    labels = labels.repeat(4, 1).repeat(4, 2).astype(np.int32)
    counts = [len(np.unique(x)) for x in labels]
    assert max(counts[:2]) == 2 and max(counts[2:]) >= 5
    preds = [(rng.normal(size=(b, q, k + 1)).astype(np.float32), rng.normal(size=(b, q, 8, 8)).astype(np.float32))
             for _ in range(2)]
    seeds = rng.integers(0, 2**31 - 1, (b, 2)).astype(np.int32)
    opts = E.EomtLossOptions(num_classes=k, num_points=50, task="panoptic")
    whole = E.eomt_loss_terms(preds, labels, seeds, opts)
    halves = [E.eomt_loss_terms([(c[s], m[s]) for c, m in preds], labels[s], seeds[s], opts)
              for s in (slice(0, 2), slice(2, 4))]
    for name in E.TERMS:
        np.testing.assert_allclose(halves[0][name].numpy() + halves[1][name].numpy(), whole[name].numpy(),
                                   rtol=1e-5, err_msg=name)


def test_more_segments_than_queries_are_cut_to_the_queries():
    """An image with more segments than queries: the matcher takes the first Q (ascending values), the mask count
    is Q, the terms finite. Fails for a matcher asked for more masks than queries (an assertion at run time), or a
    mask count of every segment while only Q are matched."""
    rng = np.random.default_rng(9)
    labels = (1000 + np.arange(36).reshape(6, 6) % 7 + 1)[None].repeat(4, 1).repeat(4, 2).astype(np.int32)
    preds = [(rng.normal(size=(1, 5, 3)).astype(np.float32), rng.normal(size=(1, 5, 6, 6)).astype(np.float32))]
    opts = E.EomtLossOptions(num_classes=2, random_points=False, task="instance")
    terms, matches = E.eomt_loss_terms(preds, labels, seeds_for(1), opts, return_matches=True)
    assert float(terms["mask_count"][0]) == 5.0
    assert sorted(matches.numpy()[0, 0].tolist()) == [0, 1, 2, 3, 4]
    assert all(np.isfinite(v.numpy()).all() for v in terms.values())
