"""Typed YAML configs: one vocabulary of groups for every command (linnet.config.groups),
each command's config (linnet.config.commands), and the machinery that reads, checks and
renders them (linnet.config.fields)."""

from linnet.config.commands import (
    COMMANDS,
    FOREIGN_FIELDS,
    FORMER_FIELDS,
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    PretrainConfig,
    RewardConfig,
    SFTConfig,
    checkpoint_epochs,
    command_of,
    from_data,
    load,
    load_any,
)
from linnet.config.fields import apply_overrides, from_dict, group, option, read_yaml, template, to_dict

__all__ = ["COMMANDS", "FOREIGN_FIELDS", "FORMER_FIELDS", "DistillConfig", "DPOConfig", "GRPOConfig", "PretrainConfig", "RewardConfig", "SFTConfig", "apply_overrides",
           "checkpoint_epochs", "command_of", "from_data", "from_dict", "group", "load", "load_any", "option",
           "read_yaml", "template", "to_dict"]
