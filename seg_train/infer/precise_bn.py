"""Precise BatchNorm statistics: re-estimates every BN layer's moving mean/variance for the weights.

Why: BN evaluates with moving averages that lag far behind the weights when training is short or
from scratch (keras.applications uses momentum 0.999); see docs/BATCHNORM.md.

`PreciseBN.reestimate` ("precise BN", Wu & Johnson, "Rethinking Batch in BatchNorm") runs
`num_batches` training batches forward in training mode on the towers, records each BN layer's
per-channel INPUT moments, combines them on the host in float64, and assigns the population mean and
(biased) variance in cross-replica context; then `state.bn_stats_step = state.step`. No gradient,
no optimizer: only moving statistics change. Frozen BN layers are left alone: Keras normalises
them with their moving statistics in training mode, so those ARE what the weights were trained with.

The batches are a fixed window of the training stream (`stream_start_step`); the stream is a pure
function of (seed, sample counter), so this never moves the training position and the result is a
deterministic function of the weights.

A BN layer's input is read through a probe model (`_probe`): a clone of the model on its own layers
whose extra outputs are the moments. A tensor inside a nested model cannot be an output of the outer
one, so each nested model holding BN layers gets its own probe, called in its place.
"""

from __future__ import annotations

import logging
import time

import keras
import numpy as np
import tensorflow as tf

from seg_train import models
from seg_train.config import Config, ConfigError, check_batch
from seg_train.data.feed import Feed
from seg_train.data.split import open_split, train_dataset_fn
from seg_train.parallel.towers import TowerPass
from seg_train.util.progress import progress_bar, shown

log = logging.getLogger("seg_train")

# Far beyond any position a run trains on, well inside the reader's 2**62 range.
STREAM_START_SAMPLE = 2**40


def stream_start_step(global_batch: int) -> int:
    """The training-stream step where the re-estimation batches start (fixed, so deterministic)."""
    return STREAM_START_SAMPLE // global_batch


class _InputMoments(keras.layers.Layer):
    """A BN layer's input as (pixel count int64, per-channel mean, per-channel M2 float32).

    Takes the BN layer's dtype policy and autocast so the input is cast as for the BN layer. A mask
    is refused: BN would normalise over unmasked pixels only. Centred per batch (M2, not sum(x^2))
    so the host combination does not lose the variance to cancellation when |mean| >> std.
    """

    def __init__(self, bn):
        super().__init__(dtype=bn.dtype_policy, autocast=bn.autocast)
        self.bn_name, self.axis = bn.name, bn.axis

    def call(self, inputs, mask=None):
        if mask is not None:
            raise ValueError(f"BN re-estimation: layer {self.bn_name!r} received a mask; masked "
                             "BatchNormalization inputs are not supported")
        x = tf.cast(inputs, tf.float32)  # BN computes in float32 under mixed precision too
        ndim = x.shape.rank
        axes = [a for a in range(ndim) if a != self.axis % ndim]
        mean, var = tf.nn.moments(x, axes)
        count = tf.size(x, out_type=tf.int64) // tf.shape(x, out_type=tf.int64)[self.axis]
        return count, mean, var * tf.cast(count, tf.float32)

    def compute_output_spec(self, inputs, mask=None):
        # Without it Keras traces `call` in a scratch graph per BN layer while building the probe.
        channels = inputs.shape[self.axis]
        return (keras.KerasTensor((), "int64"), keras.KerasTensor((channels,), "float32"),
                keras.KerasTensor((channels,), "float32"))


def _probe(model, wanted: dict):
    """(probe, layout): `model`'s outputs, then three `_InputMoments` outputs per call of a layer in
    `wanted` (id -> index); `layout` gives (index, channels) per call. Functional models only.
    """
    found = []  # (index, channels, (count, mean, m2)), in the graph's call order

    def call(layer, *args, **kwargs):
        if isinstance(layer, keras.Model) and any(id(b) in wanted for b in models.batchnorm_layers(layer)):
            sub, sub_layout = _probe(layer, wanted)
            outs = sub(*args, **kwargs)
            n = len(layer.outputs)
            found.extend((i, c, outs[k:k + 3]) for (i, c), k in zip(sub_layout, range(n, len(outs), 3), strict=True))
            return keras.tree.pack_sequence_as(layer.output, outs[:n])
        if id(layer) in wanted:
            x = args[0]
            found.append((wanted[id(layer)], int(x.shape[layer.axis]),
                          _InputMoments(layer)(x, mask=kwargs.get("mask"))))
        return layer(*args, **kwargs)

    clone = keras.models.clone_model(model, clone_function=lambda layer: layer, call_function=call)
    probe = keras.Model(clone.input, clone.outputs + [t for _, _, moments in found for t in moments])
    return probe, [(i, c) for i, c, _ in found]


def _combine(acc, count, mean, m2):
    """Chan et al.'s parallel update of (N, mean, M2) with one more batch, in float64."""
    count = float(count)
    mean = np.asarray(mean, np.float64)
    m2 = np.asarray(m2, np.float64)
    if acc is None:
        return count, mean, m2
    n_a, mean_a, m2_a = acc
    n = n_a + count
    delta = mean - mean_a
    return n, mean_a + delta * (count / n), m2_a + m2 + delta * delta * (n_a * count / n)


def _combine_rows(acc, rows, layout):
    """Merges one batch's [towers, F] records into the per-layer (N, mean, M2) accumulators."""
    for row in rows:
        pos = 0
        for i, c in layout:
            count, mean, m2 = row[pos], row[pos + 1:pos + 1 + c], row[pos + 1 + c:pos + 1 + 2 * c]
            pos += 1 + 2 * c
            acc[i] = _combine(acc[i], count, mean, m2)


class PreciseBN:
    """Precise BN for one TrainState: `reestimate` and the gate before inference, `maybe_reestimate`.

    Keeps the probe and compiled forward pass between calls (rebuilt when the trainable BN layers
    change), so repeated evaluations during training do not retrace.
    """

    def __init__(self, state):
        self.state = state
        self._forward = None  # (the BN layers' ids, the compiled forward pass, its layout)

    def _forward_fn(self, layers):
        """(tf.function of one global batch -> [towers, F] flat moments in `layout` order, layout)."""
        key = tuple(id(layer) for layer in layers)
        if self._forward is not None and self._forward[0] == key:
            return self._forward[1], self._forward[2]
        state = self.state
        model, strategy = state.model, state.strategy
        probe, layout = _probe(model, {id(layer): i for i, layer in enumerate(layers)})
        n_outputs = len(model.outputs)

        def body(tv, st, images):
            # The tower's values mapped onto the model's variables (as model.stateless_call does);
            # the moving-statistics updates stay in the scope and are dropped.
            mapping = list(zip(model.trainable_variables, tv, strict=True))
            mapping += zip(model.non_trainable_variables, st, strict=True)
            with keras.StatelessScope(state_mapping=mapping):
                outs = probe(images, training=True)[n_outputs:]
            flat = []
            for k in range(0, len(outs), 3):
                count, mean, m2 = outs[k:k + 3]
                flat += [tf.reshape(tf.cast(count, tf.float32), [1]), mean, m2]
            return tf.concat(flat, axis=0)

        @tf.function(autograph=False)
        def forward(batch):
            images, _ = batch
            per_tower = strategy.experimental_local_results(images)[0]
            # The variable lists as they are now: freezing a layer moves its weights between them.
            tower = TowerPass(body, model.trainable_variables, model.non_trainable_variables,
                              per_tower=state.per_tower_trace).trace(tf.TensorSpec(per_tower.shape, per_tower.dtype))
            out = strategy.run(tower, (images,))
            return tf.stack(strategy.experimental_local_results(out))

        self._forward = (key, forward, layout)
        return forward, layout

    def reestimate(self, reader, num_batches: int, progress: bool = True) -> bool:
        """Sets every BN layer's moving statistics to the population statistics of the current weights.

        Args:
          reader: the training split's `ImageReader` (batches with the training augmentation).
          num_batches: global batches of `cfg.data.batch_size` images to estimate from.
        Returns:
          False if the statistics already matched this step (nothing changes), else True.
        """
        state = self.state
        if int(state.bn_stats_step.numpy()) == int(state.step.numpy()):
            return False
        t0 = time.perf_counter()
        if num_batches < 1:
            raise ConfigError("invalid number of BN re-estimation batches", "eval.bn_reestimate_batches",
                              f"expected a positive number of batches, got {num_batches}")
        cfg, strategy, model = state.cfg, state.strategy, state.model
        n_towers = strategy.num_replicas_in_sync
        batch = cfg.data.batch_size
        check_batch(cfg, n_towers)
        layers = [layer for layer in models.batchnorm_layers(model) if layer.trainable]
        if not layers:
            state.bn_stats_step.assign(state.step)
            return True
        start = stream_start_step(batch)

        # Every worker reads the same batches, so each computes the same statistics without exchanging
        # them. The stream ends with the batches used, so nothing is decoded beyond them.
        dataset_fn = train_dataset_fn(reader, batch, start_step=start, end_step=start + num_batches,
                                      shard_over_workers=False)
        forward, layout = self._forward_fn(layers)
        bar = progress_bar(num_batches, "BN statistics", "batch") if shown(progress) else None
        acc, seen = [None] * len(layers), 0
        try:
            for dist_batch in Feed(state.distribute(dataset_fn)):
                rows = forward(dist_batch).numpy().astype(np.float64)  # one host read per batch
                seen += 1
                _combine_rows(acc, rows, layout)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        if seen != num_batches:  # the stream ends after them; fewer would mean a broken reader
            raise RuntimeError(f"BN re-estimation read {seen} batches, expected {num_batches}")

        # Cross-replica context: assigning a MirroredVariable writes every tower's copy.
        unused = []
        for layer, a in zip(layers, acc):
            if a is None:
                unused.append(layer.name)
                continue
            n, mean, m2 = a
            layer.moving_mean.assign(mean.astype(np.float32))
            layer.moving_variance.assign(np.maximum(m2 / n, 0.0).astype(np.float32))
        if unused:
            log.warning("BN re-estimation: %d layer(s) never called in the forward pass, left as they were: %s",
                        len(unused), ", ".join(unused))
        state.bn_stats_step.assign(state.step)
        log.info("re-estimated the statistics of %d BN layers at step %d from %d batches (%d images, %d tower(s)) "
                 "in %.1fs", len(layers) - len(unused), int(state.step.numpy()), num_batches, num_batches * batch,
                 n_towers, time.perf_counter() - t0)
        return True

    def maybe_reestimate(self, cfg: Config, progress: bool = True) -> bool:
        """Re-estimates the BN statistics if eval.bn_reestimate_batches > 0; whether they match the weights."""
        state = self.state
        if cfg.eval.bn_reestimate_batches > 0 and int(state.bn_stats_step.numpy()) != int(state.step.numpy()):
            train = open_split(cfg, cfg.data.train_split, optional=True)  # the re-estimation reads it
            if train is None:
                # E.g. predicting where the training data is not at hand: keep the trained statistics.
                log.warning("BN statistics not re-estimated: training split %r not found under %s "
                            "(eval.bn_reestimate_batches needs it)", cfg.data.train_split, cfg.data.root)
                return False
            self.reestimate(train.reader, cfg.eval.bn_reestimate_batches, progress=progress)
        return int(state.bn_stats_step.numpy()) == int(state.step.numpy())
