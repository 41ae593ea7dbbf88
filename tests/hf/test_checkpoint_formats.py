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
from safetensors.torch import save_file  # noqa: E402

import dsv4_ops  # noqa: E402
from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config  # noqa: E402
from dsv4_ops.quant_formats import decode_scale, dequantize_fp4, dequantize_fp8, unpack_fp4  # noqa: E402
from model_util import random_model  # noqa: E402
from official_names import OFFICIAL  # dsv4_ops layer names -> DeepSeek's, written out independently  # noqa: E402

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


def random_fp8(shape, gen, device="cpu") -> torch.Tensor:
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=device)
    b[(b & 0x7F) == 0x7F] = 0x38  # no NaN codes
    return b.view(torch.float8_e4m3fn).cpu()


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


# --------------------------------------------------------------------------------------
# a synthetic official-format checkpoint, written from a random model
# --------------------------------------------------------------------------------------
# dsv4_ops names -> DeepSeek's (layer level: official_names.OFFICIAL plus the compressor / indexer)
LAYER = {
    **OFFICIAL,
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
}
TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
       "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
       "model.hc_head.hc_scale": "hc_head_scale"}
FP8_LINEARS = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight",
               "self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight", "indexer.q_b_proj.weight",
               "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
               "shared_experts.down_proj.weight", "e_proj.weight", "h_proj.weight")
BF16_TENSORS = ("embed_tokens.weight", "lm_head.weight", "compressor.kv_proj.weight", "compressor.gate_proj.weight",
                "weights_proj.weight", "mlp.gate.weight")  # as the official checkpoints store them


def deepseek_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, n, rest = name.split(".", 3)
        return f"layers.{n}.{LAYER[rest]}"
    if name.startswith("mtp.0."):
        return "mtp.0." + LAYER[name[len("mtp.0."):]]
    return TOP[name]


def _blocks(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """|x| [..., N, K] -> per-block max [..., ceil(N/bn), ceil(K/bk)] (edge blocks partial)."""
    N, K = x.shape[-2:]
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    p = F.pad(x.abs(), (0, kb * bk - K, 0, nb * bn - N))
    return p.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn)).amax(dim=(-3, -1))


def _full(s: torch.Tensor, N: int, K: int, bn: int, bk: int) -> torch.Tensor:
    return s.repeat_interleave(bn, -2)[..., :N, :].repeat_interleave(bk, -1)[..., :K]


def _scale(amax: torch.Tensor, top: float, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored scale, its value as fp64)."""
    s = amax.clamp(min=1e-8) / top
    if kind == "float":
        return s, s.double()
    e = torch.ceil(torch.log2(s))  # a power of two >= amax / top: no clipping
    return (e + 127).to(torch.uint8).view(E8M0), torch.exp2(e).double()


def quant_fp8(w: torch.Tensor, block, kind: str):
    """(codes, stored scales, dequantised fp64) for an fp32 weight [..., N, K]."""
    N, K = w.shape[-2:]
    s, s64 = _scale(_blocks(w, *block), 448.0, kind)
    full = _full(s64, N, K, *block)
    codes = (w.double() / full).to(torch.float8_e4m3fn)
    return codes, s, codes.double() * full


def quant_fp4(w: torch.Tensor, kind: str, storage=torch.int8):
    """(packed codes, stored scales, dequantised fp64) for an fp32 weight [..., N, K], K even."""
    N, K = w.shape[-2:]
    s, s64 = _scale(_blocks(w, 1, 32), 6.0, kind)
    full = _full(s64, N, K, 1, 32)
    table = torch.tensor(E2M1, dtype=torch.float64)
    codes = ((w.double() / full)[..., None] - table).abs().argmin(-1)  # nearest e2m1 value
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.view(storage), s, table.index_select(0, codes.flatten()).view(codes.shape) * full


def official_checkpoint(src: DeepseekV4ForCausalLM, names: str, scale: str, block=(128, 128),
                        experts: str = "fp4", fp4_storage=torch.int8):
    """``(tensors, expected)``: ``src``'s weights as an official checkpoint (FP8 linears, FP4 or
    FP8 experts, bf16 / fp32 rest) in DeepSeek names (``X.scale``, per-expert w1/w2/w3) or HF
    names (``X.weight_scale_inv``, fused ``gate_up_proj`` / ``down_proj`` + ``..._scale_inv``),
    and the fp64 values each dsv4_ops parameter must load to."""
    tensors, expected = {}, {}
    deepseek = names == "deepseek"
    for name, t in src.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q, s, deq = quant_fp4(t, scale, fp4_storage) if experts == "fp4" else quant_fp8(t, block, scale)
            expected[name] = deq
            if not deepseek:
                tensors[name], tensors[name + "_scale_inv"] = q, s
                continue
            prefix = deepseek_name(name.rsplit(".", 3)[0] + ".mlp.gate.weight").rsplit(".", 2)[0] + ".experts"
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    parts = {"w1": slice(0, I), "w3": slice(I, 2 * I)}
                else:
                    parts = {"w2": slice(None)}
                for w, rows in parts.items():
                    if experts == "fp4":  # FP4 scales are per row: slices of the fused tensor's
                        qe, se = q[e, rows].contiguous(), s[e, rows].contiguous()
                    else:  # an FP8 block must not span w1 / w3: quantise each piece on its own
                        qe, se, expected[name][e, rows] = quant_fp8(t[e, rows].contiguous(), block, scale)
                    tensors[f"{prefix}.{e}.{w}.weight"], tensors[f"{prefix}.{e}.{w}.scale"] = qe, se
            continue
        key = deepseek_name(name) if deepseek else name
        if name.endswith(FP8_LINEARS):
            q, s, expected[name] = quant_fp8(t, block, scale)
            tensors[key] = q
            tensors[key[: -len("weight")] + ("scale" if deepseek else "weight_scale_inv")] = s
        elif name.endswith(BF16_TENSORS):
            tensors[key] = t.to(torch.bfloat16)
            expected[name] = tensors[key].double()
        elif name.endswith("tid2eid"):
            tensors[key] = t.to(torch.int32)
            expected[name] = t
        else:
            tensors[key] = t.contiguous()
            expected[name] = t.double()
    return tensors, expected


QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def write_checkpoint(path, cfg: DSV4Config, tensors: dict, n_shards: int = 1, interleave: bool = True,
                     **quant) -> list[str]:
    """config.json (+ quantization_config) and the tensors, in ``n_shards`` files with an index.
    ``interleave``: key ``i`` (sorted) goes to shard ``i % n_shards``, so consecutive experts and
    a weight and its scale sit in different shards; else contiguous runs."""
    hcfg = cfg.to_hf()
    hcfg.quantization_config = {**QUANT, **quant}
    hcfg.save_pretrained(path)
    keys = sorted(tensors)
    if n_shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return ["model.safetensors"]
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    where = {k: files[i % n_shards if interleave else i * n_shards // len(keys)] for i, k in enumerate(keys)}
    for f in files:
        save_file({k: tensors[k] for k in keys if where[k] == f}, os.path.join(path, f))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": where}, fh)
    return files


# all three layer types, hash + biased MoE, MTP; intermediate 48 = 1.5 FP4 blocks (a partial one)
CFG = DSV4Config.tiny(moe_intermediate_size=48)


@pytest.fixture(scope="module")
def src() -> DeepseekV4ForCausalLM:
    return random_model(CFG, seed=11)


@pytest.fixture(scope="module")
def shipped(src) -> tuple[dict, dict]:
    """``src`` as DeepSeek ships V4: DeepSeek names, ue8m0 scales, FP4 experts (int8 storage)."""
    return official_checkpoint(src, "deepseek", "ue8m0")


def expected_model(expected: dict, dtype=torch.float32) -> DeepseekV4ForCausalLM:
    """The model built from the dequantised values (plain ``load_state_dict``)."""
    m = DeepseekV4ForCausalLM(CFG)
    m.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in expected.items()},
                      strict=True)
    return m.eval()


@pytest.mark.parametrize("names,scale,block,fp4_storage", [
    ("deepseek", "ue8m0", (128, 128), torch.int8),  # DeepSeek-V4 as shipped
    ("hf", "float", (48, 40), FP4X2),  # HF names, fp32 scales, a block that leaves partial edges
])  # fmt: skip
def test_official_checkpoint_loads_the_dequantised_weights(src, tmp_path, names, scale, block, fp4_storage) -> None:
    tensors, expected = official_checkpoint(src, names, scale, block, fp4_storage=fp4_storage)
    files = write_checkpoint(tmp_path, CFG, tensors, n_shards=3, weight_block_size=list(block),
                             scale_fmt="ue8m0" if scale == "ue8m0" else "float", expert_dtype="fp4")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) == 3
    if names == "deepseek":  # one layer's experts span several shards, and scales sit apart from weights
        assert len({f for k, f in index.items() if k.startswith("layers.2.ffn.experts.")}) == 3
        assert index["layers.0.attn.wq_a.scale"] != index["layers.0.attn.wq_a.weight"]
        assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
        assert tensors["layers.0.ffn.experts.0.w2.weight"].shape == (64, 24)  # [D, I/2] packed
    else:
        assert tensors["model.layers.2.mlp.experts.gate_up_proj"].dtype == FP4X2
    loaded = dsv4_ops.load_pretrained(tmp_path, dtype=torch.float32)
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == src.state_dict()[k].dtype, k
        assert torch.equal(got[k], v.to(got[k].dtype)), k  # exact: ue8m0 in fp32, fp32 scales rounded once
    want = expected_model(expected)
    ids = torch.randint(0, CFG.vocab_size, (2, 37))
    with torch.no_grad():
        assert torch.equal(loaded(ids), want(ids))


def test_bf16_load_rounds_each_dequantised_value_once(shipped, tmp_path) -> None:
    tensors, expected = shipped
    write_checkpoint(tmp_path, CFG, tensors, n_shards=3, scale_fmt="ue8m0", expert_dtype="fp4")
    loaded = dsv4_ops.load_pretrained(tmp_path, dtype=torch.bfloat16)
    meta = DeepseekV4ForCausalLM(CFG, dtype=torch.bfloat16, device="meta")
    dtypes = {k: t.dtype for k, t in meta.state_dict().items()}
    for k, v in loaded.state_dict().items():
        assert v.dtype == dtypes[k], k  # bf16, except the fp32-only parameters
        assert torch.equal(v, expected[k].to(torch.float32).to(v.dtype)), k  # ue8m0: exact in fp32, one rounding


def test_fp8_experts_of_a_base_checkpoint_load_too(src, tmp_path) -> None:
    tensors, expected = official_checkpoint(src, "deepseek", "ue8m0", experts="fp8")
    assert tensors["layers.0.ffn.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    write_checkpoint(tmp_path, CFG, tensors, scale_fmt="ue8m0", expert_dtype="fp8")
    got = dsv4_ops.load_pretrained(tmp_path).state_dict()
    assert all(torch.equal(got[k], v.to(got[k].dtype)) for k, v in expected.items())


def test_load_builds_on_meta_without_random_init_and_materialises_everything(shipped, tmp_path) -> None:
    tensors, expected = shipped
    write_checkpoint(tmp_path, CFG, tensors, n_shards=3, scale_fmt="ue8m0")
    rng = torch.random.get_rng_state()
    loaded = dsv4_ops.load_pretrained(tmp_path, max_positions=512)
    assert torch.equal(torch.random.get_rng_state(), rng)  # not one random number drawn: no init ran
    every = [*loaded.named_parameters(), *loaded.named_buffers()]
    assert all(t.device.type == "cpu" for _, t in every), [n for n, t in every if t.device.type != "cpu"]
    fresh = DeepseekV4ForCausalLM(CFG, max_positions=512)  # RoPE tables (non-persistent) recomputed
    for (n, b), (_, ref) in zip(loaded.named_buffers(), fresh.named_buffers()):
        if n.endswith((".cos", ".sin")):
            assert torch.equal(b, ref), n
    # without MTP tensors the MTP block is initialised (that alone draws random numbers)
    no_mtp = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    write_checkpoint(tmp_path, CFG, no_mtp, n_shards=1, scale_fmt="ue8m0")
    for f in os.listdir(tmp_path):
        if f.startswith("model-") or f.endswith("index.json"):
            os.remove(tmp_path / f)
    m = dsv4_ops.load_pretrained(tmp_path)
    assert not any(t.is_meta for t in m.parameters())
    want = expected["model.layers.1.self_attn.q_a_proj.weight"].float()
    assert torch.equal(m.model.layers[1].self_attn.q_a_proj.weight, want)


# --------------------------------------------------------------------------------------
# streaming: peak host memory
# --------------------------------------------------------------------------------------
# ~125 M parameters: a 72 MiB FP8 / FP4 checkpoint in 8 shards that loads to a 251 MiB bf16 model
BIG = DSV4Config.tiny(hidden_size=256, q_lora_rank=128, o_lora_rank=128, vocab_size=4096, n_routed_experts=128,
                      moe_intermediate_size=256)


def random_official_tensors(cfg: DSV4Config, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random codes in the official layout for every tensor of ``cfg`` (no model needed), drawn
    on ``device`` (benchmarks/bench_load.py draws the Flash slice's 20 GB on the GPU), held on the CPU."""
    g = torch.Generator(device).manual_seed(seed)
    e8m0 = lambda shape: torch.randint(120, 130, shape, dtype=torch.uint8, generator=g, device=device).view(E8M0).cpu()  # noqa: E731
    out = {}
    for name, t in DeepseekV4ForCausalLM(cfg, device="meta").state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = deepseek_name(name.rsplit(".", 3)[0] + ".mlp.gate.weight").rsplit(".", 2)[0] + ".experts"
            E, rows, K = t.shape
            for e in range(E):
                for w in (("w2",) if name.endswith("down_proj") else ("w1", "w3")):
                    n = rows if w == "w2" else rows // 2
                    codes = torch.randint(-128, 128, (n, K // 2), dtype=torch.int8, generator=g, device=device).cpu()
                    out[f"{prefix}.{e}.{w}.weight"] = codes
                    out[f"{prefix}.{e}.{w}.scale"] = e8m0((n, math.ceil(K / 32)))
            continue
        key = deepseek_name(name)
        if name.endswith(FP8_LINEARS):
            out[key] = random_fp8(t.shape, g, device)
            out[key[: -len("weight")] + "scale"] = e8m0((math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128)))
        elif name.endswith("tid2eid"):
            out[key] = torch.randint(0, cfg.n_routed_experts, t.shape, dtype=torch.int32, generator=g, device=device).cpu()
        else:
            out[key] = torch.randn(t.shape, generator=g, device=device).to(
                torch.bfloat16 if name.endswith(BF16_TENSORS) else t.dtype).cpu()
    return out


MEASURE = textwrap.dedent("""
    import json, os, sys, time
    import torch, safetensors, dsv4_ops
    from transformers import DeepseekV4Config
    DeepseekV4Config.from_pretrained(sys.argv[1])  # imports done before measuring
    torch.set_num_threads(1)  # the CI box has 2 shared cores: threads would only wait for each other

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def peak_rss():  # VmHWM: this process image's own peak (ru_maxrss keeps the parent's across exec)
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    before, t0 = rss(), time.perf_counter()
    model = dsv4_ops.load_pretrained(sys.argv[1], dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    peak = peak_rss()
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(json.dumps(dict(before=before, peak=peak, model_bytes=model_bytes, seconds=seconds)))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_load_streams_shard_by_shard_with_bounded_peak_memory(tmp_path) -> None:
    """Peak RSS during ``load_pretrained`` - RSS before <= model bytes + 2 shards + 24 MiB slack
    (allocator, one tensor's decode temporaries). Reading every shard first would need the whole
    checkpoint (72 MiB) on top of the model: 23 MiB over the bound."""
    files = write_checkpoint(tmp_path, BIG, random_official_tensors(BIG), n_shards=8, interleave=False,
                             scale_fmt="ue8m0", expert_dtype="fp4")
    sizes = [os.path.getsize(tmp_path / f) for f in files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    extra = r["peak"] - r["before"]
    bound = r["model_bytes"] + 2 * max(sizes) + 24 * 2**20
    print(f"load_pretrained: {sum(sizes) / 2**20:.1f} MiB in {len(sizes)} shards (max {max(sizes) / 2**20:.1f}) -> "
          f"{r['model_bytes'] / 2**20:.1f} MiB bf16 model in {r['seconds']:.2f} s; peak RSS +{extra / 2**20:.1f} MiB "
          f"(bound {bound / 2**20:.1f}, all shards at once {(r['model_bytes'] + sum(sizes)) / 2**20:.1f})")
    assert extra <= bound
    assert r["model_bytes"] + sum(sizes) > bound  # the bound tells streaming from reading it all


# --------------------------------------------------------------------------------------
# bad checkpoints: a ValueError naming the tensor and its shard, or the config field
# --------------------------------------------------------------------------------------
def _drop(*keys):
    return lambda t: [t.pop(k) for k in keys]


def _set(key, value):
    return lambda t: t.__setitem__(key, (value(t.get(key)) if callable(value) else value).contiguous())


NAN_SCALE = torch.tensor([[127, 255]], dtype=torch.uint8).view(E8M0)
BROKEN = {
    "missing tensor": (_drop("layers.1.attn.wq_a.weight", "layers.1.attn.wq_a.scale"), {},
                       r"lacks 1 parameters.*'model\.layers\.1\.self_attn\.q_a_proj\.weight'"),
    "extra tensor": (_set("layers.0.attn.bogus.weight", torch.ones(2)), {},
                     r"1 checkpoint tensors have no dsv4_ops counterpart.*'layers\.0\.attn\.bogus\.weight' "
                     r"\(in model-0000"),
    "mis-shaped tensor": (_set("layers.0.attn_norm.weight", torch.ones(63)), {},
                          r"'layers\.0\.attn_norm\.weight' \(in model-\d+-of-00003\.safetensors\) has shape \[63\], "
                          r"expected \[64\]"),
    "mis-shaped FP8 weight": (_set("layers.0.attn.wq_a.weight", lambda w: w[:31]), {},
                              r"'layers\.0\.attn\.wq_a\.weight' .* has shape \[31, 64\], expected \[32, 64\]"),
    "mis-shaped FP4 weight": (_set("layers.2.ffn.experts.3.w2.weight", lambda w: w[:, :20]), {},
                              r"'layers\.2\.ffn\.experts\.3\.w2\.weight' .* shape \[64, 20\], expected \[64, 24\]"),
    "FP8 scale shape": (_set("layers.0.attn.wq_b.scale", lambda s: s[:1]), {},
                        r"scale 'layers\.0\.attn\.wq_b\.scale' \(in model-.*\) of 'layers\.0\.attn\.wq_b\.weight' has "
                        r"shape \[1, 1\], expected \[2, 1\]"),
    "FP4 scale shape": (_set("layers.2.ffn.experts.3.w2.scale", lambda s: s[:, :1]), {},
                        r"scale 'layers\.2\.ffn\.experts\.3\.w2\.scale' .* shape \[64, 1\], expected \[64, 2\]"),
    "FP8 weight without scale": (_drop("layers.0.attn.wo_b.scale"), {},
                                 r"'layers\.0\.attn\.wo_b\.weight' .* is FP8 \(float8_e4m3fn\) but has no scale"),
    "unknown weight dtype": (_set("layers.0.attn.wq_a.weight", lambda w: w.view(torch.float8_e5m2)), {},
                             r"'layers\.0\.attn\.wq_a\.weight' .* has a scale .* but dtype torch\.float8_e5m2"),
    "packed weight without scale": (_drop("layers.2.ffn.experts.0.w1.scale"), {},
                                    r"'layers\.2\.ffn\.experts\.0\.w1\.weight' .* has dtype torch\.int8"),
    "unknown scale dtype": (_set("layers.0.attn.wq_a.scale", lambda s: s.float().half()), {},
                            r"scale 'layers\.0\.attn\.wq_a\.scale' .* has dtype torch\.float16"),
    "NaN scale": (_set("layers.0.attn.wq_b.scale", NAN_SCALE.view(2, 1)), {},
                  r"'layers\.0\.attn\.wq_b\.weight' .*: ue8m0 scale has the NaN code 0xFF"),
    "missing expert": (_drop("layers.2.ffn.experts.5.w3.weight", "layers.2.ffn.experts.5.w3.scale"), {},
                       r"layers\.2\.mlp\.experts needs w3 for experts 0\.\.7 .*found w3 for \[0, 1, 2, 3, 4, 6, 7\]"),
    "expert out of range": (_set("layers.2.ffn.experts.8.w2.weight", lambda _: torch.ones(1)), {},
                            r"'layers\.2\.ffn\.experts\.8\.w2\.weight' .* names expert 8, but the config has "
                            r"8 experts"),
    "hash ids out of range": (_set("layers.0.ffn.gate.tid2eid", lambda t: t.clone().fill_(8)), {},
                              r"'layers\.0\.ffn\.gate\.tid2eid' .* holds expert ids outside \[0, 8\)"),
    "unknown quant_method": (None, {"quant_method": "gptq"},
                             r"quantization_config\.quant_method = 'gptq' is not supported"),
    "unknown scale_fmt": (None, {"scale_fmt": "ue4m3"}, r"quantization_config\.scale_fmt = 'ue4m3' is not supported"),
    "unknown fmt": (None, {"fmt": "e5m2"}, r"quantization_config\.fmt = 'e5m2' is not supported"),
    "bad block size": (None, {"weight_block_size": [128]}, r"quantization_config\.weight_block_size = \[128\]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_bad_checkpoint_is_rejected_with_the_tensor_or_field_named(shipped, tmp_path, case) -> None:
    edit, quant, message = BROKEN[case]
    tensors = dict(shipped[0])
    if edit is not None:
        edit(tensors)
    write_checkpoint(tmp_path, CFG, tensors, n_shards=3, **{"scale_fmt": "ue8m0", **quant})
    with pytest.raises(ValueError, match=message):
        dsv4_ops.load_pretrained(tmp_path)


def test_an_index_naming_a_missing_shard_or_tensor_is_rejected(shipped, tmp_path) -> None:
    files = write_checkpoint(tmp_path, CFG, dict(shipped[0]), n_shards=3, scale_fmt="ue8m0")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.0.attn.extra.weight"] = files[0]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"index.json puts 'layers.0.attn.extra.weight' in {files[0]}, but no shard"):
        dsv4_ops.load_pretrained(tmp_path)
    os.remove(tmp_path / files[1])
    with pytest.raises(ValueError, match=f"shard {files[1]} .* is missing"):
        dsv4_ops.load_pretrained(tmp_path)


# --------------------------------------------------------------------------------------
# from_hf: one copy of the weights
# --------------------------------------------------------------------------------------
def test_from_hf_shares_the_hf_tensors_when_dtype_and_device_match() -> None:
    from hf_util import make_hf

    hf = make_hf(DSV4Config.tiny(num_hidden_layers=2), seed=3)
    rng = torch.random.get_rng_state()
    ours = dsv4_ops.from_hf(hf)
    hf_sd, sd = hf.state_dict(), ours.state_dict()
    shared = [k for k in hf_sd if sd[k].data_ptr() == hf_sd[k].data_ptr()]
    assert len(shared) == len(hf_sd)  # every weight aliases HF's: no second copy
    assert not torch.equal(torch.random.get_rng_state(), rng)  # only the MTP block (HF has none) was initialised
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
    bf16 = dsv4_ops.from_hf(hf, dtype=torch.bfloat16)  # another dtype: cast copies, HF untouched
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert hf.model.embed_tokens.weight.dtype == torch.float32


def test_from_hf_draws_the_missing_mtp_block_in_the_model_dtype_without_an_fp32_copy_of_its_experts() -> None:
    """HF keeps no MTP block, so ``from_hf`` draws a fresh one beside the model: at V4 widths its experts
    are a layer's worth of weights, so they are drawn in the model's dtype (an fp32 draw, then a cast,
    once needed three times their bf16 bytes on a GPU that already holds the model). The fresh block's
    dtypes are those of a block the constructor builds in that dtype (the router stays fp32)."""
    from torch.overrides import TorchFunctionMode

    from hf_util import make_hf

    hf = make_hf(DSV4Config.tiny(num_hidden_layers=2), seed=3).to(torch.bfloat16)
    fresh = DeepseekV4ForCausalLM(DSV4Config.tiny(num_hidden_layers=2)).mtp[0].mlp.experts
    experts = {fresh.gate_up_proj.shape, fresh.down_proj.shape}

    class Factories(TorchFunctionMode):  # the dtype of every tensor of an experts' shape made off the meta device
        made: list[torch.dtype] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and not out.is_meta and out.shape in experts:
                self.made.append(out.dtype)
            return out

    with Factories():
        ours = dsv4_ops.from_hf(hf)
    assert Factories.made and set(Factories.made) == {torch.bfloat16}, Factories.made
    want = DeepseekV4ForCausalLM(DSV4Config.tiny(num_hidden_layers=2), dtype=torch.bfloat16).mtp[0]
    assert {n: p.dtype for n, p in ours.mtp[0].named_parameters()} == {n: p.dtype for n, p in want.named_parameters()}
    assert ours.mtp[0].mlp.gate.weight.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # the draw's default dtype does not leak
