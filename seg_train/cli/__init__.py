"""The command-line entry points (console scripts in setup.cfg), one module per command.

process.py's names are re-exported here. Commands call them through the module (`process.import_tensorflow`),
so a test that replaces one there reaches every command.
"""

from seg_train.cli.bench import bench_main, verify_towers_main  # noqa: F401
from seg_train.cli.eval import eval_main  # noqa: F401
from seg_train.cli.export import export_main  # noqa: F401
from seg_train.cli.predict import predict_main  # noqa: F401
from seg_train.cli.prepare import prepare_main  # noqa: F401
from seg_train.cli.process import (  # noqa: F401
    EXIT_INTERNAL,
    EXIT_PEER_FAILED,
    EXIT_USER_ERROR,
    MODEL_FAMILIES,
    TF_ENV_DEFAULTS,
    _end_process,
    import_tensorflow,
    log,
    peer_failure,
    quiet_stderr,
    run_guarded,
    set_tf_env_defaults,
    setup_logging,
    user_error,
    version_text,
)
from seg_train.cli.train import check_data_main, train_main  # noqa: F401
