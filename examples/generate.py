"""Generate with a DeepSeek-V4 model: the compiled, CUDA-graphed (on GPU) Generator.

    python examples/generate.py                       # tiny model, random weights (CPU or GPU)
    python examples/generate.py --checkpoint DIR      # a checkpoint directory (config.json + safetensors)
    python examples/generate.py --spec-steps 3        # + MTP speculative decoding (same tokens)
"""
import argparse

import torch

import dsv4_ops

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", default=None, help="HF-format or DeepSeek-format checkpoint directory")
parser.add_argument("--spec-steps", type=int, default=0)
parser.add_argument("--max-new-tokens", type=int, default=16)
parser.add_argument("--eager", action="store_true", help="skip torch.compile")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
if args.checkpoint:
    model = dsv4_ops.load_pretrained(args.checkpoint, device=device)
else:
    torch.manual_seed(0)
    model = dsv4_ops.DeepseekV4ForCausalLM(dsv4_ops.DSV4Config.tiny(num_hidden_layers=3), device=device)

# the demo's shapes (make demo): Inductor's cache then already holds the compiled steps
gen = dsv4_ops.Generator(model, max_batch_size=2, max_seq_len=128, prefill_chunk=16,
                         spec_steps=args.spec_steps, compile=not args.eager)
prompts = [[1, 2, 3], list(range(5, 45))]
out = gen.generate(prompts, max_new_tokens=args.max_new_tokens)  # greedy; new tokens per prompt
for p, o in zip(prompts, out):
    print(f"prompt of {len(p)} tokens -> {o}")
s = gen.stats
print(f"decode {s['decode_tokens_per_s']:.1f} tokens/s, graph breaks {s['graph_breaks']}, "
      f"recompiles {s['recompiles']}, compile {s['compile_time_s']:.0f} s")
