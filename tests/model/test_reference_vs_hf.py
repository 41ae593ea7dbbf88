"""The model's attention layer (incremental, on the ops) and the reference dense oracle against
HF transformers' DeepseekV4Attention, in fp32, for every layer type.

HF side: ``DeepseekV4Attention`` modules called directly with the model's own plumbing —
``DeepseekV4RotaryEmbedding`` for the {"main", "compress"} position embeddings,
``create_sliding_window_causal_mask`` for the mask and ``DynamicCache(config=...)``, which
builds a ``DynamicSlidingWindowLayer`` / ``DeepseekV4CSACache`` / ``DeepseekV4HCACache`` per
layer type — exactly what ``DeepseekV4Model.forward`` does around each layer.

Every parameter is drawn fresh (HF leaves ``sinks`` / ``position_bias`` as zeros or
``torch.empty``); the indexer has 16 heads so exact-zero score ties do not occur.
"""
from __future__ import annotations

import pytest
import torch

from dsv4_ops.config import CSA, HCA, SLIDING, DSV4Config
from dsv4_ops.model.attention import Attention
from dsv4_ops.model.plan import plan_step, ring_sizes
from dsv4_ops.reference.layer import dense_attention
from dsv4_ops.reference.rope import rope_tables

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)

LAYER_TYPES = [SLIDING, CSA, HCA]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def randomize_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Fresh random values for every parameter, at scales that keep activations O(1)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                r = 1 + 0.2 * r
            elif p.dim() == 2 and "position_bias" not in name:
                r = r / p.shape[1] ** 0.5
            p.copy_(r)


class Layers:
    """One HF attention layer of each type with shared random weights + the reference copies."""

    def __init__(self, hca_ratio: int = 16, seed: int = 0) -> None:
        self.cfg = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=hca_ratio)
        assert self.cfg.layer_types == LAYER_TYPES
        self.hcfg = self.cfg.to_hf(attn_implementation="eager")
        gen = torch.Generator().manual_seed(seed)
        self.hf = [DeepseekV4Attention(self.hcfg, i).eval() for i in range(3)]
        self.ref = []
        for i, a in enumerate(self.hf):
            randomize_(a, gen)
            theta, yarn = self.cfg.rope_params(self.cfg.layer_types[i])
            r = Attention(self.cfg, i, rope=rope_tables(theta, self.cfg.rope_head_dim, 1024, yarn)).eval()
            r.load_state_dict(a.state_dict(), strict=True)
            self.ref.append(r)
        self.rotary = DeepseekV4RotaryEmbedding(self.hcfg)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def x(self, B: int, S: int) -> list[torch.Tensor]:
        """Independent inputs per layer."""
        return [torch.randn(B, S, self.cfg.hidden_size, generator=self.gen) for _ in range(3)]


class HFRow:
    """HF incremental run of one sequence through the three layers (batch 1)."""

    def __init__(self, L: Layers, use_cache: bool = True) -> None:
        self.L = L
        self.cache = DynamicCache(config=L.hcfg) if use_cache else None
        self.pos = 0

    @torch.no_grad()
    def __call__(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        S = xs[0].shape[1]
        pid = torch.arange(self.pos, self.pos + S)[None]
        mask = create_sliding_window_causal_mask(
            config=self.L.hcfg, inputs_embeds=xs[0], attention_mask=None, cache=self.cache, position_ids=pid
        )
        pe = {k: self.L.rotary(xs[0], pid, layer_type=k) for k in ("main", "compress")}
        outs = [
            a(x, position_embeddings=pe, position_ids=pid, attention_mask=mask, cache=self.cache)[0]
            for a, x in zip(self.L.hf, xs)
        ]
        self.pos += S
        return outs


def layer_prefill(r: Attention, x, state, lengths, n_new, chunk: int | None = None) -> torch.Tensor:
    """The layer over ``x [B, S, hidden]`` in steps of ``chunk`` tokens (row ``b`` takes
    ``n_new[b]``), one plan per step, as the model runs it."""
    S = x.shape[1]
    chunk = chunk or max(S, 1)
    outs, done = [], torch.zeros_like(n_new)
    for j in range(0, S, chunk):
        w = min(chunk, S - j)
        take = (n_new - done).clamp(0, w).to(torch.int32)  # tokens of each row inside this chunk
        meta = plan_step(r.cfg, lengths + done, take, w, r.rings(state))
        outs.append(r(x[:, j : j + w], meta, state))
        done = done + take
    return torch.cat(outs, dim=1)


class RefBatch:
    """Incremental run of B rows through the three model layers, on the ops."""

    def __init__(self, L: Layers, B: int, max_seq_len: int = 1024) -> None:
        self.L = L
        self.states = [r.new_state(B, max_seq_len) for r in L.ref]
        self.lengths = torch.zeros(B, dtype=torch.int32)

    @torch.no_grad()
    def __call__(self, xs: list[torch.Tensor], n_new: torch.Tensor, chunk: int | None = None) -> list[torch.Tensor]:
        n_new = n_new.to(torch.int32)
        outs = [layer_prefill(r, x, st, self.lengths, n_new, chunk) for r, x, st in zip(self.L.ref, xs, self.states)]
        self.lengths = self.lengths + n_new
        return outs


@pytest.fixture(scope="module")
def layers() -> Layers:
    return Layers(hca_ratio=16)


@pytest.fixture(scope="module")
def layers128() -> Layers:
    return Layers(hca_ratio=128, seed=7)


# --------------------------------------------------------------------------------------
# RoPE tables and config
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("flash_dims", [False, True], ids=["tiny", "flash"])
def test_rope_tables_equal_hf(flash_dims: bool) -> None:
    cfg = DSV4Config(num_hidden_layers=4) if flash_dims else DSV4Config.tiny()
    hcfg = cfg.to_hf()
    assert hcfg.rope_parameters["compress"]["attention_factor"] == 1.0  # V4 pins YaRN mscale off
    rot = DeepseekV4RotaryEmbedding(hcfg)
    P = 3000
    pid = torch.arange(P)[None]
    for rope_type, layer_type in (("main", SLIDING), ("compress", CSA)):
        assert getattr(rot, f"{rope_type}_attention_scaling") == 1.0
        cos_hf, sin_hf = rot(torch.zeros(1), pid, layer_type=rope_type)
        theta, yarn = cfg.rope_params(layer_type)
        cos, sin = rope_tables(theta, cfg.rope_head_dim, P, yarn)
        assert cos.shape == (P, cfg.rope_head_dim // 2) and cos.dtype == torch.float32
        assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0]), rope_type
    # YaRN really changes the compress table (and not the main one)
    plain = rope_tables(cfg.compress_rope_theta, cfg.rope_head_dim, P, None)[0]
    assert not torch.equal(plain, rope_tables(*cfg.rope_params(CSA)[:1], cfg.rope_head_dim, P, cfg.yarn())[0])


def test_config_roundtrip_and_flash_checkpoint_keys() -> None:
    tiny = DSV4Config.tiny()
    assert DSV4Config.from_hf(tiny.to_hf()) == tiny
    assert set(tiny.layer_types) == set(LAYER_TYPES) and "hash_moe" in tiny.mlp_layer_types
    # The shipped V4-Flash config.json spelling (legacy keys folded by HF) == our defaults.
    hf = DeepseekV4Config(
        compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0],
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        qk_rope_head_dim=64, num_hash_layers=3,
    )  # fmt: skip
    assert DSV4Config.from_hf(hf) == DSV4Config()
    # HF's default (no rope_scaling) has no YaRN
    assert DSV4Config.from_hf(DeepseekV4Config()).yarn() is None


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(rope_head_dim=64), "head_dim"),
        (dict(rope_head_dim=15), "rope_head_dim"),
        (dict(layer_types=[SLIDING, "full_attention", HCA, CSA]), "layer_types"),
        (dict(layer_types=[SLIDING, CSA]), "layer_types"),
        (dict(o_groups=3), "num_attention_heads"),
        (dict(csa_ratio=0), "csa_ratio"),
        (dict(hca_ratio=-1), "hca_ratio"),
        (dict(index_topk=0), "index_topk"),
        (dict(mlp_layer_types=["moe"] * 3), "mlp_layer_types"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(yarn_original_max_position_embeddings=None), "yarn_factor"),
    ],
)
def test_config_validation_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"DSV4Config\.{field}\b"):
        DSV4Config.tiny(**change)


def test_parameter_names_equal_hf(layers: Layers) -> None:
    for a, r in zip(layers.hf, layers.ref):
        assert list(r.state_dict()) == list(a.state_dict())


# --------------------------------------------------------------------------------------
# whole prompt
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("S", [1, 3, 4, 5, 16, 17, 70, 129])
def test_full_prompt(layers: Layers, S: int, tol) -> None:
    bound = tol("hf_parity_fp32")["rel"]
    xs = layers.x(1, S)
    want = HFRow(layers, use_cache=False)(xs)
    want_cached = HFRow(layers)(xs)  # HF's own cache path agrees with its cache-free path
    with torch.no_grad():
        for i, lt in enumerate(LAYER_TYPES):
            assert rel(want_cached[i], want[i]) <= bound, lt
            assert rel(dense_attention(layers.ref[i], xs[i]), want[i]) <= bound, f"dense oracle {lt}"
    for chunk in (None, 7, 16, 1):
        got = RefBatch(layers, 1)(xs, torch.tensor([S]), chunk)
        for i, lt in enumerate(LAYER_TYPES):
            assert rel(got[i], want[i]) <= bound, f"incremental {lt} chunk={chunk}"


def test_hf_chunked_prefill_matches_reference_chunks(layers: Layers, tol) -> None:
    """HF's own chunked prefill (buffers carried in its cache) == our chunks == one shot."""
    bound = tol("hf_parity_fp32")["rel"]
    S, chunk = 70, 13
    xs = layers.x(1, S)
    hf = HFRow(layers)
    want = [torch.cat(t, dim=1) for t in zip(*(hf([x[:, j : j + chunk] for x in xs]) for j in range(0, S, chunk)))]
    got = RefBatch(layers, 1)(xs, torch.tensor([S]), chunk)
    for i in range(3):
        assert rel(got[i], want[i]) <= bound


# --------------------------------------------------------------------------------------
# decode after a prompt
# --------------------------------------------------------------------------------------
def run_prompt_then_decode(L: Layers, prompt: int, steps: int, bound: float, chunk: int | None = None) -> float:
    """A prompt, then ``steps`` decode steps, HF vs ours layer by layer: every decode step within ``bound``
    (relative); returns the worst error."""
    hf, ref = HFRow(L), RefBatch(L, 1)
    xs = L.x(1, prompt)
    worst = 0.0
    for h, g in zip(hf(xs), ref(xs, torch.tensor([prompt]), chunk)):
        worst = max(worst, rel(g, h))
    for _ in range(steps):
        xs = L.x(1, 1)
        for i, (h, g) in enumerate(zip(hf(xs), ref(xs, torch.tensor([1])))):
            e = rel(g, h)
            assert e <= bound, f"{LAYER_TYPES[i]} at position {ref.lengths.item() - 1}: {e}"
            worst = max(worst, e)
    return worst


@pytest.mark.parametrize("prompt", [1, 3, 4, 5, 127, 128, 129, 300])
def test_decode_after_prompt(layers: Layers, prompt: int, tol) -> None:
    bound = tol("hf_parity_fp32")["rel"]
    assert run_prompt_then_decode(layers, prompt, 20, bound) <= bound


def test_long_decode_crosses_many_hca_blocks(layers: Layers, tol) -> None:
    # positions 40..139: 6 HCA (m=16) and 25 CSA blocks close during decode
    bound = tol("hf_parity_fp32")["rel"]
    assert run_prompt_then_decode(layers, 40, 100, bound, chunk=16) <= bound


def test_real_hca_rate_128(layers128: Layers, tol) -> None:
    bound = tol("hf_parity_fp32")["rel"]
    assert layers128.cfg.hca_ratio == 128
    # chunked prompt crossing 128 and 256, then decode across the block closing at 383
    assert run_prompt_then_decode(layers128, 375, 12, bound, chunk=100) <= bound


# --------------------------------------------------------------------------------------
# batch rows of different lengths
# --------------------------------------------------------------------------------------
def test_batched_ragged_rows_match_per_row_hf(layers: Layers, tol) -> None:
    bound = tol("hf_parity_fp32")["rel"]
    prompts = [5, 37, 20, 1]
    B = len(prompts)
    hf = [HFRow(layers) for _ in range(B)]
    ref = RefBatch(layers, B)

    def check(xs: list[torch.Tensor], n_new: list[int], chunk: int | None = None) -> None:
        got = ref(xs, torch.tensor(n_new), chunk)
        for b, n in enumerate(n_new):
            if n == 0:
                continue
            want = hf[b]([x[b : b + 1, :n] for x in xs])
            for i in range(3):
                e = rel(got[i][b : b + 1, :n], want[i])
                assert e <= bound, f"row {b} {LAYER_TYPES[i]} n={n}: {e}"

    check(layers.x(B, max(prompts)), prompts, chunk=16)  # ragged prefill, chunked
    for t in range(20):  # decode; row 2 sits out some steps (n_new = 0)
        check(layers.x(B, 1), [1, 1, 0 if t % 3 == 1 else 1, 1])
    check(layers.x(B, 6), [3, 0, 6, 1])  # ragged multi-token step (e.g. a verify step)
    for _ in range(5):
        check(layers.x(B, 1), [1] * B)


def test_poisoned_state_is_never_read(layers: Layers) -> None:
    """Slots the step does not own may hold anything (here NaN): results are unchanged."""
    xs = layers.x(2, 23)
    n_new = torch.tensor([23, 9])
    clean, dirty = RefBatch(layers, 2, 256), RefBatch(layers, 2, 256)
    for st in dirty.states:
        for t in st.tensors().values():
            t.fill_(float("nan"))
    for step in range(3):
        a, b = clean(xs, n_new, chunk=8), dirty(xs, n_new, chunk=8)
        for i in range(3):
            for r, n in enumerate(n_new.tolist()):
                assert torch.equal(a[i][r, :n], b[i][r, :n]), (step, LAYER_TYPES[i])
        xs, n_new = layers.x(2, 1), torch.tensor([1, 1])


def test_ring_sizes_follow_design() -> None:
    cfg = DSV4Config.tiny()
    assert ring_sizes(cfg) == (cfg.sliding_window, 2 * cfg.csa_ratio, cfg.hca_ratio)
    assert ring_sizes(cfg, lookahead=3) == (cfg.sliding_window + 3, 2 * cfg.csa_ratio + 3, cfg.hca_ratio + 3)
