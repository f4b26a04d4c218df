"""Translate text to English with a trained NMT checkpoint, one line in, one line out.

    python -m apps.nmt.translate --ckpt runs/nmt --lang de < sentences.de > sentences.en
    python -m apps.nmt.translate --ckpt runs/nmt --lang fr --input file.fr [--beam-size 4]
        [--length-penalty 0.6] [--max-len 64] [--data-dir DIR] [--device cpu|cuda]

Runs in one process on the plain model merged from the checkpoint's shards (as
``scripts/eval_bleu.py`` does), with the corpus's SentencePiece tokenizer, which must be the
one the checkpoint was trained with (its fingerprint is in the checkpoint's tokenizer.json).
Sources are raw text in ``--lang``, one of the languages of that tokenizer (the model is
many-to-English: the language tag leads every source). Beam size and length penalty default to
the checkpoint's config (``beam_size``, ``length_penalty``); ``--beam-size 1`` is greedy.

Every input line gives exactly one output line, in order, so the output pairs with the input:

- an empty (or all-whitespace) line gives an empty line, without calling the model;
- a line longer than the model's positions (``max_positions`` tokens, the language tag
  included) is truncated to that many tokens, with a warning on stderr naming the line;
- the output of a sentence is at most ``--max-len`` tokens (default: the config's
  ``max_decode_len``) and at most twice the source's tokens plus 8.

Lines are read and translated in groups of ``--batch-lines`` (each group's translations are
printed before the next group is read), so the command also works as a filter on a stream.
Errors (no or damaged checkpoint, another app's checkpoint, a corpus or tokenizer that does not
match, an unknown language, an unreadable input file) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import TextIO

import torch
from torch import nn

import gpipe_core as gp
from apps.config import ConfigError
from apps.nmt.data import CorpusError, Tokenizer
from apps.nmt.evaluate import (
    CheckpointError,
    Sentence,
    TokenizerMismatch,
    load_checkpoint,
    translate,
)

__all__ = ["encode_lines", "main", "translate_lines"]

CLEAR_ERRORS = (CheckpointError, gp.CheckpointCorruptError, CorpusError, ConfigError,
                TokenizerMismatch)


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
    model: nn.Sequential,
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
) -> list[str]:
    """English for each of ``lines`` (an empty string for an empty line), in order."""
    encoded = encode_lines(lines, tokenizer, lang, max_positions=max_positions,
                           first_line=first_line)
    sentences = [Sentence(lang, ids, line, "") for line, ids in zip(lines, encoded, strict=True)
                 if ids is not None]
    hypotheses = iter(translate(model, sentences, tokenizer, beam_size=beam_size, alpha=alpha,
                                max_decode_len=max_len, device=device) if sentences else [])
    return ["" if ids is None else next(hypotheses) for ids in encoded]


def _groups(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while group := list(islice(iterator, size)):
        yield [line.rstrip("\r\n") for line in group]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
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
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for stream in (sys.stdin, sys.stdout):  # text in any language, whatever the locale says
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8")

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 2

    for name in ("beam_size", "max_len", "batch_lines"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return fail(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.length_penalty is not None and args.length_penalty < 0:
        return fail(f"--length-penalty={args.length_penalty} must be >= 0 (0 = no penalty)")
    source: TextIO = sys.stdin
    if args.input is not None:
        try:
            source = open(args.input, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as error:
            return fail(f"cannot read --input {args.input}: {error.strerror or error}; "
                        "give a text file of one sentence per line, or pipe the text to stdin")
    device = torch.device(args.device)
    try:
        loaded = load_checkpoint(args.ckpt, data_dir=args.data_dir, device=device)
    except CLEAR_ERRORS as error:
        return fail(str(error))
    config, tokenizer, model = loaded.config, loaded.tokenizer, loaded.model
    assert model is not None
    if args.lang not in tokenizer.languages:
        return fail(f"--lang={args.lang} is not a language of this model's tokenizer; use one "
                    f"of: {' '.join(tokenizer.languages)}")
    max_len = args.max_len or config.max_decode_len
    if max_len + 1 > config.max_positions:
        return fail(f"--max-len={max_len} + 1 (BOS) exceeds the model's max_positions="
                    f"{config.max_positions}; use --max-len {config.max_positions - 1} or less")
    first_line = 1
    try:
        for group in _groups(source, args.batch_lines):
            english = translate_lines(
                model, tokenizer, group, lang=args.lang,
                beam_size=args.beam_size or config.beam_size,
                alpha=config.length_penalty if args.length_penalty is None
                else args.length_penalty,
                max_len=max_len, max_positions=config.max_positions, device=device,
                first_line=first_line,
            )
            sys.stdout.write("".join(line + "\n" for line in english))
            sys.stdout.flush()
            first_line += len(group)
    except UnicodeDecodeError as error:
        return fail(f"line {first_line} or after of {args.input or 'stdin'} is not UTF-8 "
                    f"({error.reason} at byte {error.start}); convert the text to UTF-8")
    finally:
        if source is not sys.stdin:
            source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
