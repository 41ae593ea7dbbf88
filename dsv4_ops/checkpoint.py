"""Checkpoints on disk: ``load_pretrained`` builds a dsv4_ops model from a checkpoint directory
(HF or DeepSeek tensor names; bf16 / fp32, FP8 block-scaled and FP4 weights), streaming it
shard by shard onto the target device."""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass

import torch

from . import quant_formats as qf
from .config import DSV4Config
from .model.model import DeepseekV4ForCausalLM, cast_non_fp32_params, rope_tables_for
from .model.mtp import MTPBlock

__all__ = ["load_pretrained", "check_load", "finish_meta_model", "QuantConfig"]


def check_load(where: str, model, result) -> None:
    """Every parameter must be loaded (:func:`_check_missing`); source tensors must all be used,
    except extra MTP layers (``mtp.N`` beyond the one block we build)."""
    _check_missing(where, list(result.missing_keys), model.state_dict())
    ours = len(getattr(model, "mtp", []))
    unexpected = [
        k for k in result.unexpected_keys
        if not (k.startswith("mtp.") and int(k.split(".")[1]) >= ours)
    ]
    if unexpected:
        raise ValueError(f"{where}: {len(unexpected)} checkpoint tensors have no dsv4_ops counterpart, "
                         f"e.g. {unexpected[:5]}")


def _check_missing(where: str, missing: list[str], names) -> None:
    """``missing`` (of the parameter ``names``) must be empty, except for the MTP block's when the
    source has none of them at all (HF transformers drops them)."""
    ours_mtp = {k for k in names if k.startswith("mtp.")}
    if ours_mtp and ours_mtp <= set(missing):  # the source has no MTP weights at all
        missing = [k for k in missing if k not in ours_mtp]
    if missing:
        raise ValueError(f"{where}: the checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")


# --------------------------------------------------------------------------------------
# checkpoints on disk
# --------------------------------------------------------------------------------------
# DeepSeek's own tensor names -> HF / dsv4_ops names. transformers 5.x ``save_pretrained``
# writes this format too (it reverts its load-time conversion). Applied in order, each at
# most once per key, exactly as transformers' ``conversion_mapping["deepseek_v4"]`` does;
# per-expert w1/w2/w3 are fused afterwards. Keys are handled without their "model." prefix.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_RENAMES = [(re.compile(p), t) for p, t in _RENAMES]
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_TOP_LEVEL = ("embed_tokens.", "layers.", "norm.", "hc_head.")
# MTP: `mtp.0.<layer names>` use the layer rules above; its own head / input tensors map here
_MTP_OWN = re.compile(r"^(?P<prefix>mtp\.\d+\.)(?P<rest>(?:enorm|hnorm|e_proj|h_proj|norm)\.weight|hc_head_(?:fn|base|scale))$")
_MTP_HEAD = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}


def _target_name(key: str) -> str:
    """A checkpoint tensor name (DeepSeek or HF) -> its HF / dsv4_ops name; per-expert
    ``...experts.N.wK.weight`` keep that suffix (``_EXPERT`` matches them)."""
    name = key[len("model."):] if key.startswith("model.") else key
    mtp = _MTP_OWN.match(name)
    if mtp:  # the MTP block's own tensors: enorm, hnorm, e_proj, h_proj, norm, hc_head_*
        return mtp["prefix"] + _MTP_HEAD.get(mtp["rest"], mtp["rest"])
    for pattern, target in _RENAMES:  # main layers and the MTP block's decoder layer alike
        name = pattern.sub(target, name, count=1)
    return "model." + name if name.startswith(_TOP_LEVEL) else name


# --------------------------------------------------------------------------------------
# the checkpoint's table of contents (safetensors headers only)
# --------------------------------------------------------------------------------------
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class _Entry:
    """One tensor of the checkpoint: where it is and what it is (read from the header)."""

    key: str
    file: str
    dtype: torch.dtype | str  # a str when torch has no such dtype
    shape: tuple[int, ...]  # torch's shape (F4: two values per element, as float4_e2m1fn_x2)

    def where(self) -> str:
        return f"{self.key!r} (in {self.file})"


def _weight_map(path: str) -> dict[str, str] | None:
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        return json.load(f)["weight_map"]


def _shard_files(path: str) -> list[str]:
    weight_map = _weight_map(path)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"load_pretrained: no *.safetensors files in {path}")
    for name in files:
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"load_pretrained: shard {name} (named in model.safetensors.index.json) is missing")
    return files


def _catalogue(path: str) -> dict[str, _Entry]:
    """Every tensor's file, dtype and shape, from the safetensors headers (no data read)."""
    from safetensors import safe_open

    entries: dict[str, _Entry] = {}
    for name in _shard_files(path):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                code, shape = sl.get_dtype(), tuple(sl.get_shape())
                dtype = _ST_DTYPES.get(code, code)
                if code == "F4" and shape:  # the header counts fp4 values; torch packs two per element
                    shape = (*shape[:-1], shape[-1] // 2)
                if key in entries:
                    raise ValueError(f"load_pretrained: tensor {key!r} is in both {entries[key].file} and {name}")
                entries[key] = _Entry(key, name, dtype, shape)
    for key, name in (_weight_map(path) or {}).items():
        if key not in entries:
            raise ValueError(f"load_pretrained: model.safetensors.index.json puts {key!r} in {name}, "
                             "but no shard holds it")
    return entries


# --------------------------------------------------------------------------------------
# quantisation formats
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantConfig:
    """What ``config.json``'s ``quantization_config`` declares (transformers'
    ``FineGrainedFP8Config`` fields; DeepSeek-V4 ships ``quant_method="fp8"``, ``fmt="e4m3"``,
    ``scale_fmt="ue8m0"``, ``weight_block_size=[128, 128]``, ``activation_scheme="dynamic"``
    and ``expert_dtype`` ``"fp4"`` (instruct) or ``"fp8"`` (base)). Each tensor's format is
    then read from its own dtype: the block size is the one thing only the config says."""

    block: tuple[int, int] = (128, 128)

    @classmethod
    def from_hf(cls, hf_config) -> "QuantConfig":
        qc = getattr(hf_config, "quantization_config", None)
        if qc is None:
            return cls()
        if not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        where = "load_pretrained: config.json quantization_config"
        allowed = {"quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("float", "ue8m0"),
                   "activation_scheme": ("dynamic",), "expert_dtype": ("fp8", "fp4")}
        for field, values in allowed.items():
            value = qc.get(field)
            if field == "quant_method" and value is None:
                raise ValueError(f"{where} has no quant_method (supported: 'fp8')")
            if value is not None and str(value).lower() not in values:
                raise ValueError(f"{where}.{field} = {value!r} is not supported (supported: {', '.join(values)})")
        block = qc.get("weight_block_size") or (128, 128)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"{where}.weight_block_size = {block!r}: expected two positive ints")
        return cls(tuple(block))


_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def _scales(entries: dict[str, _Entry]) -> dict[str, _Entry]:
    """weight key -> its block-scale tensor. A scale is ``X.scale`` (DeepSeek) or
    ``X.weight_scale_inv`` (HF) next to ``X.weight``, or ``Y_scale_inv`` next to a fused HF
    expert tensor ``Y``; other ``*.scale`` tensors (mHC ``attn_hc.scale``) are parameters."""
    found: dict[str, _Entry] = {}
    for key, e in entries.items():
        weight = None
        for suffix in _SCALE_SUFFIXES:
            if key.endswith(suffix) and key[: -len(suffix)] + ".weight" in entries:
                weight = key[: -len(suffix)] + ".weight"
        if key.endswith("_scale_inv") and key[: -len("_scale_inv")] in entries:
            weight = key[: -len("_scale_inv")]
        if weight is None:
            continue
        if weight in found:
            raise ValueError(f"load_pretrained: weight {weight!r} has two scales, {found[weight].key!r} and {key!r}")
        found[weight] = e
    return found


def _format(w: _Entry, scale: _Entry | None, target: torch.Tensor, shape: tuple[int, ...], q: QuantConfig) -> str:
    """How to read ``w`` into a ``target``-like tensor of ``shape``: "plain", "fp8" or "fp4".
    Checks dtypes and shapes (of the scale too) from the header; raises ``ValueError``
    naming the tensor and its shard."""
    where = f"load_pretrained: {w.where()}"
    if isinstance(w.dtype, str):
        raise ValueError(f"{where} has dtype {w.dtype}, which this torch cannot hold")
    if scale is not None and not target.is_floating_point():
        raise ValueError(f"{where} has a scale {scale.key!r} but loads into an integer tensor")
    if scale is not None and scale.dtype not in qf.SCALE_DTYPES:
        raise ValueError(f"load_pretrained: scale {scale.where()} has dtype {scale.dtype}; "
                         "expected float32 or ue8m0 (float8_e8m0fnu / uint8)")
    if w.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError(f"{where} is FP8 (float8_e4m3fn) but has no scale "
                             f"({w.key[:-len('weight')] + 'scale'!r} or '...weight_scale_inv')")
        kind, want_w, want_s = "fp8", shape, qf.fp8_scale_shape(shape, q.block)
    elif scale is not None and w.dtype in qf.FP4_DTYPES:
        if shape[-1] % 2:
            raise ValueError(f"{where}: FP4 packs two values per byte, but the input dim is {shape[-1]} (odd)")
        kind, want_w, want_s = "fp4", (*shape[:-1], shape[-1] // 2), qf.fp4_scale_shape(shape)
    elif scale is not None:
        raise ValueError(f"{where} has a scale {scale.key!r} but dtype {w.dtype}, which is neither FP8 "
                         "(float8_e4m3fn) nor packed FP4 (int8 / uint8 / float4_e2m1fn_x2)")
    elif (w.dtype in (torch.float32, torch.bfloat16, torch.float16) if target.is_floating_point()
          else not w.dtype.is_floating_point and w.dtype != torch.bool):
        kind, want_w, want_s = "plain", shape, None
    else:
        raise ValueError(f"{where} has dtype {w.dtype}, which is not a format load_pretrained reads into a "
                         f"{target.dtype} parameter (float32 / bfloat16 / float16, float8_e4m3fn + scale, "
                         "packed FP4 + scale)")
    if w.shape != tuple(want_w):
        raise ValueError(f"{where} has shape {list(w.shape)}, expected {list(want_w)}"
                         + (f" ({kind} packing of {list(shape)})" if kind == "fp4" else ""))
    if want_s is not None and scale.shape != tuple(want_s):
        raise ValueError(f"load_pretrained: scale {scale.where()} of {w.key!r} has shape {list(scale.shape)}, "
                         f"expected {list(want_s)} (one per {'32 input values' if kind == 'fp4' else q.block} block)")
    return kind


# --------------------------------------------------------------------------------------
# plan (headers only) and streaming read
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Piece:
    """One checkpoint weight (+ its scale) and where it lands: a whole parameter, or expert
    ``expert``'s rows ``rows`` of a fused ``[E, 2I, D]`` / ``[E, D, I]`` expert parameter."""

    w: _Entry
    scale: _Entry | None
    kind: str  # "plain" | "fp8" | "fp4"
    target: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


def _plan(entries: dict[str, _Entry], want: dict[str, torch.Tensor], q: QuantConfig,
          n_mtp: int, experts_range: tuple[int, int] | None = None) -> list[_Piece]:
    """Map every checkpoint tensor onto ``want`` (the meta model's state dict) and check
    names, dtypes and shapes before any data is read. ``experts_range``: ``[first, end)``, the
    routed experts to load (a tensor-parallel rank's; default all): per-expert tensors of
    other experts are skipped, and only these must be present."""
    scales = _scales(entries)
    used_scales = {id(s) for s in scales.values()}
    pieces: list[_Piece] = []
    extra: list[str] = []
    experts: dict[tuple[str, str], dict[int, _Entry]] = {}  # (fused target, w1|w2|w3) -> expert -> entry
    for key, e in entries.items():
        if id(e) in used_scales:
            continue
        name = _target_name(key)
        mtp = re.match(r"mtp\.(\d+)\.", name)
        if mtp and int(mtp[1]) >= n_mtp:
            continue  # MTP layers beyond the one block we build
        m = _EXPERT.match(name)
        if m:
            target = m["prefix"] + (".down_proj" if m["w"] == "w2" else ".gate_up_proj")
            if target not in want:
                extra.append(e.where())
                continue
            full = want[target]
            E, rows = full.shape[0], full.shape[1]
            idx = int(m["e"])
            if idx >= E:
                raise ValueError(f"load_pretrained: {e.where()} names expert {idx}, but the config has {E} experts")
            if experts_range is not None and not experts_range[0] <= idx < experts_range[1]:
                continue  # another rank's expert
            half = rows // 2
            span = {"w1": (0, half), "w3": (half, rows), "w2": (0, rows)}[m["w"]]
            shape = (span[1] - span[0], *full.shape[2:])
            kind = _format(e, scales.get(key), full, shape, q)
            seen = experts.setdefault((target, m["w"]), {})
            if idx in seen:
                raise ValueError(f"load_pretrained: {seen[idx].where()} and {e.where()} are the same expert weight")
            seen[idx] = e
            pieces.append(_Piece(e, scales.get(key), kind, target, idx, span))
            continue
        if name not in want:
            extra.append(e.where())
            continue
        kind = _format(e, scales.get(key), want[name], tuple(want[name].shape), q)
        pieces.append(_Piece(e, scales.get(key), kind, name))
    if extra:
        raise ValueError(f"load_pretrained: {len(extra)} checkpoint tensors have no dsv4_ops counterpart, "
                         f"e.g. {extra[:5]}")
    # fused expert parameters: every expert's w1 + w3 (gate_up) or w2 (down), exactly once
    whole = {p.target for p in pieces if p.expert is None}
    for target in {t for t, _ in experts}:
        first, end = experts_range or (0, want[target].shape[0])
        parts = ("w2",) if target.endswith(".down_proj") else ("w1", "w3")
        for w in parts:
            got = experts.get((target, w), {})
            if target in whole or sorted(got) != list(range(first, end)):
                prefix = target.rsplit(".", 1)[0]
                raise ValueError(f"load_pretrained: {prefix} needs {w} for experts {first}..{end - 1} (and no "
                                 f"fused tensor besides); found {w} for {sorted(got)}")
    targets = [p.target for p in pieces if p.expert is None]
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
        raise ValueError(f"load_pretrained: several checkpoint tensors map to {dup[:5]}")
    return pieces


def _read(handles: dict, path: str, e: _Entry) -> torch.Tensor:
    from safetensors import safe_open

    f = handles.get(e.file)
    if f is not None:
        return f.get_tensor(e.key)
    with safe_open(os.path.join(path, e.file), framework="pt") as other:  # a scale in another shard
        return other.get_tensor(e.key)


def _decode(p: _Piece, w: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype, q: QuantConfig) -> torch.Tensor:
    try:
        if p.kind == "fp8":
            return qf.dequantize_fp8(w, s, q.block, dtype)
        if p.kind == "fp4":
            return qf.dequantize_fp4(w, s, dtype)
    except ValueError as err:
        raise ValueError(f"load_pretrained: {p.w.where()}: {err}") from None
    return w.to(dtype)


def _stream(path: str, pieces: list[_Piece], want: dict[str, torch.Tensor], device: torch.device,
            q: QuantConfig, n_experts: int, tp=None) -> dict[str, torch.Tensor]:
    """Read the checkpoint one shard at a time, straight into tensors on ``device``: whole
    parameters as decoded (no further copy), per-expert pieces into fused parameters
    allocated once. Only the open shard's tensors (and one tensor's decode temporaries) are
    held beyond the model itself. ``tp`` (a ``parallel.TensorParallel``): keep only this
    rank's slice of each sharded tensor; ``want`` then has the rank's shapes."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[_Piece]] = {}
    for p in pieces:
        by_file.setdefault(p.w.file, []).append(p)
    for file in sorted(by_file):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            handles = {file: f}
            for p in by_file[file]:
                raw = _read(handles, path, p.w)
                s = None if p.scale is None else _read(handles, path, p.scale).to(device)
                value = _decode(p, raw.to(device), s, want[p.target].dtype, q)
                if p.target.endswith("tid2eid") and bool(((value < 0) | (value >= n_experts)).any()):
                    # hash-routing ids index the experts: out of range would read past them
                    raise ValueError(f"load_pretrained: {p.w.where()} holds expert ids outside "
                                     f"[0, {n_experts})")
                if value.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
                    # a tensor read from the memory-mapped shard: keeping it would keep every
                    # page of the shard that this load touched resident, so own a copy
                    value = value.clone()
                del raw, s
                if p.expert is None:
                    part = value if tp is None else tp.take(p.target, value)
                    out[p.target] = value if part is value else part.clone()
                    continue
                if p.target not in out:
                    meta = want[p.target]
                    out[p.target] = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                first = 0 if tp is None else tp.expert_range(n_experts)[0]
                out[p.target][p.expert - first, p.rows[0]:p.rows[1]].copy_(value)
                del value
    return out


@contextlib.contextmanager
def building_in(dtype: torch.dtype, device):
    """Modules built inside draw their parameters in ``dtype`` on ``device`` (torch's default dtype and
    device, the dtype restored after)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def finish_meta_model(model: DeepseekV4ForCausalLM, device) -> DeepseekV4ForCausalLM:
    """Complete a model built on the meta device whose weights were loaded with
    ``assign=True``: an MTP block the source had no weights for gets a fresh (random)
    initialisation on ``device``, the RoPE tables are computed on ``device``; then no
    parameter or buffer may be left on meta."""
    for i, blk in enumerate(model.mtp):
        if all(p.is_meta for p in blk.parameters()):
            rope = rope_tables_for(model.config, 1, device)
            # drawn in the model's dtype: at V4 widths an fp32 draw of the block's experts (then cast) needs
            # twice the block's memory again, more than a GPU holding the model has left
            with building_in(model.dtype, device):
                fresh = MTPBlock(model.config, rope)
            cast_non_fp32_params(fresh, model.dtype)
            model.mtp[i] = fresh
    model.materialize_buffers(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{len(left)} tensors of the model were not loaded, e.g. {left[:5]}")
    return model


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                    max_positions: int | None = None, tp=None, shard=None) -> DeepseekV4ForCausalLM:
    """A ``dsv4_ops.DeepseekV4ForCausalLM`` from a checkpoint directory: ``config.json`` (a
    transformers ``DeepseekV4Config``) plus safetensors (one file or shards with
    ``model.safetensors.index.json``), in HF names or in DeepSeek's own names (what
    ``DeepseekV4ForCausalLM.save_pretrained`` writes in transformers 5.x, and the official
    checkpoints). No HF model is built. ``dtype`` defaults to the config's dtype (fp32 if
    unset); fp32-only parameters stay fp32. ``device`` (default CPU) is where the weights go.

    Formats (``dsv4_ops/quant_formats.py`` for the exact layouts): plain fp32 / bf16 / fp16
    tensors; FP8 ``float8_e4m3fn`` linear weights with block scales (``weight_block_size``
    from ``quantization_config``, 128x128 officially; partial edge blocks allowed) named
    ``X.scale`` (DeepSeek) or ``X.weight_scale_inv`` (HF), fp32 or ue8m0
    (``float8_e8m0fnu`` / ``uint8``); FP4 e2m1 experts packed two per byte (``int8`` /
    ``uint8`` / ``float4_e2m1fn_x2``) with one scale per 32 input values. Per-expert
    ``experts.N.w1/w2/w3`` (which may span shards) or HF's fused ``gate_up_proj`` /
    ``down_proj`` (+ ``..._scale_inv``).

    Quantised weights are dequantised at load, to ``dtype``: each value is exact in fp32
    (fp64 for fp32 scales), so the cast to ``dtype`` is the only rounding.

    Memory: the model is built on the meta device (no random init), then the checkpoint is read one
    shard at a time straight into tensors on ``device``: host memory peaks at about one shard (plus
    one tensor's decode temporaries) beyond the model; no tensor keeps a shard's memory map alive.

    MTP tensors (``mtp.0.*``, DeepSeek or dsv4_ops names; see ``model/mtp.py`` for the
    mapping) load into ``model.mtp``; a checkpoint without any keeps a freshly initialised
    MTP block, extra MTP layers (``mtp.1.*`` ...) are ignored. Raises ``ValueError`` naming
    the tensor (and its shard) or the config field when a parameter is missing, a tensor has
    no counterpart, a shape / dtype / scale does not match, or the quantisation format is
    unknown — before any weight data is read, where the headers tell.

    ``tp`` (a ``parallel.TensorParallel``) and ``shard`` (``model -> model``, the same model sliced
    for that rank: ``parallel.shard_with``): read and keep only that rank's shard
    (``dsv4_ops.parallel.load_pretrained``).
    """
    from transformers import DeepseekV4Config

    path = os.fspath(path)
    hf_config = DeepseekV4Config.from_pretrained(path)
    cfg = DSV4Config.from_hf(hf_config)
    q = QuantConfig.from_hf(hf_config)
    if dtype is None:
        dtype = getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    device = torch.device(device or "cpu")
    if tp is not None:
        tp.check(cfg)
    model = DeepseekV4ForCausalLM(cfg, dtype=dtype, device="meta", max_positions=max_positions)
    want = model.state_dict()
    experts = None if tp is None else tp.expert_range(cfg.n_routed_experts)
    pieces = _plan(_catalogue(path), want, q, len(model.mtp), experts)
    found = {p.target for p in pieces}
    if cfg.tie_word_embeddings and "lm_head.weight" not in found and "model.embed_tokens.weight" in found:
        found.add("lm_head.weight")  # tied: saved once, shared below
    _check_missing("load_pretrained", [k for k in want if k not in found], want)  # no MTP weights: a fresh block
    if tp is not None:
        want = shard(model).state_dict()  # on meta: the rank's shapes, nothing allocated
    tensors = _stream(path, pieces, want, device, q, cfg.n_routed_experts, tp)
    if "lm_head.weight" not in tensors and cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    check_load("load_pretrained", model, model.load_state_dict(tensors, strict=False, assign=True))
    if tp is None:
        return finish_meta_model(model, device).eval()
    # a fresh MTP block (the checkpoint has none) must be the same model on every rank before
    # it is sliced: draw it from one seed, then shard it like the rest
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        finish_meta_model(model, device)
    return shard(model).eval()
