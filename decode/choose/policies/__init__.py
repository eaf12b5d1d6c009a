"""Arm-selection policies. Importing this package registers every built-in policy by name."""
from . import (  # noqa: F401  (registration side effects)
    ducb, exp3, exp3spec, hedge, metasd_ucb, router, sequential_halving, simple, swucb, thompson, ucbspec)
from .base import Policy, build_policy, policy_names

__all__ = ["Policy", "build_policy", "policy_names"]
