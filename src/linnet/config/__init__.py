"""Typed YAML configs: one vocabulary of groups for every command (linnet.config.groups),
each command's config (linnet.config.commands), the sampling trainers' options
(linnet.config.sampling: GRPOOptions, PPOOptions), and the machinery that reads, checks and
renders them (linnet.config.fields)."""

from linnet.config.commands import (
    COMMANDS,
    FOREIGN_FIELDS,
    FORMER_FIELDS,
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    PPOConfig,
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
from linnet.config.sampling import GRPOOptions, PPOOptions

__all__ = ["COMMANDS", "FOREIGN_FIELDS", "FORMER_FIELDS", "DistillConfig", "DPOConfig", "GRPOConfig", "GRPOOptions",
           "PPOConfig", "PPOOptions", "PretrainConfig", "RewardConfig", "SFTConfig", "apply_overrides",
           "checkpoint_epochs", "command_of", "from_data", "from_dict", "group", "load", "load_any", "option",
           "read_yaml", "template", "to_dict"]
