"""Distil the MTP drafter into agreement with its own main model (issue #14).

A speculative step accepts a draft only when it equals the main model's greedy token, so the
drafter's best target is the main model itself. ``distill_mtp`` generates greedy continuations
with the main model (the plain ``Generator``), reads the main model's final streams at every
position (``main_streams``, cache-free), and trains ONLY the MTP block to predict token ``t+2``
from ``(streams at t, token t+1)`` with cross-entropy on the generated tokens — plus, with
``recursive > 0``, the first recursive draft (its own output streams at ``t-1`` with token
``t+1``, attending main entries before ``t``), which is what draft steps 2..k run on.

The dsv4 ops are inference kernels without a backward, so the training forward is the
plain-math block of ``reference/mtp_oracle.py`` — the same math that tests/model/test_mtp_oracle.py
checks against the op-based block at every drafted position. Everything outside ``mtp.0.`` is
frozen (no grad, never written), including the shared embedding and ``lm_head``.

Precision: trainable weights get fp32 master copies and fp32 AdamW states; each forward casts
them to the parameter's dtype, and every matrix product runs in the parameter's dtype (bf16 for
a bf16 model) with norms, mHC, softmaxes and the loss in fp32. Frozen weights are used as
stored (never copied to fp32), so ``params="attn+proj"`` on a bf16 model with 256 experts adds
no memory for the ~13 GB of routed-expert weights. At the end the masters are rounded into the
model's parameters in place.
"""
from __future__ import annotations

import io
import math
import sys
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .progress import Progress
from .reference.mtp_oracle import MTP_PREFIX, mtp_forward, mtp_weights
from .streams import main_streams

__all__ = ["distill_mtp", "greedy_sequences", "init_from_last_layer", "PARAM_SETS"]

# which MTP parameters to train (names without "mtp.0."); the rest of the block stays frozen
PARAM_SETS: dict[str, Callable[[str], bool]] = {
    "all": lambda name: True,
    # everything but the routed experts (attention, e/h projections, norms, mHC, router, shared expert)
    "attn+proj": lambda name: not name.startswith("mlp.experts."),
}


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], gen: torch.Generator) -> list[list[int]]:
    lo, hi = lengths
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lens]


@torch.no_grad()
def greedy_sequences(model, prompts: Sequence[Sequence[int]], seq_len: int, batch: int) -> tuple[Tensor, Tensor]:
    """Each prompt continued greedily by the main model to ``seq_len`` tokens -> (ids
    ``[n, seq_len]`` on the model's device, prompt lengths ``[n]``)."""
    from .generator import Generator  # the generator imports the model; keep this module light

    longest = max(len(p) for p in prompts)
    if longest >= seq_len - 2:
        raise ValueError(f"distill_mtp: prompts of up to {longest} tokens leave no continuation in seq_len {seq_len}")
    gen = Generator(model, max_batch_size=batch, max_seq_len=seq_len + longest, compile=False)
    rows = []
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i:i + batch]]
        new = gen.generate(chunk, max_new_tokens=seq_len - min(len(p) for p in chunk))
        rows += [(p + o)[:seq_len] for p, o in zip(chunk, new)]
    model.clear_caches()  # the pool was only for generating; a later Generator allocates its own
    ids = torch.tensor(rows, dtype=torch.long, device=model.device)
    return ids, torch.tensor([len(p) for p in prompts], device=model.device)


@torch.no_grad()
def init_from_last_layer(model) -> None:
    """Start the MTP block as "the main model's last layer, run one position later": its decoder
    layer (attention projections, norms, sinks, MoE, mHC) copied from the main model's last
    layer where names and shapes match (a compressor or hash table has no counterpart), its
    ``hc_head`` / ``norm`` from the main model's, ``h_proj = 0`` and ``e_proj`` scaling the
    normed embedding back to the embedding's size. At position ``t`` the block then sees token
    ``t+1`` through the layer the main model applies to it — exact when the main model is that
    one sliding layer, otherwise only a starting point."""
    blk, main = model.mtp[0], model.model
    src = dict(main.layers[-1].named_parameters()) | dict(main.layers[-1].named_buffers())
    for name, t in [*blk.named_parameters(), *blk.named_buffers()]:
        if name in src and src[name].shape == t.shape and name.split(".")[-1] not in ("cos", "sin"):
            t.copy_(src[name])
    for mine, theirs in ((blk.hc_head, main.hc_head), (blk.norm, main.norm)):
        for (_, t), (_, u) in zip(mine.named_parameters(), theirs.named_parameters()):
            t.copy_(u)
    emb = main.embed_tokens.weight.float()
    blk.enorm.weight.fill_(1.0)
    blk.hnorm.weight.fill_(1.0)
    blk.h_proj.weight.zero_()
    eye = torch.eye(emb.shape[1], device=emb.device)
    blk.e_proj.weight.copy_(eye * emb.pow(2).mean(-1).sqrt().mean())


def _trainable(model, params) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(frozen weights by oracle name, fp32 masters of the trained ones)."""
    select = PARAM_SETS[params] if isinstance(params, str) else params
    weights = mtp_weights(model, dtype=None)
    own = {n[len(MTP_PREFIX):]: p for n, p in model.named_parameters() if n.startswith(MTP_PREFIX)}
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in own.items() if select(n)}
    if not masters:
        raise ValueError("distill_mtp: no MTP parameter selected for training")
    return weights, masters


def _xent(logits: Tensor, target: Tensor, teacher: Tensor | None) -> Tensor:
    """Cross-entropy against the main model's greedy tokens (``teacher`` None) or against its
    whole next-token distribution (soft targets: the same optimum, a far richer signal, and no
    push towards over-confident logits that would overfit a small data pool)."""
    if teacher is None:
        return F.cross_entropy(logits, target)
    return -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def _losses(weights, masters, cfg, ids, streams, prompt_lens, recursive: float, model=None):
    """(total loss, first-draft loss, first-draft accuracy, recursive accuracy) for one batch;
    ``model`` given: soft targets from its logits at ``t+1``."""
    w = dict(weights)
    w.update((n, m.to(weights[n].dtype)) for n, m in masters.items())
    S = ids.shape[1]
    act = torch.promote_types(streams.dtype, torch.float32)
    X = streams[:, : S - 1].to(act)  # positions 0..S-2 pair with tokens 1..S-1
    nxt = ids[:, 1:]
    tgt = ids[:, 2:]  # what position t (0..S-3) predicts
    keep = torch.arange(2, S, device=ids.device)[None] >= prompt_lens[:, None]  # generated targets only
    teacher = None
    if model is not None:
        with torch.no_grad():
            teacher = model.logits(streams[:, 1: S - 1]).float()  # the main model at t+1 predicts t+2
    out = mtp_forward(w, cfg, X, nxt)
    logits = out.logits[:, : S - 2].float()
    loss1 = _xent(logits[keep], tgt[keep], None if teacher is None else teacher[keep])
    acc1 = (logits.argmax(-1) == tgt)[keep].float().mean()
    loss, acc2 = loss1, torch.tensor(float("nan"))
    if recursive > 0:
        # position t (>= 1) re-run with the block's own output at t-1 in place of the main streams
        X2 = torch.cat([out.streams[:, :1], out.streams[:, :-1]], dim=1)
        rec = mtp_forward(w, cfg, X2, nxt, past_kv=out.kv).logits[:, 1: S - 2].float()
        keep2 = keep[:, 1:]
        soft = None if teacher is None else teacher[:, 1:][keep2]
        loss = loss + recursive * _xent(rec[keep2], tgt[:, 1:][keep2], soft)
        acc2 = (rec.argmax(-1) == tgt[:, 1:])[keep2].float().mean()
    return loss, loss1, acc1, acc2


def distill_mtp(model, steps: int = 300, batch: int = 8, seq_len: int = 64, lr: float = 3e-4, seed: int = 0,
                progress: bool = True, *, prompts: Sequence[Sequence[int]] | None = None,
                n_sequences: int | None = None,
                prompt_lengths: tuple[int, int] = (4, 24), params="all", recursive: float = 0.5,
                weight_decay: float = 0.0, log_every: int | None = None,
                data: tuple[Tensor, Tensor] | None = None, init: str | None = None, loss: str = "soft") -> dict:
    """Train the MTP block of ``model`` (in place) to draft the main model's greedy tokens.

    Args:
        model: a ``DeepseekV4ForCausalLM`` with an MTP block, on any device and dtype.
        steps: optimizer steps; batch: sequences per step; seq_len: tokens per sequence.
        lr: AdamW peak learning rate (linear warm-up over 5% of the steps, cosine decay to 10%).
        seed: prompts, data order.
        progress: print what runs (data generation, training) with the loss now and then.
        prompts: token-id lists to continue (default: ``n_sequences`` random prompts with
            lengths in ``prompt_lengths`` — right for random-weight models; give real text for a
            real checkpoint). Loss is taken on the greedy continuation only.
        n_sequences: size of the generated data pool (default ``4 * batch``, at least ``batch``).
        params: ``"all"`` MTP parameters, ``"attn+proj"`` (all but the routed experts, which stay
            frozen and get no optimizer state), or a callable ``name -> bool`` on names without
            ``mtp.0.``.
        recursive: weight of the first recursive draft position's loss (0 = off).
        data: ``(ids [n, seq_len], prompt_lens [n])`` already generated (``greedy_sequences``);
            skips generating (``prompts``, ``n_sequences`` and ``seq_len`` are then ignored).
        loss: ``"soft"`` cross-entropy against the main model's next-token distribution at ``t+1``
            (default), ``"hard"`` against its greedy token.
        init: ``"last_layer"`` starts the block from the main model's last layer
            (:func:`init_from_last_layer`); None trains the block's current weights.

    Returns a dict: ``steps``, ``trained_params`` (count), ``trained_names``, ``loss`` (per step),
    ``first_loss``/``final_loss`` (mean of the first / last 10 steps), ``draft_accuracy`` /
    ``recursive_accuracy`` (top-1 agreement with the main model's greedy token on the training
    pool at the end), ``data_s`` / ``train_s`` seconds.
    """
    if len(model.mtp) == 0:
        raise ValueError("distill_mtp: the model has no MTP block (config.num_nextn_predict_layers = 0)")
    if isinstance(params, str) and params not in PARAM_SETS or not (isinstance(params, str) or callable(params)):
        raise ValueError(f"distill_mtp: params must be one of {tuple(PARAM_SETS)} or a callable, got {params!r}")
    if loss not in ("soft", "hard"):
        raise ValueError(f"distill_mtp: loss must be 'soft' or 'hard', got {loss!r}")
    if init not in (None, "last_layer"):
        raise ValueError(f"distill_mtp: init must be None or 'last_layer', got {init!r}")
    cfg, dev = model.config, model.device
    g = torch.Generator().manual_seed(seed)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    quiet = None if progress else io.StringIO()  # Progress prints to stderr unless silenced

    t0 = time.perf_counter()
    if data is None and prompts is None:
        prompts = random_prompts(n_sequences or 4 * batch, cfg.vocab_size, prompt_lengths, g)
    n = len(prompts) if data is None else len(data[0])
    with Progress(f"distill_mtp: greedy data and main streams ({n} x {seq_len} tokens)", stream=quiet):
        ids, plens = greedy_sequences(model, prompts, seq_len, batch) if data is None else data
        ids, plens = ids.to(dev), plens.to(dev)
        streams = torch.cat([main_streams(model, ids[i:i + batch]) for i in range(0, len(ids), batch)])
    data_s = time.perf_counter() - t0

    if init == "last_layer":
        init_from_last_layer(model)
    weights, masters = _trainable(model, params)
    opt = torch.optim.AdamW(masters.values(), lr=lr, weight_decay=weight_decay)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))))
    n_trained = sum(m.numel() for m in masters.values())
    log_every = log_every or max(1, steps // 10)
    losses = []
    t1 = time.perf_counter()
    with Progress(f"distill_mtp: {steps} steps on {n_trained / 1e6:.2f}M MTP parameters", stream=quiet):
        for step in range(steps):
            pick = torch.randint(0, len(ids), (batch,), generator=g).to(dev)
            loss_, loss1, acc1, acc2 = _losses(weights, masters, cfg, ids[pick], streams[pick], plens[pick], recursive,
                                              model if loss == "soft" else None)
            opt.zero_grad(set_to_none=True)
            loss_.backward()
            torch.nn.utils.clip_grad_norm_(masters.values(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss_.detach()))
            if (step + 1) % log_every == 0 or step == 0:
                say(f"    step {step + 1}/{steps}: loss {losses[-1]:.3f} (draft 1: {float(loss1.detach()):.3f}), "
                    f"batch accuracy draft 1 {float(acc1):.2f}, recursive {float(acc2):.2f}")
    train_s = time.perf_counter() - t1

    with torch.no_grad():
        own = dict(model.named_parameters())
        for n, m in masters.items():
            own[MTP_PREFIX + n].copy_(m.to(own[MTP_PREFIX + n].dtype))
        accs = [_losses(mtp_weights(model, dtype=None), {}, cfg, ids[i:i + batch], streams[i:i + batch],
                        plens[i:i + batch], 1.0)[2:] for i in range(0, len(ids), batch)]
    return dict(steps=steps, trained_params=n_trained, trained_names=sorted(masters), loss=losses,
                first_loss=_mean(losses[:10]), final_loss=_mean(losses[-10:]),
                draft_accuracy=sum(float(a) for a, _ in accs) / len(accs),
                recursive_accuracy=sum(float(b) for _, b in accs) / len(accs), data_s=data_s, train_s=train_s)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
