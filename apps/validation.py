"""The checks both apps share, run once before any process group: one ``error:`` line, exit 2.

What the config dataclass's types cannot say, in three kinds, each message naming the option
and the fix:

- *types* (``apps.config._coerce``): an integer option refuses a fraction, ``2.5e0``, ``1e-3``
  (which ``int(float(...))`` turned into 2 and 0), NaN and infinity; a float option refuses
  NaN and infinity; a text option refuses the empty string (:func:`check_text`).
- *ranges*: each app's ``validate()``; ``timeout_s`` has a floor, :data:`MIN_TIMEOUT_S`
  (:func:`check_timeout`).
- *relations*: ``balance`` against the model's layers and ``num_stages``
  (:func:`check_balance`, both apps), ``num_stages`` against the world size torchrun
  launched (:func:`check_world`, the train scripts, from ``WORLD_SIZE`` before any group);
  ``memory_budget_mb`` against the smallest per-rank peak any plan of the run's K, M and
  schedule reaches (``apps.planning.plan_for_budget``, counted on ``meta``, the train scripts
  before any group): the error names the budget, that peak and the fix.

The inference commands (translate, evaluate, classify) parse their flags with
:class:`CommandParser`, whose errors are one ``error:`` line too (rank 0 only under torchrun),
and check ``--threads``, ``--device`` and counts with :func:`threads`, :func:`device_name` and
:func:`at_least`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from apps.config import ConfigError

# Below this, gloo cannot even connect the ranks: `--timeout_s=0.001` failed with
# DistStoreError and gloo connect tracebacks that read as a network fault. Measured on 2 busy
# CPU cores with the tiny NMT config (docs/RELIABILITY.md): 0.001 s and 0.1 s fail at the
# rendezvous, 0.5 s and up train. The floor leaves room above the last failure.
MIN_TIMEOUT_S = 1.0


def check_timeout(timeout_s: float) -> None:
    """ConfigError unless ``timeout_s`` reaches :data:`MIN_TIMEOUT_S`."""
    if timeout_s < MIN_TIMEOUT_S:
        raise ConfigError(
            f"timeout_s={timeout_s} is below the floor of {MIN_TIMEOUT_S:g} s (connecting the "
            f"ranks alone takes longer, and the failure reads as a network fault); give "
            f"timeout_s >= {MIN_TIMEOUT_S:g} (the default is 300)"
        )


def check_text(config: Any) -> None:
    """ConfigError for a text option given as the empty string (``--out_dir=``): no option of
    either app means anything by it, and some (out_dir: the current folder) would act on it."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        if hints[field.name] is str and not str(getattr(config, field.name)).strip():
            raise ConfigError(f"{field.name} is empty; give a value (default: "
                              f"{field.default!r})")


def check_balance(balance: Sequence[int] | None, *, num_stages: int, num_layers: int,
                  layers: str) -> None:
    """ConfigError unless ``balance`` (layers per stage; None: chosen by the app) has one
    positive entry per stage summing to the model's ``num_layers`` (``layers`` says how they
    are counted, e.g. "2 * num_layers + 2")."""
    if balance is None:
        return
    if len(balance) != num_stages or sum(balance) != num_layers:
        raise ConfigError(
            f"balance={list(balance)} must have num_stages={num_stages} entries summing to the "
            f"model's {num_layers} layers ({layers})"
        )
    if min(balance) <= 0:
        raise ConfigError(f"balance={list(balance)} must give every stage a layer")


def check_world(num_stages: int, *, environ: dict[str, str] | None = None) -> None:
    """ConfigError unless the world torchrun launched (``WORLD_SIZE``, set before any process
    group) is whole pipelines of ``num_stages`` ranks."""
    environ = dict(os.environ) if environ is None else environ
    if "WORLD_SIZE" not in environ:
        return
    world = int(environ["WORLD_SIZE"])
    if world % num_stages:
        fits = [k for k in range(1, world + 1) if world % k == 0]
        raise ConfigError(
            f"num_stages={num_stages} does not divide the {world} ranks torchrun started "
            f"(world = replicas x num_stages); pass --num_stages as one of {fits}, or launch "
            f"torchrun with --nproc-per-node {num_stages} (or a multiple of it)"
        )


# ---------------------------------------------------------------------------------------------
# The inference commands' flags


# How long a rank other than 0, on an error every rank reaches alike before any process group,
# leaves rank 0 to say it under torchrun: rank 0 exits with it, and torchrun then stops this rank.
SAY_ONCE_WAIT_S = 15.0


def _torchrun_worker() -> bool:
    """Whether this process is a worker that torchrun (torch.distributed.elastic) started: its
    agent sets ``TORCHELASTIC_RUN_ID``; a process that only has ``RANK`` set is not one."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def leave_it_to_rank_0(wait_s: float = SAY_ONCE_WAIT_S) -> bool:
    """On a rank other than 0, with an error every rank reaches alike before any process group:
    whether this rank should say it too. Rank 0 always says it. Under torchrun another rank
    waits up to ``wait_s`` with SIGTERM's default action back (the train scripts turn SIGTERM
    into a flag): had it exited at once, torchrun could stop rank 0 before rank 0 printed (a
    slow import on a busy host) and the run would end with no line at all. Rank 0 exiting with
    the error makes torchrun stop this rank during the wait; if the run outlives the wait (rank
    0 did not fail alike), this rank says it, so it is never lost. A process with ``RANK`` set
    outside torchrun leaves it to rank 0 at once."""
    if int(os.environ.get("RANK", "0")) == 0:
        return True
    if not _torchrun_worker():
        return False
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread: the handler stays
        pass
    time.sleep(wait_s)
    return True


def say_once(line: str, *, wait_s: float = SAY_ONCE_WAIT_S) -> None:
    """Print ``line`` (an ``error: ...`` line every rank reaches alike) once for the run under
    torchrun: rank 0 at once, another rank only if the run outlives
    :func:`leave_it_to_rank_0`'s wait."""
    if leave_it_to_rank_0(wait_s):
        print(line, file=sys.stderr, flush=True)


class CommandParser(argparse.ArgumentParser):
    """argparse whose errors are one ``error: <message>; see <prog> --help`` line, exit 2, said
    once under torchrun (:func:`say_once`; argparse prints its usage and ``prog: error:`` on
    every rank)."""

    def error(self, message: str) -> NoReturn:
        head, _, rest = message.partition(": ")
        if head.startswith("argument ") and rest.startswith(head.removeprefix("argument ")):
            message = rest  # "argument --threads: --threads=0 ..." names the flag once
        say_once(f"error: {message}; see `{self.prog} --help`")
        sys.exit(2)


def at_least(flag: str, minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum`` (``what`` it counts, for the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is not a whole number; give {what} as an integer >= {minimum}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"{flag}={value} must be >= {minimum} ({what})")
        return value
    parse.__name__ = "int"
    return parse


def threads(flag: str = "--threads") -> Callable[[str], int]:
    """An argparse type for ``--threads``: torch's CPU threads, 1 or more."""
    return at_least(flag, 1, "torch CPU threads")


def device_name(text: str) -> str:
    """An argparse type for ``--device``: ``cpu``, ``cuda`` or ``cuda:N`` that this machine has."""
    import torch

    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(
            f"--device={text!r} is not a device; give cpu, cuda or cuda:N")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"--device={text} but this machine has no CUDA GPU that torch can use; give "
                "--device cpu")
        if index and int(index) >= count:
            raise argparse.ArgumentTypeError(
                f"--device={text} but this machine has {count} CUDA GPU(s) (cuda:0 .. "
                f"cuda:{count - 1}); give one of them")
    return text
