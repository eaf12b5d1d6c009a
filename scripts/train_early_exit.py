"""Train the early-exit head:
`python scripts/train_early_exit.py [--recipe recipes/heads/early_exit.yaml] [--task math] [key=value ...]`
(= `python -m toolkit train early-exit ...`; also runs under `deepspeed`/`torchrun`; see
toolkit/train/early_exit.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.train.cli import main_for  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_for("early-exit"))
