"""Command line: ``python -m dsv4_ops {demo,generate,export,info}``."""
from __future__ import annotations

import argparse
import sys


def _export(args) -> int:
    import torch

    import dsv4_ops

    if args.config == "tiny":
        torch.manual_seed(args.seed)
        model = dsv4_ops.DeepseekV4ForCausalLM(dsv4_ops.DSV4Config.tiny(), device=args.device)
    else:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        model = dsv4_ops.load_pretrained(args.config, dtype=dtype, device=args.device)
    chunks = args.prefill_chunk
    path = dsv4_ops.export(model, args.out, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                           prefill_chunk=chunks[0] if chunks and len(chunks) == 1 else chunks)
    print(f"wrote {path}: load it with dsv4_ops.AOTIGenerator({path!r}) or build/dsv4_run {path} --prompt 1,2,3")
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit code 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m dsv4_ops", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="the bundled trained tiny model writing Python: greedy, sampled, speculative; "
                                       "eager vs compiled (vs CUDA graphs)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--model", default=None, help="checkpoint directory with a tokenizer.json and training.json "
                                                    "(default: dsv4_ops.pretrained.tiny())")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--no-compile", action="store_true", help="eager only (fast)")
    demo.add_argument("--spec-steps", type=int, default=2, help="MTP draft tokens of the speculative runs (0: none)")
    from .text import generate_cli

    generate = sub.add_parser("generate", help="one prompt in, its answer streamed out (text; --chat for the chat "
                                               "format)", description=generate_cli.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    generate_cli.add_arguments(generate)
    export = sub.add_parser("export", help="write an AOTInductor .pt2 package (prefill + decode programs)",
                            description="Export a model as one .pt2 package for dsv4_ops.AOTIGenerator and the "
                                        "C++ runner build/dsv4_run.")
    export.add_argument("--config", default="tiny",
                        help="'tiny' (DSV4Config.tiny(), random weights) or a checkpoint directory (config.json + "
                             "safetensors, as load_pretrained reads)")
    export.add_argument("--out", required=True, help="package path, ending in .pt2")
    export.add_argument("--max-batch-size", type=int, default=4)
    export.add_argument("--max-seq-len", type=int, default=512)
    export.add_argument("--prefill-chunk", type=int, nargs="+", default=None,
                        help="tokens a row per prefill step, one size or several, a prefill program each "
                             "(default: export()'s chunk buckets for the batch size)")
    export.add_argument("--device", default="cpu", help="device the package runs on (cpu or cuda)")
    export.add_argument("--dtype", default=None, help="weights dtype for a checkpoint (e.g. bfloat16)")
    export.add_argument("--seed", type=int, default=0, help="random weights of --config tiny")
    from .serve import cli as serve_cli

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, prefix cache)",
                           description=serve_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_cli.add_arguments(serve)
    sub.add_parser("info", help="versions, devices and the registered ops")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2

    if args.cmd == "generate":
        return generate_cli.run(args)
    if args.cmd == "demo":
        from .demo import run

        return run(args.device, args.max_new_tokens, compile=not args.no_compile, spec_steps=args.spec_steps,
                   model_path=args.model)
    if args.cmd == "export":
        return _export(args)
    if args.cmd == "serve":
        return serve_cli.run(args)
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
