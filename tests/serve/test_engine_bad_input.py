"""Bad input to the engine: a ValueError that names the argument and its limit, raised before
anything runs, and the engine keeps serving the other requests."""
import pytest
import torch

from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM
from dsv4_ops.serve import Engine
from engine_cases import MAX_LEN, PAGE, alone, engine, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(3)


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_ids=[1] * (MAX_LEN + 1)), r"max_seq_len 256"),
    (dict(prompt_ids=[1] * 200, max_new_tokens=100), r"max_new_tokens \(100\) - 1 = 299 > max_seq_len 256"),
    (dict(prompt_ids=[1, 256]), r"token id 256 .*vocab_size=256"),
    (dict(prompt_ids=[1, -1]), r"token id -1"),
    (dict(prompt_ids=[]), r"prompt"),
    (dict(prompt_ids=[1], max_new_tokens=0), r"max_new_tokens"),
    (dict(prompt_ids=[1], temperature=-1.0), r"temperature"),
    (dict(prompt_ids=[1], top_p=0.0), r"top_p"),
    (dict(prompt_ids=[1], top_k=-2), r"top_k"),
    (dict(prompt_ids=[1], eos_token_id=999), r"eos_token_id"),
])
def test_a_bad_request_is_rejected_and_the_engine_keeps_serving(model, kw, match):
    eng = engine(model)
    good = eng.add_request([5, 6, 7], max_new_tokens=4)
    with pytest.raises(ValueError, match=match):
        eng.add_request(**kw)
    got = []
    while eng.has_unfinished():
        got += [t for o in eng.step() if o.request_id == good for t in o.new_token_ids]
    assert got == alone(model, [5, 6, 7], max_new_tokens=4)


def test_a_request_longer_than_the_whole_pool_is_rejected_at_add_request(model):
    eng = engine(model, num_pages=3)  # 2 real pages = 64 positions
    with pytest.raises(ValueError, match=r"need 3 pages of 32 positions; the pool has 2"):
        eng.add_request([1] * 60, max_new_tokens=10)
    eng.add_request([1] * 60, max_new_tokens=5)  # 64 positions fit


def test_abort_of_an_unknown_request_names_it(model):
    eng = engine(model)
    rid = eng.add_request([1, 2], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"abort: request_id=12345 is not a waiting or running request"):
        eng.abort(12345)
    eng.abort(rid)
    with pytest.raises(ValueError, match=r"request_id=0"):
        eng.abort(rid)  # aborted already
    assert [o.finish_reason for o in eng.step()] == ["abort"]
    assert not eng.has_unfinished()


@pytest.mark.parametrize("kw, match", [
    (dict(page_size=24), r"page_size=24 must be a multiple of every compression rate \[4, 16\]"),
    (dict(prefill_chunk=24), r"prefill_chunk=24 must divide page_size=32 or be a multiple of it"),
    (dict(prefill_chunk=64, spec_steps=1), r"prefill_chunk=64 must divide page_size=32 \("),  # MTP: divisors only
    (dict(max_running=0), r"max_running"),
    (dict(num_pages=1), r"num_pages"),
    (dict(num_pages=8, kv_memory_gb=1.0), r"num_pages or kv_memory_gb"),
    (dict(kv_memory_gb=-1), r"kv_memory_gb must be a positive number"),
    (dict(spec_steps=-1), r"spec_steps must be an int >= 0, got -1"),
    (dict(spec_steps=1.5), r"spec_steps must be an int"),
    (dict(kv_cache_dtype="int4"), r"kv_cache_dtype"),
    (dict(admit_wait=-1), r"admit_wait must be an int >= 0, got -1"),
    (dict(admit_order="shortest"), r"admit_order must be one of \('arrival', 'longest_output'\), got 'shortest'"),
])
def test_bad_engine_settings_name_the_argument(model, kw, match):
    with pytest.raises(ValueError, match=match):
        engine(model, **kw)


def test_spec_steps_on_a_model_without_an_mtp_block_names_spec_steps():
    torch.manual_seed(0)
    no_mtp = DeepseekV4ForCausalLM(DSV4Config.tiny(num_nextn_predict_layers=0)).eval()
    with pytest.raises(ValueError, match=r"spec_steps=2 needs the model's MTP block"):
        engine(no_mtp, spec_steps=2)
    assert engine(no_mtp).generate([[1, 2, 3]], max_new_tokens=3) == [alone(no_mtp, [1, 2, 3], max_new_tokens=3)]


def test_kv_memory_gb_sizes_the_pool_in_pages(model):
    page = Engine(model, max_running=2, max_seq_len=MAX_LEN, page_size=PAGE, compile=False, num_pages=2).pool
    per_page = page.nbytes()["page"]
    eng = engine(model, kv_memory_gb=per_page * 10 / 2**30)
    assert eng.allocator.num_pages == 10
