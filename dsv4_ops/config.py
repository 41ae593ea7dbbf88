"""``DSV4Config``: every hyper-parameter of a DeepSeek-V4 model, validated once.

Field names follow the checkpoint / HF names where one exists (architecture.md §1).
Defaults are DeepSeek-V4-Flash as shipped (YaRN on the compressed layers included).
``from_hf`` / ``to_hf`` convert to and from transformers' ``DeepseekV4Config``;
``tiny()`` is the small CPU-test preset.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["DSV4Config", "SLIDING", "CSA", "HCA", "LAYER_TYPES", "MLP_LAYER_TYPES"]

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
# router scoring functions HF's DeepseekV4 builds (ACT2FN[scoring_func]; it has no "softmax")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


def _flash_layer_types(n: int) -> list[str]:
    # V4-Flash pattern (compress_ratios [0,0] + [4,128]*20 + [4]): two sliding-only
    # layers, then CSA on even and HCA on odd layers; cut to n layers.
    return [SLIDING if i < 2 else (CSA if i % 2 == 0 else HCA) for i in range(n)]


@dataclass
class DSV4Config:
    # model shape
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6

    # attention (MQA with one shared K = V head)
    num_attention_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64  # HF: qk_rope_head_dim = head_dim * partial_rotary_factor
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: list[str] | None = None  # None: V4-Flash pattern for num_hidden_layers
    csa_ratio: int = 4  # compress rate m of "compressed_sparse_attention" layers
    hca_ratio: int = 128  # compress rate of "heavily_compressed_attention" layers

    # RoPE: "main" (sliding layers, plain) and "compress" (CSA/HCA layers, YaRN)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float | None = 16.0  # None: no YaRN on the compress rope
    yarn_original_max_position_embeddings: int | None = 65536
    yarn_beta_fast: float | None = 32.0
    yarn_beta_slow: float | None = 1.0

    # lightning indexer (CSA layers)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512

    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    # MoE
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    mlp_layer_types: list[str] | None = None  # None: 3 x "hash_moe" then "moe"

    # MTP
    num_nextn_predict_layers: int = 1

    # ----------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = _flash_layer_types(self.num_hidden_layers)
        if self.mlp_layer_types is None:
            n = self.num_hidden_layers
            self.mlp_layer_types = ["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)
        self.layer_types = list(self.layer_types)
        self.mlp_layer_types = list(self.mlp_layer_types)
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"DSV4Config.{name} = {getattr(self, name)!r}: {why}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings",
            "num_attention_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups",
            "o_lora_rank", "sliding_window", "csa_ratio", "hca_ratio", "index_n_heads",
            "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size",
        ):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                fail(name, "must be a positive int")
        for name in ("n_shared_experts", "num_nextn_predict_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                fail(name, "must be an int >= 0")
        for name in ("rope_theta", "compress_rope_theta", "rms_norm_eps", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                fail(name, "must be > 0")
        if not self.hc_eps >= 0:
            fail("hc_eps", "must be >= 0")

        if self.rope_head_dim % 2:
            fail("rope_head_dim", "must be even (RoPE rotates channel pairs)")
        if self.head_dim <= self.rope_head_dim:
            fail("head_dim", f"must be > rope_head_dim ({self.rope_head_dim})")
        if self.num_attention_heads % self.o_groups:
            fail("num_attention_heads", f"must be divisible by o_groups ({self.o_groups})")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"must be <= n_routed_experts ({self.n_routed_experts})")
        self._validate_moe(fail)

        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = getattr(self, name)
            if len(types) != self.num_hidden_layers:
                fail(name, f"has {len(types)} entries but num_hidden_layers = {self.num_hidden_layers}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                fail(name, f"unknown entries {bad}; allowed: {allowed}")
        if CSA in self.layer_types and self.index_head_dim < self.rope_head_dim:
            fail("index_head_dim", f"must be >= rope_head_dim ({self.rope_head_dim}): indexer q/k are roped")

        yarn = (self.yarn_factor, self.yarn_original_max_position_embeddings)
        if (yarn[0] is None) != (yarn[1] is None):
            fail("yarn_factor", "yarn_factor and yarn_original_max_position_embeddings go together")
        if self.yarn_factor is not None:
            if not self.yarn_factor > 0:
                fail("yarn_factor", "must be > 0")
            if not self.yarn_original_max_position_embeddings > 0:
                fail("yarn_original_max_position_embeddings", "must be > 0")

    def _validate_moe(self, fail) -> None:
        """MoE fields whose other values HF's DeepseekV4 would compute differently or not at all:
        refuse them here rather than build a model that silently disagrees."""
        if self.scoring_func not in SCORING_FUNCS:
            fail("scoring_func", f"must be one of {SCORING_FUNCS} (HF's DeepseekV4 router has no other)")
        if self.norm_topk_prob is not True:
            fail("norm_topk_prob", "only True is supported: DeepSeek-V4 (and HF's router, whatever this "
                                   "says) always normalises the top-k weights to sum to 1")
        if not self.swiglu_limit > 0:
            fail("swiglu_limit", "must be > 0 (the SwiGLU clamp; float('inf') for none)")

    # ----------------------------------------------------------------------------------
    # derived values
    @property
    def compress_rates(self) -> dict[str, int]:
        """HF-style ``{layer_type: rate}`` view of ``csa_ratio`` / ``hca_ratio``."""
        return {CSA: self.csa_ratio, HCA: self.hca_ratio}

    def compress_ratio(self, layer_idx: int) -> int:
        """Compression rate m of a layer; 0 for sliding-window-only layers."""
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[self.layer_types[layer_idx]]

    def yarn(self) -> dict | None:
        """YaRN parameters of the "compress" rope as ``rope.rope_tables`` takes them."""
        if self.yarn_factor is None:
            return None
        return {
            "factor": self.yarn_factor,
            "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
            "beta_fast": 32.0 if self.yarn_beta_fast is None else self.yarn_beta_fast,
            "beta_slow": 1.0 if self.yarn_beta_slow is None else self.yarn_beta_slow,
        }

    def rope_params(self, layer_type: str) -> tuple[float, dict | None]:
        """``(theta, yarn)`` of the rope a layer type uses (sliding: main; CSA/HCA: compress)."""
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"unknown layer type {layer_type!r}; allowed: {LAYER_TYPES}")
        if layer_type == SLIDING:
            return self.rope_theta, None
        return self.compress_rope_theta, self.yarn()

    def replace(self, **changes: Any) -> "DSV4Config":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------
    # presets
    @classmethod
    def tiny(cls, **overrides: Any) -> "DSV4Config":
        """Small model for CPU tests: all three layer types, hash + biased MoE, mHC with 4
        streams, 16 indexer heads (exact-zero score ties are then vanishingly rare), small
        head_dim (64, 16 of it roped), window 16, HCA rate 16, index_topk 8. YaRN factor 16
        over an original context of 256 (= max_position_embeddings / 16, so HF does not
        warn); with rope_dim 16 the ramp spans pairs 0..3 and the rest is interpolated."""
        base = dict(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=4,
            max_position_embeddings=4096,
            num_attention_heads=4,
            head_dim=64,
            rope_head_dim=16,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=32,
            sliding_window=16,
            layer_types=[SLIDING, CSA, HCA, CSA],
            csa_ratio=4,
            hca_ratio=16,
            index_n_heads=16,
            index_head_dim=32,
            index_topk=8,
            yarn_original_max_position_embeddings=256,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            num_nextn_predict_layers=1,
        )
        base.update(overrides)
        if "num_hidden_layers" in overrides:
            n = overrides["num_hidden_layers"]
            if "layer_types" not in overrides:
                base["layer_types"] = ([SLIDING, CSA, HCA] * n)[:n]
            if "mlp_layer_types" not in overrides:
                base["mlp_layer_types"] = (["hash_moe"] * 2 + ["moe"] * n)[:n]
        return cls(**base)

    # ----------------------------------------------------------------------------------
    # transformers interop
    @classmethod
    def from_hf(cls, hf_config: Any) -> "DSV4Config":
        """Read a transformers ``DeepseekV4Config`` (any of its legacy spellings are already
        folded in by its own ``__post_init__``)."""
        rp = hf_config.rope_parameters or {}
        main, comp = rp.get("main") or {}, rp.get("compress") or {}
        main_type = main.get("rope_type", main.get("type", "default"))
        comp_type = comp.get("rope_type", comp.get("type", "default"))
        if main_type != "default":
            raise ValueError(f"rope_parameters['main'] rope_type {main_type!r} unsupported: V4 uses plain RoPE there")
        yarn: dict[str, Any] = dict(
            yarn_factor=None, yarn_original_max_position_embeddings=None, yarn_beta_fast=None, yarn_beta_slow=None
        )
        if comp_type == "yarn":
            if comp.get("attention_factor", 1.0) != 1.0:
                raise ValueError(
                    f"rope_parameters['compress']['attention_factor'] = {comp['attention_factor']}: "
                    "DeepSeek-V4 uses 1.0 (no YaRN mscale)"
                )
            factor = comp.get("factor")
            original = comp["original_max_position_embeddings"]
            if factor is None:  # HF's fallback for a missing factor
                factor = hf_config.max_position_embeddings / original
            yarn = dict(
                yarn_factor=float(factor),
                yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(comp.get("beta_fast") or 32),
                yarn_beta_slow=float(comp.get("beta_slow") or 1),
            )
        elif comp_type != "default":
            raise ValueError(f"rope_parameters['compress'] rope_type {comp_type!r} unsupported (default or yarn)")

        _check_hf_moe(hf_config)
        rates = hf_config.compress_rates or {}
        rope_head_dim = getattr(hf_config, "qk_rope_head_dim", None)
        if rope_head_dim is None:
            rope_head_dim = int(hf_config.head_dim * hf_config.partial_rotary_factor)
        return cls(
            **{name: getattr(hf_config, name) for name in _SAME_IN_HF},
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            layer_types=list(hf_config.layer_types),
            mlp_layer_types=list(hf_config.mlp_layer_types),
            rope_head_dim=rope_head_dim,
            csa_ratio=rates.get(CSA, 4),
            hca_ratio=rates.get(HCA, 128),
            rope_theta=main.get("rope_theta", hf_config.rope_theta),
            compress_rope_theta=comp.get("rope_theta", hf_config.compress_rope_theta),
            **yarn,
        )

    def to_hf(self, **overrides: Any):
        """A transformers ``DeepseekV4Config`` with the same values (``overrides`` are
        passed through, e.g. ``attn_implementation="eager"``)."""
        from transformers import DeepseekV4Config

        if self.n_shared_experts != 1:
            raise ValueError(f"DSV4Config.n_shared_experts = {self.n_shared_experts}: HF's DeepseekV4 always builds "
                             "exactly one shared expert of width moe_intermediate_size, so only 1 converts")
        rope = {"rope_type": "default"} if self.yarn_factor is None else {"rope_type": "yarn", **self.yarn()}
        kwargs = dict(
            {name: getattr(self, name) for name in _SAME_IN_HF},
            tie_word_embeddings=self.tie_word_embeddings,
            norm_topk_prob=self.norm_topk_prob,
            layer_types=list(self.layer_types),
            mlp_layer_types=list(self.mlp_layer_types),
            n_shared_experts=self.n_shared_experts,
            num_key_value_heads=1,
            partial_rotary_factor=self.rope_head_dim / self.head_dim,
            compress_rates=dict(self.compress_rates),
            rope_theta=self.rope_theta,
            compress_rope_theta=self.compress_rope_theta,
            rope_parameters=rope,
        )
        kwargs.update(overrides)
        hf = DeepseekV4Config(**kwargs)
        if hf.qk_rope_head_dim != self.rope_head_dim:
            raise ValueError(
                f"rope_head_dim {self.rope_head_dim} / head_dim {self.head_dim} is not exactly representable "
                f"as HF's partial_rotary_factor (got qk_rope_head_dim {hf.qk_rope_head_dim})"
            )
        return hf


# the fields HF's DeepseekV4Config names and stores as we do
_SAME_IN_HF = (
    "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "rms_norm_eps", "num_attention_heads",
    "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
    "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "routed_scaling_factor", "scoring_func", "swiglu_limit", "num_nextn_predict_layers",
)


def _check_hf_moe(hf_config: Any) -> None:
    """HF config fields that change the MoE math but that HF's DeepseekV4 model reads differently
    from their name (or not at all): only the values it and DeepSeek-V4 agree on convert."""

    def fail(name: str, value: Any, why: str) -> None:
        raise ValueError(f"DeepseekV4Config.{name} = {value!r}: {why}")

    n_shared = getattr(hf_config, "n_shared_experts", 1)
    if n_shared != 1:
        fail("n_shared_experts", n_shared, "HF's DeepseekV4 ignores it and builds exactly one shared expert of "
             "width moe_intermediate_size; only 1 is unambiguous")
    for name, ok in (("hidden_act", ("silu",)), ("mlp_bias", (False,)), ("topk_method", (None, "noaux_tc")),
                     ("n_group", (None, 1)), ("topk_group", (None, 1))):
        value = getattr(hf_config, name, None)
        if value not in ok:
            fail(name, value, f"DeepSeek-V4's MoE uses {ok[-1]!r} (flat top-k, SwiGLU, no biases)")
