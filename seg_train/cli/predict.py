"""seg-predict: whole images segmented by a checkpoint, a .tflite or a .onnx file."""

from __future__ import annotations

from seg_train.cli import process


def predict_main(argv=None) -> int:
    def add_arguments(parser):
        parser.add_argument("--output", required=True, metavar="DIR", help="folder for the PNGs and overlays")
        parser.add_argument("--label-ids", action="store_true",
                            help="write only the data set's raw label values (Cityscapes labelIds as "
                                 "<city>_<seq>_<frame>_labelIds.png, ADE20K 1..150, VOC indices, the inverse of "
                                 "data.label_map), single-channel PNGs as the official evaluators read them")
        parser.add_argument("inputs", nargs="+", metavar="INPUT",
                            help="image files or folders of images (one level deep); names must be distinct")

    def fail_fast(args):
        from seg_train.infer.predict import check_output_dir, collect_inputs
        collect_inputs(args.inputs, args.label_ids)
        check_output_dir(args.output)

    def run(cfg, strategy, args):
        from seg_train.infer.predict import run_predict
        run_predict(cfg, strategy, args.checkpoint, args.inputs, args.output, label_ids=args.label_ids)

    def run_model(cfg, args):
        from seg_train.infer.litert import run_predict_model
        run_predict_model(cfg, args.model, args.inputs, args.output, args.threads, label_ids=args.label_ids)

    return process.checkpoint_command(
        argv, "seg-predict", f"Segment whole images with a checkpoint ({process.MODEL_FAMILIES}) or a .tflite "
        "or .onnx file (each in one pass: any size that fits in memory; with --model, resized to the file's input "
        "size and back): <name>.png (palette PNG of class indices, original size) and <name>_overlay.jpg for each "
        "input, or with --label-ids one PNG of the data set's raw label values.", add_arguments, fail_fast, run,
        run_model)
