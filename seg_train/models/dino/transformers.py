"""Checkpoints in the transformers format (a folder with config.json and model.safetensors, or a sharded
model.safetensors.index.json) loaded into models/dino/vit.py's DINO encoders and models/eomt/eomt.py's EoMT, without
PyTorch or transformers (safetensors read by models/safetensors_file.py).

  model.backbone_weights: DIR   DINOv3ViTModel (dinov3_*), Dinov2Model (dinov2_vit*14), Dinov2WithRegistersModel
                                (dinov2_vit*14_reg) into the encoder
  model.init_weights: DIR       EomtForUniversalSegmentation (DINOv2 inside, learned positions, key bias: the
                                dinov2_vit*16_reg backbones) or EomtDinov3ForUniversalSegmentation (RoPE, no key
                                bias: dinov3_*) into EoMT: encoder, queries, class head, mask MLP, upscale blocks

A folder is told from a keras-hub preset by its config.json ("model_type" / "architectures"; keras-hub's has
"class_name" / "config"). Two steps, so nothing is built for a wrong folder and nothing is half-loaded:
`check_backbone_folder` / `check_eomt_folder` read config.json and the safetensors headers only (before the
model is built): the architecture, every size the run's model fixes (width, depth, heads, MLP, patch, registers,
position grid, queries, EoMT blocks, ...), every tensor's name, shape and dtype, and that no tensor is left
over; each refusal is one ConfigError line naming the config key and both values. `load_backbone_folder` /
`load_eomt_folder` then read every array, check it against the variable it goes to, and assign them all.

Deliberately not loaded: blocks after the last one the encoder is built with (model.vit_layers), the mask token
(masked-image pre-training only), EoMT's attn_mask_probs (the annealing state: seg-train predicts without masks,
as a trained EoMT ends) and criterion.empty_weight (the loss's no-object weight, from loss settings), and the
class head when its classes are not data.num_classes (+ "no object"): it keeps its initialisation, with a
one-line notice (fine-tuning COCO's 133 classes to ADE20K's 150).

Layouts (torch -> Keras): Linear [out, in] -> Dense [in, out]; Conv2d [out, in, kh, kw] -> [kh, kw, in, out];
ConvTranspose2d [in, out, kh, kw] -> [kh, kw, out, in]; depthwise [C, 1, 3, 3] -> [3, 3, C, 1]; SwiGLU's gate_proj
and up_proj side by side in one Dense (gate first: vit.SwiGLU's first half), DINOv2's fused weights_in as it is;
DINOv2's position table [1, 1 + G*G, C] as it is, EoMT's [G*G, C] without a CLS entry
(variants.ViTVariant.cls_position false). Positions are resized as transformers resizes them
(variants.ViTVariant.torch_bicubic: model.position_resize torch). What transformers' classes cannot do, seg-train's
do: EoMT at another size than its config's image_size (positions resized, or RoPE), masked attention at any grid.

Held to transformers by tests/test_transformers_weights.py (folders scripts/reference_transformers_checkpoints.py
writes with save_pretrained, and transformers' outputs on them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from seg_train.config import ConfigError
from seg_train.config.variants import VIT_VARIANTS, ViTVariant, swiglu_width
from seg_train.models.safetensors_file import FLOATS, Checkpoint

log = logging.getLogger("seg_train")

ENCODERS = ("DINOv3ViTModel", "Dinov2Model", "Dinov2WithRegistersModel")
EOMTS = ("EomtForUniversalSegmentation", "EomtDinov3ForUniversalSegmentation")
_MODEL_TYPES = {"dinov3_vit": "DINOv3ViTModel", "dinov2": "Dinov2Model",
                "dinov2_with_registers": "Dinov2WithRegistersModel", "eomt": "EomtForUniversalSegmentation",
                "eomt_dinov3": "EomtDinov3ForUniversalSegmentation"}
_FAMILY = {"DINOv3ViTModel": "dinov3", "Dinov2Model": "dinov2", "Dinov2WithRegistersModel": "dinov2",
           "EomtForUniversalSegmentation": "dinov2", "EomtDinov3ForUniversalSegmentation": "dinov3"}

# transformers 5's defaults of the config keys checked, for a config.json written without them.
_COMMON = {"num_channels": 3, "hidden_act": "gelu", "layerscale_value": 1.0}
_DINOV3 = {**_COMMON, "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 12,
           "num_attention_heads": 6, "layer_norm_eps": 1e-5, "patch_size": 16, "query_bias": True,
           "key_bias": False, "value_bias": True, "proj_bias": True, "mlp_bias": True, "use_gated_mlp": False,
           "num_register_tokens": 0, "rope_theta": 100.0}
_DINOV2 = {**_COMMON, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "mlp_ratio": 4,
           "layer_norm_eps": 1e-6, "image_size": 224, "patch_size": 14, "qkv_bias": True, "use_swiglu_ffn": False,
           "num_register_tokens": 0}
_EOMT = {"num_upscale_blocks": 2, "num_blocks": 4, "num_queries": 200, "num_register_tokens": 4}
_DEFAULTS = {
    "DINOv3ViTModel": _DINOV3,
    "Dinov2Model": _DINOV2,
    "Dinov2WithRegistersModel": {**_DINOV2, "patch_size": 16, "num_register_tokens": 4},
    "EomtForUniversalSegmentation": {**_DINOV2, **_EOMT, "hidden_size": 1024, "num_hidden_layers": 24,
                                     "num_attention_heads": 16, "image_size": 640, "patch_size": 16},
    "EomtDinov3ForUniversalSegmentation": {**_DINOV3, **_EOMT, "hidden_size": 1024, "intermediate_size": 4096,
                                           "num_hidden_layers": 24, "num_attention_heads": 16,
                                           "layer_norm_eps": 1e-6, "image_size": 640},
}
UPSCALE_BLOCKS = 2  # models/eomt/eomt.py builds two (4 x the patch grid), as every EoMT checkpoint has


def _read_config(directory) -> tuple[Path, dict] | None:
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return (path, raw) if isinstance(raw, dict) else None


def is_transformers_folder(directory) -> bool:
    """Whether `directory`'s config.json is transformers' ("model_type" / "architectures"), not keras-hub's."""
    found = _read_config(directory)
    return found is not None and ("model_type" in found[1] or "architectures" in found[1]) \
        and "class_name" not in found[1]


def _architecture(raw: dict) -> str:
    names = raw.get("architectures") or []
    if isinstance(names, list) and len(names) == 1 and isinstance(names[0], str):
        return names[0]
    return _MODEL_TYPES.get(raw.get("model_type"), f"model_type {raw.get('model_type')!r}")


def configured_variant(backbone: str, position_grid: int | None = None, position_resize: str | None = None) \
        -> ViTVariant:
    """The ViT of model.backbone with model.position_grid / model.position_resize (null: the backbone's own)."""
    spec = VIT_VARIANTS[backbone]
    changes = {}
    if position_grid is not None:
        changes["pos_grid"] = position_grid
    if position_resize is not None:
        changes["torch_bicubic"] = position_resize == "torch"
    return replace(spec, **changes) if changes else spec


@dataclass(frozen=True)
class _Entry:
    """One variable of ours: from transformers' tensors `names` (their shapes `shapes`) through `convert`."""
    target: tuple[str, str]  # (layer name, variable attribute); layer "eomt": the EoMT model itself
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    convert: str = "same"  # a key of _CONVERT


def _swiglu_in(gate, up):
    return np.concatenate([gate.T, up.T], axis=1)


_CONVERT = {
    "same": lambda a: a,
    "linear": lambda a: a.T,
    "conv": lambda a: a.transpose(2, 3, 1, 0),
    "deconv": lambda a: a.transpose(2, 3, 1, 0),
    "depthwise": lambda a: a.transpose(2, 3, 0, 1),
    "batch": lambda a: a[None],
    "swiglu_in": _swiglu_in,
    "concat": lambda *parts: np.concatenate(parts),
}


@dataclass
class Folder:
    """A checked transformers folder: what `load_backbone_folder` / `load_eomt_folder` assign."""
    directory: Path
    architecture: str
    spec: ViTVariant
    checkpoint: Checkpoint
    entries: list[_Entry]
    skipped: list[str]
    class_head: bool = True  # EoMT: its classes are the run's


def _encoder_entries(arch: str, spec: ViTVariant) -> tuple[list[_Entry], list[str]]:
    """The encoder's variables from architecture `arch`'s tensor names; the names skipped deliberately."""
    c, p, r = spec.width, spec.patch, spec.registers
    eomt = arch in EOMTS
    out: list[_Entry] = []

    def add(target, names, shapes, convert="same"):
        out.append(_Entry(target, tuple(names), tuple(tuple(s) for s in shapes), convert))

    def dense(ours, theirs, n_in, n_out, bias=True):
        add((ours, "kernel"), [f"{theirs}.weight"], [(n_out, n_in)], "linear")
        if bias:
            add((ours, "bias"), [f"{theirs}.bias"], [(n_out,)])

    def norm(ours, theirs):
        add((ours, "gamma"), [f"{theirs}.weight"], [(c,)])
        add((ours, "beta"), [f"{theirs}.bias"], [(c,)])

    v3 = spec.family == "dinov3"
    patch = "embeddings.patch_embeddings" if v3 else "embeddings.patch_embeddings.projection"
    add(("patch_embed", "kernel"), [f"{patch}.weight"], [(c, 3, p, p)], "conv")
    add(("patch_embed", "bias"), [f"{patch}.bias"], [(c,)])
    add(("tokens", "cls_token"), ["embeddings.cls_token"], [(1, 1, c)])
    if r:
        add(("tokens", "register_tokens"), ["embeddings.register_tokens"], [(1, r, c)])
    skipped = [] if arch == "EomtForUniversalSegmentation" else ["embeddings.mask_token"]
    if not v3:
        g2 = spec.pos_grid ** 2
        if eomt:
            add(("tokens", "position_embeddings"), ["embeddings.position_embeddings.weight"], [(g2, c)], "batch")
        else:
            add(("tokens", "position_embeddings"), ["embeddings.position_embeddings"], [(1, 1 + g2, c)])
    if v3 or eomt:
        layer = "layers.{}" if eomt else "layer.{}"
        attn = {"q": "attention.q_proj", "k": "attention.k_proj", "v": "attention.v_proj",
                "out": "attention.out_proj" if arch == "EomtForUniversalSegmentation" else "attention.o_proj"}
    else:
        layer = "encoder.layer.{}"
        attn = {"q": "attention.attention.query", "k": "attention.attention.key",
                "v": "attention.attention.value", "out": "attention.output.dense"}
    for i in range(spec.depth):
        hf, me = layer.format(i), f"block{i + 1}"
        norm(f"{me}_norm1", f"{hf}.norm1")
        for role, theirs in attn.items():
            dense(f"{me}_attn_{role}", f"{hf}.{theirs}", c, c, bias=role != "k" or spec.key_bias)
        add((f"{me}_ls1", "gamma"), [f"{hf}.layer_scale1.lambda1"], [(c,)])
        norm(f"{me}_norm2", f"{hf}.norm2")
        if v3:
            if spec.gated:
                dense(f"{me}_mlp_gate", f"{hf}.mlp.gate_proj", c, spec.mlp)
            dense(f"{me}_mlp_up", f"{hf}.mlp.up_proj", c, spec.mlp)
            dense(f"{me}_mlp_down", f"{hf}.mlp.down_proj", spec.mlp, c)
        elif spec.gated:
            h = swiglu_width(spec.mlp)
            if eomt:  # transformers 5's EomtSwiGLUFFN: three Linear layers
                add((f"{me}_mlp_in", "kernel"), [f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"],
                    [(h, c), (h, c)], "swiglu_in")
                add((f"{me}_mlp_in", "bias"), [f"{hf}.mlp.gate_proj.bias", f"{hf}.mlp.up_proj.bias"],
                    [(h,), (h,)], "concat")
                dense(f"{me}_mlp_out", f"{hf}.mlp.down_proj", h, c)
            else:  # DINOv2's checkpoints: the fused layer (gate half first)
                dense(f"{me}_mlp_in", f"{hf}.mlp.weights_in", c, 2 * h)
                dense(f"{me}_mlp_out", f"{hf}.mlp.weights_out", h, c)
        else:
            dense(f"{me}_mlp_up", f"{hf}.mlp.fc1", c, spec.mlp)
            dense(f"{me}_mlp_down", f"{hf}.mlp.fc2", spec.mlp, c)
        add((f"{me}_ls2", "gamma"), [f"{hf}.layer_scale2.lambda1"], [(c,)])
    norm("norm", "norm" if arch == "DINOv3ViTModel" else "layernorm")
    return out, skipped



def _eomt_entries(spec: ViTVariant, queries: int, classes: int) -> list[_Entry]:
    """EoMT's own variables (queries, class head, mask MLP, upscale blocks); `classes` with no-object."""
    c = spec.width

    def e(target, name, shape, convert="same"):
        return _Entry(target, (name,), (shape,), convert)

    out = [e(("eomt", "queries"), "query.weight", (queries, c)),
           e(("class_head", "kernel"), "class_predictor.weight", (classes, c), "linear"),
           e(("class_head", "bias"), "class_predictor.bias", (classes,))]
    for i in (1, 2, 3):
        out += [e((f"mask_mlp{i}", "kernel"), f"mask_head.fc{i}.weight", (c, c), "linear"),
                e((f"mask_mlp{i}", "bias"), f"mask_head.fc{i}.bias", (c,))]
    for i in range(UPSCALE_BLOCKS):
        hf, me = f"upscale_block.block.{i}", f"upscale{i + 1}"
        out += [e((f"{me}_deconv", "kernel"), f"{hf}.conv1.weight", (c, c, 2, 2), "deconv"),
                e((f"{me}_deconv", "bias"), f"{hf}.conv1.bias", (c,)),
                e((f"{me}_dwconv", "kernel"), f"{hf}.conv2.weight", (c, 1, 3, 3), "depthwise"),
                e((f"{me}_norm", "gamma"), f"{hf}.layernorm2d.weight", (c,)),
                e((f"{me}_norm", "beta"), f"{hf}.layernorm2d.bias", (c,))]
    return out


def _value(raw: dict, arch: str, key: str):
    if arch == "EomtDinov3ForUniversalSegmentation" and key == "rope_theta":
        return (raw.get("rope_parameters") or {}).get("rope_theta", _DEFAULTS[arch][key])
    value = raw.get(key, _DEFAULTS[arch].get(key))
    if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:  # (h, w) sizes, square
        return value[0]
    return value


def _check_config(path: Path, raw: dict, arch: str, backbone: str, spec: ViTVariant, eomt: dict | None):
    """config.json against the run's model: each (their key, our value, our config key, whose value)."""
    label = f"{backbone}'s"
    wanted = [("hidden_size", spec.width, "model.backbone", label),
              ("num_hidden_layers", spec.depth, "model.backbone", label),
              ("num_attention_heads", spec.heads, "model.backbone", label),
              ("patch_size", spec.patch, "model.backbone", label),
              ("num_register_tokens", spec.registers, "model.backbone", label),
              ("num_channels", 3, "model.backbone", "RGB's"),
              ("layer_norm_eps", spec.epsilon, "model.backbone", label)]
    if spec.family == "dinov3":
        wanted += [("intermediate_size", spec.mlp, "model.backbone", label),
                   ("use_gated_mlp", spec.gated, "model.backbone", label),
                   ("hidden_act", spec.activation, "model.backbone", label),
                   ("key_bias", spec.key_bias, "model.backbone", label),
                   ("rope_theta", spec.rope_theta, "model.backbone", label)]
        wanted += [(k, True, "model.backbone", label) for k in ("query_bias", "value_bias", "proj_bias", "mlp_bias")]
    else:
        wanted += [("mlp_ratio", spec.mlp / spec.width, "model.backbone", label),
                   ("use_swiglu_ffn", spec.gated, "model.backbone", label),
                   ("hidden_act", "gelu", "model.backbone", label)]
        if arch in ENCODERS:
            wanted.append(("qkv_bias", True, "model.backbone", label))
    if eomt is not None:
        wanted += [("num_queries", eomt["queries"], "model.num_queries", "this config's"),
                   ("num_blocks", eomt["blocks"], "model.eomt_blocks", "this config's"),
                   ("num_upscale_blocks", UPSCALE_BLOCKS, "model.head", "seg-train's EoMT's"),
                   ("hidden_act", "gelu", "model.head", "seg-train's EoMT head's (GELU, as the EoMT reference's; "
                                                        "transformers gives the head hidden_act)")]
    for theirs, ours, key, whose in wanted:
        got = _value(raw, arch, theirs)
        if got != ours:
            raise ConfigError("transformers folder does not fit the model", key,
                              f"{theirs} {ours!r} ({whose}), got {got!r} in {path}")
    if spec.family == "dinov2":
        image, patch = _value(raw, arch, "image_size"), spec.patch
        grid = image // patch if isinstance(image, int) and image % patch == 0 else None
        if grid != spec.pos_grid:
            raise ConfigError("transformers folder does not fit the model", "model.position_grid",
                              f"image_size / patch_size {spec.pos_grid} (this config's position grid), got "
                              f"image_size {image!r} with patch_size {patch} in {path}")
        if arch in ENCODERS:
            if not spec.torch_bicubic:
                raise ConfigError("transformers folder does not fit the model", "model.position_resize",
                                  f"torch for a transformers {arch} (its positions are resized by torch's "
                                  f"bicubic), got tensorflow")
            if spec.antialias != (arch == "Dinov2WithRegistersModel") or not spec.cls_position:
                raise ConfigError("transformers folder does not fit the model", "model.backbone",
                                  f"a {arch} folder for {backbone} (its positions: antialias {spec.antialias}, "
                                  f"CLS entry {spec.cls_position}), got one in {path.parent}")
        elif spec.cls_position:
            raise ConfigError("transformers folder does not fit the model", "model.backbone",
                              f"an EoMT backbone with positions for the patches only (dinov2_vit*16_reg) for "
                              f"{arch}, got {backbone!r}")


def _check_tensors(folder: Folder) -> None:
    """Every entry's tensors present with their shapes and a float dtype; no tensor left over."""
    ckpt, used = folder.checkpoint, set(folder.skipped)
    for entry in folder.entries:
        for name, shape in zip(entry.names, entry.shapes):
            if name not in ckpt.tensors:
                raise ConfigError("tensor missing from the transformers folder", str(ckpt.path),
                                  f"{name!r} of shape {list(shape)} for {'/'.join(entry.target)} "
                                  f"({folder.architecture})")
            dtype, got = ckpt.tensors[name]
            if tuple(got) != shape:
                raise ConfigError("tensor of another shape in the transformers folder", str(ckpt.file_of(name)),
                                  f"{name!r} of shape {list(shape)} for {'/'.join(entry.target)}, got {list(got)}")
            if dtype not in FLOATS:
                raise ConfigError("tensor of another dtype in the transformers folder", str(ckpt.file_of(name)),
                                  f"{name!r} as one of {', '.join(FLOATS)}, got {dtype}")
            used.add(name)
    left = sorted(set(ckpt.tensors) - used)
    if left:
        raise ConfigError("tensor the model has no place for", str(ckpt.file_of(left[0])),
                          f"only {folder.architecture}'s tensors for this model, got {left[0]!r}"
                          + (f" and {len(left) - 1} more" if len(left) > 1 else ""))


def _open(directory, key: str, accepted: tuple[str, ...], spec: ViTVariant, label: str):
    found = _read_config(directory)
    if found is None:
        raise ConfigError("transformers folder not found", key,
                          f"a folder with a readable config.json, got {str(directory)!r}")
    path, raw = found
    arch = _architecture(raw)
    wanted = [a for a in accepted if _FAMILY[a] == spec.family]
    if arch not in wanted:
        other = " (an EoMT folder goes in model.init_weights with model.head eomt)" \
            if arch in EOMTS and key != "model.init_weights" else \
            " (a DINO encoder folder goes in model.backbone_weights)" \
            if arch in ENCODERS and key != "model.backbone_weights" else ""
        raise ConfigError("transformers folder of another architecture", str(path),
                          f"{' or '.join(wanted)} for {key} with model.backbone {label!r}, got {arch}{other}")
    return path, raw, arch


def check_backbone_folder(directory, spec: ViTVariant, label: str) -> Folder:
    """model.backbone_weights: a transformers DINOv3 / DINOv2 folder checked against the ViT `spec` (named `label`
    in messages; `configured_variant`): config.json and the tensors' headers, nothing built, nothing read.
    Returns what `load_backbone_folder` assigns."""
    path, raw, arch = _open(directory, "model.backbone_weights", ENCODERS, spec, label)
    _check_config(path, raw, arch, label, spec, None)
    entries, skipped = _encoder_entries(arch, spec)
    folder = Folder(Path(directory), arch, spec, Checkpoint(directory), entries, skipped)
    _check_tensors(folder)
    return folder


def check_eomt_folder(directory, spec: ViTVariant, label: str, queries: int, eomt_blocks: int,
                      num_classes: int) -> Folder:
    """model.init_weights: a transformers EoMT folder checked against EoMT on the ViT `spec` with `queries`,
    `eomt_blocks` and the run's `num_classes` (config.json and the tensors' headers). Returns what
    `load_eomt_folder` assigns."""
    path, raw, arch = _open(directory, "model.init_weights", EOMTS, spec, label)
    _check_config(path, raw, arch, label, spec, {"queries": queries, "blocks": eomt_blocks})
    ckpt = Checkpoint(directory)
    entries, skipped = _encoder_entries(arch, spec)
    skipped += ["attn_mask_probs", "criterion.empty_weight"]
    theirs = ckpt.tensors.get("class_predictor.weight", (None, (num_classes + 1,)))[1]
    class_head = tuple(theirs)[:1] == (num_classes + 1,)
    head = _eomt_entries(spec, queries, num_classes + 1)
    if not class_head:
        skipped += [n for e in head if e.target[0] == "class_head" for n in e.names]
        head = [e for e in head if e.target[0] != "class_head"]
    folder = Folder(Path(directory), arch, spec, ckpt, entries + head, skipped, class_head)
    _check_tensors(folder)
    return folder


def _variables(folder: Folder, encoder, eomt=None) -> list:
    """(variable, array) for every entry, each array checked against its variable, every variable of the model
    given one array (the class head none when not loaded); nothing assigned yet."""
    pairs = []
    built = {layer.name for layer in encoder.layers}
    for entry in folder.entries:
        layer, attr = entry.target
        if layer.startswith("block") and layer not in built:  # a block after the last one the model reads
            continue
        if layer == "eomt":
            variable = getattr(eomt, attr)
        elif eomt is not None and layer.startswith(("class_head", "mask_mlp", "upscale")):
            variable = getattr(_eomt_layer(eomt, layer), attr)
        else:
            variable = getattr(encoder.get_layer(layer), attr)
        array = _CONVERT[entry.convert](*(folder.checkpoint.read(n) for n in entry.names))
        if tuple(array.shape) != tuple(variable.shape):  # the table and the model disagree: a seg-train bug
            raise ValueError(f"{'/'.join(entry.target)}: {entry.names} give {array.shape}, the variable is "
                             f"{tuple(variable.shape)}")
        pairs.append((variable, array))
    model = encoder if eomt is None else eomt
    kept = [] if folder.class_head or eomt is None else eomt.class_head.weights
    wanted = {id(v) for v in model.weights} - {id(v) for v in kept}
    given = [id(v) for v, _ in pairs]
    if len(given) != len(set(given)) or set(given) != wanted:  # the table and the model disagree: a seg-train bug
        missing = [v.path for v in model.weights if id(v) in wanted - set(given)]
        raise ValueError(f"{folder.architecture} table: variables set twice or never ({missing[:3]})")
    return pairs


def _eomt_layer(eomt, name: str):
    for layer in [eomt.class_head, *eomt.mask_mlp, *eomt.upscale]:
        if layer.name == name:
            return layer
    raise ValueError(f"EoMT has no layer {name}")


def load_backbone_folder(encoder, folder: Folder) -> int:
    """The checked folder's tensors into `encoder` (vit.dino_encoder's model). Returns the number assigned."""
    pairs = _variables(folder, encoder)
    for variable, array in pairs:
        variable.assign(array.astype(variable.dtype))
    log.info("loaded %d tensors of the transformers %s %s into the %s encoder", len(pairs), folder.architecture,
             folder.directory, encoder.name)
    return len(pairs)


def load_eomt_folder(model, folder: Folder) -> int:
    """The checked folder's tensors into `model` (eomt.EoMT): encoder, queries, mask MLP, upscale blocks and,
    when its classes are the run's, the class head (else kept as initialised, with a notice)."""
    pairs = _variables(folder, model.backbone, model)
    for variable, array in pairs:
        variable.assign(array.astype(variable.dtype))
    if not folder.class_head:
        theirs = folder.checkpoint.tensors["class_predictor.weight"][1][0] - 1
        log.info("class head of %s not loaded: its %d classes are not data.num_classes (%d); it starts as "
                 "initialised", folder.directory, theirs, model.num_classes)
    probs = folder.checkpoint.tensors.get("attn_mask_probs")
    if probs is not None and np.any(folder.checkpoint.read("attn_mask_probs")):
        log.info("%s was saved with masked attention still on (attn_mask_probs); seg-train predicts without "
                 "masks, as a trained EoMT ends", folder.directory)
    log.info("loaded %d tensors of the transformers %s %s into EoMT", len(pairs), folder.architecture,
             folder.directory)
    return len(pairs)


__all__ = ["Folder", "check_backbone_folder", "check_eomt_folder", "configured_variant", "is_transformers_folder",
           "load_backbone_folder", "load_eomt_folder"]
