"""Train the calibrator head:
`python scripts/train_calibrator.py [--recipe recipes/heads/calibrator.yaml] [--task math] [key=value ...]`
(= `python -m toolkit train calibrator ...`; also runs under `deepspeed`/`torchrun`; see
toolkit/train/calibrator.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.train.cli import main_for  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_for("calibrator"))
