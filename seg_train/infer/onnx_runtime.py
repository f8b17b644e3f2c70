""".onnx files in ONNX Runtime (the `onnxruntime` package, CPU), as an app or a server without TensorFlow runs
them: seg-eval / seg-predict --model FILE.onnx and seg-export --format onnx --check.

Everything but opening the file and the call itself is litert.FileModel's, shared with the .tflite files:
the input and output checks, the resizes, the latency (the wall time of `InferenceSession.run` alone, after
one warm-up call), the evaluation.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from seg_train.config import ConfigError, exception_text

INSTALL_HINT = "pip install 'seg-train[onnx]' (the tf2onnx converter and ONNX Runtime)"
# ONNX Runtime's names of the tensor types seg-export writes (NodeArg.type) -> numpy.
ONNX_TYPES = {"tensor(uint8)": np.uint8, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
              "tensor(float)": np.float32}


def session_class(where: str):
    """ONNX Runtime's InferenceSession; a one-line ConfigError naming `where` when onnxruntime is missing."""
    try:
        from onnxruntime import InferenceSession
    except ImportError:
        raise ConfigError("onnxruntime is not installed", where, INSTALL_HINT) from None
    return InferenceSession


def session_options(threads: int):
    """`threads` for the ops themselves, the graph's nodes run one after another (as LiteRT runs them)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3  # errors only: its warnings would break the commands' one-line errors
    return options


class ONNXFile:
    """A .onnx file in ONNX Runtime on the CPU (litert.FileModel's runner); `where`: what to name in error
    messages (the flag that gave the path)."""

    runtime = "ONNX Runtime"
    format = "onnx"

    def __init__(self, path: str | os.PathLike, threads: int, where: str):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError("model file not found", str(path), "a .onnx file (seg-export --format onnx)")
        session = session_class(where)
        try:
            self.session = session(str(self.path), sess_options=session_options(threads),
                                   providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own classes per failure kind
            raise ConfigError("not an ONNX model ONNX Runtime can run", str(path),
                              f"a .onnx file ({exception_text(e)})") from None
        self.size_bytes = self.path.stat().st_size

        def tensors(args):
            # A dimension the file leaves open is a name or None here: never the fixed input FileModel takes.
            return [(a.name, [d if isinstance(d, int) else -1 for d in a.shape], ONNX_TYPES.get(a.type, np.void))
                    for a in args]

        self.inputs = tensors(self.session.get_inputs())
        self.outputs = tensors(self.session.get_outputs())

    def run(self, input_name: str, output_name: str, x: np.ndarray) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        (out,) = self.session.run([output_name], {input_name: x})
        return out, time.perf_counter() - start

    def run_all(self, input_name: str, output_names, x: np.ndarray) -> tuple[list, float]:
        """`run` reading several outputs of the one call."""
        start = time.perf_counter()
        outs = self.session.run(list(output_names), {input_name: x})
        return outs, time.perf_counter() - start
