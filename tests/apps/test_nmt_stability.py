"""Issue 21's model options (post-norm, qk-layernorm, z-loss) and its per-step measurements
(largest attention logit per layer, log Z), each against a hand computation on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from apps.config import ConfigError
from apps.nmt.config import NMTConfig, build_model, load_nmt_config, replace
from apps.nmt.model import (
    DecoderLayer,
    EncoderLayer,
    activation_stats,
    count_parameters,
    decode,
    encode,
    new_decoder_cache,
    stability_stats,
    token_cross_entropy,
    token_cross_entropy_sum,
)
from apps.nmt.monitor import attention_index, combine, split_stats
from tests.apps.test_nmt_model import random_batch

PAD = 0


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)


def tiny_config(**changes: object) -> NMTConfig:
    """The tiny config with the attention-logit record on (off by default: it costs a product)."""
    return replace(load_nmt_config(["--config=tiny"]), **{"record_attention": True, **changes})


# --- config ------------------------------------------------------------------------------------


def test_issue21_options_are_accepted_and_checked() -> None:
    config = tiny_config(norm="post", qk_norm=True, z_loss=1e-4, label_smoothing=0.0,
                         clip_norm=0.0)
    assert (config.norm, config.qk_norm, config.z_loss) == ("post", True, 1e-4)
    with pytest.raises(ConfigError, match=r"norm='middle' is not one of \['pre', 'post'\]"):
        tiny_config(norm="middle")
    with pytest.raises(ConfigError, match="z_loss=-1.0 must be >= 0"):
        tiny_config(z_loss=-1.0)
    defaults = NMTConfig()
    assert (defaults.norm, defaults.qk_norm, defaults.z_loss) == ("pre", False, 0.0)
    assert defaults.record_attention is False


# --- post-norm -----------------------------------------------------------------------------


def test_post_norm_encoder_layer_is_layernorm_of_the_residual_sum() -> None:
    config = tiny_config(norm="post")
    model = build_model(config).double().eval()
    layer = model.encoder_0
    assert isinstance(layer, EncoderLayer) and layer.post_norm
    x = torch.randn(3, 5, config.d_model, dtype=torch.float64)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    allowed = (~pad)[:, None, None, :]
    h = layer.self_attn_norm(x + layer.self_attn(x, x, allowed))
    expected = layer.ffn_norm(h + layer.ffn.down(F.relu(layer.ffn.up(h))))
    torch.testing.assert_close(layer.encode(x, pad), expected, rtol=0, atol=1e-12)
    # the same weights as pre-norm give another function
    pre = x + layer.self_attn(layer.self_attn_norm(x), layer.self_attn_norm(x), allowed)
    pre = pre + layer.ffn(layer.ffn_norm(pre))
    assert (layer.encode(x, pad) - pre).abs().max() > 1e-3


def test_post_norm_decoder_layer_normalises_after_each_residual() -> None:
    config = tiny_config(norm="post")
    model = build_model(config).double().eval()
    layer = model.decoder_1
    assert isinstance(layer, DecoderLayer) and layer.post_norm and layer.memory_norm is None
    y = torch.randn(2, 4, config.d_model, dtype=torch.float64)
    memory = torch.randn(2, 6, config.d_model, dtype=torch.float64)
    src_pad = torch.zeros(2, 6, dtype=torch.bool)
    src_pad[0, 4:] = True
    tgt_pad = torch.zeros(2, 4, dtype=torch.bool)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    h = layer.self_attn_norm(y + layer.self_attn(y, y, causal))
    h = layer.cross_attn_norm(h + layer.cross_attn(h, memory, (~src_pad)[:, None, None, :]))
    expected = layer.ffn_norm(h + layer.ffn(h))
    torch.testing.assert_close(layer.decode(y, memory, src_pad, tgt_pad), expected,
                               rtol=0, atol=1e-12)


def test_post_norm_has_no_final_layernorms() -> None:
    pre, post = build_model(tiny_config()), build_model(tiny_config(norm="post"))
    assert post.decoder_0.memory_norm is None and isinstance(post.project.norm, torch.nn.Identity)
    d = tiny_config().d_model
    assert count_parameters(pre) - count_parameters(post) == 2 * 2 * d  # two LayerNorms


@pytest.mark.parametrize("options", [dict(norm="post"), dict(norm="post", qk_norm=True),
                                     dict(qk_norm=True)])
def test_cut_and_micro_batches_give_the_same_logits(options: dict[str, object]) -> None:
    model = build_model(tiny_config(**options)).double().eval()
    src, tgt = random_batch()
    whole = model((src, tgt))
    for cut in range(1, len(model)):
        assert torch.equal(model[cut:](model[:cut]((src, tgt))), whole)
    parts = [model((s, t)) for s, t in zip(src.split(2), tgt.split(2), strict=True)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [dict(norm="post"), dict(norm="post", qk_norm=True)])
def test_cached_decoding_matches_the_full_decoder(options: dict[str, object]) -> None:
    model = build_model(tiny_config(**options)).double().eval()
    src, tgt = random_batch()
    tgt[:, :] = tgt.clamp(min=4)  # no padding in the prefix: incremental decoding has none
    memory, src_pad = encode(model, src)
    full = decode(model, memory, src_pad, tgt)
    torch.testing.assert_close(full, model((src, tgt)), rtol=0, atol=1e-12)
    cache = new_decoder_cache(model)
    steps = [decode(model, memory, src_pad, tgt[:, i:i + 1], cache=cache)
             for i in range(tgt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("options", [dict(norm="post"),
                                     dict(norm="post", qk_norm=True, z_loss=1e-2)])
def test_gpipe_gives_the_plain_loss_and_gradients(checkpoint: str,
                                                  options: dict[str, object]) -> None:
    gp = pytest.importorskip("gpipe_core")
    config = tiny_config(**options)
    model = build_model(config).double()  # tiny has dropout 0: same function either way
    src, tgt = random_batch()
    tokens = int(tgt.ne(PAD).sum())

    def loss_of(logits: Tensor) -> Tensor:
        return token_cross_entropy_sum(logits, tgt, pad_id=PAD, z_loss=config.z_loss) / tokens

    loss_of(model((src, tgt))).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    plain_loss = loss_of(model((src, tgt)))
    model.zero_grad()
    pipe = gp.GPipe(model, balance=[2, 4], chunks=3, checkpoint=checkpoint)
    loss = loss_of(pipe((src, tgt)))
    loss.backward()
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-12, msg=name)


# --- qk-layernorm and z-loss -------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_blind_to_the_query_and_key_scale(qk_norm: bool) -> None:
    model = build_model(tiny_config(qk_norm=qk_norm)).double().eval()
    src, tgt = random_batch()
    before = model((src, tgt))
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, EncoderLayer | DecoderLayer):
                for linear in (layer.self_attn.query, layer.self_attn.key):
                    linear.weight.mul_(30.0)  # biases are 0 at init: q and k scale by 30
    after = model((src, tgt))
    if qk_norm:  # LayerNorm(30 q) = LayerNorm(q) up to its epsilon (1e-5 against var(q))
        torch.testing.assert_close(after, before, rtol=0, atol=1e-3)
    else:
        assert (after - before).abs().max() > 1e-2


def test_z_loss_adds_the_weighted_squared_log_normaliser() -> None:
    logits = torch.randn(3, 4, 11, dtype=torch.float64) * 3
    target = torch.randint(1, 11, (3, 4))
    target[0, 2:] = PAD
    real = target.ne(PAD)
    log_z = torch.logsumexp(logits, dim=-1)
    log_probs = logits - log_z[..., None]
    ce = -log_probs.gather(-1, target[..., None])[..., 0][real].sum()
    w = 1e-2
    by_hand = ce + w * (log_z[real] ** 2).sum()
    got = token_cross_entropy_sum(logits, target, pad_id=PAD, z_loss=w)
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-10)
    torch.testing.assert_close(token_cross_entropy_sum(logits, target, pad_id=PAD), ce,
                               rtol=0, atol=1e-10)
    torch.testing.assert_close(token_cross_entropy(logits, target, pad_id=PAD, z_loss=w),
                               by_hand / real.sum(), rtol=0, atol=1e-12)
    # the z-loss pulls log Z towards 0: its gradient on a logit shared by every class is
    # 2 w log Z per token (softmax-invariant shifts are invisible to the cross entropy)
    shift = torch.zeros((), dtype=torch.float64, requires_grad=True)
    token_cross_entropy_sum(logits + shift, target, pad_id=PAD, z_loss=w).backward()
    torch.testing.assert_close(shift.grad, 2 * w * log_z[real].sum(), rtol=1e-9, atol=1e-9)


# --- the per-step measurements ---------------------------------------------------------------


def hand_max_logit(attn: torch.nn.Module, query_in: Tensor, key_in: Tensor, allowed: Tensor,
                   query_pad: Tensor) -> float:
    """max over allowed (real query, key) pairs of q.k / sqrt(head_dim), written out."""
    b, lq, _ = query_in.shape
    lk = key_in.shape[1]
    a, hd = attn.num_heads, attn.head_dim
    q = attn.query(query_in).view(b, lq, a, hd)
    k = attn.key(key_in).view(b, lk, a, hd)
    best = -math.inf
    for i in range(b):
        for h in range(a):
            for t in range(lq):
                if query_pad[i, t]:
                    continue
                for s in range(lk):
                    if allowed[i, 0, min(t, allowed.shape[2] - 1), s]:
                        best = max(best, float(q[i, t, h] @ k[i, s, h]) / math.sqrt(hd))
    return best


def test_stability_stats_against_a_hand_computation() -> None:
    config = tiny_config(logits_abs_max=0.3)  # a bound the tiny logits cross: log Z of clipped
    model = build_model(config).double().train()  # tiny has dropout 0
    src = torch.randint(4, 128, (3, 5))
    tgt = torch.randint(4, 128, (3, 4))
    src[1, 3:] = PAD
    tgt[2, 2:] = PAD
    logits = model((src, tgt))
    stats = stability_stats(model)
    expected_keys = {"encoder_0.self_attn", "encoder_1.self_attn", "decoder_0.self_attn",
                     "decoder_0.cross_attn", "decoder_1.self_attn", "decoder_1.cross_attn"}
    assert {k.split("/")[0] for k in stats if k.endswith("max_attention_logit")} == expected_keys
    assert activation_stats(model)["project/max_abs_logit"] > 0.3  # the clip did engage
    model.eval()  # the same function (dropout 0), and the hand computation records nothing
    with torch.no_grad():
        src_pad, tgt_pad = src.eq(PAD), tgt.eq(PAD)
        enc, dec, _, _ = model.embed((src, tgt))
        layer = model.encoder_0
        normed = layer.self_attn_norm(enc)
        enc_allowed = (~src_pad)[:, None, None, :]
        assert stats["encoder_0.self_attn/max_attention_logit"] == pytest.approx(
            hand_max_logit(layer.self_attn, normed, normed, enc_allowed, src_pad), rel=1e-6)
        state = model[:3]((src, tgt))  # through encoder_1: the decoder's input
        memory = model.decoder_0.memory_norm(state[0])
        normed = model.decoder_0.self_attn_norm(dec)
        causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None] & ~tgt_pad[:, None, None, :]
        assert stats["decoder_0.self_attn/max_attention_logit"] == pytest.approx(
            hand_max_logit(model.decoder_0.self_attn, normed, normed, causal, tgt_pad), rel=1e-6)
        after_self = dec + model.decoder_0.self_attn(normed, normed, causal)
        normed = model.decoder_0.cross_attn_norm(after_self)
        assert stats["decoder_0.cross_attn/max_attention_logit"] == pytest.approx(
            hand_max_logit(model.decoder_0.cross_attn, normed, memory, enc_allowed, tgt_pad),
            rel=1e-6)  # recorded in float32, as the other monitors
        # log Z of the (clipped) output softmax at real target positions, by hand
        clipped = logits.clamp(-0.3, 0.3)
        assert torch.equal(clipped, logits)  # the model's output is already the clipped one
        real = ~tgt_pad
        log_z = [math.log(sum(math.exp(v) for v in row.tolist())) for row in logits[real]]
        assert stats["project/log_z_count"] == len(log_z) == int(real.sum())
        assert stats["project/log_z_sum"] == pytest.approx(sum(log_z), abs=1e-9)
        assert stats["project/log_z_sq_sum"] == pytest.approx(sum(v * v for v in log_z),
                                                              abs=1e-9)
    assert stability_stats(model) == {}  # a read resets; evaluation forwards record nothing
    # the older monitor keeps its keys: reading one does not reset the other
    model.train()
    model((src, tgt))
    assert "project/max_abs_logit" in activation_stats(model)
    assert "project/log_z_sum" in stability_stats(model)


def test_stability_stats_over_micro_batches_add_up_to_the_full_batch() -> None:
    model = build_model(tiny_config(norm="post", qk_norm=True)).double().train()
    src, tgt = random_batch()
    model((src, tgt))
    full = stability_stats(model)
    for s, t in zip(src.split(2), tgt.split(2), strict=True):
        model((s, t))
    assert stability_stats(model) == pytest.approx(full, rel=1e-9)


def test_record_attention_off_records_no_attention_logit() -> None:
    model = build_model(tiny_config(record_attention=False)).train()
    model(random_batch())
    assert set(stability_stats(model)) == {"project/log_z_sum", "project/log_z_sq_sum",
                                           "project/log_z_count"}


def test_monitor_places_every_attention_of_a_partition() -> None:
    layers = 2
    assert attention_index("partitions.0.encoder_1.self_attn", layers) == 1
    assert attention_index("decoder_0.self_attn/max_attention_logit", layers) == 2
    assert attention_index("x.decoder_1.cross_attn", layers) == 5
    assert attention_index("decoder_1.ffn", layers) is None
    model = build_model(tiny_config(z_loss=0.5)).double().train()
    model(random_batch())
    # two "stages" read separately, then combined as the all-reduces would (max; sum)
    first, last = stability_stats(model[:3]), stability_stats(model[3:])
    (m1, s1), (m2, s2) = split_stats(first, layers), split_stats(last, layers)
    record = combine(torch.maximum(m1, m2), s1 + s2, layers, z_loss=0.5, record_attention=True)
    assert record["attn_logit_enc"] == [first["encoder_0.self_attn/max_attention_logit"],
                                        first["encoder_1.self_attn/max_attention_logit"]]
    assert record["attn_logit_dec_cross"][1] == last["decoder_1.cross_attn/max_attention_logit"]
    values = [*record["attn_logit_enc"], *record["attn_logit_dec_self"],
              *record["attn_logit_dec_cross"]]
    assert None not in values and record["max_attention_logit"] == max(values)
    count = last["project/log_z_count"]
    assert record["mean_log_z"] == pytest.approx(last["project/log_z_sum"] / count)
    assert record["z_loss_term"] == pytest.approx(0.5 * last["project/log_z_sq_sum"] / count)
