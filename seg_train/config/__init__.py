"""Typed, frozen configuration: YAML -> validated dataclasses. No TensorFlow here.

Every key is a field of schema.py (default, constraint, doc); load.py reads a file strictly, resolve.py
fills derived defaults and refuses combinations that cannot work. Outside itself the package imports
only pure tables (the label maps and the one-line errors).
"""

from seg_train.config.load import (
                                   dump,
                                   flatten,
                                   from_dict,
                                   is_url,
                                   load,
                                   parse_override,
                                   read_yaml,
                                   set_dotted,
                                   without_weight_files,
)
from seg_train.config.resolve import check_batch, resolve_defaults
from seg_train.config.schema import (
                                   SECTIONS,
                                   Config,
                                   DataConfig,
                                   EvalConfig,
                                   LossConfig,
                                   ModelConfig,
                                   TrainConfig,
                                   replace,
                                   to_plain,
)
from seg_train.util.errors import ConfigError, exception_text, without_reprs

__all__ = ["Config", "DataConfig", "ModelConfig", "TrainConfig", "LossConfig", "EvalConfig", "ConfigError",
           "load", "from_dict", "dump", "flatten", "replace", "without_weight_files", "resolve_defaults",
           "check_batch", "parse_override", "read_yaml", "is_url", "exception_text", "without_reprs",
           "SECTIONS", "set_dotted", "to_plain"]
