"""Tests of the NMT Transformer, its config and beam search (CPU, each a few seconds at most)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from apps.config import ConfigError
from apps.nmt.config import CONFIG_DIR, NMTConfig, build_model, load_nmt_config, replace
from apps.nmt.model import (
    DecoderLayer,
    EncoderLayer,
    activation_stats,
    count_parameters,
    decode,
    encode,
    new_decoder_cache,
    token_cross_entropy,
    token_cross_entropy_sum,
)
from apps.nmt.search import beam_decode, beam_search, greedy_decode, length_penalty

PAD, BOS, EOS = 0, 2, 3


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)


def tiny_config(**changes: object) -> NMTConfig:
    return replace(load_nmt_config(["--config=tiny"]), **changes)


def random_batch(
    batch: int = 6, src_len: int = 9, tgt_len: int = 7, vocab: int = 128
) -> tuple[Tensor, Tensor]:
    """Random ids with some padded tails, so masks matter."""
    src = torch.randint(4, vocab, (batch, src_len))
    tgt = torch.randint(4, vocab, (batch, tgt_len))
    src[0, 5:] = PAD
    src[3, 2:] = PAD
    tgt[1, 3:] = PAD
    tgt[4, 6:] = PAD
    return src, tgt


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# --- parameter counts -------------------------------------------------------------------------

PAPER = [
    # config file, the paper's rounded count, what the issue computes for this layout
    ("t6_8192_16", 400e6, 0.41e9),
    ("t12_16384_32", 1.3e9, 1.24e9),
    ("t24_8192_16", 1.3e9, 1.24e9),
    ("t32_16384_32", 3e9, 3.08e9),
    ("t64_16384_32", 6e9, 6.04e9),
]


@pytest.mark.parametrize(("name", "paper", "computed"), PAPER)
def test_paper_parameter_counts_on_meta(name: str, paper: float, computed: float) -> None:
    config = load_nmt_config([f"--config={name}"])
    assert (config.d_model, config.vocab_size, config.head_dim) == (1024, 64000, 64)
    before = rss_bytes()
    model = build_model(config, device="meta")
    grown = rss_bytes() - before
    assert all(p.is_meta for p in model.parameters())
    assert grown < 200 * 2**20, f"building {name} on meta grew RSS by {grown / 2**20:.0f} MiB"
    count = count_parameters(model)
    assert abs(count - paper) / paper < 0.07, f"{name}: {count:,} vs paper {paper:,.0f}"
    assert abs(count - computed) / computed < 0.01, f"{name}: {count:,} vs {computed:,.0f}"


def test_paper_layout_matches_separate_embeddings_with_tied_output() -> None:
    # the paper's reading (separate source/target tables, output tied to the target table) and
    # ours (one shared table, untied output) both hold two V x D tables: the same count
    ours = load_nmt_config(["--config=t6_8192_16"])
    paper = replace(ours, share_embeddings=False, tie_output=True, num_stages=1)
    three_tables = replace(ours, share_embeddings=False, tie_output=False)
    count = count_parameters(build_model(ours, device="meta"))
    assert count_parameters(build_model(paper, device="meta")) == count
    table = ours.vocab_size * ours.d_model
    assert count_parameters(build_model(three_tables, device="meta")) == count + table


def test_deep_narrow_and_shallow_wide_have_equal_counts() -> None:
    deep = load_nmt_config(["--config=cpu_deep"])
    wide = load_nmt_config(["--config=cpu_wide"])
    assert deep.num_layers > wide.num_layers and deep.ffn_dim < wide.ffn_dim
    deep_count = count_parameters(build_model(deep, device="meta"))
    wide_count = count_parameters(build_model(wide, device="meta"))
    assert abs(deep_count - wide_count) / wide_count < 0.02, (deep_count, wide_count)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_builds_on_meta(path: Path) -> None:
    config = load_nmt_config([f"--config={path}"])
    model = build_model(config, device="meta")
    assert len(model) == config.num_model_layers


def test_cpu_default_is_a_small_two_stage_pipeline() -> None:
    # small enough to beat copy-the-source in 28 minutes on a machine half as fast as ours
    # (docs/RESULTS.md), and still a pipeline: 3+3 layers with embedding and projection on 2 stages
    config = load_nmt_config(["--config=cpu_default"])
    assert config.num_model_layers >= 8 and config.num_stages == 2
    assert count_parameters(build_model(config, device="meta")) < 3e6


# --- the layer contract the pipeline relies on ---------------------------------------------


def test_layer_names_and_tuple_contract() -> None:
    config = tiny_config()
    model = build_model(config).eval()
    names = [name for name, _ in model.named_children()]
    assert names == ["embed", "encoder_0", "encoder_1", "decoder_0", "decoder_1", "project"]
    src, tgt = random_batch()
    state: object = (src, tgt)
    for name, layer in model.named_children():
        state = layer(state)
        if name == "project":
            assert isinstance(state, Tensor) and state.shape == (6, 7, config.vocab_size)
        else:
            assert isinstance(state, tuple) and len(state) == 4
            enc_state, dec_state, src_pad, tgt_pad = state
            assert enc_state.shape == (6, 9, config.d_model)
            assert dec_state.shape == (6, 7, config.d_model)
            assert src_pad.dtype == tgt_pad.dtype == torch.bool
            assert torch.equal(src_pad, src.eq(PAD)) and torch.equal(tgt_pad, tgt.eq(PAD))


def test_cut_at_every_layer_boundary_gives_the_same_logits() -> None:
    model = build_model(tiny_config()).double().eval()
    src, tgt = random_batch()
    whole = model((src, tgt))
    for cut in range(1, len(model)):
        assert torch.equal(model[cut:](model[:cut]((src, tgt))), whole)


@pytest.mark.parametrize("sizes", [(3, 3), (1, 5), (2, 1, 3)])
def test_micro_batches_give_the_same_logits_as_the_full_batch(sizes: tuple[int, ...]) -> None:
    model = build_model(tiny_config()).double().eval()
    src, tgt = random_batch()
    whole = model((src, tgt))
    parts = [
        model((s, t)) for s, t in zip(src.split(list(sizes)), tgt.split(list(sizes)), strict=True)
    ]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-12)


def test_padding_does_not_change_real_positions() -> None:
    model = build_model(tiny_config()).double().eval()
    src, tgt = random_batch()
    logits = model((src, tgt))
    more_pad_src = torch.cat([src, torch.full((6, 5), PAD)], dim=1)
    more_pad_tgt = torch.cat([tgt, torch.full((6, 3), PAD)], dim=1)
    padded_logits = model((more_pad_src, more_pad_tgt))[:, : tgt.shape[1]]
    real = tgt.ne(PAD)
    torch.testing.assert_close(padded_logits[real], logits[real], rtol=0, atol=1e-12)


def test_all_padding_sequence_stays_finite() -> None:
    model = build_model(tiny_config())
    src, tgt = random_batch()
    src[2] = PAD
    loss = token_cross_entropy(model((src, tgt)), tgt, pad_id=PAD)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_encode_and_decode_reuse_the_layers_exactly() -> None:
    model = build_model(tiny_config()).double().eval()
    src, tgt = random_batch()
    memory, src_pad = encode(model, src)
    assert torch.equal(decode(model, memory, src_pad, tgt), model((src, tgt)))
    last = decode(model, memory, src_pad, tgt, last_only=True)
    # the last position alone is a matmul of another shape: equal up to summation order
    torch.testing.assert_close(last, model((src, tgt))[:, -1], rtol=0, atol=1e-12)


def test_cached_incremental_decoding_matches_the_full_decoder() -> None:
    model = build_model(tiny_config()).double().eval()
    src, _ = random_batch()
    tgt = torch.randint(4, 128, (6, 7))  # decoding prefixes hold no padding
    memory, src_pad = encode(model, src)
    full = decode(model, memory, src_pad, tgt)
    cache = new_decoder_cache(model)
    steps = [decode(model, memory, src_pad, tgt[:, :1], cache=cache)[:, -1]]
    steps += [decode(model, memory, src_pad, tgt[:, 1:4], cache=cache)[:, -1]]  # several at once
    rows = torch.tensor([5, 0, 2, 2])  # reorder and duplicate rows, as beam search does
    cache.select(rows)
    for position in range(4, 7):
        logits = decode(
            model, memory[rows], src_pad[rows], tgt[rows, position : position + 1], cache=cache
        )
        torch.testing.assert_close(logits[:, -1], full[rows, position], rtol=0, atol=1e-12)
    torch.testing.assert_close(steps[0], full[:, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(steps[1], full[:, 3], rtol=0, atol=1e-12)


def test_too_long_input_names_max_positions() -> None:
    model = build_model(tiny_config(max_positions=40, max_len=32, max_decode_len=24))
    with pytest.raises(ValueError, match="max_positions=40"):
        model((torch.ones(2, 41, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)))


def test_micro_batch_losses_sum_to_the_full_batch_loss() -> None:
    model = build_model(tiny_config()).double().eval()
    src, tgt = random_batch()
    full = token_cross_entropy(model((src, tgt)), tgt, pad_id=PAD, label_smoothing=0.1)
    tokens = int(tgt.ne(PAD).sum())
    summed = sum(
        token_cross_entropy_sum(model((s, t)), t, pad_id=PAD, label_smoothing=0.1)
        for s, t in zip(src.split(2), tgt.split(2), strict=True)
    )
    torch.testing.assert_close(summed / tokens, full)


# --- stability fixes and monitoring ----------------------------------------------------------


def blow_up_logits(model: nn.Sequential) -> None:
    with torch.no_grad():
        model.project.weight.mul_(200.0)


@pytest.mark.parametrize("training", [True, False])
def test_clipped_logits_never_exceed_the_bound(training: bool) -> None:
    config = tiny_config(logits_abs_max=5.0)
    model = build_model(config).train(training)
    blow_up_logits(model)
    src, tgt = random_batch()
    logits = model((src, tgt))
    assert logits.abs().max() <= config.logits_abs_max
    assert logits.abs().max() == config.logits_abs_max  # the clamp was active
    if training:  # the record is the logit before clipping
        assert activation_stats(model)["project/max_abs_logit"] > config.logits_abs_max


def test_clipping_off_leaves_logits_alone() -> None:
    model = build_model(tiny_config(logits_abs_max=5.0, clip_logits=False)).train()
    blow_up_logits(model)
    assert model(random_batch()).abs().max() > 5.0


@pytest.mark.parametrize("scaled", [True, False])
def test_scaled_init_has_the_intended_std(scaled: bool) -> None:
    config = tiny_config(
        num_layers=3, d_model=256, ffn_dim=1024, num_heads=4, head_dim=64, scaled_init=scaled
    )
    model = build_model(config)
    factor = (2 * config.num_layers) ** -0.5 if scaled else 1.0  # (2L)^-1/2, 2L = 6 layers
    for layer in model:
        if isinstance(layer, EncoderLayer | DecoderLayer):
            up, down = layer.ffn.up.weight, layer.ffn.down.weight
            assert up.std().item() == pytest.approx(factor / math.sqrt(256), rel=0.03)
            assert down.std().item() == pytest.approx(factor / math.sqrt(1024), rel=0.03)
            # attention is not a feed-forward layer: not scaled
            query = layer.self_attn.query.weight
            assert query.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.03)


def test_activation_stats_cover_every_layer_and_reset() -> None:
    model = build_model(tiny_config()).train()
    src, tgt = random_batch()
    model((src, tgt))
    for layer in model:
        assert layer.max_abs_activation.dim() == 0
        assert not layer.max_abs_activation.requires_grad
    stats = activation_stats(model)
    names = [name for name, _ in model.named_children()]
    expected = {f"{n}/max_abs_activation" for n in names[:-1]} | {"project/max_abs_logit"}
    assert set(stats) == expected | {"project/clipped_fraction"}
    assert all(math.isfinite(stats[k]) and stats[k] > 0 for k in expected)
    assert 0.0 <= stats["project/clipped_fraction"] <= 1.0
    assert activation_stats(model) == {}  # read resets
    model.eval()
    model((src, tgt))
    assert activation_stats(model) == {}  # only training forwards are recorded


def test_activation_stats_over_micro_batches_equal_the_full_batch() -> None:
    # the record is a running max until read, so a step of M micro-batches reports the step's max
    model = build_model(tiny_config()).double().train()  # tiny has dropout 0
    src, tgt = random_batch()
    model((src, tgt))
    full = activation_stats(model)
    for s, t in zip(src.split(3), tgt.split(3), strict=True):
        model((s, t))
    assert activation_stats(model) == pytest.approx(full, rel=1e-9)


def test_activation_stats_on_a_partition_use_its_names() -> None:
    model = build_model(tiny_config()).train()
    model(random_batch())
    stats = activation_stats(model[3:])
    assert set(stats) == {
        "decoder_0/max_abs_activation",
        "decoder_1/max_abs_activation",
        "project/max_abs_logit",
        "project/clipped_fraction",
    }


def test_meta_model_materialises_with_reset_parameters() -> None:
    config = tiny_config()
    model = build_model(config, device="meta").to_empty(device="cpu")
    for layer in model:
        layer.reset_parameters()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model(random_batch()).shape == (6, 7, config.vocab_size)


def test_tied_output_shares_the_target_table() -> None:
    model = build_model(tiny_config(share_embeddings=False, tie_output=True, num_stages=1))
    assert model.project.weight is model.embed.target_table.weight
    assert model.project.weight is not model.embed.source_table.weight


# --- search --------------------------------------------------------------------------------


def table_step_fn(table: dict[tuple[int, ...], dict[int, float]], vocab: int = 8):
    """A step function from a table prefix -> {token: probability}; unlisted tokens get ~0 and
    unlisted prefixes (reached only through ~0 tokens) end."""

    def step(prefix: Tensor, source: Tensor, parent: Tensor | None) -> Tensor:
        rows = []
        for row in prefix.tolist():
            probs = torch.full((vocab,), 1e-9, dtype=torch.float64)
            for token, p in table.get(tuple(row[1:]), {EOS: 1.0}).items():
                probs[token] = p
            rows.append(probs.log())
        return torch.stack(rows)

    return step


def test_length_penalty_values() -> None:
    assert length_penalty(7, 0.0) == 1.0
    assert length_penalty(1, 1.0) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx(2.0**0.6)


def test_beam_finds_a_better_sequence_than_greedy() -> None:
    a, b, c = 4, 5, 6
    table = {(): {a: 0.6, b: 0.4}, (a,): {EOS: 0.3, c: 0.25}, (b,): {EOS: 0.9}, (a, c): {EOS: 1.0}}
    common = dict(batch_size=1, bos_id=BOS, eos_id=EOS, max_len=5)
    assert greedy_decode(table_step_fn(table), **common) == [[a]]  # 0.6 * 0.3 = 0.18
    assert beam_decode(table_step_fn(table), beam_size=2, **common) == [[b]]  # 0.4 * 0.9 = 0.36


def test_length_penalty_prefers_longer_output() -> None:
    a = 4
    # raw: [] scores log 0.5 = -0.69, [a] scores log 0.5 + log 0.9 = -0.80; with alpha=2 the
    # longer one wins: -0.80 / (7/6)^2 = -0.59
    table = {(): {EOS: 0.5, a: 0.5}, (a,): {EOS: 0.9, a: 0.1}, (a, a): {EOS: 1.0}}
    common = dict(batch_size=1, beam_size=2, bos_id=BOS, eos_id=EOS, max_len=5)
    assert beam_decode(table_step_fn(table), alpha=0.0, **common) == [[]]
    assert beam_decode(table_step_fn(table), alpha=2.0, **common) == [[a]]


def test_beam_search_respects_max_len() -> None:
    a = 4
    table = {(a,) * n: {a: 0.99, EOS: 0.01} for n in range(10)}
    common = dict(batch_size=2, bos_id=BOS, eos_id=EOS, max_len=4)
    assert beam_decode(table_step_fn(table), beam_size=3, **common) == [[a] * 4] * 2
    assert greedy_decode(table_step_fn(table), **common) == [[a] * 4] * 2


def copy_batch(generator: torch.Generator, size: int, vocab: int) -> tuple[Tensor, ...]:
    lengths = torch.randint(2, 7, (size,), generator=generator)
    width = int(lengths.max())
    seq = torch.randint(4, vocab, (size, width), generator=generator)
    seq[torch.arange(width)[None] >= lengths[:, None]] = PAD
    tgt_in = torch.cat([torch.full((size, 1), BOS), seq], dim=1)
    tgt_out = torch.cat([seq, torch.full((size, 1), PAD)], dim=1)
    tgt_out[torch.arange(size), lengths] = EOS
    return seq, tgt_in, tgt_out


def test_beam_search_decodes_a_learned_copy_task() -> None:
    config = tiny_config(vocab_size=16)
    model = build_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):  # ~2 s
        src, tgt_in, tgt_out = copy_batch(generator, 64, config.vocab_size)
        loss = token_cross_entropy(model((src, tgt_in)), tgt_out, pad_id=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.2
    src, _, _ = copy_batch(generator, 24, config.vocab_size)
    expected = [[token for token in row if token != PAD] for row in src.tolist()]
    for beam_size in (1, 4):
        for use_cache in (True, False):
            hypotheses = beam_search(
                model,
                src,
                bos_id=BOS,
                eos_id=EOS,
                beam_size=beam_size,
                alpha=0.6,
                max_len=12,
                use_cache=use_cache,
            )
            assert hypotheses == expected, f"beam_size={beam_size} use_cache={use_cache}"
    assert model.training  # the search restored the mode


# --- config --------------------------------------------------------------------------------


def test_dataclass_defaults_are_the_cpu_default() -> None:
    # the embedded default runs on this CPU machine; cpu_default.yaml spells it out with reasons
    assert load_nmt_config([]) == load_nmt_config(["--config=cpu_default"])


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config key.*d_modle"):
        load_nmt_config(["--d_modle=64"])
    path = tmp_path / "bad.yaml"
    path.write_text("num_layer: 3\n")
    with pytest.raises(ConfigError, match="num_layer"):
        load_nmt_config([f"--config={path}"])


def test_yaml_then_command_line_override(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("num_layers: 5\nd_model: 64\nlanguages: [de, fr]\n")
    config = load_nmt_config([f"--config={path}", "--d_model=96"])
    assert config.num_layers == 5  # from YAML (the default is 3)
    assert config.d_model == 96  # the command line wins over YAML
    assert config.languages == ["de", "fr"]
    assert load_nmt_config([f"--config={path}"]).d_model == 64


def test_command_line_lists_and_bools() -> None:
    config = load_nmt_config(
        ["--languages=de,fr", "--scaled_init=false", "--num_stages=3", "--balance=2,3,3"]
    )
    assert config.languages == ["de", "fr"] and config.scaled_init is False
    assert config.balance == [2, 3, 3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--d_model=0"], "d_model=0 must be positive"),
        (["--logits_abs_max=0"], "logits_abs_max=0.0 must be > 0"),
        (["--dropout=1.5"], r"dropout=1.5 must be in \[0, 1\)"),
        (["--schedule=zigzag"], "schedule='zigzag': unknown schedule 'zigzag'"),
        (["--balance=3,3"], "balance=.*8 layers"),
        (["--tie_output=true"], "tie_output=true"),
        (["--eos_id=0"], "special token ids must differ"),
        (["--max_len=500"], "max_positions"),
    ],
)
def test_bad_values_get_clear_errors(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_nmt_config(args)


# --- under the pipeline ----------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpipe_gives_the_plain_loss_and_gradients(checkpoint: str) -> None:
    gp = pytest.importorskip("gpipe_core")
    model = build_model(tiny_config()).double()  # tiny has dropout 0: same function either way
    src, tgt = random_batch()
    token_cross_entropy(model((src, tgt)), tgt, pad_id=PAD).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    plain_loss = token_cross_entropy(model((src, tgt)), tgt, pad_id=PAD)
    model.zero_grad()
    pipe = gp.GPipe(model, balance=[2, 4], chunks=3, checkpoint=checkpoint)
    loss = token_cross_entropy(pipe((src, tgt)), tgt, pad_id=PAD)
    loss.backward()
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-12, msg=name)


def test_clipped_fraction_counts_logits_beyond_the_bound_at_real_positions() -> None:
    config = tiny_config()
    model = build_model(replace(config, logits_abs_max=0.05)).double().train()
    src, tgt = random_batch()
    model((src, tgt))
    fraction = activation_stats(model)["project/clipped_fraction"]
    model.eval()  # same function without dropout in tiny: recompute the raw logits by hand
    project = model[-1]
    state = model[:-1]((src, tgt))
    raw = torch.nn.functional.linear(project.norm(state[1]), project.weight, project.bias)
    real = tgt.ne(PAD)
    expected = (raw.abs() > 0.05)[real].double().mean().item()
    assert 0.0 < fraction < 1.0
    assert fraction == pytest.approx(expected, abs=1e-12)
    unclipped = build_model(replace(config, clip_logits=False)).train()
    unclipped((src, tgt))
    assert "project/clipped_fraction" not in activation_stats(unclipped)
