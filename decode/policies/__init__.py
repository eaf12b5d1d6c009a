"""Arm-selection policies. Importing this package registers every built-in policy by name."""
from . import exp3spec, simple, ucbspec  # noqa: F401  (registration side effects)
from .base import Policy, build_policy, policy_names

__all__ = ["Policy", "build_policy", "policy_names"]
