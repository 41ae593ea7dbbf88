"""Are two compilations of the same Generator step bit-equal, with and without Inductor's PDL?
Three generators on one random tiny model (fp32): pdl off, off again, on; greedy prefill + decode
logits compared (max |difference|) and the greedy tokens. Session 18's diagnosis of
``tests/test_generator_pdl.py``'s bit-equality failure: the two unpaired runs gave the same bits,
the PDL run differed by up to 7.2e-6 with the same tokens (BENCHMARKS.md, session 18)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dsv4_ops import DSV4Config, Generator  # noqa: E402
from model_util import random_model  # noqa: E402


def run(model, pdl: bool, steps: int) -> torch.Tensor:
    torch._dynamo.reset()
    gen = Generator(model, compile=True, pdl=pdl, max_batch_size=4, max_seq_len=160, prefill_chunk=32)
    out = [gen.prefill([[3, 1, 4, 1, 5], list(range(40)), [7] * 17])]
    for _ in range(steps):
        out.append(gen.decode(out[-1].argmax(-1)))
    return torch.stack(out)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8), dtype=torch.float32, device="cuda")
    a, b, c = run(model, False, 24), run(model, False, 24), run(model, True, 24)
    for name, x in (("off vs off again", b), ("off vs on", c)):
        print(f"{name}: bit-equal {torch.equal(a, x)}, max |diff| {(a - x).abs().max().item():.3e}, "
              f"first differing step {next((i for i in range(len(a)) if not torch.equal(a[i], x[i])), None)}, "
              f"tokens equal {torch.equal(a.argmax(-1), x.argmax(-1))}", flush=True)


if __name__ == "__main__":
    main()
