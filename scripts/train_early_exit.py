"""Train the early-exit head: `python scripts/train_early_exit.py [--recipe recipes/heads/early_exit.yaml] [--task math] [key=value ...]`
(also runs under `deepspeed`/`torchrun`; see toolkit/train/early_exit.py)."""
import sys

from toolkit.train.early_exit import main

if __name__ == "__main__":
    sys.exit(main())
