"""`python -m seg_train.cli ARGS`: seg-train ARGS."""

import sys

from seg_train.cli import train_main

sys.exit(train_main())
