"""The harness both apps' train scripts share, one concept per module (imports point down).

====================  =====================================================================
``run``               this rank's place in a run under torchrun (``setup_run``, ``Run``)
``pipeline``          what the apps ask of gpipe_core: valid pipeline options, the balance
``out_dir``           the run's folder: writable, and locked by one run at a time
``checkpoints``       step folders, ``latest``, train state, resume and evaluation lookups
``run_log``           rank 0's sinks: ``log.jsonl`` and wandb
``guards``            divergence and interrupts (SIGINT / SIGTERM)
``rank0``             one-rank jobs the other ranks wait for, watched by a heartbeat
``entry``             a train script's entry point: one line per error the user can fix
``loop``              the training loop's control: stop vote, checkpoints, evaluation, windows
====================  =====================================================================
"""
