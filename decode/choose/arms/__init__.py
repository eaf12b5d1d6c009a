"""Arms (proposers). Importing this package registers every built-in arm by name."""
from . import model, ngram, none, retrieval, suffix  # noqa: F401  (registration side effects)
from . import eagle, early_exit  # noqa: F401  (self-drafting arms, decode/choose/heads)
from . import union  # noqa: F401  (several arms as one tree; EAGLE trees are eagle:...,tree=dynamic|K=k)
from .base import Arm, ArmEnv, arm_names, build_arm, build_arms, check_arm_spec

__all__ = ["Arm", "ArmEnv", "arm_names", "build_arm", "build_arms", "check_arm_spec"]
