"""``Generator(pdl=True)``: Inductor launches the compiled steps' kernels as programmatic dependent
launches (``triton.enable_pdl``; off by default). CPU: the compile options say what
``mode="reduce-overhead"`` says plus PDL, torch accepts them, and the argument is checked. GPU
(sm_90+): the generated kernels carry the PDL wait; greedy tokens of decode and of a speculative
generate equal the unpaired run's, the logits within ``pdl_vs_plain_logits`` (1e-4; the H200 measured
up to 7.2e-6 of difference, which two unpaired compilations do not show: BENCHMARKS.md session 18)."""
from __future__ import annotations

import pytest
import torch

from dsv4_ops import DSV4Config, Generator
from dsv4_ops.compiled_steps import compile_options
from model_util import random_model

SM90 = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9


def test_compile_options_are_reduce_overhead_plus_pdl():
    from torch._inductor import list_mode_options, list_options

    assert compile_options(True, False) == list_mode_options("reduce-overhead")
    assert compile_options(False, False) == {"triton.cudagraphs": False}
    assert compile_options(True, True) == {"triton.cudagraphs": True, "triton.enable_pdl": True}
    assert set(compile_options(True, True)) <= set(list_options())  # torch.compile accepts every key


def test_pdl_argument_is_checked_and_off_by_default():
    model = random_model(DSV4Config.tiny())
    kw = dict(max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match="pdl must be True or False"):
        Generator(model, pdl=None, **kw)
    with pytest.raises(ValueError, match="pdl=True needs compile=True"):
        Generator(model, compile=False, pdl=True, **kw)
    assert Generator(model, compile=True, **kw).pdl is False


def _generated_code(fn):
    """What ``fn`` returns and the source of every graph Inductor compiled while it ran."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="Inductor's PDL needs an sm_90+ NVIDIA GPU")
def test_pdl_steps_give_the_unpaired_tokens_and_logits_within_1e_4(tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)
    model = random_model(cfg, dtype=torch.float32, device="cuda")
    kw = dict(max_batch_size=4, max_seq_len=160, prefill_chunk=32)
    prompts = [[3, 1, 4, 1, 5], list(range(40)), [7] * 17]
    runs = {}
    for pdl in (False, True):
        torch._dynamo.reset()
        gen = Generator(model, compile=True, pdl=pdl, **kw)
        assert gen.pdl is pdl and gen.cuda_graphs
        logits, codes = _generated_code(lambda: gen.prefill(prompts))
        waits = sum(code.count("gdc_wait") for code in codes)
        assert (waits > 0) is pdl, f"pdl={pdl}: {waits} PDL waits in the generated code"
        steps = [logits]
        for _ in range(40):  # past the window's wrap and several HCA blocks
            steps.append(gen.decode(steps[-1].argmax(-1)))
        runs[pdl] = torch.stack(steps)
    assert torch.equal(runs[True].argmax(-1), runs[False].argmax(-1))
    torch.testing.assert_close(runs[True], runs[False], **tol("pdl_vs_plain_logits"))


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="Inductor's PDL needs an sm_90+ NVIDIA GPU")
def test_pdl_speculative_generate_gives_the_greedy_tokens():
    cfg = DSV4Config.tiny(num_hidden_layers=2, hca_ratio=8, num_nextn_predict_layers=1)
    model = random_model(cfg, dtype=torch.float32, device="cuda", seed=3)
    prompts = [[5, 6, 7], list(range(30))]
    torch._dynamo.reset()
    want = Generator(model, max_batch_size=2, max_seq_len=128, compile=True, pdl=False).generate(
        prompts, max_new_tokens=40)
    torch._dynamo.reset()
    spec = Generator(model, max_batch_size=2, max_seq_len=128, compile=True, pdl=True, spec_steps=2)
    assert spec.generate(prompts, max_new_tokens=40) == want
