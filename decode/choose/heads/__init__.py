"""Small trainable modules that live on top of a frozen target (shared by decode arms and toolkit
trainers): the EAGLE feature head, the EESD early-exit drafter and the Cali-TS calibration predictor.

Every head saves to a folder holding ``head.safetensors`` (trainable weights only) and
``head.json`` (kind, hyper-parameters, the target it was trained for); :func:`load_head` rebuilds it
on top of the target it is given. A new head subclasses :class:`Head` with its own ``kind`` (that
registers it for :func:`load_head`) and is imported below.
"""
from __future__ import annotations

from .common import HEAD_CONFIG, HEAD_KINDS, HEAD_WEIGHTS, Head, load_head, read_head_config, save_head
from .calibrator import CalibrationPredictor
from .eagle import EagleHead
from .early_exit import EarlyExitDrafter

__all__ = ["CalibrationPredictor", "EagleHead", "EarlyExitDrafter", "HEAD_CONFIG", "HEAD_KINDS", "HEAD_WEIGHTS", "Head",
           "load_head", "read_head_config", "save_head"]
