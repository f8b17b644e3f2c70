"""seg-export: a checkpoint as a SavedModel, a .tflite or a .onnx file."""

from __future__ import annotations

from seg_train.cli import process
from seg_train.config import ConfigError


def export_main(argv=None) -> int:
    def add_arguments(parser):
        parser.add_argument("--output", required=True, metavar="DIR|FILE.tflite|FILE.onnx",
                            help="SavedModel folder (new or empty), or the .tflite file with --format tflite, "
                                 "the .onnx file with --format onnx")
        parser.add_argument("--force", action="store_true", help="replace a non-empty output folder or a file")
        parser.add_argument("--format", choices=("savedmodel", "tflite", "onnx"), default="savedmodel",
                            help="savedmodel (any image size, the eval.* inference modes; default), tflite "
                                 "(a fixed input size, one pass, for LiteRT) or onnx (the tflite file's model "
                                 "in float32, for ONNX Runtime; needs pip install 'seg-train[onnx]')")
        parser.add_argument("--input-size", type=int, nargs=2, metavar=("H", "W"),
                            help="tflite, onnx: the model's input size (default: eval.crop_size, else "
                                 "data.crop_size)")
        parser.add_argument("--quantize", choices=("none", "float16", "int8"), default="none",
                            help="tflite: float32 (none, default), float16 weights, or full-integer int8 "
                                 "(calibrated on training images)")
        parser.add_argument("--calibration-images", type=int, default=200, metavar="N",
                            help="tflite int8: training images to calibrate on (default 200)")
        parser.add_argument("--float-ops", metavar="OPS",
                            help="tflite int8: TFLite op kinds to keep in float32, comma-separated (e.g. "
                                 "BATCH_MATMUL,SOFTMAX,GELU,RSQRT,SQUARED_DIFFERENCE for a SegFormer on XNNPACK)")
        parser.add_argument("--probabilities", action="store_true",
                            help="tflite, onnx: also output the softmax [1, H, W, C] beside the class map")
        parser.add_argument("--check", action="store_true",
                            help="tflite: evaluate the file (and, if quantized, the float32 conversion) in LiteRT "
                                 "on data.val_split and print mIoU, size and latency side by side; onnx: the "
                                 "file in ONNX Runtime")
        parser.add_argument("--threads", type=int, default=1,
                            help="--check: LiteRT / ONNX Runtime threads (default 1)")

    def fail_fast(args):
        if args.format == "tflite":
            from seg_train.infer.litert import check_threads
            from seg_train.infer.tflite_export import check_calibration_images, check_output_file
            check_output_file(args.output, args.force)
            if args.check:
                from seg_train.infer.litert import interpreter_class
                interpreter_class("seg-export --check")
            check_calibration_images(args.calibration_images)
            check_threads(args.threads)
            from seg_train.infer.tflite_export import parse_float_ops
            parse_float_ops(args.float_ops, args.quantize)
            return
        if args.format == "onnx":
            from seg_train.infer.tflite_export import check_output_file
            given = [flag for flag, value in (("--quantize", args.quantize != "none"), ("--float-ops", args.float_ops))
                     if value]
            if given:
                raise ConfigError(f"{given[0]} needs --format tflite", given[0],
                                  "--format tflite (the .onnx file is float32)")
            check_output_file(args.output, args.force, ".onnx")
            from seg_train.infer.onnx_export import check_converter
            check_converter("seg-export --format onnx")
            if args.check:
                from seg_train.infer.litert import check_threads
                from seg_train.infer.onnx_runtime import session_class
                session_class("seg-export --check")
                check_threads(args.threads)
            return
        given = [flag for flag, value in (("--input-size", args.input_size), ("--quantize", args.quantize != "none"),
                                          ("--probabilities", args.probabilities), ("--check", args.check),
                                          ("--float-ops", args.float_ops))
                 if value]
        if given:
            formats = "tflite" if given[0] in ("--quantize", "--float-ops") else "tflite or onnx"
            raise ConfigError(f"{given[0]} needs --format {formats}", given[0],
                              f"--format {formats} (the SavedModel takes any image size, in float32)")
        from seg_train.infer.export import check_output
        check_output(args.output, args.force)

    def run(cfg, strategy, args):
        if args.format == "tflite":
            from seg_train.infer.tflite_export import parse_float_ops, run_export_tflite
            run_export_tflite(cfg, strategy, args.checkpoint, args.output, force=args.force, size=args.input_size,
                              quantize=args.quantize, calibration_images=args.calibration_images,
                              probabilities=args.probabilities, check=args.check, threads=args.threads,
                              float_ops=parse_float_ops(args.float_ops, args.quantize))
            return
        if args.format == "onnx":
            from seg_train.infer.onnx_export import run_export_onnx
            run_export_onnx(cfg, strategy, args.checkpoint, args.output, force=args.force, size=args.input_size,
                            probabilities=args.probabilities, check=args.check, threads=args.threads)
            return
        from seg_train.infer.export import run_export
        run_export(cfg, strategy, args.checkpoint, args.output, args.force)

    return process.checkpoint_command(
        argv, "seg-export", f"Export a checkpoint ({process.MODEL_FAMILIES}) as a SavedModel: "
        "serving_default(image uint8 [height, width, 3]) -> classes [height, width], preprocessing inside the "
        "graph; or with --format tflite as one .tflite file (uint8 [1, H, W, 3] -> classes uint8 [1, H, W]; "
        "float32, float16 or int8) for LiteRT; or with --format onnx as one .onnx file (the same model, float32) "
        "for ONNX Runtime.",
        add_arguments, fail_fast, run)
