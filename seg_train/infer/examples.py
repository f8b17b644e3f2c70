"""eval/examples: the predictions of a fixed set of val images, the same ones at every evaluation.

The first `k` val images at full resolution, predicted by the serving function on one device: no
collective is involved, so every worker of a multi-worker run can do it on its own.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

NUM_EXAMPLES = 4  # val images shown in eval/examples


def predict_examples(module, reader, k: int = NUM_EXAMPLES) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(uint8 RGB image [h, w, 3], uint8 label [h, w], uint8 prediction [h, w]) of the first k images.

    `module`: serving.serving_module's, used after any BN re-estimation so the pictures match the numbers.
    """
    out = []
    for i in range(min(k, len(reader))):
        image, label = reader.decode(tf.constant(i, tf.int64))
        pred = module.serve(image)["classes"]
        out.append((image.numpy(), label.numpy(), pred.numpy().astype(np.uint8)))
    return out
