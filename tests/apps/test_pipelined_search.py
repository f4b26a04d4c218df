"""Pipelined decoding in groups of sentences (``apps.nmt.pipelined_search``) against the
one-process search on the same groups: the same tokens and the same scores, bit for bit, on 2
and 4 ranks, float32 and float64, uneven groups, sentences that end at different steps; and a
failing stage is named instead of a hang."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from apps.nmt.model import transformer
from apps.nmt.search import search_hypotheses, split_groups
from tests.distributed import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PAD, BOS, EOS, VOCAB, LAYERS, MAX_LEN = 0, 2, 3, 12, 2, 7
BEAMS = (1, 3)  # greedy and beam search


def tiny_model(dtype: torch.dtype) -> torch.nn.Sequential:
    """The same random model in every process: 2+2 layers, d=16, 12 tokens; EOS made likely
    enough that sentences end at different steps, some at MAX_LEN."""
    torch.manual_seed(3)
    model = transformer(num_layers=LAYERS, d_model=16, ffn_dim=32, num_heads=2, head_dim=8,
                        vocab_size=VOCAB, dropout=0.0, max_positions=32, pad_id=PAD)
    with torch.no_grad():
        model[-1].bias[EOS] += 1.5
    return model.to(dtype).eval()


def sources() -> torch.Tensor:
    """7 padded sentences of 2 to 6 tokens."""
    generator = torch.Generator().manual_seed(5)
    src = torch.randint(4, VOCAB, (7, 6), generator=generator)
    for row, length in enumerate([6, 2, 4, 5, 3, 6, 2]):
        src[row, length:] = PAD
    return src


def several_batches() -> list[tuple[torch.Tensor, int]]:
    """Batches of other widths, sizes and max_len, more of them than are in flight at once."""
    src = sources()
    return [(src[:3, :4], 5), (src[3:], MAX_LEN), (src[1:2], 3), (src[2:6, :5], 6)]


def decode_on_ranks(rank: int, world_size: int, dtype: torch.dtype, balances: list[list[int]],
                    groups: list[int | None]) -> dict[Any, Any]:
    from apps.nmt.pipelined_search import pipelined_search_batches, pipelined_search_hypotheses
    from gpipe_core import DistributedGPipe

    results = {}
    for balance in balances:
        pipe = DistributedGPipe(tiny_model(dtype), balance, chunks=1,
                                loss_fn=lambda out, target: out.sum(), timeout_s=30)
        for beam in BEAMS:
            for group_count in groups:
                results[(tuple(balance), beam, group_count)] = pipelined_search_hypotheses(
                    pipe, sources(), pad_id=PAD, bos_id=BOS, eos_id=EOS, beam_size=beam,
                    alpha=0.6, max_len=MAX_LEN, groups=group_count)
            results[(tuple(balance), beam, "batches")] = pipelined_search_batches(
                pipe, several_batches(), pad_id=PAD, bos_id=BOS, eos_id=EOS, beam_size=beam,
                alpha=0.6, in_flight=2)
    return results


@pytest.mark.parametrize("world_size, balances", [
    (1, [[6]]),  # one stage: no messages, the same rotation
    (2, [[3, 3], [4, 2]]),  # encoders | decoders; the first decoder on stage 0
    (4, [[1, 2, 2, 1], [2, 2, 1, 1]]),  # embed and project alone; a stage of both kinds
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_pipelined_search_gives_the_one_process_hypotheses_and_scores(
        tmp_path: Path, world_size: int, balances: list[list[int]], dtype: torch.dtype) -> None:
    groups: list[int | None] = [1, 3, None]  # the whole batch; 3+2+2 sentences; the default
    model, src = tiny_model(dtype), sources()
    expected = {}
    for beam in BEAMS:
        for group_count in groups:
            count = min(world_size, 7) if group_count is None else group_count
            expected[(beam, group_count)] = search_hypotheses(
                model, src, bos_id=BOS, eos_id=EOS, beam_size=beam, alpha=0.6, max_len=MAX_LEN,
                groups=count)
        expected[(beam, "batches")] = [  # each batch as one process decodes it
            search_hypotheses(model, batch, bos_id=BOS, eos_id=EOS, beam_size=beam, alpha=0.6,
                              max_len=max_len) for batch, max_len in several_batches()]
    greedy = expected[(1, 3)]
    lengths = {len(hypothesis.tokens) for hypothesis in greedy}
    assert len(lengths) > 2 and MAX_LEN in lengths  # sentences end at different steps
    assert len({len(hypothesis.tokens) for hypothesis in expected[(3, 3)]}) > 2
    assert [len(rows) for rows in split_groups(7, 3)] == [3, 2, 2]
    ranks = launch.spawn(decode_on_ranks, world_size, tmp_path, dtype, balances, groups)
    for per_rank in ranks:  # every rank gets the hypotheses
        for (balance, beam, group_count), hypotheses in per_rank.items():
            want = expected[(beam, group_count)]
            if group_count == "batches":  # per batch
                assert [len(batch) for batch in hypotheses] == [len(batch) for batch in want]
                hypotheses = [h for batch in hypotheses for h in batch]
                want = [h for batch in want for h in batch]
            assert [h.tokens for h in hypotheses] == [h.tokens for h in want], (balance, beam)
            assert [h.score for h in hypotheses] == [h.score for h in want], (balance, beam)
            assert all(math.isfinite(h.score) for h in hypotheses)


def fail_on_the_last_stage(rank: int, world_size: int) -> str:
    from apps.nmt.pipelined_search import pipelined_search_hypotheses
    from gpipe_core import DistributedGPipe, PipelineFailure

    pipe = DistributedGPipe(tiny_model(torch.float32), [2] * (world_size - 1) + [6 - 2 * (
        world_size - 1)], chunks=1, loss_fn=lambda out, target: out.sum(), timeout_s=5)
    if pipe.is_last:
        project = list(pipe)[-1]
        calls = iter(range(1000))

        def logits(state: torch.Tensor, tgt_pad: Any = None) -> torch.Tensor:
            if next(calls) == 4:
                raise ValueError("broken projection")
            return type(project).logits(project, state, tgt_pad)

        project.logits = logits  # type: ignore[method-assign]
    try:
        pipelined_search_hypotheses(pipe, sources(), pad_id=PAD, bos_id=BOS, eos_id=EOS,
                                    beam_size=2, max_len=MAX_LEN, groups=3)
    except PipelineFailure as failure:
        return f"PipelineFailure: {failure}"
    except ValueError as error:
        return f"ValueError: {error}"
    return "no error"


def test_a_failing_stage_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    results = launch.spawn(fail_on_the_last_stage, 2, tmp_path, timeout_s=120)
    assert results[1] == "ValueError: broken projection"
    assert results[0].startswith("PipelineFailure: ") and "broken projection" in results[0]


def one_stage_stays_silent(rank: int, world_size: int) -> str:
    import time

    from apps.nmt.pipelined_search import pipelined_search_hypotheses
    from gpipe_core import DistributedGPipe, PipelineFailure

    pipe = DistributedGPipe(tiny_model(torch.float32), [3, 3], chunks=1,
                            loss_fn=lambda out, target: out.sum(), timeout_s=3)
    if rank == 1:  # alive, but never decodes
        time.sleep(12)
        return "silent"
    start = time.monotonic()
    try:
        pipelined_search_hypotheses(pipe, sources(), pad_id=PAD, bos_id=BOS, eos_id=EOS,
                                    beam_size=2, max_len=MAX_LEN, groups=2)
    except PipelineFailure as failure:
        return f"{time.monotonic() - start:.0f} s: {failure}"
    return "no error"


def test_a_silent_stage_times_out_instead_of_hanging(tmp_path: Path) -> None:
    results = launch.spawn(one_stage_stays_silent, 2, tmp_path, timeout_s=120)
    assert results[1] == "silent"
    seconds, message = results[0].split(" s: ", 1)
    assert int(seconds) < 10, results[0]
    # this rank and stage, and the peer's rank and stage (stage 1 alone would be ambiguous
    # with data-parallel replicas)
    assert "rank 0 (stage 0) in pipelined decoding, waiting for" in message
    assert "rank 1 (stage 1)" in message
