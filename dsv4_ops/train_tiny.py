"""Train a small DeepSeek-V4 on offline text: ``python -m dsv4_ops.train_tiny --out DIR``.

What it trains is the whole V4 recipe at a small width: sliding, CSA (with its lightning
indexer) and HCA attention, hash-routed and learned-routed MoE, mHC, and the MTP block with its
own loss (DeepSeek-V3/V4: ``loss = CE(main, t+1) + mtp_weight * CE(mtp, t+2)``), on the source
of this Python's standard library with a byte-level BPE tokenizer it trains first. Files are
split once by a hash of their path: held-out files are never trained on, not even by the
tokenizer.

The dsv4 ops are inference kernels without a backward, so the differentiable forward is HF
transformers' own ``DeepseekV4ForCausalLM`` (eager, same parameter names; the parity tests hold
our model's logits to it) plus the plain-math MTP block of ``reference/mtp_oracle.py`` (tested
against our MTP block), reading the main model's final streams at ``hc_head``'s input. What is
trained is therefore what both models compute at inference, top-k selections included. The
parts no gradient reaches are trained as DeepSeek trains them:

* the lightning indexer (its top-k is discrete): a KL loss between its scores and the main
  attention's head-summed probabilities over the compressed entries (DeepSeek-V3.2), on
  detached inputs, with all entries visible during a dense warm-up, then over the entries it
  selected;
* the learned routers' ``e_score_correction_bias``: auxiliary-loss-free balancing, each step
  ``bias += gamma * sign(mean load - load)`` (DeepSeek-V3). The MTP block's router keeps a
  zero bias (the oracle does not expose its picks);
* hash routing ``tid2eid``: a fixed table, ``num_experts_per_tok`` distinct experts per token.

Determinism: one seed draws the init, the data order and the hash table; CPU kernels are
deterministic for a fixed thread count, so the same seed, ``--threads`` and machine give the
same checkpoint bytes. On CUDA, scatter / index_add backward kernels are not bit-reproducible.

The checkpoint: ``config.json`` (transformers ``DeepseekV4Config``), ``model.safetensors`` (HF
names + ``mtp.0.*``), ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``,
``training.json`` (command, seed, steps, commit, machine, time, held-out numbers).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import CSA, HCA, SLIDING, DSV4Config

__all__ = ["PRESETS", "SPECIAL_TOKENS", "corpus_files", "read_texts", "train_tokenizer", "encode_texts",
           "unigram_log_probs", "build_models", "train", "main"]

# BOS / EOS / pad first (ids 0, 1, 2 as in DeepSeek's tokenizer), then the DeepSeek-V4 chat
# tokens (serving_design.md §5), so a chat format can be built on this vocabulary later.
SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<think>", "</think>"]
BOS, EOS, PAD = 0, 1, 2

# Directories that are not ordinary source (tests with odd data, generated tables, machine
# specifics); a file is held out when crc32 of its path relative to the stdlib root is 0 mod 20.
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
             "__pycache__", "lib-dynload"}
HELDOUT_EVERY = 20


def _model(vocab: int, hidden: int, **kw) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, **kw)


PRESETS = {
    # CPU, ~30 min on one core: one layer of each attention kind (3 layers compile fastest for the
    # demo), a hash-routed MoE layer then learned-routed ones
    "tiny": dict(
        model=_model(
            2048, 128, num_hidden_layers=3, layer_types=[SLIDING, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
            max_position_embeddings=4096,
            num_attention_heads=4, head_dim=80, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64,
            sliding_window=64, csa_ratio=4, hca_ratio=16, index_n_heads=8, index_head_dim=32, index_topk=16,
            yarn_original_max_position_embeddings=256, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=96, num_nextn_predict_layers=1),
        seq_len=256, batch=8, steps=1500, lr=3e-3, eval_tokens=65536),
    # one H200 in bf16, run with --time-limit 4.5 (minutes; the step count is then only a cap):
    # V4-Flash ratios (window 128, CSA m=4 + indexer, HCA m=128, two sliding hash-MoE layers
    # first), 64 experts top-6, MTP
    "gpu": dict(
        model=_model(
            8192, 512, num_hidden_layers=8, layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA, CSA, HCA],
            mlp_layer_types=["hash_moe", "hash_moe"] + ["moe"] * 6, max_position_embeddings=65536,
            num_attention_heads=8, head_dim=128, rope_head_dim=64, q_lora_rank=256, o_groups=4, o_lora_rank=256,
            sliding_window=128, csa_ratio=4, hca_ratio=128, index_n_heads=16, index_head_dim=64, index_topk=64,
            yarn_original_max_position_embeddings=4096, n_routed_experts=64, num_experts_per_tok=6,
            moe_intermediate_size=256, num_nextn_predict_layers=1),
        seq_len=1024, batch=16, steps=3000, lr=2e-3, eval_tokens=262144),
    # seconds on a CPU: the determinism test's
    "micro": dict(
        model=_model(
            320, 32, num_hidden_layers=3, layer_types=[SLIDING, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
            max_position_embeddings=4096, num_attention_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=16,
            o_groups=1, o_lora_rank=16, sliding_window=16, csa_ratio=4, hca_ratio=8, index_n_heads=4,
            index_head_dim=16, index_topk=4, yarn_original_max_position_embeddings=256, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, num_nextn_predict_layers=1),
        seq_len=64, batch=2, steps=3, lr=3e-3, eval_tokens=256, max_files=8),
}
MTP_WEIGHT = 0.3  # lambda of the MTP loss (DeepSeek-V3 uses 0.3 for most of its training)
BIAS_GAMMA = 1e-3  # aux-loss-free balancing step (DeepSeek-V3)
DENSE_WARMUP = 0.1  # fraction of steps with every compressed entry visible (indexer warm-up)


# ----------------------------------------------------------------------------- corpus
def corpus_files(root: str | os.PathLike | None = None) -> tuple[list[Path], list[Path]]:
    """``(train, heldout)``: the ``.py`` files of the standard library at ``root`` (default this
    Python's), sorted by path, split by ``crc32(relative path) % HELDOUT_EVERY == 0`` (held out)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in SKIP_DIRS or p.startswith("config-") for p in rel.parts[:-1]) or rel.name.startswith("_sysconfig"):
            continue
        (heldout if zlib.crc32(rel.as_posix().encode()) % HELDOUT_EVERY == 0 else train).append(path)
    return train, heldout


def read_texts(paths: list[Path]) -> list[str]:
    """File contents (UTF-8; files that are not are skipped), one string per file."""
    out = []
    for p in paths:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenisation, no normaliser: decode(encode(s)) == s for any s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_texts(tok, texts: list[str]) -> Tensor:
    """One token stream: ``BOS text EOS`` per file, concatenated (int64 ``[N]``)."""
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += [BOS, *enc.ids, EOS]
    return torch.tensor(ids, dtype=torch.long)


def unigram_log_probs(train_ids: Tensor, vocab_size: int) -> Tensor:
    """Add-one smoothed unigram log-probabilities from the training token counts, ``[vocab]``."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1
    return (counts / counts.sum()).log()


# ----------------------------------------------------------------------------- models
@torch.no_grad()
def init_weights_(model, seed: int) -> None:
    """GPT-style init of a dsv4_ops model in place, drawn from ``seed`` in parameter-name order:
    matrices N(0, 0.02), norm gains and mHC scales 1, biases / sinks / position biases 0; the
    hash table gets distinct experts per token, the routers' balancing biases start at 0."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        elif name.endswith("norm.weight") or leaf in ("scale", "hc_scale"):
            p.fill_(1.0)
        else:
            p.zero_()
    for name, b in sorted(model.named_buffers()):
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], model.config.n_routed_experts, generator=g).argsort(-1)[:, :b.shape[1]])
        elif name.endswith("e_score_correction_bias"):
            b.zero_()


def build_models(cfg: DSV4Config, seed: int, device):
    """``(hf, ours)``: ours (a ``dsv4_ops.DeepseekV4ForCausalLM``) initialised by
    :func:`init_weights_`; HF's eager ``DeepseekV4ForCausalLM`` loaded from it (the trained
    forward). Ours keeps the trained MTP block (HF has none); the rest is copied back at the end."""
    from transformers import DeepseekV4ForCausalLM as HFModel

    from .model.model import DeepseekV4ForCausalLM

    torch.manual_seed(seed)  # HF's own init draws from the global generator before we overwrite it
    ours = DeepseekV4ForCausalLM(cfg, max_positions=cfg.max_position_embeddings)
    init_weights_(ours, seed)
    hcfg = cfg.to_hf(attn_implementation="eager", bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    hcfg._experts_implementation = "eager"
    hf = HFModel(hcfg)
    result = hf.load_state_dict(ours.state_dict(), strict=False)
    if result.missing_keys or any(not k.startswith("mtp.") for k in result.unexpected_keys):
        raise RuntimeError(f"train_tiny: HF and dsv4_ops state dicts differ: {result}")
    return hf.to(device).train(), ours.to(device)


class _Hooks:
    """What the losses read off HF's forward: the final streams (``hc_head``'s input), each CSA
    layer's indexer scores, picks and attention probabilities, each learned router's picks."""

    def __init__(self, hf) -> None:
        self.streams, self.csa, self.loads = None, {}, {}
        self.handles = [hf.model.hc_head.register_forward_pre_hook(lambda m, a: setattr(self, "streams", a[0]))]
        self.indexers = []  # (indexer, its configured top-k)
        for i, layer in enumerate(hf.model.layers):
            attn = layer.self_attn
            if attn.layer_type == CSA:
                idx = attn.compressor.indexer
                self.indexers.append((idx, idx.index_topk))
                rec = self.csa.setdefault(i, {})
                self.handles += [
                    # the indexer loss trains the indexer only (DeepSeek-V3.2 detaches its inputs)
                    idx.register_forward_pre_hook(lambda m, a: (a[0].detach(), a[1].detach(), *a[2:])),
                    idx.scorer.register_forward_hook(lambda m, a, out, rec=rec: rec.__setitem__("scores", out)),
                    idx.register_forward_hook(lambda m, a, out, rec=rec: rec.__setitem__("picks", out)),
                    attn.register_forward_hook(lambda m, a, out, rec=rec: rec.__setitem__("probs", out[1])),
                ]
            gate = layer.mlp.gate
            if hasattr(gate, "e_score_correction_bias"):
                self.handles.append(gate.register_forward_hook(
                    lambda m, a, out, i=i: self.loads.__setitem__(i, out[2])))

    def dense(self, on: bool) -> None:
        """Dense warm-up: every causal compressed entry selected (top-k wider than any row)."""
        for idx, topk in self.indexers:
            idx.index_topk = 1 << 30 if on else topk

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def indexer_loss(rec: dict, S: int) -> Tensor:
    """KL(attention || softmax(indexer scores)) over the entries the indexer selected, averaged
    over queries that see one: the attention's probabilities of the compressed entries summed
    over heads and renormalised (the target, no gradient)."""
    scores, picks, probs = rec["scores"], rec["picks"], rec["probs"]  # [B,S,T], [B,S,k], [B,H,S,S+T]
    T = scores.shape[-1]
    sel = torch.zeros(*scores.shape[:2], T + 1, dtype=torch.bool, device=scores.device)
    sel.scatter_(-1, torch.where(picks >= 0, picks, T), True)
    sel = sel[..., :T]
    target = probs[..., S:].detach().float().sum(1) * sel
    mass = target.sum(-1, keepdim=True)
    rows = (mass[..., 0] > 0) & sel.any(-1)
    target = target / mass.clamp_min(1e-30)
    logp = scores.float().masked_fill(~sel, float("-inf")).log_softmax(-1)
    kl = (target * (target.clamp_min(1e-30).log() - logp)).masked_fill(~sel, 0).sum(-1)
    return kl[rows].mean() if bool(rows.any()) else scores.sum() * 0


def _mtp_weights(hf, ours) -> dict[str, Tensor]:
    """The oracle's weight dict: our MTP block's own parameters (trained in place) and HF's
    embedding and head (shared with the main model, as in DeepSeek-V3/V4)."""
    blk = ours.mtp[0]
    w = dict(blk.named_parameters())
    w.update((n, b) for n, b in blk.named_buffers() if n.endswith("_bias"))
    w.update(embed=hf.model.embed_tokens.weight, head=hf.lm_head.weight)
    return w


def _losses(hf, hooks: _Hooks, w: dict, cfg: DSV4Config, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(main CE of t+1, MTP CE of t+2, mean indexer KL) of one batch ``ids [B, S]``."""
    from .reference.mtp_oracle import mtp_forward

    S = ids.shape[1]
    logits = hf(input_ids=ids, use_cache=False).logits
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    # position t: the main model's streams at t with token t+1 -> token t+2 (t = 0 .. S-3)
    draft = mtp_forward(w, cfg, hooks.streams[:, : S - 2], ids[:, 1: S - 1]).logits
    mtp = F.cross_entropy(draft.flatten(0, 1).float(), ids[:, 2:].flatten())
    idx = [indexer_loss(rec, S) for rec in hooks.csa.values()]
    return main, mtp, (sum(idx) / len(idx) if idx else main.detach() * 0)


@torch.no_grad()
def _balance_routers(hf, hooks: _Hooks, n_experts: int) -> None:
    for i, picks in hooks.loads.items():
        load = torch.bincount(picks.flatten(), minlength=n_experts).float()
        hf.model.layers[i].mlp.gate.e_score_correction_bias.add_(BIAS_GAMMA * torch.sign(load.mean() - load))


@torch.no_grad()
def evaluate(model, stream: Tensor, seq_len: int, batch: int, max_tokens: int, unigram: Tensor) -> dict:
    """Held-out numbers of a dsv4_ops model over non-overlapping ``seq_len`` windows of ``stream``
    (at most ``max_tokens``): perplexity of the main model and of the unigram baseline on the same
    targets, the MTP block's top-1 accuracy for t+2 and its agreement with the main model's own
    greedy t+2 (what speculative decoding accepts)."""
    from .reference.mtp_oracle import mtp_forward, mtp_weights
    from .streams import main_streams

    n = min(len(stream) // seq_len, max(1, max_tokens // seq_len))
    windows = stream[: n * seq_len].view(n, seq_len).to(model.device)
    w = mtp_weights(model, dtype=None) if len(model.mtp) else None
    nll = uni = hits = agree = count = mcount = 0.0
    for i in range(0, n, batch):
        ids = windows[i:i + batch]
        streams = main_streams(model, ids)
        logits = model.logits(streams)
        tgt = ids[:, 1:]
        nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), tgt.flatten(), reduction="sum"))
        uni -= float(unigram.to(ids.device)[tgt].sum())
        count += tgt.numel()
        if w is not None:
            draft = mtp_forward(w, model.config, streams[:, : seq_len - 2], ids[:, 1: seq_len - 1]).logits.argmax(-1)
            hits += float((draft == ids[:, 2:]).sum())
            agree += float((draft == logits[:, 1:-1].argmax(-1)).sum())
            mcount += draft.numel()
    return dict(heldout_tokens=int(count), heldout_ppl=math.exp(nll / count), unigram_ppl=math.exp(uni / count),
                mtp_top1_t2=hits / max(mcount, 1), mtp_agrees_with_main=agree / max(mcount, 1))


def _lr_at(progress: float, lr: float) -> float:
    """Linear warm-up over the first 5% of training, then cosine decay to 10% of the peak."""
    if progress < 0.05:
        return lr * max(progress, 1e-3) / 0.05
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (progress - 0.05) / 0.95)))


def train(hf, ours, cfg: DSV4Config, stream: Tensor, *, steps: int, batch: int, seq_len: int, lr: float, seed: int,
          autocast_dtype: torch.dtype | None = None, time_limit_s: float | None = None, log=print) -> dict:
    """Train ``hf`` (main model) and ``ours.mtp`` in place on random windows of ``stream``.

    Progress through the schedules (learning rate, the indexer's dense warm-up) is
    ``step / steps``, or with ``time_limit_s`` the larger of that and the elapsed fraction of
    the limit: a time-limited run still warms up, anneals and stops on time (but how many
    steps it takes then depends on the machine)."""
    dev = next(hf.parameters()).device
    hooks = _Hooks(hf)
    w = _mtp_weights(hf, ours)
    params = [p for p in [*hf.parameters(), *ours.mtp.parameters()] if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(seed + 1)
    history, seen, step, progress, next_log = [], 0, 0, 0.0, 0.0  # a log line per 1/40 of the run
    torch.set_flush_denormal(True)  # tiny Adam moments and softmax tails would otherwise go subnormal (slow on CPUs)
    t0 = time.perf_counter()
    try:
        while progress < 1.0:
            hooks.dense(progress < DENSE_WARMUP)
            starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=g)
            ids = torch.stack([stream[s: s + seq_len] for s in starts.tolist()]).to(dev)
            for group in opt.param_groups:
                group["lr"] = _lr_at(progress, lr)
            with torch.autocast(dev.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                main, mtp, idx = _losses(hf, hooks, w, cfg, ids)
            opt.zero_grad(set_to_none=True)
            (main + MTP_WEIGHT * mtp + idx).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            _balance_routers(hf, hooks, cfg.n_routed_experts)
            step, seen = step + 1, seen + ids.numel()
            elapsed = time.perf_counter() - t0
            progress = step / steps if time_limit_s is None else max(step / steps, elapsed / time_limit_s)
            if progress >= next_log or progress >= 1.0:
                next_log = (math.floor(progress * 40) + 1) / 40
                row = dict(step=step, loss=main.item(), mtp_loss=mtp.item(), indexer_kl=idx.item(),
                           tokens_per_s=seen / elapsed, elapsed_s=elapsed)
                history.append(row)
                log(f"step {step:5d}/{steps}  loss {row['loss']:.3f}  mtp {row['mtp_loss']:.3f}  "
                    f"indexer KL {row['indexer_kl']:.3f}  {row['tokens_per_s']:.0f} tok/s  {elapsed:.0f} s", flush=True)
    finally:
        torch.set_flush_denormal(False)  # torch's default
        hooks.dense(False)
        hooks.remove()
    return dict(steps_done=step, train_s=time.perf_counter() - t0, train_tokens_seen=seen, history=history)


# ----------------------------------------------------------------------------- the checkpoint
def save_checkpoint(out: Path, hf, ours, tok, cfg: DSV4Config) -> None:
    """Write the checkpoint directory; ``ours`` gets HF's trained main weights first. Tensors
    are stored as a bf16 model holds them (projections, embeddings and experts bf16; norms,
    mHC, sinks, biases fp32): half the bytes, and ``config.json`` says float32, so both
    loaders build an fp32 model from them. The held-out numbers are of the stored weights."""
    from safetensors.torch import save_file

    from .model.model import DeepseekV4ForCausalLM

    storage = DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16, device="meta").state_dict()
    out.mkdir(parents=True, exist_ok=True)
    ours.load_state_dict(hf.state_dict(), strict=False)
    tensors = {k: v.detach().to("cpu", storage[k].dtype).contiguous() for k, v in sorted(ours.state_dict().items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hcfg = cfg.to_hf(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, architectures=["DeepseekV4ForCausalLM"])
    hcfg.dtype = torch.float32
    hcfg.save_pretrained(str(out))
    tok.save(str(out / "tokenizer.json"))
    names = dict(bos_token=SPECIAL_TOKENS[BOS], eos_token=SPECIAL_TOKENS[EOS], pad_token=SPECIAL_TOKENS[PAD])
    _write_json(out / "tokenizer_config.json", dict(tokenizer_class="PreTrainedTokenizerFast", **names,
                                                     model_max_length=cfg.max_position_embeddings,
                                                     clean_up_tokenization_spaces=False))
    _write_json(out / "generation_config.json", dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD))


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "dsv4_ops"], cwd=root, capture_output=True,
                               text=True).stdout.strip()
        return sha.stdout.strip() + (" (+ uncommitted changes in dsv4_ops/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine(device: torch.device) -> str:
    what = f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".replace("  ", " ")
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device) + ", " + what
    return f"{what}; {platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}"


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_ops.train_tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="autocast dtype of the training forward (default: bf16 on CUDA, fp32 elsewhere)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens to evaluate")
    p.add_argument("--time-limit", type=float, default=None,
                   help="minutes: the schedules then run on the clock, so training anneals and ends in time")
    p.add_argument("--corpus", default=None, help="a standard-library directory (default: this Python's)")
    p.add_argument("--max-files", type=int, default=None, help="train on the first N training files only")
    args = p.parse_args(argv)

    t_start, commit = time.perf_counter(), _commit()  # before anything is written (--out may be in the repo)
    preset = PRESETS[args.preset]
    steps, batch = args.steps or preset["steps"], args.batch or preset["batch"]
    seq_len, lr = args.seq_len or preset["seq_len"], args.lr or preset["lr"]
    eval_tokens = args.eval_tokens or preset["eval_tokens"]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = DSV4Config(**preset["model"])

    train_files, heldout_files = corpus_files(args.corpus)
    max_files = args.max_files or preset.get("max_files")
    if max_files:
        train_files, heldout_files = train_files[:max_files], heldout_files[:max(1, max_files // 8)]
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    print(f"corpus: {len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
          f"{len(heldout_texts)} held-out files, from {args.corpus or sysconfig.get_paths()['stdlib']}", flush=True)
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    train_ids, heldout_ids = encode_texts(tok, train_texts), encode_texts(tok, heldout_texts)
    print(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens; {len(train_ids) / 1e6:.2f} M training tokens, "
          f"{len(heldout_ids) / 1e6:.2f} M held-out", flush=True)

    hf, ours = build_models(cfg, args.seed, device)
    n_params = sum(t.numel() for t in ours.state_dict().values())
    print(f"model: {n_params / 1e6:.2f} M parameters ({cfg.num_hidden_layers} layers: {', '.join(cfg.layer_types)}; "
          f"MoE {', '.join(cfg.mlp_layer_types)}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}; "
          f"MTP), {steps} steps of {batch} x {seq_len} tokens on {device} ({dtype})", flush=True)
    stats = train(hf, ours, cfg, train_ids, steps=steps, batch=batch, seq_len=seq_len, lr=lr, seed=args.seed,
                  autocast_dtype=torch.bfloat16 if dtype == "bf16" else None,
                  time_limit_s=args.time_limit * 60 if args.time_limit else None)

    out = Path(args.out)
    save_checkpoint(out, hf, ours, tok, cfg)
    del hf
    from .checkpoint import load_checkpoint

    model = load_checkpoint(out, device=device)  # evaluate exactly what was written
    unigram = unigram_log_probs(train_ids, cfg.vocab_size)
    ev = evaluate(model, heldout_ids, seq_len, batch, eval_tokens, unigram)
    print(f"held-out ({ev['heldout_tokens']} tokens): perplexity {ev['heldout_ppl']:.2f}, unigram baseline "
          f"{ev['unigram_ppl']:.2f}; MTP top-1 accuracy for t+2 {ev['mtp_top1_t2']:.3f} (agrees with the main "
          f"model's greedy t+2: {ev['mtp_agrees_with_main']:.3f})", flush=True)
    info = dict(
        command="python -m dsv4_ops.train_tiny " + " ".join(argv if argv is not None else sys.argv[1:]),
        preset=args.preset, seed=args.seed, steps=steps, batch=batch, seq_len=seq_len, lr=lr, device=str(device),
        dtype=dtype, threads=torch.get_num_threads(), commit=commit, machine=_machine(device),
        corpus=dict(root=str(args.corpus or sysconfig.get_paths()["stdlib"]), train_files=len(train_texts),
                    heldout_files=len(heldout_texts), train_tokens=len(train_ids), heldout_tokens=len(heldout_ids),
                    split=f"crc32(path relative to the root) % {HELDOUT_EVERY} == 0 is held out"),
        parameters=n_params, mtp_weight=MTP_WEIGHT, **{k: v for k, v in stats.items() if k != "history"},
        total_s=time.perf_counter() - t_start, heldout=ev, history=stats["history"])
    _write_json(out / "training.json", info)
    print(f"wrote {out} in {info['total_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
