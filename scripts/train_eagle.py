"""Train the eagle head: `python scripts/train_eagle.py [--recipe recipes/heads/eagle.yaml] [--task math] [key=value ...]`
(also runs under `deepspeed`/`torchrun`; see toolkit/train/eagle.py)."""
import sys

from toolkit.train.eagle import main

if __name__ == "__main__":
    sys.exit(main())
