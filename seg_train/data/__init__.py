"""Files to batches: the reader (data/reader.py), its decoders (decode.py) and file access through
tf.io.gfile (files.py), the pre-training scan of a split (scan.py) and its cache (scan_cache.py), label
PNG I/O and palettes (label_images.py), the synthetic demo data set (synthetic.py), and what the
data-preparation scripts share (prepare.py). Imports nothing from training or inference."""
