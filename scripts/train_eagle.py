"""Train the eagle head:
`python scripts/train_eagle.py [--recipe recipes/heads/eagle.yaml] [--task math] [key=value ...]`
(= `python -m toolkit train eagle ...`; also runs under `deepspeed`/`torchrun`; see toolkit/train/eagle.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.train.cli import main_for  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_for("eagle"))
