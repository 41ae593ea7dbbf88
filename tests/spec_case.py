"""The speculative-decoding tests' case (``runtime/test_speculative.py``, ``model/test_mtp_oracle.py``):
the three-layer tiny model (sliding + CSA + HCA; window 16 and HCA rate 8, so 40 new tokens cross
many boundaries), ragged prompts, and the eager Generator's limits."""
from dsv4_ops import DSV4Config

CFG = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)
PROMPTS = [[3, 1, 4, 1, 5], list(range(40)), [7] * 17]
NEW = 40
KW = dict(max_batch_size=4, max_seq_len=128, compile=False, prefill_chunk=16)
