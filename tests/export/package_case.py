"""The exported test case shared by tests/export: config, limits, prompts."""
from dsv4_ops import DSV4Config

CFG = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)  # sliding + CSA + HCA
LIMITS = dict(max_batch_size=4, max_seq_len=96, prefill_chunk=16)
SPEC_STEPS = 2  # the shared package also holds the MTP speculative programs
PROMPTS = [[3, 1, 4, 1, 5], list(range(40, 77)), [7]]  # ragged: 1, 3 and 1 chunks of 16; bucket padded to 4
# the package's prefill chunk sizes: PROMPTS prefill in a step of 32 and one of 16 (the eager Generator: 16s)
PACKAGE_CHUNKS = (16, 32)
NEW_TOKENS = 40  # crosses the window (16) and several HCA (8) / CSA (4) blocks
