"""The serving function: one uint8 image in, class map and probabilities out, preprocessing and
inference modes in the graph. seg-export, seg-predict and the TensorBoard examples all use it, so
they agree. TensorFlow is imported inside the function, so arguments are checked first.
"""

from __future__ import annotations


def serving_module(model, mean, std, eval_cfg=None, offsets=None):
    """A tf.Module holding `model`, whose `serve` segments one image with the inference modes of `eval_cfg`.

    `serve(image)`: image uint8 [height, width, 3] (RGB) -> {"classes": int32 [height, width],
    "probabilities": float32 [height, width, num_classes]}, at the input's size.

    Args:
      eval_cfg: an EvalConfig; default: one whole-image pass.
      offsets: modes.score_offsets' result, or None.
    """
    import tensorflow as tf

    from seg_train import models
    from seg_train.config import EvalConfig
    from seg_train.infer import modes

    eval_cfg = EvalConfig() if eval_cfg is None else eval_cfg
    num_classes = model.output_shape[-1]
    pad_to = models.input_multiple(model)
    module = tf.Module()
    module.model = model  # tracked: its variables are saved with the module
    mean = tf.constant(mean, tf.float32)
    std = tf.constant(std, tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, None, 3], tf.uint8, name="image")])
    def serve(image):
        x = (tf.cast(image, tf.float32) - mean) / std  # the same ops as ImageReader.normalize
        scores = modes.class_scores(lambda t: model(t, training=False), x[None], eval_cfg, num_classes,
                                     pad_to=pad_to, offsets=offsets)[0]
        return {"classes": tf.argmax(scores, axis=-1, output_type=tf.int32),
                "probabilities": modes.probabilities(scores, eval_cfg)}

    module.serve = serve
    return module


def mask_serving_module(model, mean, std):
    """A tf.Module holding an EoMT `model` for data.task panoptic / instance, whose `serve` gives its raw outputs;
    the letterbox before and the post-processing after it are the caller's (infer/mask_evaluate.py's letterbox,
    infer/mask_postprocess.py), as in evaluation.

    `serve(image)`: image uint8 [height, width, 3] (RGB; the letterboxed crop, height and width multiples of the
    patch, else padded with black to them) -> {"class_logits": float32 [Q, K + 1] (the last class "no object"),
    "mask_logits": float32 [Q, h, w] of the (padded) input, h, w = 4 x its patch grid}.
    """
    import tensorflow as tf

    from seg_train import models

    pad_to = models.input_multiple(model)
    module = tf.Module()
    module.model = model
    mean = tf.constant(mean, tf.float32)
    std = tf.constant(std, tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, None, 3], tf.uint8, name="image")])
    def serve(image):
        h, w = tf.shape(image)[0], tf.shape(image)[1]
        image = tf.pad(image, [[0, (-h) % pad_to], [0, (-w) % pad_to], [0, 0]])
        x = (tf.cast(image, tf.float32) - mean) / std  # ImageReader.normalize's ops, as in serving_module
        class_logits, mask_logits = model.predictions(x[None], training=False)[-1]
        return {"class_logits": class_logits[0], "mask_logits": mask_logits[0]}

    module.serve = serve
    return module
