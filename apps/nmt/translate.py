"""Translate text to English with a trained NMT checkpoint, one line in, one line out.

    python -m apps.nmt.translate --ckpt runs/nmt --lang de < sentences.de > sentences.en
    python -m apps.nmt.translate --ckpt runs/nmt --lang fr --input file.fr [--beam-size 4]
        [--length-penalty 0.6] [--max-len 64] [--data-dir DIR] [--device cpu|cuda]

Runs in one process on the plain model merged from the checkpoint's shards (as
``apps.nmt.evaluate`` does: ``apps.nmt.checkpoint_loading``), with the corpus's SentencePiece tokenizer, which must be the
one the checkpoint was trained with (its fingerprint is in the checkpoint's tokenizer.json).
Sources are raw text in ``--lang``, one of the languages of that tokenizer (the model is
many-to-English: the language tag leads every source). Beam size and length penalty default to
the checkpoint's config (``beam_size``, ``length_penalty``); ``--beam-size 1`` is greedy.

Every input line gives exactly one output line, in order, so the output pairs with the input:

- an empty (or all-whitespace) line gives an empty line, without calling the model;
- a ``--lang`` the tokenizer knows but the model was not trained on (not in the config's
  ``languages``) is translated, with a warning: its tag's embedding never learned anything;
- a line longer than the model's positions (``max_positions`` tokens, the language tag
  included) is truncated to that many tokens, with a warning on stderr naming the line;
- the output of a sentence is at most ``--max-len`` tokens (default: the config's
  ``max_decode_len``) and at most twice the source's tokens plus 8.

Under torchrun the same command decodes through the pipeline instead, and no rank holds the
whole model::

    torchrun --nproc-per-node 2 -m apps.nmt.translate --ckpt runs/nmt --lang de --input f.de

One pipeline over the world: each rank builds its stage on the ``meta`` device and loads only
its weights (only its own shard when the world has the checkpoint's number of stages: the
training balance is read from the checkpoint; otherwise the layers are split by parameters).
Rank 0 reads the input and shares each group of lines; the source is encoded through the
stages and each decoding step runs through them with a key/value cache per decoder layer on its
stage (``apps.nmt.pipelined_search``); rank 0 prints exactly what the one-process command
prints. Give ``--input`` (or pipe a file): every rank waits for rank 0's next lines at most the
config's ``timeout_s``.

Lines are read and translated in groups of ``--batch-lines`` (each group's translations are
printed before the next group is read), so the command also works as a filter on a stream.
Errors (no or damaged checkpoint, another app's checkpoint, a corpus or tokenizer that does not
match, an unknown language, an unreadable input file) print one line and exit with status 2.
Under torchrun, a rank whose pipeline peer fails or stops answering prints one line naming
itself and that peer (rank and stage) and exits with status 1.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, TextIO

import torch
from torch import Tensor, nn

import gpipe_core as gp
from apps.nmt.checkpoint_loading import (
    LOAD_ERRORS,
    LoadedCheckpoint,
    load_checkpoint,
    load_pipeline,
)
from apps.nmt.data import Tokenizer
from apps.nmt.decoding import Sentence, translate
from apps.nmt.pipelined_search import pipeline_search
from apps.validation import CommandParser, device_name, say_once, threads

__all__ = ["encode_lines", "main", "translate_lines"]


def encode_lines(lines: Sequence[str], tokenizer: Tokenizer, lang: str, *, max_positions: int,
                 first_line: int = 1, warn: TextIO | None = sys.stderr) -> list[list[int] | None]:
    """Source ids (language tag first) of each line; None for an empty line. A line of more
    than ``max_positions`` tokens is cut to that many, with a warning naming its number
    (``first_line`` is the number of ``lines[0]``)."""
    encoded: list[list[int] | None] = []
    for number, line in enumerate(lines, start=first_line):
        if not line.strip():
            encoded.append(None)
            continue
        ids = tokenizer.encode_source(line.strip(), lang)
        if len(ids) > max_positions:
            if warn is not None:
                print(f"warning: line {number} has {len(ids)} tokens with its language tag, "
                      f"more than the model's max_positions={max_positions}; translating its "
                      f"first {max_positions} tokens only (split the line to keep the rest)",
                      file=warn, flush=True)
            ids = ids[:max_positions]
        encoded.append(ids)
    return encoded


def translate_lines(
    model: nn.Sequential | None,
    tokenizer: Tokenizer,
    lines: Sequence[str],
    *,
    lang: str,
    beam_size: int,
    alpha: float,
    max_len: int,
    max_positions: int,
    device: torch.device,
    first_line: int = 1,
    search: Callable[[Tensor, int], list[list[int]]] | None = None,
    warn: TextIO | None = sys.stderr,
) -> list[str]:
    """English for each of ``lines`` (an empty string for an empty line), in order.

    ``search(src_ids, max_len)`` decodes instead of ``model`` (through a pipeline)."""
    encoded = encode_lines(lines, tokenizer, lang, max_positions=max_positions,
                           first_line=first_line, warn=warn)
    sentences = [Sentence(lang, ids, line, "") for line, ids in zip(lines, encoded, strict=True)
                 if ids is not None]
    hypotheses = iter(translate(model, sentences, tokenizer, beam_size=beam_size, alpha=alpha,
                                max_decode_len=max_len, device=device, search=search)
                      if sentences else [])
    return ["" if ids is None else next(hypotheses) for ids in encoded]


def _groups(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while group := list(islice(iterator, size)):
        yield [line.rstrip("\r\n") for line in group]


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m apps.nmt.translate",
        description="Translate lines of text to English with an apps.nmt checkpoint "
        "(stdin or --input to stdout, one line per line; an empty line gives an empty line).",
    )
    parser.add_argument("--ckpt", default="runs/nmt", help="run out_dir or a step-* directory")
    parser.add_argument("--lang", required=True,
                        help="language of the input, as the corpus names it (de, fr, pt_BR, ...)")
    parser.add_argument("--input", default=None, help="file of sentences (default: stdin)")
    parser.add_argument("--beam-size", type=int, default=None,
                        help="beam width, 1 = greedy (default: the checkpoint's beam_size)")
    parser.add_argument("--length-penalty", type=float, default=None,
                        help="GNMT alpha (default: the checkpoint's length_penalty)")
    parser.add_argument("--max-len", type=int, default=None,
                        help="most tokens per translation (default: the config's max_decode_len)")
    parser.add_argument("--batch-lines", type=int, default=32,
                        help="lines read and translated together (default 32)")
    parser.add_argument("--data-dir", default=None, help="corpus directory (default: config's)")
    parser.add_argument("--threads", type=threads(), default=1,
                        help="torch CPU threads (default 1)")
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for stream in (sys.stdin, sys.stdout):  # text in any language, whatever the locale says
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8")

    rank = int(os.environ.get("RANK", "0"))
    pipelined = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun

    def fail(message: str) -> int:
        say_once(f"error: {message}")  # every rank reaches the same errors; one says it
        return 2

    for name in ("beam_size", "max_len", "batch_lines"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return fail(f"--{name.replace('_', '-')}={value} must be >= 1")
    alpha = args.length_penalty
    if alpha is not None and not (math.isfinite(alpha) and alpha >= 0):
        return fail(f"--length-penalty={args.length_penalty} must be a finite number >= 0 "
                    "(0 = no penalty)")
    source: TextIO = sys.stdin
    if args.input is not None:
        try:
            source = open(args.input, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as error:
            return fail(f"cannot read --input {args.input}: {error.strerror or error}; "
                        "give a text file of one sentence per line, or pipe the text to stdin")
    device = torch.device(args.device)
    try:
        loaded = load_checkpoint(args.ckpt, data_dir=args.data_dir, device=device,
                                 model=not pipelined)
    except LOAD_ERRORS as error:
        return fail(str(error))
    config, tokenizer, model = loaded.config, loaded.tokenizer, loaded.model
    if args.lang not in tokenizer.languages:
        return fail(f"--lang={args.lang} is not a language of this model's tokenizer; use one "
                    f"of: {' '.join(tokenizer.languages)}")
    trained = config.languages or tokenizer.languages  # empty config list = every language
    if args.lang not in trained and rank == 0:
        # the tag has an embedding, but an untrained one: allowed (zero-shot), never silent
        print(f"warning: --lang={args.lang} is in the tokenizer but this model was not trained "
              f"on it (trained: {' '.join(trained)}); expect poor translations",
              file=sys.stderr, flush=True)
    max_len = args.max_len or config.max_decode_len
    if max_len + 1 > config.max_positions:
        return fail(f"--max-len={max_len} + 1 (BOS) exceeds the model's max_positions="
                    f"{config.max_positions}; use --max-len {config.max_positions - 1} or less")
    beam_size = args.beam_size or config.beam_size
    alpha = config.length_penalty if args.length_penalty is None else args.length_penalty
    groups = _groups(source, args.batch_lines)
    search: Callable[[Tensor, int], list[list[int]]] | None = None
    next_group: Callable[[], list[str] | str | None] = lambda: next(groups, None)  # noqa: E731
    if pipelined:
        search, next_group, device = _pipeline(loaded, groups, beam_size=beam_size, alpha=alpha,
                                               device=args.device)
    first_line = 1
    try:
        while True:
            try:
                group = next_group()
            except UnicodeDecodeError as error:  # rank 0 says it to the other ranks too
                group = (f"line {first_line} or after of {args.input or 'stdin'} is not UTF-8 "
                         f"({error.reason} at byte {error.start}); convert the text to UTF-8")
                if pipelined:
                    _share(group)
            if isinstance(group, str):
                return fail(group)
            if group is None:
                break
            english = translate_lines(
                model, tokenizer, group, lang=args.lang, beam_size=beam_size, alpha=alpha,
                max_len=max_len, max_positions=config.max_positions, device=device,
                first_line=first_line, search=search, warn=sys.stderr if rank == 0 else None,
            )
            if rank == 0:
                sys.stdout.write("".join(line + "\n" for line in english))
                sys.stdout.flush()
            first_line += len(group)
    except gp.PipelineFailure as error:  # under torchrun: each survivor says where it stopped
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        if source is not sys.stdin:
            source.close()
    if pipelined:
        from apps.harness.run import end_run

        end_run()
    return 0


def _share(value: object) -> object:
    """``value`` of global rank 0 on every rank (the others pass anything)."""
    import torch.distributed as dist

    box = [value]
    with gp.collectives("translate: the next lines from rank 0"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _pipeline(loaded: LoadedCheckpoint, groups: Iterator[list[str]], *, beam_size: int,
              alpha: float, device: str) -> tuple[Any, Any, torch.device]:
    """Under torchrun: the search through this rank's stage (``load_pipeline``), and the input's
    groups of lines, read on rank 0 and shared with every rank."""
    pipe, run = load_pipeline(loaded, device=device)
    search = pipeline_search(pipe, loaded.config, beam_size=beam_size, alpha=alpha)

    def next_group() -> list[str] | str | None:
        return _share(next(groups, None) if run.master else None)  # type: ignore[return-value]

    return search, next_group, run.device


if __name__ == "__main__":
    sys.exit(main())
