"""The compressed mean (sync/wire.py): values rounded once in and once out, sums in fp32, the same bits everywhere.

The references are computed here from the public encode functions: the exact fp32 mean of what each
rank sent, encoded once more. Three ranks and a length that fills neither a chunk nor a block check
the padding and the rank-order sums; two ranks, which send their whole vectors, get that mean
rounded only on the way in.
"""
import pytest
import torch

from torchbearer_dist.sync import wire

from _dist import run_workers  # noqa: I001 (tests/ on sys.path)

LENGTH = 1000  # not a multiple of 3 x 128 (or 3 x 64): chunks and blocks are padded
WORLD = 3
ENCODINGS = ('fp16', 'bf16', 'int8', 'int4')


def _values(rank):
    """Rank r's vector; for the half types, values each exactly representable, so only the sums can round."""
    generator = torch.Generator().manual_seed(rank)
    values = torch.randn(LENGTH, generator=generator) * (1 + rank)
    values[:10] = 1.0 + rank * 2 ** -7  # bf16 holds 1 + 2^-7; the sums of three are not held
    return values


def _worker():
    import torch.distributed as dist
    rank = dist.get_rank()
    return {encoding: wire.mean(_values(rank), encoding) for encoding in ENCODINGS}


@pytest.fixture(scope='module')
def means():
    return run_workers(_worker, WORLD, deadline=60)


@pytest.fixture(scope='module')
def two_rank_means():
    return run_workers(_worker, 2, deadline=60)


def _sent(encoding, values, world=WORLD):
    """What a rank's values become on the way in: the encoding, decoded."""
    padded = torch.zeros(wire.padded_length(LENGTH, world, encoding))
    padded[:LENGTH] = values
    if encoding == 'int8':
        return wire.dequantize(*wire.quantize(padded))
    if encoding == 'int4':
        return wire.dequantize(*wire.quantize(padded, wire.BLOCK4, 7))
    return padded.to(wire.ENCODINGS[encoding]).to(torch.float32)


@pytest.mark.parametrize('encoding', ENCODINGS)
def test_every_rank_gets_the_same_bits_the_fp32_mean_rounded_once_more(means, encoding):
    got = [rank[encoding] for rank in means]
    for other in got[1:]:
        assert torch.equal(got[0], other)
    sent = [_sent(encoding, _values(r)) for r in range(WORLD)]
    exact = (sent[0] + sent[1] + sent[2]) / WORLD  # fp32, in rank order, as the owner of each chunk adds
    assert torch.equal(got[0], _sent(encoding, exact[:LENGTH])[:LENGTH])


@pytest.mark.parametrize('encoding', ENCODINGS)
def test_two_ranks_get_the_same_bits_the_fp32_mean_of_what_they_sent(two_rank_means, encoding):
    got = [rank[encoding] for rank in two_rank_means]
    assert torch.equal(got[0], got[1])
    sent = [_sent(encoding, _values(r), world=2) for r in range(2)]
    assert torch.equal(got[0], ((sent[0] + sent[1]) / 2)[:LENGTH])  # not encoded on the way out
    assert not torch.equal(got[0], _sent(encoding, got[0], world=2)[:LENGTH])  # which would round it again


def test_the_half_types_do_not_round_partial_sums():
    # Rounding each partial sum to bf16, as a bf16 all-reduce does, loses what the fp32 sum keeps.
    first = [_values(r)[0] for r in range(WORLD)]  # 1, 1 + 2^-7, 1 + 2^-6
    half_sum = ((first[0].bfloat16() + first[1].bfloat16()).bfloat16() + first[2].bfloat16()).float()
    assert half_sum != sum(first)  # a half-precision ring's answer is off ...
    assert sum(first) == 3 + 3 * 2 ** -7  # ... where the fp32 sum is exact


def test_int8_blocks_keep_each_value_within_half_a_step_and_zero_blocks_exact():
    values = torch.randn(4 * wire.BLOCK) * torch.tensor([1e-3, 1.0, 1e3, 0.0]).repeat_interleave(wire.BLOCK)
    steps, scales = wire.quantize(values)
    assert steps.dtype == torch.int8 and scales.shape == (4,)
    back = wire.dequantize(steps, scales)
    step = scales.repeat_interleave(wire.BLOCK)
    assert torch.all((back - values).abs() <= step / 2 * (1 + 1e-6))
    assert torch.equal(back[3 * wire.BLOCK:], torch.zeros(wire.BLOCK))


def test_int4_keeps_each_value_within_half_a_step_of_a_seventh_of_its_blocks_largest_and_packs_two_a_byte():
    values = torch.randn(3 * wire.BLOCK4) * torch.tensor([1e-3, 1e3, 0.0]).repeat_interleave(wire.BLOCK4)
    steps, scales = wire.quantize(values, wire.BLOCK4, 7)
    assert int(steps.abs().max()) == 7 and torch.equal(scales[:2], values.view(3, -1).abs().amax(dim=1)[:2] / 7)
    back = wire.dequantize(steps, scales)
    assert torch.all((back - values).abs() <= scales.repeat_interleave(wire.BLOCK4) / 2 * (1 + 1e-6))
    packed = wire.pack4(steps)
    assert packed.dtype == torch.uint8 and packed.numel() == steps.numel() // 2
    assert torch.equal(wire.unpack4(packed), steps)
    assert torch.equal(wire.unpack4(torch.tensor([0x0f, 0xf1], dtype=torch.uint8)),
                       torch.tensor([7, -8, -7, 7], dtype=torch.int8))  # low nibble first, 8 is zero


@pytest.mark.parametrize('encoding, per_value', [('fp16', 2), ('bf16', 2), ('int8', 1 + 4 / wire.BLOCK),
                                                 ('int4', 0.5 + 4 / wire.BLOCK4)])
def test_the_bytes_are_the_padded_encoded_vector(encoding, per_value):
    assert wire.wire_bytes(LENGTH, WORLD, encoding) == wire.padded_length(LENGTH, WORLD, encoding) * per_value
