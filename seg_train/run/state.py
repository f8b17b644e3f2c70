"""What a run is made of between steps: the model, the optimizer, the counters, the EMA weights and
the loss scale, with the checkpoint objects they are saved as (the step itself is step.py).

Inference builds one with `optimizer=False`: no slot variables, and only the weights, counters and
EMA are read from a checkpoint.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from seg_train import models
from seg_train.config import Config
from seg_train.models import param_groups
from seg_train.parallel import towers
from seg_train.run.loss_scale import LossScale
from seg_train.run.schedule import lr_pair_at


class TrainState:
    """The model and its companions, built inside `strategy.scope()`.

    `optimizer`: build Keras' optimizer with its slot variables (training); False for inference.
    `step`: updates made so far (the data position is a pure function of it); `bn_stats_step`: the
    step the BN statistics were last re-estimated at (-1: never); `bn_positions`: where the statistics
    the forward pass updates sit in `non_trainable`.
    """

    def __init__(self, cfg: Config, strategy: tf.distribute.Strategy, optimizer: bool = True):
        self.cfg, self.strategy = cfg, strategy
        self.num_replicas = strategy.num_replicas_in_sync
        t = cfg.train
        only_first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        with strategy.scope():
            # The dtype policy is global in Keras; set it only while this model's layers are built.
            previous = keras.config.dtype_policy()
            keras.config.set_dtype_policy("float32" if t.precision == "float32" else t.precision)
            try:
                self.model = models.build(cfg.model, cfg.data.num_classes, cfg.seed)
                models.set_recompute(self.model, t.recompute)
            finally:
                keras.config.set_dtype_policy(previous)
            self.loss_scaling = LossScale(t.precision == "mixed_float16", only_first)
            self.loss_scale, self.good_steps = self.loss_scaling.scale, self.loss_scaling.good_steps
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step", aggregation=only_first)
            # The BN moving statistics match the weights only while bn_stats_step equals `step`.
            self.bn_stats_step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="bn_stats_step",
                                             aggregation=only_first)
            self.optimizer = None
            if optimizer:
                # Keras' optimizer holds the slots and iteration count (checkpoint layout); step.py updates.
                if t.optimizer == "adam":
                    self.optimizer = keras.optimizers.Adam(learning_rate=t.learning_rate)
                elif t.optimizer == "adamw":
                    self.optimizer = keras.optimizers.AdamW(learning_rate=t.learning_rate, weight_decay=t.weight_decay)
                    # Decay only the conv and dense kernels, not norms and biases (timm's and mmsegmentation's
                    # rule); kept in Keras' AdamW object, where update.decoupled_decay reads it back.
                    decayed = {id(v) for v in param_groups.decay_variables(self.model)}
                    self.optimizer.exclude_from_weight_decay(
                        var_list=[v for v in self.model.trainable_variables if id(v) not in decayed])
                else:
                    self.optimizer = keras.optimizers.SGD(learning_rate=t.learning_rate, momentum=t.momentum)
                # Build the slots now: restoring into an unbuilt optimizer silently skips them.
                self.optimizer.build(self.model.trainable_variables)
            # Inference builds the EMA too, to read a training checkpoint's averages.
            self.ema, self.ema_restored = None, False
            if t.ema_decay:
                self.ema = [tf.Variable(v.value, trainable=False, name=f"ema/{v.path}") for v in
                            self.model.trainable_variables]
        self.variables = list(self.model.trainable_variables)
        self.non_trainable = list(self.model.non_trainable_variables)
        self.bn_layers = models.batchnorm_layers(self.model)
        # Frozen BN layers update nothing.
        position = {id(v): i for i, v in enumerate(self.non_trainable)}
        self.bn_positions = [position[id(v)] for b in self.bn_layers if b.trainable
                             for v in (b.moving_mean, b.moving_variance)]
        self.per_tower_trace = towers.per_tower_trace(cfg.model.sync_batchnorm, self.num_replicas)

    @property
    def bn_variables(self) -> list:
        """The BN moving statistics the step updates, in the order TrainStep.probe returns them."""
        return [self.non_trainable[i] for i in self.bn_positions]

    @property
    def bn_momenta(self) -> list[float]:
        """The momentum of each of `bn_variables` (its layer's)."""
        return [float(b.momentum) for b in self.bn_layers if b.trainable for _ in range(2)]

    # ---- checkpoints -------------------------------------------------------------------------------
    def checkpoint_objects(self) -> dict:
        """What a training checkpoint holds (the data position is a pure function of `step`, data/reader.py)."""
        if self.optimizer is None:
            raise ValueError("a TrainState built without its optimizer (inference) writes no training checkpoint")
        objects = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                   "bn_stats_step": self.bn_stats_step}
        if self.ema is not None:
            objects["ema"] = self.ema
        objects.update(self.loss_scaling.checkpoint_objects())
        return objects

    def restore_weights(self, prefix: str) -> int:
        """Loads model weights, step and bn_stats_step (and the EMA if the checkpoint has one).

        Returns the checkpoint's step. The optimizer state is not read.
        """
        objects = {"model": self.model, "step": self.step, "bn_stats_step": self.bn_stats_step}
        reader = tf.train.load_checkpoint(prefix)
        if self.ema is not None and any(k.startswith("ema/") for k in reader.get_variable_to_shape_map()):
            objects["ema"] = self.ema  # a checkpoint of training (best/ holds the averaged weights as the model)
        ckpt = tf.train.Checkpoint(**objects)
        ckpt.read(prefix).expect_partial().assert_existing_objects_matched()
        self.ema_restored = "ema" in objects
        return int(self.step.numpy())

    def use_averaged_weights(self) -> None:
        """For evaluation, prediction and export: the model keeps the EMA weights from now on.

        The BN statistics belong to the training weights: bn_stats_step = -1 marks them for re-estimation.
        """
        for v, e in zip(self.variables, self.ema):
            v.assign(e)
        self.bn_stats_step.assign(-1)

    @contextlib.contextmanager
    def averaged_weights(self):
        """Within the block the model holds the EMA weights (train.ema_decay; a no-op without it).

        The training weights, BN statistics and bn_stats_step are restored exactly on exit; inside,
        bn_stats_step is -1 so precise BN re-estimates the statistics for the averaged weights.
        """
        if self.ema is None:
            yield
            return
        saved = [tf.identity(v.value) for v in self.variables + self.non_trainable]
        saved_marker = int(self.bn_stats_step.numpy())
        for v, e in zip(self.variables, self.ema):
            v.assign(e)
        self.bn_stats_step.assign(-1)
        try:
            yield
        finally:
            for v, x in zip(self.variables + self.non_trainable, saved):
                v.assign(x)
            self.bn_stats_step.assign(saved_marker)

    def learning_rates(self, step: int | None = None) -> tuple[float, float]:
        """(head, backbone) learning rates of the update made at `step` (default: the next one), computed on the
        host; they differ only during train.backbone_warmup_steps' two-stage warmup."""
        t = self.cfg.train
        step = int(self.step.numpy()) if step is None else step
        return lr_pair_at(step, t.learning_rate, t.num_steps, t.lr_power, t.warmup_steps, t.backbone_warmup_steps)

    def learning_rate(self, step: int | None = None) -> float:
        """The head's learning rate of the update made at `step` (the summaries' learning_rate)."""
        return self.learning_rates(step)[0]

    def distribute(self, dataset_fn):
        """Distributes a per-replica-batched dataset function (see ImageReader.train_dataset)."""
        return self.strategy.distribute_datasets_from_function(dataset_fn)
