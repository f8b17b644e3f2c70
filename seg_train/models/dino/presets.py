"""keras-hub's DINOv3 and DINOv2 backbone presets loaded into models/dino/vit.py's encoders without keras-hub.

config.json and model.weights.h5, read as models/mit/presets.py reads MiT's; keras-hub's layout mapped onto
vit.py's layers by name (`_i` counts the blocks: none for the first):

  layers/dinov{3,2}_embedding/patch_embeddings/projection   -> patch_embed
  layers/dinov{3,2}_embedding/vars                         -> tokens: cls_token, [mask token: not used],
                                                              register_tokens, DINOv2: [its resized copy:
                                                              derived, not used], position_embeddings
  layers/dinov{3,2}_encoder/layers/dinov{3,2}_layer[_i]/   -> block<i+1>_
      norm1, norm2, layer_scale1, layer_scale2                 norm1, norm2, ls1, ls2
      DINOv3 attention/{query,key,value,output}_dense          attn_q, attn_k, attn_v, attn_out
      DINOv2 attention/attention/{query,key,value,output}_dense  the same (MultiHeadAttention's per-head
                                                                  kernels reshaped: heads are contiguous)
      DINOv3 mlp/{up_proj, down_proj} [+ gate_proj]            mlp_up, mlp_down [+ mlp_gate]
      DINOv2 mlp/{fc1, fc2} or mlp/{weights_in, weights_out}   mlp_up, mlp_down or mlp_in, mlp_out
  layers/layer_normalization                                -> norm

`check_dino_preset` reads only config.json, so a wrong preset is refused before any model is built;
every array is checked before any is assigned. Arrays of layers the encoder does not build are skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path

import keras
import numpy as np

from seg_train.config import ConfigError
from seg_train.config.variants import VIT_VARIANTS, ViTVariant
from seg_train.models.keras_hub import WeightsFile, assign, preset_directory, read_json

log = logging.getLogger("seg_train")

_CLASS = {"dinov3": "DINOV3Backbone", "dinov2": "DINOV2Backbone"}


def _expected(spec: ViTVariant) -> dict:
    """The config.json values that fix the architecture of `spec` (keras-hub's names)."""
    out = {"patch_size": spec.patch, "num_layers": spec.depth, "hidden_dim": spec.width, "num_heads": spec.heads,
           "intermediate_dim": spec.mlp, "num_register_tokens": spec.registers}
    if spec.family == "dinov3":
        out.update(use_gated_mlp=spec.gated, hidden_activation=spec.activation, use_key_bias=spec.key_bias,
                   use_query_bias=True, use_value_bias=True, use_proj_bias=True, use_mlp_bias=True,
                   rope_theta=spec.rope_theta, layer_norm_eps=spec.epsilon)
    else:
        out.update(use_swiglu_ffn=spec.gated, antialias_in_interpolation=spec.antialias,
                   position_embedding_grid=spec.pos_grid)
    return out


def _spec(name) -> tuple[str, ViTVariant]:
    return (name, VIT_VARIANTS[name]) if isinstance(name, str) else (f"{name.family}_custom", name)


def check_dino_preset(directory, name) -> Path:
    """The preset directory, its config.json checked to be keras-hub's backbone of the DINO variant `name`
    (a VIT_VARIANTS key or a ViTVariant). Cheap: before the model is built."""
    label, spec = _spec(name)
    wanted = _CLASS[spec.family]
    d = preset_directory(directory, "the DINO preset", wanted)
    raw = read_json(d, "config.json", "the DINO preset", wanted)
    path = d / "config.json"
    got_class = raw.get("class_name")
    if got_class != wanted:
        raise ConfigError("preset of another model", str(path),
                          f"expected a keras-hub {wanted} for {label}, got {got_class!r}")
    config = dict(raw["config"])
    if spec.family == "dinov2":
        shape = config.get("position_embedding_shape") or [0]
        patch = config.get("patch_size") or 1
        config["position_embedding_grid"] = shape[0] // patch if isinstance(shape[0], int) else None
    wrong = [f"{k} {v!r} (got {config.get(k)!r})" for k, v in _expected(spec).items() if config.get(k) != v]
    if wrong:
        raise ConfigError("preset of another model size", str(path),
                          f"expected {label}'s {', '.join(wrong)}")
    return d


def load_dino_preset(model: keras.Model, directory, name=None) -> int:
    """A keras-hub DINOv3/DINOv2 preset directory into `model` (vit.dino_encoder of the variant `name`;
    default the model's name). Returns the number of arrays loaded."""
    label, spec = _spec(name if name is not None else model.name)
    d = check_dino_preset(directory, label if label in VIT_VARIANTS else spec)
    fam = spec.family
    weights = WeightsFile(d / "model.weights.h5", f"{_CLASS[fam]} ({label})")
    pairs = []
    built = {layer.name for layer in model.layers}

    def take(ours: str, group: str, attrs: tuple[str, ...], reshape: bool = False):
        arrays = weights.arrays(group)
        if ours not in built:  # a block after the last output, or the final norm when off
            return
        layer = model.get_layer(ours)
        variables = [getattr(layer, a) for a in attrs if getattr(layer, a, None) is not None]
        if len(arrays) != len(variables):
            raise ConfigError("preset weights do not match", str(weights.path),
                              f"expected {len(variables)} arrays for {ours} at '{group}', got {len(arrays)}")
        for v, a in zip(variables, arrays):
            if reshape and a.size == np.prod(v.shape):
                a = a.reshape(v.shape)
            if tuple(a.shape) != tuple(v.shape):
                raise ConfigError("preset weights do not match", str(weights.path),
                                  f"expected {ours}/{v.name} of shape {tuple(v.shape)} at '{group}/vars', "
                                  f"got {tuple(a.shape)}")
            pairs.append((v, a))

    try:
        embed = f"layers/{fam}_embedding"
        take("patch_embed", f"{embed}/patch_embeddings/projection", ("kernel", "bias"))
        arrays = weights.arrays(embed)
        tokens = model.get_layer("tokens")
        # keras-hub's order: cls, mask, registers, then DINOv2's resized copy and its position embedding.
        mine = [tokens.cls_token, None]
        if spec.registers:
            mine.append(tokens.register_tokens)
        if fam == "dinov2":
            mine += [None, tokens.position_embeddings]
        if len(arrays) != len(mine):
            raise ConfigError("preset weights do not match", str(weights.path),
                              f"expected {len(mine)} arrays at '{embed}/vars' (use_mask_token true), "
                              f"got {len(arrays)}")
        for v, a in zip(mine, arrays):
            if v is None:
                continue
            if tuple(a.shape) != tuple(v.shape):
                raise ConfigError("preset weights do not match", str(weights.path),
                                  f"expected tokens/{v.name} of shape {tuple(v.shape)} at '{embed}/vars', "
                                  f"got {tuple(a.shape)}")
            pairs.append((v, a))

        attn = "attention" if fam == "dinov3" else "attention/attention"
        if fam == "dinov3":
            mlp = (("mlp_gate", "gate_proj"),) if spec.gated else ()
            mlp += (("mlp_up", "up_proj"), ("mlp_down", "down_proj"))
        else:
            mlp = (("mlp_in", "weights_in"), ("mlp_out", "weights_out")) if spec.gated else \
                (("mlp_up", "fc1"), ("mlp_down", "fc2"))
        for i in range(spec.depth):
            block = f"layers/{fam}_encoder/layers/{fam}_layer" + (f"_{i}" if i else "")
            ours = f"block{i + 1}"
            take(f"{ours}_norm1", f"{block}/norm1", ("gamma", "beta"))
            for mine_, theirs in (("q", "query"), ("k", "key"), ("v", "value"), ("out", "output")):
                take(f"{ours}_attn_{mine_}", f"{block}/{attn}/{theirs}_dense", ("kernel", "bias"), reshape=True)
            take(f"{ours}_ls1", f"{block}/layer_scale1", ("gamma",))
            take(f"{ours}_norm2", f"{block}/norm2", ("gamma", "beta"))
            for mine_, theirs in mlp:
                take(f"{ours}_{mine_}", f"{block}/mlp/{theirs}", ("kernel", "bias"))
            take(f"{ours}_ls2", f"{block}/layer_scale2", ("gamma",))
        take("norm", "layers/layer_normalization", ("gamma", "beta"))
        weights.check_all_read()
    finally:
        weights.close()
    n = assign(pairs)
    log.info("loaded %d arrays of the keras-hub preset %s into the %s encoder", n, d, label)
    return n
