"""A trained model used: the inference modes (modes.py), full-resolution evaluation and the Evaluator that
owns its compiled functions (evaluate.py, metrics.py), precise BN (precise_bn.py), weights from a checkpoint
without an optimizer (load.py), seg-eval (eval_checkpoint.py), seg-predict (predict.py), seg-export and its
serving function (export.py), and the fixed val examples shown in TensorBoard (examples.py)."""
