"""Load an official-format checkpoint of the Flash slice onto the GPU: FP8 (e4m3, 128 x 128 blocks,
ue8m0 scales) linear weights, FP4 (e2m1, ue8m0 per 32) experts, DeepSeek's names, sharded with an
index. Measures ``dsv4_ops.load_pretrained(path, dtype=bf16, device="cuda")``: seconds, peak host
RSS above the start, peak GPU memory against the model's own bytes (two copies of the weights
would show), and one forward pass of the loaded model (finite logits).

The checkpoint holds random codes (tests/hf/test_checkpoint_formats.py::random_official_tensors, the
writer the CPU test uses), written once to ``--dir`` (~17 GB).

    python3 benchmarks/bench_load.py --dir /tmp/flash_ckpt --out out/bench_load.json      # GPU box
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MEASURE = textwrap.dedent("""
    import json, os, sys, time
    import torch, dsv4_ops
    from transformers import DeepseekV4Config
    DeepseekV4Config.from_pretrained(sys.argv[1])  # imports done before measuring

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def peak_rss():  # VmHWM: this process image's own peak (ru_maxrss keeps the parent's across exec)
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    dev = torch.device(sys.argv[2])
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.init()
    before, t0 = rss(), time.perf_counter()
    model = dsv4_ops.load_pretrained(sys.argv[1], dtype=torch.bfloat16, device=dev)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak_host = peak_rss()
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = {t.data_ptr(): t for _, t in named if t.numel()}  # shared tensors once
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    elsewhere = [f"{n} {tuple(t.shape)} {t.device}" for n, t in named if t.device.type != dev.type]
    on_device = not elsewhere
    peak_gpu = torch.cuda.max_memory_allocated() if cuda else 0
    with torch.no_grad():
        logits = model(torch.randint(0, model.config.vocab_size, (1, 16), device=dev))
    print(json.dumps(dict(seconds=seconds, rss_before=before, peak_host_rss=peak_host, model_bytes=model_bytes,
                          all_on_device=on_device, not_on_device=elsewhere[:20], peak_gpu_bytes=peak_gpu, logits_finite=bool(logits.isfinite().all()),
                          logits_std=float(logits.float().std()))))
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/flash_ckpt")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--out", default="out/bench_load.json")
    ap.add_argument("--smoke", action="store_true", help="the tiny config, loaded on the CPU: a seconds-long check")
    args = ap.parse_args()
    from random_weights import flash_slice_config
    from test_checkpoint_formats import BIG, random_official_tensors, write_checkpoint

    cfg = BIG if args.smoke else flash_slice_config()
    device = "cpu" if args.smoke else "cuda"
    t0 = time.perf_counter()
    tensors = random_official_tensors(cfg, device=device)  # codes drawn on the GPU: seconds, not minutes
    made_s = time.perf_counter() - t0
    files = write_checkpoint(args.dir, cfg, tensors, n_shards=args.shards, interleave=False, scale_fmt="ue8m0",
                             expert_dtype="fp4")
    del tensors
    sizes = [os.path.getsize(os.path.join(args.dir, f)) for f in files]
    print(f"[load] wrote {sum(sizes) / 1e9:.1f} GB in {len(files)} shards (largest {max(sizes) / 1e9:.2f} GB) "
          f"in {time.perf_counter() - t0:.0f} s (codes drawn in {made_s:.0f} s)", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", MEASURE, args.dir, device], capture_output=True, text=True, env=env,
                          timeout=900)
    if proc.returncode != 0:
        print(proc.stderr[-4000:])
        raise SystemExit("load failed")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update(checkpoint_bytes=sum(sizes), shards=len(sizes), largest_shard_bytes=max(sizes))
    host_extra = r["peak_host_rss"] - r["rss_before"]
    print(f"[load] load_pretrained -> {device} bf16: {r['seconds']:.1f} s for {sum(sizes) / 1e9:.1f} GB of FP8/FP4 "
          f"({sum(sizes) / 1e9 / r['seconds']:.2f} GB/s) -> {r['model_bytes'] / 1e9:.1f} GB of bf16 weights; "
          f"peak host RSS +{host_extra / 1e9:.2f} GB (largest shard {max(sizes) / 1e9:.2f} GB); peak GPU "
          f"{r['peak_gpu_bytes'] / 1e9:.1f} GB = {r['peak_gpu_bytes'] / r['model_bytes']:.3f}x the model; "
          f"all on {device}: {r['all_on_device']}; logits finite: {r['logits_finite']}", flush=True)
    if r["not_on_device"]:
        print(f"[load] not on {device}: {', '.join(r['not_on_device'])}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
