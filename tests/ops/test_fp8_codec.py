"""The FP8 codec of the Triton kernels (``lowering/triton/fp8_codec.py``) bit for bit: the integer
e4m3 encode, bf16 bits and scale exponent against torch's casts and the reference on every finite
e4m3 value, the midpoints between them (ties to even) and their neighbours, random and tiny values,
signed zeros and subnormals; every e4m3 code's decode to bf16, fp32 and fp16 by each decode a target
can run; and the attention's FP8 row reader (``load_kv_entries``) against the reference's
dequantised values, scales far apart and subnormal codes included.

Under ``TRITON_INTERPRET=1`` on CPU (the bit-move decodes 3 and 4 only on a GPU), compiled on a GPU.
"""
import pytest
import torch
import triton
import triton.language as tl

from dsv4_ops.reference import fp8_cache as fp8
from launchers import CUDA, DEVICE, kernel_module

codec = kernel_module("fp8_codec")


@triton.jit
def _codec_kernel(x_ptr, code_ptr, bf_ptr, exp_ptr, dec_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    code = codec.e4m3_encode(x)
    tl.store(code_ptr + offs, code.to(tl.uint8), mask=m)
    tl.store(bf_ptr + offs, codec.bf16_bits(x), mask=m)
    tl.store(exp_ptr + offs, codec.scale_exponent(tl.abs(x)), mask=m)
    tl.store(dec_ptr + offs, codec.e4m3_decode(code), mask=m)


def test_codec_matches_torch_casts_bit_for_bit():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[every.isfinite()].sort().values
    mid = (every[1:] + every[:-1]) / 2  # exact ties: round half to even
    x = torch.cat([every, mid, torch.nextafter(mid, torch.full_like(mid, 1e9)),
                   torch.nextafter(mid, torch.full_like(mid, -1e9)), (torch.rand(4000) * 2 - 1) * 448,
                   torch.randn(2000) * 1e-3, torch.tensor([0.0, -0.0, 1e-40, -1e-40])]).clamp(-448, 448).to(DEVICE)
    n = x.numel()
    code = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    bf, exp = (torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(2))
    dec = torch.empty(n, device=DEVICE)
    _codec_kernel[(triton.cdiv(n, 4096),)](x, code, bf, exp, dec, n, BLOCK=4096)
    assert torch.equal(code, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(bf, x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
    assert torch.equal(exp, fp8.scale_exponent(x.abs()))
    assert torch.equal(dec, x.to(torch.float8_e4m3fn).float())


@triton.jit
def _decode_kernel(code_ptr, out_ptr, N, DT: tl.constexpr, HW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    code = tl.load(code_ptr + offs, mask=offs < N, other=0)
    tl.store(out_ptr + offs, codec.e4m3_to(code, DT, HW), mask=offs < N)


# the decodes each target can run: the interpreter multiplies bf16 as raw bits, so the bit-move
# decodes (3 a bf16 multiply, 4 PTX) run on a GPU only; ROCm's integer one (0) runs everywhere
DECODES = [0, 1, 2, 3, 4] if CUDA else [0, 1]


@pytest.mark.parametrize("hw", DECODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_every_e4m3_code_decodes_exactly(hw, dtype):
    # all 256 codes but the two NaNs (never written), subnormals and -0 included
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].to(DEVICE)
    out = torch.full(codes.shape, float("nan"), dtype=dtype, device=DEVICE)
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float16: tl.float16}[dtype]
    _decode_kernel[(1,)](codes, out, codes.numel(), DT=tl_dtype, HW=hw, BLOCK=256)
    want = codes.view(torch.float8_e4m3fn).to(dtype)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


@triton.jit
def _entries_kernel(data_ptr, scale_ptr, out_ptr, n, NOPE, D, ENTRY: tl.constexpr, SB: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr, HW: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    live = offs_n < n
    e = codec.load_kv_entries(data_ptr + offs_n * ENTRY, scale_ptr + offs_n * SB, live, NOPE, D, BLOCK_N, BLOCK_D,
                              DT, HW)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + offs_n[:, None] * BLOCK_D + offs_d[None, :], e)


@pytest.mark.parametrize("hw", DECODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_entries_read_as_the_reference_dequantises_them(hw, dtype):
    # the attention's FP8 row reader: values scaled from 1e-4 to 1e3 (scales far apart, subnormal
    # codes), every decode, the reference's values rounded to the dot dtype, bit for bit
    torch.manual_seed(7)
    n, D, rope = 9, 256, 64
    lay = fp8.KVLayout(D, rope, n)
    x = torch.randn(n, D, device=DEVICE) * torch.logspace(-4, 3, D, device=DEVICE)[torch.randperm(D, device=DEVICE)]
    data, scales = fp8.quantize_kv(x, rope)
    want = torch.zeros(16, D, dtype=dtype, device=DEVICE)
    want[:n] = fp8.dequantize_kv(data, scales, lay).to(dtype)
    out = torch.full((16, D), float("nan"), dtype=dtype, device=DEVICE)
    tl_dtype = tl.bfloat16 if dtype == torch.bfloat16 else tl.float32
    _entries_kernel[(1,)](data.contiguous(), scales.contiguous(), out, n, D - rope, D, ENTRY=lay.data_bytes,
                          SB=lay.scale_bytes, BLOCK_N=16, BLOCK_D=D, DT=tl_dtype, HW=hw)
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.view(view), want.view(view))
