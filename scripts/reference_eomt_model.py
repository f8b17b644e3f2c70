"""Writes tests/fixtures/eomt_model.npz: a small EoMT with random weights run by the reference implementation,
Hugging Face transformers' `EomtForUniversalSegmentation` (PyTorch), for tests/test_eomt_model.py.

Not part of seg-train and never imported by it: it needs torch and transformers, which seg-train does not.
Run it from the repository root with a separate environment:

    python3 -m venv /tmp/eomt-ref && /tmp/eomt-ref/bin/pip install torch transformers
    /tmp/eomt-ref/bin/python scripts/reference_eomt_model.py            # or give another output path

What the fixture holds (float32 unless said):
  config/<name>     the EomtConfig numbers (int64 / float64 scalars)
  w/<name>          every weight under its transformers name (torch layout: Linear [out, in], conv OIHW,
                    ConvTranspose2d [in, out, kh, kw])
  images            [2, S, S, 3] the inputs, NHWC (the reference takes them as NCHW)
  eval_class, eval_mask      eval mode without masking (attn_mask_probs 0, as a trained model ends):
                             the one prediction, [1, b, Q, K+1] and [1, b, Q, S/4, S/4]
  eval_semantic              [b, K, S, S] the semantic scores of post_process_semantic_segmentation
  masked_class, masked_mask  training mode with every attention mask kept (attn_mask_probs 1): each prediction
                             in the order the reference computes them (before each of the last num_blocks
                             blocks, then the final one), [num_blocks + 1, b, ...]
  masked_margin     (float64) the smallest |mask logit| at the patch grid where the masks were thresholded:
                    a value near 0 would make the masks depend on rounding

The reference takes only inputs of its config's image_size (its patch grid and position embeddings are
fixed), so both images are S x S. No dropout or drop path is configured, so training mode is deterministic.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import EomtConfig, EomtForUniversalSegmentation

CONFIG = dict(hidden_size=32, num_hidden_layers=5, num_attention_heads=2, mlp_ratio=4, patch_size=16,
              image_size=64, num_queries=8, num_blocks=3, num_labels=5, num_register_tokens=2,
              num_upscale_blocks=2, layerscale_value=1.0, layer_norm_eps=1e-6, hidden_act="gelu")
SEED = 5


def _randomize(model: torch.nn.Module, rng: np.random.Generator) -> None:
    """Every 1-D weight and token array away from its initial value (norm weights and layer scales near 1,
    biases, register tokens near 0), so a dropped or misplaced one changes the outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "token" in name:
                a = rng.normal(0.0, 0.1, tuple(p.shape))
                if p.ndim == 1 and (name.endswith("lambda1") or ("norm" in name and name.endswith("weight"))):
                    a += 1.0
                p.copy_(torch.from_numpy(a.astype(np.float32)))


def _recorded(model):
    """Runs the model and returns (output, every (mask, class) prediction `model.predict` made, in order)."""
    made = []
    plain = model.predict

    def predict(hidden):
        out = plain(hidden)
        made.append(out)
        return out

    model.predict = predict
    return made


def _masked_margin(model, predictions) -> float:
    """The smallest |logit| the masked pass thresholded: each intermediate prediction's masks resized to the
    patch grid as the reference does before `> 0`."""
    margins = []
    for mask, _ in predictions[:-1]:
        small = F.interpolate(mask, size=model.grid_size, mode="bilinear")
        margins.append(float(small.abs().min()))
    return min(margins)


def _semantic(mask_logits, class_logits, size):
    """EomtImageProcessor.post_process_semantic_segmentation's arithmetic (its image processor needs torchvision,
    so the same ops are written out): the mask logits resized to `size`, then the class probabilities without
    the no-object class times the sigmoid masks, summed over the queries; the target size is `size` here, so the
    last resize is the identity."""
    masks = F.interpolate(mask_logits, size=size, mode="bilinear")
    classes = class_logits.softmax(dim=-1)[..., :-1]
    scores = torch.einsum("bqc, bqhw -> bchw", classes, masks.sigmoid())
    return F.interpolate(scores, size=size, mode="bilinear", align_corners=False)


def main(out: Path) -> None:
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    config = EomtConfig(**CONFIG)
    model = EomtForUniversalSegmentation(config)
    _randomize(model, rng)
    s = CONFIG["image_size"]
    images = rng.normal(0.0, 1.0, (2, s, s, 3)).astype(np.float32)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()

    arrays = {f"config/{k}": np.asarray(v) for k, v in CONFIG.items() if not isinstance(v, str)}
    arrays.update({f"w/{k}": v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()
                   if k != "embeddings.position_ids" and not k.startswith("criterion.")
                   and k != "attn_mask_probs"})
    arrays["images"] = images

    with torch.no_grad():
        model.eval()
        model.attn_mask_probs.fill_(0.0)
        made = _recorded(model)
        output = model(pixel_values=pixels)
        assert len(made) == 1 and torch.equal(made[-1][0], output.masks_queries_logits)
        arrays["eval_mask"] = np.stack([m.numpy() for m, _ in made])
        arrays["eval_class"] = np.stack([c.numpy() for _, c in made])
        arrays["eval_semantic"] = _semantic(output.masks_queries_logits, output.class_queries_logits,
                                            (s, s)).numpy()

        model.train()
        model.attn_mask_probs.fill_(1.0)
        made = _recorded(model)
        output = model(pixel_values=pixels)
        assert len(made) == CONFIG["num_blocks"] + 1
        assert torch.equal(made[-1][0], output.masks_queries_logits)
        arrays["masked_mask"] = np.stack([m.numpy() for m, _ in made])
        arrays["masked_class"] = np.stack([c.numpy() for _, c in made])
        arrays["masked_margin"] = np.float64(_masked_margin(model, made))

    margin = float(arrays["masked_margin"])
    if margin < 1e-3:
        raise SystemExit(f"a mask logit at the patch grid is {margin:.2e} from the threshold: change SEED")
    differs = np.max(np.abs(arrays["masked_mask"][-1] - arrays["eval_mask"][-1]))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({out.stat().st_size} bytes); masked vs unmasked final masks differ by {differs:.3g}, "
          f"threshold margin {margin:.3g}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/fixtures/eomt_model.npz"))
