"""The front door of the data (seg_train/data/split.py): `open_split` and `train_dataset_fn`.

Fails for: the dataset_fn ignoring its input pipeline's id or the pipeline count (each worker would read
the first towers' slices: multi-worker sharding lost), its stream not ending at end_step, precise BN's
every-worker stream dealt with the global tower count instead of the worker's own, a split other than the
one asked for (listed against the split file itself), a missing split given as None instead of the one-line
error that names it (or an optional one opened anyway), the class names not the config's, and seg-eval on a
data.synthetic config whose set is not there failing instead of generating it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from seg_train.config import ConfigError
from seg_train.data import synthetic
from seg_train.data.split import open_split, train_dataset_fn
from seg_train.run import checkpoint as ckpt_lib
from tests.helpers import tiny_config

B = 8  # the global batch: 4 towers of 2 on 2 workers (2 towers each)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=6, num_val=2, size=(24, 32),
                              num_classes=3)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, root):
    return tiny_config(tmp_path_factory.mktemp("cfg"), root, seed=4,
                       data={"crop_size": [16, 16], "batch_size": B, "num_parallel_calls": 1})


def context(pipeline: int, pipelines: int = 2, towers: int = 4):
    return tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline,
                                      num_replicas_in_sync=towers)


def rows(batches) -> tuple[np.ndarray, np.ndarray]:
    """The batches' rows, concatenated: (images, labels)."""
    return (np.concatenate([b[0].numpy() for b in batches]), np.concatenate([b[1].numpy() for b in batches]))


def test_each_worker_reads_its_own_towers_slices_of_the_global_batches(cfg):
    """Steps 2 and 3 on 4 towers over 2 workers: worker p reads rows 4p..4p+3 of each global batch of the one
    stream (the 1-tower stream here, cut by hand), its two towers 2 rows each; nothing past step 3."""
    reader = open_split(cfg, cfg.data.train_split).reader
    whole = list(reader.train_dataset(B, 2, 1, end_step=4))
    assert len(whole) == 2 and whole[0][0].shape[0] == B
    for p in (0, 1):
        got = list(train_dataset_fn(reader, B, start_step=2, end_step=4)(context(p)).take(5))
        assert len(got) == 4 and all(b[0].shape[0] == 2 for b in got)  # 2 steps x 2 towers, then the end
        images, labels = rows(got)
        expected = [(w[0].numpy()[4 * p:4 * p + 4], w[1].numpy()[4 * p:4 * p + 4]) for w in whole]
        np.testing.assert_array_equal(images, np.concatenate([e[0] for e in expected]))
        np.testing.assert_array_equal(labels, np.concatenate([e[1] for e in expected]))


def test_every_worker_reads_the_same_batches_when_not_sharded(cfg):
    """shard_over_workers=False (precise BN): each of 2 workers reads the whole stream itself, the training
    per-tower batch (8 / 4 = 2) on each of its 2 towers: global batches of 4, the same on both workers."""
    reader = open_split(cfg, cfg.data.train_split).reader
    whole = rows(list(reader.train_dataset(4, 5, 1, end_step=7)))
    for p in (0, 1):
        got = list(train_dataset_fn(reader, B, start_step=5, end_step=7, shard_over_workers=False)(context(p)).take(5))
        assert len(got) == 4 and all(b[0].shape[0] == 2 for b in got)
        images, labels = rows(got)
        np.testing.assert_array_equal(images, whole[0])
        np.testing.assert_array_equal(labels, whole[1])


def ids(root, split: str) -> list[str]:
    return (root / "ImageSets" / "Segmentation" / f"{split}.txt").read_text().split()


def test_open_split_lists_the_split_asked_for(cfg, root):
    train, val = open_split(cfg, cfg.data.train_split), open_split(cfg, cfg.data.val_split)
    assert [s.id for s in train.samples] == ids(root, "train") and len(train) == 6
    assert [s.id for s in val.samples] == ids(root, "val") and len(val) == 2
    assert (train.name, train.reader.split, train.reader.seed) == ("train", "train", 4)
    assert train.label_table is None  # VOC: labels hold class indices
    assert train.class_names == (root / "classes.txt").read_text().split()


def test_a_missing_split_is_one_line_naming_it_unless_optional(cfg, root):
    with pytest.raises(ConfigError) as e:
        open_split(cfg, "nope")
    assert (e.value.what, e.value.where) == ("split not found", str(root / "ImageSets" / "Segmentation" / "nope.txt"))
    assert open_split(cfg, "nope", optional=True) is None
    assert len(open_split(cfg, "val", optional=True)) == 2


def test_class_names_are_the_configs(tmp_path, root):
    cfg = tiny_config(tmp_path, root, data={"class_names": ["sky", "road", "car"]})
    assert open_split(cfg, "val").class_names == ["sky", "road", "car"]


@pytest.mark.slow
def test_seg_eval_generates_the_synthetic_set_it_evaluates(tmp_path):
    """seg-eval of a data.synthetic run where the set is not (or no longer) there: the front door generates
    it, and every image of its val split is evaluated. Wrong answer: 'data root not found' (the set generated
    when the training split is opened only)."""
    from seg_train.infer.eval_checkpoint import run_eval
    from seg_train.run.state import TrainState

    root = tmp_path / "demo"
    cfg = tiny_config(tmp_path, root, data={"synthetic": True}, eval={"bn_reestimate_batches": 0})
    strategy = tf.distribute.MirroredStrategy(["/device:CPU:0"])
    state = TrainState(cfg, strategy)
    ckpt_lib.Checkpointer(tmp_path / "run" / "checkpoints", 1, **state.checkpoint_objects()).save(1)
    assert not root.exists()
    record = run_eval(cfg, strategy, str(tmp_path / "run"), progress=False)
    assert (root / synthetic.COMPLETE_MARKER).is_file()
    assert record["split"] == "val" and record["num_images"] == len(ids(root, "val")) > 0
