"""What the bundled trained tiny model (``dsv4_ops.pretrained.tiny()``) shows on held-out text:
MTP acceptance for k = 1..4 drafts (and that the greedy tokens never change), the FP8 cache
against the float cache (perplexity, teacher-forced argmax agreement, and how much of a greedy
continuation changes), and routing locality (how many routed experts consecutive tokens share,
trained vs the same model at its initialisation).

    python benchmarks/trained_tiny_quality.py [--model DIR] [--threads 1] [--device cuda]

CPU is fine for the bundled model (a few minutes on one core); the GPU-trained one wants
``--device cuda``. Numbers are quality, not speed; the model runs in fp32 throughout.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv4_ops  # noqa: E402
from dsv4_ops import Generator, pretrained, train_tiny  # noqa: E402


def heldout_stream(tok) -> torch.Tensor:
    return train_tiny.encode_texts(tok, train_tiny.read_texts(train_tiny.corpus_files()[1]))


def prompts_from(stream: torch.Tensor, n: int, length: int) -> list[list[int]]:
    starts = (stream == train_tiny.BOS).nonzero().flatten().tolist()
    return [stream[s: s + length].tolist() for s in starts[:n]]


def acceptance(model, prompts, new: int) -> None:
    kw = dict(max_batch_size=len(prompts), max_seq_len=len(prompts[0]) + new + 8, compile=False)
    plain = Generator(model, **kw).generate(prompts, max_new_tokens=new)
    print(f"MTP speculative greedy decoding, {len(prompts)} held-out prompts of {len(prompts[0])} tokens, {new} new:")
    for k in range(1, 5):
        gen = Generator(model, spec_steps=k, **kw)
        same = gen.generate(prompts, max_new_tokens=new) == plain
        s = gen.stats
        print(f"  k={k}: acceptance {s['acceptance_rate']:.3f}, tokens per step {s['tokens_per_step']:.2f}, "
              f"tokens identical to spec_steps=0: {same}")


def fp8(model, windows: torch.Tensor, prompts, new: int) -> None:
    with torch.no_grad():
        ref = model(windows)
        model.simulate_fp8_cache(True)
        q = model(windows)
        model.simulate_fp8_cache(False)
    tgt = windows[:, 1:].flatten()
    ppl = [math.exp(F.cross_entropy(x[:, :-1].flatten(0, 1), tgt)) for x in (ref, q)]
    same = (ref.argmax(-1) == q.argmax(-1)).float().mean().item()
    print(f"FP8 cache ({windows.numel()} held-out tokens, cache-free forward with the FP8 reference numerics): "
          f"perplexity {ppl[1]:.3f} vs {ppl[0]:.3f} (fp32 cache), same argmax at {same:.2%} of positions")
    kw = dict(max_batch_size=len(prompts), max_seq_len=len(prompts[0]) + new, compile=False)
    a = Generator(model, **kw).generate(prompts, max_new_tokens=new)
    for cache in ("bf16", "fp8"):
        b = Generator(model, kv_cache_dtype=cache, **kw).generate(prompts, max_new_tokens=new)
        for i, (x, y) in enumerate(zip(a, b)):
            diff = [j for j in range(new) if x[j] != y[j]]
            print(f"  greedy continuation {i} ({new} tokens), kv_cache_dtype={cache!r} vs fp32: {len(diff) / new:.1%} "
                  f"of tokens differ, the first at token {diff[0] if diff else None}")


def hf_parity(path: str, model, stream: torch.Tensor, tokens: int) -> None:
    """HF transformers' ``DeepseekV4ForCausalLM`` from the same directory, fp32, on one held-out stretch."""
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).to(model.device).eval()
    ids = stream[:tokens][None].to(model.device)
    with torch.no_grad():
        diff = (hf(ids).logits.float() - model(ids)).abs().max().item()
    print(f"HF transformers from the same checkpoint, fp32, {tokens} held-out tokens: max |logit difference| {diff:.2e}")
    del hf


SPAN = 5  # a speculative step at k = 4 verifies 5 consecutive tokens


def routing(model, windows: torch.Tensor) -> dict[int, tuple[float, float, list[float]]]:
    """Per learned-routed layer: (mean fraction of the K routed experts token t+1 shares with
    token t, the busiest expert's share of the picks times E: 1 = perfectly balanced, the mean number
    of distinct experts w consecutive tokens pick for w = 1 .. SPAN: what a step verifying them reads)."""
    picks, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if not layer.mlp.is_hash:
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: picks.__setitem__(i, out[1])))
    with torch.no_grad():
        model(windows)
    for h in hooks:
        h.remove()
    out = {}
    B, S = windows.shape
    E = model.config.n_routed_experts
    for i, idx in picks.items():
        onehot = F.one_hot(idx, E).sum(-2).clamp(max=1).view(B, S, E)  # [B, S, E] experts of each token
        shared = ((onehot[:, 1:] & onehot[:, :-1]).sum(-1).float() / idx.shape[-1]).mean().item()
        distinct = [onehot.unfold(1, w, 1).amax(-1).sum(-1).float().mean().item() for w in range(1, SPAN + 1)]
        out[i] = shared, (torch.bincount(idx.flatten(), minlength=E).max() * E / idx.numel()).item(), distinct
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or pretrained.tiny()
    model, tok = dsv4_ops.load_pretrained(path, device=args.device), pretrained.tokenizer(path)
    stream = heldout_stream(tok)
    windows = stream[: 32 * 256].view(32, 256).to(model.device)
    hf_parity(path, model, stream, 3 * model.config.sliding_window + 13)
    acceptance(model, prompts_from(stream, 4, 32), 64)
    fp8(model, windows, prompts_from(stream, 4, 32), 256)
    trained = routing(model, windows)
    untrained = dsv4_ops.DeepseekV4ForCausalLM(model.config).to(model.device).eval()
    train_tiny.init_weights_(untrained, pretrained.training_info(path)["seed"])
    initial = routing(untrained, windows)
    K, E = model.config.num_experts_per_tok, model.config.n_routed_experts
    print(f"routing: fraction of the {K} routed experts (of {E}) token t+1 shares with token t "
          f"(chance {K / E:.2f} for independent picks):")
    for i in trained:
        print(f"  layer {i}: trained {trained[i][0]:.3f}, at initialisation {initial[i][0]:.3f} (busiest expert: "
              f"{trained[i][1]:.2f} x its fair share trained, {initial[i][1]:.2f} at initialisation)")
    # the routed experts a step of w tokens reads (batch 1: plain decode w = 1, speculative k: w = k + 1), averaged over
    # the layers, against independent picks: the routed-bytes floor of a speculative step over a plain one's
    mean = lambda r, w: sum(v[2][w - 1] for v in r.values()) / len(r)  # noqa: E731
    print("routed experts a step of w consecutive tokens reads per layer (routed-bytes floor vs a plain step):")
    for w in range(1, SPAN + 1):
        independent = E * (1 - (1 - K / E) ** w)
        print(f"  w = {w} (k = {w - 1}): trained {mean(trained, w):.2f} ({mean(trained, w) / K:.2f}x), "
              f"at initialisation {mean(initial, w):.2f} ({mean(initial, w) / K:.2f}x), "
              f"independent picks {independent:.2f} ({independent / K:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
