"""seg-predict for data.task panoptic and instance: COCO files other tools read, and overlays.

Each image is letterboxed as evaluation does it (mask_evaluate.letterbox), its raw class and mask logits come from
the checkpoint's serving module or a .tflite file, and mask_postprocess.py turns them into segments at the image's
size. Written into the output folder:
  panoptic  `<name>.png`, the COCO panoptic PNG (segment id = R + 256 G + 256^2 B, 0 none), and `panoptic.json`,
            COCO's panoptic predictions file ({"annotations": [{image_id, file_name, segments_info}], "categories"}),
            which panopticapi's pq_compute and cityscapesscripts' panoptic evaluator read;
  instance  `instances.json`, COCO's results list ({image_id, category_id, segmentation: RLE, score}), which
            pycocotools' COCO.loadRes reads;
  both      `<name>_overlay.png`: the image with one colour per segment (instance: the predictions scored above
            mask_pictures.SHOWN_SCORE).
image_id is the file name's stem, as an integer when it is one (COCO's file names: 000000000139.jpg is image 139);
category ids are the data set's own (data/split.py categories_of: COCO's category ids, Cityscapes' labelIds).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from PIL import Image

from seg_train.infer import coco_format, mask_pictures
from seg_train.infer import mask_postprocess as post
from seg_train.infer.mask_evaluate import letterbox
from seg_train.run.rundir import write_atomic
from seg_train.util.progress import progress_bar

PANOPTIC_JSON = "panoptic.json"
INSTANCE_JSON = "instances.json"


def image_id_of(path: Path):
    """The COCO image id of an input file: its stem as an int when it is all digits, else the stem."""
    return int(path.stem) if path.stem.isdigit() else path.stem


def _save_png(path: Path, pixels: np.ndarray) -> None:
    Image.fromarray(np.ascontiguousarray(pixels, np.uint8)).save(path, format="PNG")


def write_mask_predictions(files, out: Path, logits_of, setup, category_ids, class_names,
                           progress: bool = True) -> list[Path]:
    """Writes the files' predictions into `out` (module doc); `logits_of(uint8 [crop_h, crop_w, 3])` -> (class logits
    [Q, K + 1], mask logits [Q, h, w]) of a letterboxed image. Returns the per-image files (panoptic PNGs, or the
    overlays) in input order."""
    out.mkdir(parents=True, exist_ok=True)
    written, entries = [], []
    with progress_bar(len(files), "predict", enabled=progress) as bar:
        for f in files:
            with Image.open(f) as im:
                image = np.asarray(im.convert("RGB"))
            class_logits, mask_logits = logits_of(letterbox(image, setup.crop))
            size = image.shape[:2]
            if setup.task == "panoptic":
                pred = post.panoptic_prediction(class_logits, mask_logits, setup.is_thing,
                                                mask_thresh=setup.mask_thresh, overlap_thresh=setup.overlap_thresh,
                                                image_size=size, crop_size=setup.crop)
                png = out / f"{f.stem}.png"
                write_atomic(png, functools.partial(_save_png, pixels=coco_format.id_to_rgb(pred.segment_ids)))
                entries.append(coco_format.panoptic_annotation(image_id_of(f), png.name, pred.segment_ids,
                                                               pred.segments, category_ids))
                written.append(png)
            else:
                pred = post.instance_prediction(class_logits, mask_logits, image_size=size, crop_size=setup.crop)
                entries += coco_format.instance_results(image_id_of(f), pred.masks, pred.scores, pred.labels,
                                                        category_ids)
            ids = mask_pictures.prediction_ids(pred)
            blended = mask_pictures.overlay(image, mask_pictures.segment_colours(ids), ids > 0)
            overlay_path = out / f"{f.stem}_overlay.png"
            write_atomic(overlay_path, functools.partial(_save_png, pixels=blended))
            if setup.task != "panoptic":
                written.append(overlay_path)
            bar.update(1)
    if setup.task == "panoptic":
        categories = [{"id": int(category_ids[c]), "name": str(class_names[c]), "isthing": int(setup.is_thing[c])}
                      for c in range(setup.num_classes)]
        body = {"annotations": entries, "categories": categories}
        path = out / PANOPTIC_JSON
    else:
        body, path = entries, out / INSTANCE_JSON
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(body) + "\n"))
    return written


def summary_line(task: str, n: int) -> str:
    """What seg-predict wrote, for its last line."""
    if task == "panoptic":
        return f"{n} COCO panoptic PNG(s), {PANOPTIC_JSON} and {n} overlay(s)"
    return f"{INSTANCE_JSON} (COCO results, RLE masks) and {n} overlay(s)"
