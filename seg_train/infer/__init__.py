"""Using a trained model: inference modes, evaluation, precise BN, loading, seg-eval, seg-predict, seg-export."""
