"""The bundled trained tiny DeepSeek-V4: ``dsv4_ops.pretrained.tiny()`` (DESIGN.md §2).

A real checkpoint directory shipped with the package (``dsv4_ops/assets/tiny/``), trained by
``python -m dsv4_ops.train_tiny`` on the source of Python's standard library: ``config.json``,
``model.safetensors`` (HF names + the trained ``mtp.0.*`` block), ``tokenizer.json`` (byte-level
BPE), ``training.json`` (how it was made and its held-out numbers). Random-weight configs
(``DSV4Config.tiny()``) stay what the parity tests use; this one is for judging generation,
speculative decoding and the FP8 cache on language.

>>> model = dsv4_ops.load_pretrained(dsv4_ops.pretrained.tiny())
>>> tok = dsv4_ops.pretrained.tokenizer()
>>> tok.decode(dsv4_ops.Generator(model, max_batch_size=1, max_seq_len=64, compile=False)
...            .generate([tok.encode("import os\\n").ids], max_new_tokens=8)[0])
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["tiny", "tokenizer", "training_info", "describe"]

TINY_DIR = Path(__file__).resolve().parent / "assets" / "tiny"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "training.json")


def tiny() -> str:
    """Path of the bundled trained tiny checkpoint directory (loads with
    ``dsv4_ops.load_pretrained`` and with HF's ``DeepseekV4ForCausalLM.from_pretrained``)."""
    missing = [f for f in FILES if not (TINY_DIR / f).is_file()]
    if missing:
        raise FileNotFoundError(f"dsv4_ops.pretrained.tiny(): {TINY_DIR} lacks {missing}; the package was installed "
                                "without its data (setup.py package_data) or the checkout is incomplete")
    return str(TINY_DIR)


def tokenizer(path: str | None = None):
    """The checkpoint's ``tokenizers.Tokenizer`` (``decode`` drops special tokens by default)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path or tiny()) / "tokenizer.json"))


def training_info(path: str | None = None) -> dict:
    """``training.json`` of a checkpoint written by ``train_tiny`` (command, seed, steps, commit,
    machine, time, held-out perplexity and its unigram baseline, MTP accuracy)."""
    return json.loads((Path(path or tiny()) / "training.json").read_text(encoding="utf-8"))


def describe(path: str | None = None) -> str:
    """Two lines saying which model this is: where, how big, how trained, how good."""
    path = Path(path or tiny())
    info = training_info(path)
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    mb = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA", "heavily_compressed_attention": "HCA"}
    layers = ", ".join(kinds[t] for t in cfg["layer_types"])
    ev, corpus = info["heldout"], info["corpus"]
    return (f"{path} ({mb:.1f} MB, {info['parameters'] / 1e6:.2f} M parameters: {len(cfg['layer_types'])} layers "
            f"({layers}), hidden {cfg['hidden_size']}, {cfg['n_routed_experts']} experts top-"
            f"{cfg['num_experts_per_tok']}, MTP block, vocab {cfg['vocab_size']})\n"
            f"trained {info['steps_done']} steps ({info['train_tokens_seen'] / 1e6:.1f} M tokens, "
            f"{info['train_s'] / 60:.0f} min on {info['device']}, seed {info['seed']}) on {corpus['train_files']} files "
            f"of Python's standard library; held-out perplexity {ev['heldout_ppl']:.1f} "
            f"(unigram baseline {ev['unigram_ppl']:.0f}), MTP top-1 for t+2 {ev['mtp_top1_t2']:.0%}")
