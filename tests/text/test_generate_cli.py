"""``python -m dsv4_ops generate`` on the bundled trained tiny model (eager, CPU, a few tokens).

Specification:
* stdout is the answer (then a newline): the decoding of the tokens ``Generator.generate`` gives
  for the same prompt ids (greedy, stopping at EOS); stderr is one summary line (tokens, tokens/s,
  time to first token, why it finished; with --spec-steps the measured acceptance);
* --chat (--system, --thinking) feeds the chat encoding: --dry-run prints it and its ids;
* a stop string, also one spanning tokens, ends the answer just before it;
* bad arguments and inputs exit with code 2 and one line on stderr naming the argument, no traceback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dsv4_ops
from dsv4_ops.__main__ import main
from dsv4_ops.text import encode_chat, encode_chat_ids, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):"
NEW = 8


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(dsv4_ops.pretrained.tiny())


@pytest.fixture(scope="module")
def greedy(tok):
    """The new tokens ``Generator.generate`` gives for PROMPT (greedy, EOS stops)."""
    model = dsv4_ops.load_pretrained(dsv4_ops.pretrained.tiny())
    gen = dsv4_ops.Generator(model, max_batch_size=1, max_seq_len=256, compile=False)
    return gen.generate([tok.encode(PROMPT)], NEW, eos_token_id=tok.eos_token_id)[0]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "dsv4_ops", "generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=300)


def generate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", "--config", "tiny", "--device", "cpu", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_streams_the_generate_tokens_text(tok, greedy):
    res = cli("--config", "tiny", "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--device", "cpu", "--no-compile")
    assert res.returncode == 0, res.stderr
    assert res.stdout == tok.decode(greedy) + "\n"
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"{len(greedy)} tokens in" in lines[0] and "time to first token" in lines[0] and "tokens/s" in lines[0]
    assert "finished: length" in lines[0] and f"({len(tok.encode(PROMPT))} prompt tokens)" in lines[0]


def test_cli_error_is_one_line_exit_2_no_traceback(tmp_path):
    res = cli("--model", str(tmp_path / "missing"), "--prompt", "x")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "--model" in res.stderr and "missing" in res.stderr
    assert "Traceback" not in res.stderr


def test_chat_dry_run_prints_the_chat_encoding(capsys, tok):
    code, out, err = generate(capsys, "--prompt", "Sort a list.", "--system", "Be brief.", "--thinking", "--dry-run")
    assert code == 0 and err == ""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]
    text, ids = out.rsplit("\n", 2)[:2]
    assert text == encode_chat(messages, thinking=True)
    assert json.loads(ids) == encode_chat_ids(tok, messages, thinking=True)
    code, out, _ = generate(capsys, "--prompt", "Sort a list.", "--chat", "--dry-run")
    assert out.splitlines()[0] == encode_chat([messages[1]]) and out.splitlines()[0].endswith("</think>")
    code, out, _ = generate(capsys, "--prompt", PROMPT, "--dry-run")  # no --chat: the prompt as typed
    assert out == PROMPT + "\n" + json.dumps(tok.encode(PROMPT)) + "\n"


def test_a_stop_string_spanning_tokens_ends_the_answer(capsys, tok, greedy):
    pieces = [tok.decode(greedy[:i]) for i in range(len(greedy) + 1)]
    # a stop string across the boundary after the third token (the last char of its text, the first of the next)
    b = len(pieces[3])
    text = pieces[-1]
    stop = text[b - 1:b + 1]
    code, out, err = generate(capsys, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--stop", stop)
    assert code == 0, err
    assert out == text[: text.find(stop)] + "\n"
    assert f"finished: stop string {stop!r}" in err


def test_spec_steps_report_acceptance_and_give_the_greedy_text(capsys, tok, greedy):
    code, out, err = generate(capsys, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--spec-steps", "2")
    assert code == 0, err
    assert out == tok.decode(greedy) + "\n"
    assert "MTP k=2:" in err and "drafts accepted" in err and "tokens per step" in err


BAD = [
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "many"], "--max-new-tokens"),
    (["--max-new-tokens", "5000"], "--max-new-tokens 5000: .* limit of 4096"),
    (["--seed", "-1"], "--seed"),
    (["--spec-steps", "-1"], "--spec-steps"),
    (["--stop", ""], "--stop"),
    (["--device", "tpu"], "--device"),
    (["--prompt", "x " * 5000], "--prompt has [0-9]+ tokens, more than the model's limit of 4096"),
    (["--prompt", ""], "--prompt is empty"),
]


@pytest.mark.parametrize("args, match", BAD, ids=[" ".join(a)[:30] for a, _ in BAD])
def test_bad_arguments_exit_2_naming_the_argument(capsys, args, match):
    import re

    args = args if "--prompt" in args else ["--prompt", "x", *args]
    code, out, err = generate(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and re.search(match, err), err
    assert err.startswith("python -m dsv4_ops generate: error:")


def test_model_dir_errors_name_the_path(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert f"{tmp_path / 'config.json'} not found" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert f"{tmp_path / 'tokenizer.json'} not found" in capsys.readouterr().err
