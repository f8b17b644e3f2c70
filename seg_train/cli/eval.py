"""seg-eval: a checkpoint (or a .tflite file in LiteRT, a .onnx file in ONNX Runtime) evaluated at full resolution."""

from __future__ import annotations

from seg_train.cli import process


def eval_main(argv=None) -> int:
    def add_arguments(parser):
        parser.add_argument("--split", help="split to evaluate (default: data.val_split)")
        parser.add_argument("--json", action="store_true",
                            help="print the evaluation record (the JSON file's object) as the last line of stdout")

    def run(cfg, strategy, args):
        from seg_train.infer.eval_checkpoint import run_eval
        record = run_eval(cfg, strategy, args.checkpoint, args.split)
        if args.json:
            process.print_json(record)

    def run_model(cfg, args):
        from seg_train.infer.litert import run_eval_model
        record = run_eval_model(cfg, args.model, args.split, args.threads)
        if args.json:
            process.print_json(record)

    return process.checkpoint_command(
        argv, "seg-eval", f"Evaluate a checkpoint ({process.MODEL_FAMILIES}) at full resolution, or a "
        ".tflite file in LiteRT, a .onnx file in ONNX Runtime: per-class IoU, mIoU, pixel accuracy. Writes "
        "RUN_DIR/eval/<split>-step<k>.json (a checkpoint; RUN_DIR/eval/<split>-init.json without one: the model as "
        "model.init_weights starts it, e.g. a published EoMT) or FILE.eval-<split>.json beside the file.",
        add_arguments, lambda args: None, run, run_model, start_weights=True)
