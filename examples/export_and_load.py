"""Export a model as ONE AOTInductor package (prefill + decode programs) and run it from Python
with AOTIGenerator -- no torch.compile at load, no model code needed.

    python examples/export_and_load.py [--out model.pt2] [--load-only]

On the GPU box (torch 2.11) start Python with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
(loading a .pt2 otherwise segfaults in std::regex there).
"""
import argparse

import torch

import dsv4_ops

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="build/tiny.pt2")
parser.add_argument("--load-only", action="store_true", help="the package at --out exists: skip step 1")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = dsv4_ops.DeepseekV4ForCausalLM(dsv4_ops.DSV4Config.tiny(), device=device)

# 1. export: batches of up to 2 requests of up to 128 tokens, prefill in chunks of 16
if not args.load_only:
    dsv4_ops.export(model, args.out, max_batch_size=2, max_seq_len=128, prefill_chunk=16)

# 2. load and generate (a fresh process would do only this part)
gen = dsv4_ops.AOTIGenerator(args.out)
prompts = [[1, 2, 3], list(range(5, 45))]
out = gen.generate(prompts, max_new_tokens=16)

# 3. the same tokens as the eager model
want = dsv4_ops.Generator(model, max_batch_size=2, max_seq_len=128, prefill_chunk=16, compile=False).generate(
    prompts, max_new_tokens=16)
print("AOTI tokens:", out)
assert out == want, (out, want)
print(f"OK: {args.out} generates the eager tokens; C++: build/dsv4_run {args.out} --prompt 1,2,3 --max-new-tokens 16")
