"""data.photometric: the colour jitter against numpy by hand, its draws, and the stream it leaves exact.

Wrong answers these catch: a step's formula or order off (saturation scaling V, hue in degrees not
on the 0..180 scale, no clipping between steps); draws tied to state (a resumed or N-tower stream
that differs); the new draws taken from the old keys (old configs' crops move); the padding jittered.
"""

import colorsys
import hashlib

import numpy as np
import pytest
import tensorflow as tf

from seg_train.data import synthetic
from seg_train.data.reader import apply_photometric, photometric_draws
from tests.helpers import open_reader, tiny_config

MMSEG = {"brightness": 32, "contrast": 0.5, "saturation": 0.5, "hue": 18}


def numpy_jitter(image, brightness=None, contrast=None, saturation=None, hue=None):
    """The jitter by hand: float RGB 0..255, HSV through colorsys, clip after each step."""
    x = image.astype(np.float64)
    if brightness is not None:
        x = np.clip(x + brightness, 0, 255)
    if contrast is not None:
        x = np.clip(x * contrast, 0, 255)
    for factor, shift in ((saturation, None), (None, hue)):
        if factor is None and shift is None:
            continue
        out = np.empty_like(x)
        for i in np.ndindex(x.shape[:2]):
            h, s, v = colorsys.rgb_to_hsv(*(x[i] / 255.0))
            if factor is not None:
                s = min(s * factor, 1.0)
            else:
                h = (h + shift / 180.0) % 1.0
            out[i] = np.array(colorsys.hsv_to_rgb(h, s, v)) * 255.0
        x = np.clip(out, 0, 255)
    return x


@pytest.mark.parametrize("draw", [
    {"brightness": 20.0}, {"brightness": -40.0}, {"contrast": 1.4}, {"saturation": 0.6}, {"saturation": 1.5},
    {"hue": 10.0}, {"hue": -17.0},
    {"brightness": 25.0, "contrast": 1.3, "saturation": 1.4, "hue": 12.0},
])
def test_jitter_matches_numpy_by_hand(draw):
    rng = np.random.default_rng(0)
    image = rng.uniform(0, 255, size=(5, 6, 3)).astype(np.float32)
    image[0, 0] = [250, 240, 10]  # near the top: brightness and contrast must clip
    image[0, 1] = [7, 7, 7]  # grey: no hue, saturation stays 0
    amounts = {k: v - 1.0 if k in ("contrast", "saturation") else v for k, v in draw.items()}
    draws = {k: (tf.constant(True), tf.constant(a, tf.float32)) for k, a in amounts.items()}
    got = apply_photometric(tf.constant(image), draws).numpy()
    np.testing.assert_allclose(got, numpy_jitter(image, **draw), atol=2e-3 * 255)
    # A step not drawn leaves the image as it is.
    off = {k: (tf.constant(False), a) for k, (_, a) in draws.items()}
    np.testing.assert_array_equal(apply_photometric(tf.constant(image), off).numpy(), image)


def test_draws_half_applied_and_uniform_in_the_ranges():
    applied = {k: [] for k in MMSEG}
    amounts = {k: [] for k in MMSEG}
    for k in range(400):
        for name, (on, amount) in photometric_draws(MMSEG, tf.constant([5, k], tf.int64)).items():
            applied[name].append(bool(on))
            amounts[name].append(float(amount))
    for name, v in MMSEG.items():
        a = np.array(amounts[name])
        assert 0.4 < np.mean(applied[name]) < 0.6, name
        assert a.min() >= -v and a.max() <= v and a.min() < -0.8 * v and a.max() > 0.8 * v, name
        assert abs(a.mean()) < 0.15 * v, name
    # Each step's draws are its own: turning the others off does not move them.
    alone = photometric_draws({"hue": 18}, tf.constant([5, 3], tf.int64))["hue"]
    both = photometric_draws(MMSEG, tf.constant([5, 3], tf.int64))["hue"]
    assert float(alone[1]) == float(both[1]) and bool(alone[0]) == bool(both[0])


def reader_for(tmp_path, photometric, seed=7):
    root = synthetic.generate(tmp_path / "demo", num_train=10, num_val=2, size=(40, 48), num_classes=3)
    # A crop larger than some scaled images: the padding is in the batches.
    cfg = tiny_config(tmp_path, data_root=root, data={"batch_size": 4, "crop_size": [44, 44],
                                                      "photometric": photometric})
    return open_reader(cfg, "train", seed=seed)


def batches(reader, start, n, towers=1):
    it = iter(reader.train_dataset(4, start_step=start, num_replicas=towers))
    out = []
    for _ in range(n):
        parts = [next(it) for _ in range(towers)]
        out.append((np.concatenate([p[0].numpy() for p in parts]), np.concatenate([p[1].numpy() for p in parts])))
    return out


def test_stream_exact_across_towers_and_resume(tmp_path):
    """Global batches: 1 tower = 4 towers, and a fresh reader started at step 2 (a resumed run) continues
    the stream of one that ran from step 0, bit for bit, across an epoch boundary."""
    straight = batches(reader_for(tmp_path / "a", MMSEG), 0, 4)
    for got, want in zip(batches(reader_for(tmp_path / "b", MMSEG), 0, 4, towers=4), straight):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    for got, want in zip(batches(reader_for(tmp_path / "c", MMSEG), 2, 2), straight[2:]):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    # The jitter is on, the crops are those without it, and the padding is still the mean (0).
    plain = batches(reader_for(tmp_path / "d", None), 0, 4)
    changed = 0
    for (im, lb), (im0, lb0) in zip(straight, plain):
        np.testing.assert_array_equal(lb, lb0)
        pad = (lb == 255) & (im0 == 0).all(axis=-1)  # (the synthetic labels also ignore pixels inside)
        assert pad.any()
        np.testing.assert_array_equal(im[pad], 0.0)
        changed += int(np.abs(im - im0).max() > 0.05)
    assert changed == 4


# sha256 of the first three global batches (images, labels) of reader_for(..., None), computed with the
# code before data.photometric existed: an old config's stream is bit for bit what it was.
OLD_STREAM = "85579cc03290c2b7fe2d4d1b6ef9506e21e3085eeff933310ddcd864d33f3cb2"


def test_old_config_stream_unchanged(tmp_path):
    digest = hashlib.sha256()
    for im, lb in batches(reader_for(tmp_path, None), 0, 3):
        digest.update(im.tobytes())
        digest.update(lb.tobytes())
    assert digest.hexdigest() == OLD_STREAM


@pytest.mark.parametrize("value, expected", [
    ({"brightnes": 32}, "keys among brightness, contrast, saturation, hue"),
    ({"hue": 120}, "hue in (0, 90]"),
    ({"contrast": 0}, "contrast in (0, 1]"),
    ([32, 0.5], "a mapping"),
])
def test_config_errors(tmp_path, value, expected):
    from seg_train.config import ConfigError
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, data={"photometric": value})
    assert e.value.where == "data.photometric" and expected in e.value.expected, str(e.value)
