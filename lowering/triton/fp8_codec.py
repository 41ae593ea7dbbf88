"""Triton helpers of the FP8 cache formats: the rule of ``dsv4_ops/reference/fp8_cache.py``
(its docstring defines the layouts and the rule), written with integer ops only.

Why integers: a float -> e4m3 cast is not available on every target (gfx942 has only the
"fnuz" e4m3 variant) and the interpreter's bf16 cast need not round like the GPUs'; bit ops
give the same bytes everywhere, which the layout tests check bit for bit against torch's casts.
Decoding uses the fp16 trick (an e4m3 byte shifted into an fp16 bit pattern is the value
times ``2^-8``, subnormals included), one integer op pair and a convert per value. The readers
decode through ``e4m3_to`` (``E4M3_HW``, chosen by ``e4m3_hw``): that decode on ROCm, bit moves
in PTX straight to bf16 on CUDA (no convert instruction), the e4m3 type's convert in the
interpreter. Every decode is exact, and the tests check each against torch's cast.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["e4m3_hw", "scale_exponent", "pow2", "e4m3_encode", "e4m3_decode", "e4m3_to", "bf16_bits",
           "bf16_from_bytes", "store_kv_entry", "bytes_of_words", "load_kv_entries", "word_aligned"]


def e4m3_hw(backend: str) -> int:
    """The readers' ``E4M3_HW`` constexpr (``e4m3_to``'s decode) for a backend (``"cuda"`` /
    ``"hip"``): ROCm 0, the integer decode (gfx942 has only the fnuz e4m3); the interpreter 1,
    the e4m3 type's convert (it multiplies bf16 as raw bits, so no bf16 arithmetic); CUDA 4, bit
    moves in PTX, the fastest measured (docs/kernels.md). Modes 2 and 3 only by a config override."""
    if backend == "hip":
        return 0
    return 1 if triton.knobs.runtime.interpret else 4


@triton.jit
def scale_exponent(amax):
    """ue8m0 byte (int32) of ``2^ceil(log2(max(amax, 1e-4) / 448))``, exact (see the reference)."""
    a = tl.maximum(amax.to(tl.float32), 1e-4)
    bits = a.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    return e - 8 + (mant > 0x600000).to(tl.int32)


@triton.jit
def pow2(exponent):
    """``2^(exponent - 127)`` as fp32 from a biased exponent in 1..254."""
    return (exponent.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_encode(y):
    """e4m3fn code (int32 in 0..255) of fp32 ``y`` (``|y| <= 448``), round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    # normal range (|y| >= 2^-6, fp32 exponent >= 121): keep 3 mantissa bits, rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: the code is round_half_even(|y| * 2^9); m * 2^(e - 150) in units of 2^-9
    m = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - e, 30)
    shift = tl.maximum(shift, 1)
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    code = tl.where(e >= 121, normal, tl.where(e == 0, 0, sub))
    return sign | code


@triton.jit
def e4m3_decode(code):
    """fp32 value of e4m3fn codes (any int type holding 0..255; 0x7F / 0xFF, NaN, never written)."""
    c = code.to(tl.int32)
    h = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.int16)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


# the PTX of ``_e4m3x4_bf16``, which the Gluon FP8 reader (``lowering/gluon/sparse_attention_fp8.py``) runs too
E4M3X4_BF16_ASM = tl.constexpr(  # one line: torch 2.11 splices kernel source unescaped (pytorch#183420)
    "{ "
    ".reg .b32 t0, t1, k; "
    "mov.b32 k, 0x7B807B80; "
    "prmt.b32 t0, $2, 0, 0x9180; "
    "prmt.b32 t1, $2, 0, 0xB3A2; "
    "shl.b32 t0, t0, 4; "
    "shl.b32 t1, t1, 4; "
    "and.b32 t0, t0, 0x87F087F0; "
    "and.b32 t1, t1, 0x87F087F0; "
    "mul.rn.bf16x2 $0, t0, k; "
    "mul.rn.bf16x2 $1, t1, k; "
    "}")


@triton.jit
def _e4m3x4_bf16(code):
    """``e4m3_to(code, bf16, 3)`` in PTX, four codes (one 32-bit register) at a time: a byte permute
    puts each code in the low byte of a 16-bit lane with its sign replicated into the high byte,
    a shift and a mask leave the sign at bit 15 and the 7 low bits at bits 4..10, and one
    ``bf16x2`` multiply by ``2^120`` (0x7B80) scales two values. 4 instructions per two values."""
    return tl.inline_asm_elementwise(asm=E4M3X4_BF16_ASM, constraints="=r,=r,r", args=[code], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)


@triton.jit
def e4m3_to(code, dtype: tl.constexpr, HW: tl.constexpr):
    """Exact values of e4m3fn codes (any int type holding 0..255) in ``dtype`` (bf16, fp16 or
    fp32 hold every e4m3 value). ``HW`` (``e4m3_hw``): 0 ``e4m3_decode``; 1, 2 the hardware
    convert; 3 (bf16 only, else as 2) bit moves, no convert: sign to bit 15 and the 7 low bits
    to bits 4..10 make the bf16 whose value is the code's times ``2^-120`` (an e4m3 subnormal
    lands on a bf16 subnormal), and one bf16 multiply by ``2^120`` (exact: bf16 multiplies keep
    subnormals) restores it; 4 (bf16 only, CUDA) the same in PTX, four codes at a time. On sm_90
    the hardware convert costs an F2F per value, on the conversion pipe."""
    if HW == 4 and dtype == tl.bfloat16:
        return _e4m3x4_bf16(code.to(tl.uint8))
    elif HW == 3 and dtype == tl.bfloat16:
        c = code.to(tl.int16)
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << 4)
        return bits.to(tl.bfloat16, bitcast=True) * tl.full([], 2.0**120, tl.bfloat16)
    elif HW:
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
    else:
        return e4m3_decode(code).to(dtype)


@triton.jit
def bf16_bits(x):
    """The 16 bits (int32, 0..65535) of ``x`` rounded to bf16, nearest even (no NaN inputs)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return r & 0xFFFF


@triton.jit
def bf16_from_bytes(lo, hi):
    """fp32 value of a little-endian bf16 given as two bytes."""
    bits = ((hi.to(tl.int32) << 8) | lo.to(tl.int32)) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def store_kv_entry(y, data, scales, d, NOPE, SCALE_BYTES, BLOCK_D: tl.constexpr, BLOCK_SB: tl.constexpr):
    """Quantise the channel-ordered entry ``y [BLOCK_D]`` (its first ``d`` channels: ``NOPE`` nope,
    then rope) into an FP8 KV entry: e4m3 codes with one ue8m0 scale per 64 nope values, the
    scale row's padding zeroed, rope as little-endian bf16 bytes (``fp8_cache.quantize_kv``).
    The one writer of the layout: ``cache_write`` and ``compress`` both call it."""
    NB: tl.constexpr = BLOCK_D // 64
    blk = tl.arange(0, NB)
    col = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
    live = blk < NOPE // 64
    y2 = tl.reshape(y, (NB, 64))
    exp = scale_exponent(tl.max(tl.where(live[:, None], tl.abs(y2), 0.0), 1))
    code = e4m3_encode(y2 * pow2(254 - exp)[:, None])
    tl.store(data + col, code.to(tl.uint8), mask=live[:, None])
    tl.store(scales + blk, exp.to(tl.uint8), mask=live)
    pad = tl.arange(0, BLOCK_SB)
    tl.store(scales + pad, tl.zeros([BLOCK_SB], tl.uint8), mask=(pad >= NOPE // 64) & (pad < SCALE_BYTES))
    ch = tl.arange(0, BLOCK_D)
    rm = (ch >= NOPE) & (ch < d)
    bits = bf16_bits(y)
    tl.store(data + NOPE + 2 * (ch - NOPE), (bits & 0xFF).to(tl.uint8), mask=rm)
    tl.store(data + NOPE + 2 * (ch - NOPE) + 1, (bits >> 8).to(tl.uint8), mask=rm)


def word_aligned(*caches) -> bool:
    """Whether every entry of these FP8 page caches ``[B, pages, page, entry_bytes]`` starts on a
    4-byte boundary (storage offset, batch and page strides), so the readers may load words."""
    return all(t.storage_offset() % 4 == 0 and t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0 for t in caches)


@triton.jit
def bytes_of_words(words):
    """The 4 bytes of each int32 of ``words [..., W]`` (little-endian), as ``[..., W, 2, 2]``
    int32 whose row-major order is the byte order: reshaped to ``[..., 4W]``, channel
    ``4w + 2j + l`` is byte ``2j + l`` of word ``w``. Loading codes as words takes a quarter
    of the load instructions of one byte per lane."""
    b0, b1 = words & 0xFF, (words >> 8) & 0xFF
    b2, b3 = (words >> 16) & 0xFF, (words >> 24) & 0xFF
    return tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [..., w, j, l] = byte 2j + l


@triton.jit
def load_kv_entries(data, scales, live, NOPE, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    dtype: tl.constexpr, HW: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` values in ``dtype`` of the FP8 KV entries whose data / scale bytes
    start at ``data`` / ``scales [BLOCK_N]`` (lanes not ``live``: zeros; channels past ``D``: zeros).

    Needs ``NOPE % 64 == 0``, ``D - NOPE <= 64`` (the rope fits one 64-channel block) and 4-byte
    aligned entries (the launcher checks). Three gathers per entry instead of four per channel:
    the e4m3 codes as whole rows (``HW``: bytes, which the compiler vectorises; else 32-bit words
    split into bytes in registers); the ue8m0 scales once per 64 channels, broadcast over their
    block; the rope as whole bf16 values, broadcast into its block. Fewer, wider loads keep less
    in flight (sm_90: no spills at D = 512, where the per-channel gathers spilled).

    ``HW`` (``e4m3_hw``, a target with the e4m3 type): bf16 rows are decoded by ``e4m3_to``
    straight to bf16 and scaled there (the interpreter, ``HW == 1``, scales in fp32: it
    multiplies bf16 as raw bits). A power-of-two scale times a value with at most 4 significant
    bits is exact in bf16, so the values are the fp32 path's (``e4m3_decode`` x ``pow2`` in
    fp32, rounded to ``dtype``) bit for bit, with no fp32 step."""
    NB: tl.constexpr = BLOCK_D // 64
    blk = tl.arange(0, NB)
    r = tl.arange(0, 64)
    nope_blk = live[:, None] & (blk < NOPE // 64)[None, :]  # [BLOCK_N, NB]
    col = (blk[:, None] * 64 + r[None, :])[None, :, :]  # [1, NB, 64]
    sc = tl.load(scales[:, None] + blk[None, :], mask=nope_blk, other=127)  # [BLOCK_N, NB]
    rope_bits = tl.load((data + NOPE).to(tl.pointer_type(tl.uint16))[:, None] + r[None, :],
                        mask=live[:, None] & (r < D - NOPE)[None, :], other=0)  # [BLOCK_N, 64]
    rope = rope_bits.to(tl.bfloat16, bitcast=True).to(dtype)
    if HW:
        codes = tl.load(data[:, None, None] + col, mask=nope_blk[:, :, None], other=0)  # [BLOCK_N, NB, 64] uint8
        if HW >= 2 and dtype == tl.bfloat16:
            nope = e4m3_to(codes, dtype, HW) * pow2(sc).to(dtype)[:, :, None]
        else:  # fp32 / fp16 rows (a scale need not fit fp16), or the interpreter (bf16 products as raw bits)
            nope = (e4m3_to(codes, tl.float32, HW) * pow2(sc)[:, :, None]).to(dtype)
    else:
        wi = tl.arange(0, 16)
        word = (blk[:, None] * 16 + wi[None, :])[None, :, :]
        words = tl.load(data.to(tl.pointer_type(tl.int32))[:, None, None] + word,
                        mask=nope_blk[:, :, None], other=0)  # [BLOCK_N, NB, 16]: 4 codes each, little-endian
        codes = tl.reshape(bytes_of_words(words), (BLOCK_N, NB, 64))
        nope = (e4m3_decode(codes) * pow2(sc)[:, :, None]).to(dtype)
    rope3 = tl.broadcast_to(rope[:, None, :], (BLOCK_N, NB, 64))  # rope channel NOPE + r sits at lane r
    e = tl.where(col < NOPE, nope, tl.where(col < D, rope3, tl.zeros_like(rope3)))
    return tl.reshape(e, (BLOCK_N, BLOCK_D))
