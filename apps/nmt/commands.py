"""The commands an NMT error message names, for the user to run: train a run, build its corpus.

The bottom of the NMT app: the trainer (``apps.nmt.train``), checkpoint loading
(``apps.nmt.checkpoint_loading``) and the commands above them read these strings from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apps.nmt.config import NMTConfig

__all__ = ["TRAIN_COMMAND", "prepare_command"]

TRAIN_COMMAND = (
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m apps.nmt.train"
)


def prepare_command(config: NMTConfig) -> str:
    """The command that builds the corpus (and its tokenizer) ``config`` was trained on."""
    languages = f" --languages {','.join(config.languages)}" if config.languages else ""
    return (
        f"python -m data.gettext_m2en.prepare --out {config.data_dir} --packages "
        f"{config.packages} --vocab-size {config.vocab_size}{languages}"
    )
