"""The crop-first reader's JPEG window (seg_train/data/decode.py `decode_jpeg_window`, what the training stream's
`_decode_crop` calls with each crop's source box) at every class of window offset, against the whole image's
decode then cropped (TensorFlow's whole decode with the same accurate integer IDCT: the outside reference).

libjpeg-turbo's cropped decode upsamples the chroma of its window's first column as if it were the image's left
edge; with 4:2:0 and 4:2:2 chroma that column then differs from the whole decode (tens of levels) whenever the
window starts on the 8- or 16-pixel grid, and not when it starts between, so random windows step on it only
now and then. 4:4:4 files have no chroma upsampling and never differ. Offsets: 0 (the image's own edge), on
the 8-pixel grid only, on the 16-pixel MCU grid, off the grid; the same for the rows; Pillow's `subsampling`
2 / 1 / 0 (4:2:0 / 4:2:2 / 4:4:4).

Wrong answers these catch: the margin around the window removed, or kept only past the window's end.
"""

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.data import decode

H, W = 80, 144
BOX_H, BOX_W = 24, 40
OFFSETS = {"zero": 0, "grid8": 24, "grid16": 32, "grid16b": 48, "off_grid": 33, "off_grid_b": 13}


def _jpeg(subsampling: int) -> bytes:
    """Sharp colour edges in every column (chroma that upsampling smears), a smooth ramp under them."""
    yy, xx = np.mgrid[0:H, 0:W]
    blocks = np.random.default_rng(0).integers(0, 2, (H // 4, W // 4)).repeat(4, 0).repeat(4, 1) * 255
    image = np.stack([(xx * 7 + yy * 3) % 256, blocks, ((xx // 3 + yy // 5) % 2) * 255], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


@pytest.mark.parametrize("subsampling", [2, 1, 0], ids=["420", "422", "444"])
def test_window_at_every_offset_class_is_the_whole_decodes_crop(subsampling):
    data = _jpeg(subsampling)
    with Image.open(io.BytesIO(data)) as im:  # the premise: luma sampling factors (chroma 1 x 1)
        assert im.layer[0][1:3] == {2: (2, 2), 1: (2, 1), 0: (1, 1)}[subsampling]
    whole = tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_ACCURATE").numpy()
    contents = tf.constant(data)
    for row_name, top in OFFSETS.items():
        for col_name, left in OFFSETS.items():
            if top + BOX_H > H:
                continue
            box = tf.constant([top, left, BOX_H, BOX_W], tf.int32)
            part, origin = decode.decode_jpeg_window(contents, box, tf.constant([H, W], tf.int32))
            part, (y, x) = part.numpy(), origin.numpy()
            got = part[top - y:top - y + BOX_H, left - x:left - x + BOX_W]
            want = whole[top:top + BOX_H, left:left + BOX_W]
            assert got.shape == want.shape, (row_name, col_name)
            diff = np.abs(got.astype(int) - want).max()
            assert diff == 0, (f"window at row {top} ({row_name}), column {left} ({col_name}): "
                               f"{diff} levels off the whole decode")
