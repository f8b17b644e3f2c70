"""Files to batches. The front door is data/split.py: `open_split` opens a split of the configured data
(its samples, label table, reader and class names; the synthetic demo set generated when asked) and
`train_dataset_fn` deals its training stream to the towers; every command reads its data through them.
Behind it: the reader (reader.py), its decoders (decode.py) and file access through tf.io.gfile
(files.py), every layout's listing (layouts.py), label maps applied (labels.py), TFRecord shards
(records.py), the pre-training scan of a split (scan.py) and its cache (scan_cache.py), label PNG I/O and
palettes (label_images.py), the synthetic demo data set (synthetic.py), iterators owned by a Feed
(feed.py), and what the data-preparation scripts share (prepare.py). Imports nothing from training or
inference.

This file imports nothing: any module of the package can be imported alone (feed.py and labels.py
before TensorFlow starts), and none of them reads a half-run __init__.py.
"""
