"""Compressors on their own (no processes): what they keep, bias, error feedback, bytes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from trainstack.compression import (
    QSGD,
    Cast,
    CommStats,
    Compressor,
    ErrorFeedback,
    LowRank,
    RandK,
    Sign,
    TopK,
    modelled_comm_seconds,
    pack_bits,
    packed_bytes,
    register_compression,
    sparse_k,
    unpack_bits,
)
from trainstack.compression.local import LocalGradient
from trainstack.compression.sparsify import warmup_ratio
from trainstack.config import CompressionConfig

TRIALS = 10_000
"""Independent compressions averaged by the unbiasedness tests."""


def fixed_vector(n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def round_trip(compressor: Compressor, g: torch.Tensor, *, step: int = 0) -> torch.Tensor:
    payload = compressor.encode(g, step=step, bucket_index=3)
    return compressor.decode(payload, step=step, bucket_index=3)


# ---- what each method keeps --------------------------------------------------------


def test_k_is_ceil_of_ratio_times_n_at_least_one() -> None:
    assert sparse_k(1000, 0.013) == 13
    assert sparse_k(100, 0.07) == 7  # 0.07 * 100 is 7.000000000000001 in floating point
    assert sparse_k(1001, 0.01) == 11
    assert sparse_k(10, 1e-6) == 1
    assert sparse_k(10, 1.0) == 10


def test_top_k_keeps_exactly_the_k_largest_magnitudes() -> None:
    g = fixed_vector(1000)
    decoded = round_trip(TopK(0.013), g)
    largest = g.abs().argsort(descending=True)[:13]
    kept = decoded.nonzero().flatten()
    assert set(kept.tolist()) == set(largest.tolist())
    assert torch.equal(decoded[largest], g[largest])
    assert g.abs()[largest].min() > g.abs()[decoded == 0].max()


def test_sign_sends_mean_magnitude_times_sign() -> None:
    g = fixed_vector(1001)
    assert (g != 0).all()
    assert torch.allclose(round_trip(Sign(), g), g.abs().mean() * g.sign(), rtol=1e-6, atol=0)
    assert torch.equal(round_trip(Sign(), torch.tensor([0.0, -2.0])), torch.tensor([1.0, -1.0]))


def test_casts_round_to_16_bit_floats() -> None:
    g = fixed_vector(100)
    assert torch.equal(round_trip(Cast(torch.float16), g), g.half().float())
    assert torch.equal(round_trip(Cast(torch.bfloat16), g), g.bfloat16().float())


def test_qsgd_keeps_zeros_and_the_largest_coordinate_exactly() -> None:
    g = fixed_vector(200)
    g[::7] = 0
    for bits in (2, 4, 8):
        decoded = round_trip(QSGD(bits, seed=1), g)
        assert (decoded[::7] == 0).all()
        top = g.abs().argmax()
        assert decoded[top] == g[top]
        step = g.abs().max() / (2 ** (bits - 1) - 1)  # grid spacing: rounding is to a neighbour
        assert ((decoded - g).abs() <= step * (1 + 1e-6)).all()


def test_low_rank_reproduces_a_matrix_of_that_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(40, 2, generator=gen) @ torch.randn(2, 30, generator=gen)
    codec = LowRank(2, seed=0)
    assert torch.allclose(round_trip(codec, m), m, atol=1e-4)
    assert 3 in codec.warm_start  # warm start kept per bucket
    bias = fixed_vector(30)
    assert torch.equal(round_trip(codec, bias), bias)  # vectors travel dense


# ---- unbiasedness -----------------------------------------------------------------


def mean_of_compressions(compressor: Compressor, g: torch.Tensor) -> torch.Tensor:
    total = torch.zeros_like(g, dtype=torch.float64)
    for step in range(TRIALS):
        total += round_trip(compressor, g, step=step)
    return (total / TRIALS).float()


def six_standard_errors(variance: torch.Tensor) -> torch.Tensor:
    return 6 * (variance / TRIALS).sqrt() + 1e-6


def test_random_k_is_unbiased_and_a_biased_variant_is_caught() -> None:
    g, ratio = fixed_vector(), 0.25
    keep = sparse_k(g.numel(), ratio) / g.numel()
    tolerance = six_standard_errors(g.square() * (1 / keep - 1))  # per-coordinate variance
    assert tolerance.norm() < 0.11 * g.norm()  # tight enough to mean something

    estimate = mean_of_compressions(RandK(ratio, seed=5), g)
    assert ((estimate - g).abs() <= tolerance).all()

    unscaled = mean_of_compressions(RandK(ratio, seed=5, unbiased=False), g)
    assert ((unscaled - g).abs() > tolerance).float().mean() > 0.9


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_qsgd_is_unbiased(bits: int) -> None:
    g = fixed_vector(seed=bits)
    levels = 2 ** (bits - 1) - 1
    spacing = g.abs().max() / levels
    position = g.abs() / spacing
    fraction = position - position.floor()
    tolerance = six_standard_errors(fraction * (1 - fraction) * spacing**2)
    assert tolerance.norm() < 0.11 * g.norm()

    estimate = mean_of_compressions(QSGD(bits, seed=9, rank=1), g)
    assert ((estimate - g).abs() <= tolerance).all()


def test_qsgd_ranks_draw_independent_noise() -> None:
    g = fixed_vector()
    first = QSGD(2, seed=9, rank=0).encode(g, step=0, bucket_index=0)
    second = QSGD(2, seed=9, rank=1).encode(g, step=0, bucket_index=0)
    again = QSGD(2, seed=9, rank=0).encode(g, step=0, bucket_index=0)
    assert not torch.equal(first.parts[0], second.parts[0])
    assert torch.equal(first.parts[0], again.parts[0])


# ---- error feedback ---------------------------------------------------------------

LOSSY = {
    "topk": lambda: TopK(0.05),
    "randk": lambda: RandK(0.05, seed=2, unbiased=False),
    "qsgd2": lambda: QSGD(2, seed=2),
    "qsgd8": lambda: QSGD(8, seed=2),
    "sign": lambda: Sign(),
    "fp16": lambda: Cast(torch.float16),
    "bf16": lambda: Cast(torch.bfloat16),
    "powersgd": lambda: LowRank(2, seed=2),
}


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_error_feedback_conserves_mass(name: str) -> None:
    compressor, feedback = LOSSY[name](), ErrorFeedback(enabled=True)
    gen = torch.Generator().manual_seed(4)
    inputs = torch.zeros(20, 30)
    sent = torch.zeros(20, 30)
    for step in range(12):
        g = torch.randn(20, 30, generator=gen)
        inputs += g
        payload = feedback.encode(compressor, g, step=step, bucket_index=0)
        sent += compressor.decode(payload, step=step, bucket_index=0)
    residual = feedback.residuals[0]
    assert residual.abs().max() > 1e-4  # something was held back
    assert torch.allclose(sent + residual, inputs, rtol=0, atol=1e-5)


def test_error_feedback_off_keeps_nothing_and_state_round_trips() -> None:
    off = ErrorFeedback(enabled=False)
    off.encode(TopK(0.1), fixed_vector(), step=0, bucket_index=0)
    assert off.residuals == {}
    on = ErrorFeedback(enabled=True)
    on.encode(TopK(0.1), fixed_vector(), step=0, bucket_index=7)
    restored = ErrorFeedback(enabled=True)
    restored.load_state_dict(on.state_dict())
    assert torch.equal(restored.corrected(fixed_vector(), 7), on.corrected(fixed_vector(), 7))


# ---- bit packing ------------------------------------------------------------------


def test_pack_bits_layout_is_lowest_bits_first() -> None:
    codes = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert pack_bits(codes, 1).tolist() == [0b1101, 0b1]
    assert pack_bits(torch.tensor([3, 0, 2], dtype=torch.uint8), 2).tolist() == [0b100011]
    assert pack_bits(torch.tensor([15, 1, 7], dtype=torch.uint8), 4).tolist() == [0x1F, 0x7]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 9, 13, 1001])
def test_packing_round_trips_odd_lengths(bits: int, n: int) -> None:
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack_bits(codes.to(torch.uint8), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes.to(torch.uint8))


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_packing_round_trip_property(bits: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=300))
    codes = torch.tensor(values, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_bytes(len(values), bits)
    assert unpack_bits(packed, bits, len(values)).tolist() == values


# ---- bytes on the wire ------------------------------------------------------------


@pytest.mark.parametrize("n", [1000, 4097])
def test_payload_bytes_match_the_formulas(n: int) -> None:
    g, shape = fixed_vector(n), torch.Size([n])
    expected = {
        "topk": 8 * math.ceil(0.01 * n),
        "randk": 4 * math.ceil(0.01 * n),
        "qsgd8": n + 4,
        "qsgd4": math.ceil(n / 2) + 4,
        "qsgd2": math.ceil(n / 4) + 4,
        "sign": math.ceil(n / 8) + 4,
        "fp16": 2 * n,
    }
    compressors: dict[str, Compressor] = {
        "topk": TopK(0.01),
        "randk": RandK(0.01, seed=0),
        "qsgd8": QSGD(8, seed=0),
        "qsgd4": QSGD(4, seed=0),
        "qsgd2": QSGD(2, seed=0),
        "sign": Sign(),
        "fp16": Cast(torch.float16),
    }
    for name, compressor in compressors.items():
        payload = compressor.encode(g, step=0, bucket_index=0)
        assert payload.nbytes == compressor.payload_bytes(shape) == expected[name], name
        assert payload.nbytes < 4 * n, name
    assert abs(expected["topk"] - 0.01 * n * 8) < 8  # ≈ ρ·n·(4 + 4)
    matrix = torch.Size([64, 48])
    assert LowRank(4, seed=0).payload_bytes(matrix) == 4 * (64 + 48) * 4


def test_comm_stats_ratio_is_dense_over_sent() -> None:
    assert CommStats(bytes_sent=25, dense_bytes=100).ratio == 4.0
    assert CommStats().ratio == 1.0


def test_wire_bytes_follow_ring_collectives() -> None:
    stats = CommStats(bytes_sent=100, dense_bytes=400, gathered_bytes=40)
    assert stats.wire_bytes(1) == 0
    assert stats.wire_bytes(2) == 60 + 40  # 2(N-1)/N of the all-reduced + (N-1) x gathered
    assert stats.wire_bytes(4) == 90 + 120


def test_alpha_beta_model() -> None:
    gbit, alpha = 8.0, 1e-5  # β = 1e9 bytes/s
    reduce = modelled_comm_seconds(
        kind="all_reduce", bytes_per_rank=1e6, world_size=4, bandwidth_gbit=gbit, latency_s=alpha
    )
    assert reduce == pytest.approx(6 * alpha + 1.5e6 / 1e9)
    gather = modelled_comm_seconds(
        kind="all_gather", bytes_per_rank=1e6, world_size=4, bandwidth_gbit=gbit, latency_s=alpha
    )
    assert gather == pytest.approx(3 * alpha + 3e6 / 1e9)
    alone = modelled_comm_seconds(
        kind="all_reduce", bytes_per_rank=1e6, world_size=1, bandwidth_gbit=gbit, latency_s=alpha
    )
    assert alone == 0


def test_one_worker_needs_no_hook_and_reports_nothing_sent() -> None:
    state = register_compression(
        nn.Linear(64, 64), CompressionConfig(kind="topk"), world_size=1, seed=0
    )
    assert state.stats == CommStats(bytes_sent=0, dense_bytes=0) and state.step == 0
    saved = state.state_dict()
    state.load_state_dict(saved)
    other = register_compression(
        nn.Linear(2, 2), CompressionConfig(kind="sign"), world_size=1, seed=0
    )
    with pytest.raises(ValueError, match="compression state is for kind=topk; this run uses sign"):
        other.load_state_dict(saved)


# ---- Deep Gradient Compression's parts: warm-up, local clipping, moments on ranks ----


def test_sparsity_warmup_falls_exponentially_from_dense_to_the_ratio() -> None:
    ratios = [warmup_ratio(0.01, step=t, warmup_steps=4) for t in range(6)]
    assert ratios[0] == 1.0
    assert ratios[2] == pytest.approx(0.1)  # halfway in log space
    assert ratios[4:] == [0.01, 0.01]
    assert all(a > b for a, b in itertools.pairwise(ratios[:5]))


def test_local_clip_bounds_the_rank_gradient_by_each_tensor_share() -> None:
    local = LocalGradient(moments="none", clip=1.0, total_numel=400)
    big, small = torch.full((300,), 5.0), torch.full((100,), 1e-3)
    clipped = [local.prepare(big, 0, step=0), local.prepare(small, 1, step=0)]
    assert float(clipped[0].norm()) == pytest.approx(math.sqrt(300 / 400), rel=1e-5)
    assert torch.equal(clipped[1], small)  # under its share: untouched
    whole = torch.cat(clipped).norm()
    assert float(whole) <= 1.0


def test_adamw_moments_on_a_rank_give_torch_adamw_update() -> None:
    """Lossless, the update a rank sends is AdamW's step direction (lr 1, no decay)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=gen) * (1 + t) for t in range(6)]
    weight = nn.Parameter(torch.zeros(50))
    adamw = torch.optim.AdamW([weight], lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    local = LocalGradient(moments="adamw", momentum=0.9, beta2=0.95, eps=1e-8)
    for step, g in enumerate(grads):
        before = weight.detach().clone()
        weight.grad = g.clone()
        adamw.step()
        sent = local.prepare(g, 0, step=step)
        torch.testing.assert_close(sent, before - weight.detach(), rtol=1e-5, atol=1e-6)


def test_sgd_momentum_correction_masks_what_was_sent() -> None:
    local = LocalGradient(moments="sgd", momentum=0.5)
    g = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(local.prepare(g, 0, step=0), g)
    local.mask(0, torch.tensor([False, False, True]))
    # u = 0.5 * [1, 2, 0] + g
    assert torch.equal(local.prepare(g, 0, step=1), torch.tensor([1.5, 3.0, 3.0]))
    saved = local.state_dict()
    again = LocalGradient(moments="sgd", momentum=0.5)
    again.load_state_dict(saved)
    assert torch.equal(again.prepare(g, 0, step=2), local.prepare(g, 0, step=2))
