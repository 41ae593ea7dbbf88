"""Command line: ``python -m dsv4_ops {demo,bench,info}``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv4_ops", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="tiny model: prefill + greedy generate, eager vs compiled (vs CUDA graphs)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.add_argument("--no-compile", action="store_true", help="eager only (fast)")
    demo.add_argument("--spec-steps", type=int, default=0, help="also run MTP speculative decoding with k drafts")
    bench = sub.add_parser("bench", help="per-kernel decode benchmark: Triton ops vs reference vs roofline (CUDA)",
                           description="Time each torch.ops.dsv4 op (Triton path) and its plain-PyTorch reference at "
                                       "V4-Flash / V4-Pro decode shapes; write JSON, a markdown table and a plot.")
    from .bench.run import add_arguments as bench_arguments

    bench_arguments(bench)
    sub.add_parser("info", help="versions, devices and the registered ops")
    args = parser.parse_args(argv)

    if args.cmd == "demo":
        from .demo import run

        return run(args.device, args.max_new_tokens, compile=not args.no_compile, spec_steps=args.spec_steps)
    if args.cmd == "bench":
        from .bench.run import run

        return run(args)
    if args.cmd == "info":
        import torch

        import dsv4_ops  # noqa: F401  (registers the ops)

        print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
        ops = sorted(n for n in dir(torch.ops.dsv4) if not n.startswith("_") and n not in ("name", "is_loaded"))
        print("torch.ops.dsv4:", ", ".join(ops))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
