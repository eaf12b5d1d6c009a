#!/usr/bin/env python
"""Train a task drafter for the target on self-distilled data (issue: task-specialised drafters).

    deepspeed scripts/train_drafter.py --recipe recipes/drafters/cpu-small.yaml --task math [key=value ...]
    torchrun --nproc-per-node 2 scripts/train_drafter.py --recipe ... --task code
    python scripts/train_drafter.py --recipe ... --task all train.max_steps=20

All logic lives in :mod:`toolkit.train.drafter`; this file only makes the checkout importable.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.train.drafter import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
