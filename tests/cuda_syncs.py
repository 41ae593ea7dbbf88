"""Counting the synchronising CUDA calls a block of code makes (torch.cuda's sync debug mode)."""
import collections
import contextlib
import warnings
from pathlib import Path

import torch


@contextlib.contextmanager
def counted_syncs():
    """Yields a Counter, filled on exit: ``file:line`` -> the synchronising CUDA calls made there. The
    block ends with a known sync (``.item()``), which must be seen (else the mode was off) and is
    then left out of the count."""
    syncs = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
            torch.ones(1, device="cuda").item()  # the known sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs.update(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                 if "called a synchronizing CUDA operation" in str(w.message))
    known = [site for site in syncs if site.startswith(Path(__file__).name)]
    assert len(known) == 1 and syncs[known[0]] == 1, f"the sync debug mode saw no known sync: {syncs}"
    del syncs[known[0]]
