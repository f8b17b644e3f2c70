"""Which layer classes a model is built with: one value passed down the build.

`models.build` makes one `LayerChoice` from the config and hands it to the backbone and head. Passed
explicitly rather than as process-wide flags, so no build can see another's choice. The classes have
the same variables, so the choice changes speed and rounding, never what a checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from keras import layers

from seg_train.models.atrous import conv2d_class
from seg_train.models.bn import bn_class


@dataclass(frozen=True)
class LayerChoice:
    """The layer classes of one build; every field is a config key of the same name under `model:`."""

    sync_batchnorm: bool   # statistics synchronized across towers (models/sync_bn.py)
    fused_batchnorm: bool  # False: Keras' own BatchNormalization per tower instead of models/fused_bn.py
    fast_atrous: bool      # False: Keras' own Conv2D for dilated convs instead of models/atrous.py

    def batch_norm_class(self) -> type:
        """The BatchNormalization class (models/bn.py maps the flags to it)."""
        return bn_class(sync=self.sync_batchnorm, fused=self.fused_batchnorm)

    def batch_norm(self, momentum: float, epsilon: float, name: str) -> layers.BatchNormalization:
        """A new BatchNormalization layer of the chosen class."""
        return self.batch_norm_class()(momentum=momentum, epsilon=epsilon, synchronized=self.sync_batchnorm,
                                       name=name)

    def conv2d_class(self, dilation) -> type:
        """The Conv2D class for a stride-1 'same' conv at this dilation (models/atrous.py maps it)."""
        return conv2d_class(dilation, fast=self.fast_atrous)


def layer_choice(cfg) -> LayerChoice:
    """The LayerChoice a ModelConfig asks for."""
    return LayerChoice(sync_batchnorm=cfg.sync_batchnorm, fused_batchnorm=cfg.fused_batchnorm,
                       fast_atrous=cfg.fast_atrous)


def drop_path_rate(cfg) -> float:
    """The backbone's stochastic depth from a ModelConfig. A frozen backbone runs as in inference: no residual
    branch dropped (config/resolve.py refuses a rate with it)."""
    return 0.0 if cfg.freeze_backbone else (cfg.drop_path_rate or 0.0)
