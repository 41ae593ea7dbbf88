"""Official DeepSeek-V4 checkpoint formats in ``load_pretrained``.

Spec:
* FP8 linear weights (``float8_e4m3fn``) carry one scale per 128x128 block (``weight_block_size``),
  named ``X.scale`` (DeepSeek) or ``X.weight_scale_inv`` (HF), fp32 or ue8m0 (``2**(b-127)``);
  edge blocks may be partial. FP4 experts pack two e2m1 codes per byte, the even element in the low
  nibble, with one scale per 32 input values. Dequantised values are exact; the cast to the model
  dtype is the only rounding. Checked here against references written from the format definitions
  (a table of the 16 e2m1 values, e4m3 decoded bit by bit, explicit ``2.0 ** k``), not dsv4_ops code.
* A checkpoint written by this file from a random model (FP8 + FP4 experts + scales, sharded with an
  index, experts of one layer across shards, scales in other shards than their weights) loads to
  exactly the dequantised weights, in DeepSeek names and in HF names, and gives the logits of the
  model built from those values.
* Loading is streamed: the model is built on the meta device (no random init), then read one shard
  at a time; host memory peaks at about the model plus one shard (measured in a subprocess).
* Bad checkpoints raise ``ValueError`` naming the tensor and its shard, or the config field.
"""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import dsv4_ops  # noqa: E402
from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config  # noqa: E402
from dsv4_ops.quant_formats import decode_scale, dequantize_fp4, dequantize_fp8, unpack_fp4  # noqa: E402
from model_util import random_model  # noqa: E402
from test_mtp_weights import OFFICIAL  # dsv4_ops layer names -> DeepSeek's, written out independently  # noqa: E402

E8M0 = torch.float8_e8m0fnu
FP4X2 = torch.float4_e2m1fn_x2

# --------------------------------------------------------------------------------------
# references from the format definitions
# --------------------------------------------------------------------------------------
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e4m3(byte: int) -> float:
    """float8_e4m3fn by definition: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 = NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def ue8m0(byte: int) -> float:
    return 2.0 ** (byte - 127)


def round_to_bits(x: float, bits: int) -> float:
    """Round-to-nearest-even to ``bits`` significant bits (normal range): fp32 = 24, bf16 = 8."""
    if x == 0:
        return x
    m, e = math.frexp(x)
    return math.ldexp(round(m * 2**bits), e - bits)  # m * 2**bits is exact; round() is half-to-even


BITS = {torch.float32: 24, torch.bfloat16: 8}


def reference(values, scales, bn: int, bk: int, dtype) -> torch.Tensor:
    """values [N][K] and block scales (python floats) -> the correctly rounded products."""
    out = [[round_to_bits(v * scales[i // bn][j // bk], BITS[dtype]) for j, v in enumerate(row)]
           for i, row in enumerate(values)]
    return torch.tensor(out, dtype=torch.float64).to(dtype)  # representable: exact


def random_fp8(shape, gen) -> torch.Tensor:
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x38  # no NaN codes
    return b.view(torch.float8_e4m3fn)


def random_scales(shape, kind: str, gen) -> tuple[torch.Tensor, list]:
    """(tensor, python floats) of fp32 or ue8m0 scales."""
    if kind == "ue8m0":
        b = torch.randint(118, 134, shape, dtype=torch.uint8, generator=gen)
        return b.view(E8M0), [[ue8m0(x) for x in row] for row in b.tolist()]
    s = torch.rand(shape, generator=gen) * 0.05 + 1e-3
    return s, s.tolist()


# --------------------------------------------------------------------------------------
# the dequantisers
# --------------------------------------------------------------------------------------
def test_fp4_packs_the_16_e2m1_values_low_nibble_first() -> None:
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = unpack_fp4(every_byte.view(torch.int8)[None])[0].view(256, 2)
    want = torch.tensor([[E2M1[b & 0xF], E2M1[b >> 4]] for b in range(256)])
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert unpack_fp4(torch.tensor([[0x21]], dtype=torch.uint8)).tolist() == [[0.5, 1.0]]  # element 0 = low nibble
    for as_dtype in (torch.uint8, FP4X2):  # the other two storage dtypes are the same bytes
        assert torch.equal(unpack_fp4(every_byte.view(as_dtype)[None]), got.view(1, 512))


def test_ue8m0_scales_are_powers_of_two_and_nan_is_rejected() -> None:
    codes = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    want = torch.tensor([ue8m0(b) for b in range(255)], dtype=torch.float64)
    for stored in (codes, codes.view(E8M0)):
        got = decode_scale(stored)
        assert got.dtype == torch.float32 and torch.equal(got.double(), want)  # incl. 2**-127 (subnormal)
    with pytest.raises(ValueError, match="NaN"):
        decode_scale(torch.tensor([127, 255], dtype=torch.uint8).view(E8M0))


@pytest.mark.parametrize("scale_kind", ["ue8m0", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 200), (2, 130, 129), (128, 256)])  # partial edge blocks; exact fit
def test_fp8_block_dequantisation_matches_the_definition(shape, dtype, scale_kind) -> None:
    gen = torch.Generator().manual_seed(hash((shape, scale_kind)) % 2**31)
    w = random_fp8(shape, gen)
    grid = (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    s = torch.empty(0)
    got = None
    if len(shape) == 2:
        s, s_list = random_scales(grid, scale_kind, gen)
        got = dequantize_fp8(w, s, (128, 128), dtype)
        values = [[e4m3(b) for b in row] for row in w.view(torch.uint8).tolist()]
        want = reference(values, s_list, 128, 128, dtype)
    else:  # leading (expert) dims: each slice on its own scales
        wants, ss = [], []
        for i in range(shape[0]):
            si, s_list = random_scales(grid[1:], scale_kind, gen)
            ss.append(si)
            values = [[e4m3(b) for b in row] for row in w[i].view(torch.uint8).tolist()]
            wants.append(reference(values, s_list, 128, 128, dtype))
        s, want = torch.stack(ss), torch.stack(wants)
        got = dequantize_fp8(w, s, (128, 128), dtype)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("scale_kind", ["ue8m0", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", [torch.int8, torch.uint8, FP4X2])
def test_fp4_dequantisation_matches_the_definition(storage, dtype, scale_kind) -> None:
    gen = torch.Generator().manual_seed(7)
    N, K = 40, 80  # 80 = 2.5 blocks of 32: a partial last block
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    s, s_list = random_scales((N, math.ceil(K / 32)), scale_kind, gen)
    got = dequantize_fp4(packed.view(storage), s, dtype)
    values = [[E2M1[(b >> (4 * half)) & 0xF] for b in row for half in (0, 1)] for row in packed.tolist()]
    assert torch.equal(got, reference(values, s_list, 1, 32, dtype))


def test_fp32_scales_round_once_to_bf16() -> None:
    """An e4m3 value times an fp32 scale has up to 28 significant bits: rounding it to fp32 first
    and then to bf16 can land on the wrong side of a bf16 tie. The dequantiser rounds once."""
    v = 1.125  # e4m3 0x39
    assert e4m3(0x39) == v
    target = 1 + 2.0**-8  # a bf16 tie (halfway between 1 and 1 + 2**-7)
    start = struct.unpack("<I", struct.pack("<f", target / v))[0]
    for bits in range(start - 4096, start + 4096):
        s = struct.unpack("<f", struct.pack("<I", bits))[0]
        exact = v * s
        if round_to_bits(exact, 8) != round_to_bits(round_to_bits(exact, 24), 8):
            break
    else:
        pytest.fail("no double-rounding case near the tie")
    w = torch.tensor([[0x39]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = dequantize_fp8(w, torch.tensor([[s]]), (128, 128), torch.bfloat16)
    assert got.item() == round_to_bits(exact, 8) != round_to_bits(round_to_bits(exact, 24), 8)


def test_dequantisers_reject_a_wrong_scale_shape_or_dtype() -> None:
    w = random_fp8((130, 64), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"scale has shape \(1, 1\), expected \(2, 1\)"):
        dequantize_fp8(w, torch.ones(1, 1), (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(w.view(torch.uint8), torch.ones(2, 1), (128, 128))
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        dequantize_fp4(torch.zeros(4, 20, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scale format"):
        dequantize_fp4(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 1, dtype=torch.float16))
