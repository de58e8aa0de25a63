"""Training entry point for ``accelerate launch`` (same flags as ``hf-varlen train``).

python scripts/train.py                                     # embedded tiny default
accelerate launch --config_file scripts/accelerate/cpu_2proc.yaml scripts/train.py  # 2 CPU procs (gloo)
accelerate launch --config_file scripts/accelerate/ddp.yaml scripts/train.py --model ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_varlen.train import main  # noqa: E402

if __name__ == "__main__":
    main()
