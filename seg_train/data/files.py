"""File access for the data through `tf.io.gfile`, so a data root on any TensorFlow file system (gs://,
s3://, ram://) reads like a local folder. Paths are strings joined with '/': `pathlib.Path` would turn
`gs://bucket/x` into `gs:/bucket/x`.
"""

from __future__ import annotations

import posixpath

import tensorflow as tf

from seg_train.config import ConfigError, exception_text


def join(root, *parts: str) -> str:
    """`root/part/...` as a string; a URL root keeps its `scheme://`."""
    return posixpath.join(str(root), *parts)


def stem(path: str) -> str:
    """The file name without its folder and extension (`a/b/x.jpg` -> `x`)."""
    return posixpath.splitext(posixpath.basename(path))[0]


def is_dir(path) -> bool:
    return tf.io.gfile.isdir(str(path))


def is_file(path) -> bool:
    path = str(path)
    return tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path)


def read_bytes(path) -> bytes:
    """The whole file in one read (not Pillow's many small reads); FileNotFoundError, else OSError."""
    try:
        with tf.io.gfile.GFile(str(path), "rb") as f:
            return f.read()
    except tf.errors.NotFoundError:
        raise FileNotFoundError(2, "No such file or directory", str(path)) from None
    except tf.errors.OpError as e:
        raise OSError(f"{e.message.splitlines()[0] if e.message else type(e).__name__}") from None


def read_text(path) -> str:
    """The file as UTF-8 text (errors as `read_bytes`; UnicodeDecodeError for bytes that are not UTF-8)."""
    return read_bytes(path).decode("utf-8")


def split_lines(path) -> list[tuple[int, list[str], str]]:
    """A split's list file as (line number, whitespace-separated fields, line), for each line that is
    neither blank nor a '#' comment. An unreadable or non-UTF-8 file is a ConfigError naming it."""
    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("cannot read split", path, f"a readable UTF-8 text file ({exception_text(e)})") from None
    return [(lineno, parts, line) for lineno, line in enumerate(text.splitlines(), 1)
            if (parts := line.split()) and not parts[0].startswith("#")]
