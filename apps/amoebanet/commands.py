"""The command an AmoebaNet error message names, for the user to run: train a run.

The bottom of the AmoebaNet app: the trainer (``apps.amoebanet.train``), checkpoint loading
(``apps.amoebanet.checkpoint_loading``) and the commands above them read it from here.
"""

from __future__ import annotations

__all__ = ["TRAIN_COMMAND"]

# ``.format(out_dir=...)`` gives the command that trains into that out_dir
TRAIN_COMMAND = (
    "python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d "
    "--rdzv-endpoint 127.0.0.1:0 -m apps.amoebanet.train --out_dir={out_dir}"
)
