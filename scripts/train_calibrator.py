"""Train the calibrator head: `python scripts/train_calibrator.py [--recipe recipes/heads/calibrator.yaml] [--task math] [key=value ...]`
(also runs under `deepspeed`/`torchrun`; see toolkit/train/calibrator.py)."""
import sys

from toolkit.train.calibrator import main

if __name__ == "__main__":
    sys.exit(main())
