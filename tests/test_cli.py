"""The `kvforge` command: help, JSON contract, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvforge.cli import app

runner = CliRunner()
SUBCOMMANDS = ["models", "generate", "demo", "bench", "eval", "fit"]


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _last_json(result):
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_help_lists_every_subcommand_and_each_has_help():
    result = subprocess.run([sys.executable, "-m", "kvforge", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for name in SUBCOMMANDS:
        assert name in result.stdout
    for args in (["models"], ["generate"], ["demo"], ["bench", "exact"], ["bench", "ridgefill"], ["eval", "exact"], ["eval", "ridgefill"], ["fit", "ridgefill"]):
        assert _run(*args, "--help").exit_code == 0, args


def test_models_json_lists_the_aliases():
    obj = _last_json(_run("models", "--json"))
    assert {m["alias"] for m in obj["models"]} >= {"smollm2-135m", "gemma3-270m"}


def test_generate_json_has_the_contract_keys(tiny_model_dir):
    result = _run("generate", "--model", tiny_model_dir, "--prompt", "hello there", "-n", 6, "--json")
    assert result.exit_code == 0, result.output
    obj = _last_json(result)
    for key in ("command", "model", "method", "tokens", "text", "token_ids", "prompt_tokens", "ttft_s", "decode_tokens_per_s"):
        assert key in obj
    assert obj["method"] == "exact" and obj["prompt_tokens"] == len("hello there")
    assert 1 <= len(obj["token_ids"]) <= 6


def test_generate_greedy_is_deterministic_across_calls(tiny_model_dir):
    a = _last_json(_run("generate", "--model", tiny_model_dir, "--prompt", "abc", "-n", 8, "--json"))
    b = _last_json(_run("generate", "--model", tiny_model_dir, "--prompt", "abc", "-n", 8, "--json"))
    assert a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model", "--prompt", "hi"], "unknown model"),
        (["--prompt", "   "], "empty prompt"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "does not exist"),
        ([], "exactly one of --prompt or --prompt-file"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--device", "cuda:7"], "not available"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tiny_model_dir):
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    result = _run("generate", *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.output


def test_prompt_over_the_context_names_both_lengths(tiny_model_dir):
    result = _run("generate", "--model", tiny_model_dir, "--prompt", "a" * 300)
    assert result.exit_code == 2
    assert "300 tokens" in result.stderr and "256 tokens" in result.stderr


def test_bench_rejects_bad_lengths():
    result = _run("bench", "exact", "--tokens", "10,abc")
    assert result.exit_code == 2 and "--tokens" in result.stderr


@pytest.fixture(scope="module")
def tiny_maps(tiny_model_dir, tmp_path_factory):
    """RidgeFill maps fitted through the CLI on the tiny model and real chat text."""
    out = tmp_path_factory.mktemp("maps") / "tiny.safetensors"
    result = _run("fit", "ridgefill", "--model", tiny_model_dir, "--split", "2", "--calib-tokens", 1400, "--seq-len", 64, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    obj = _last_json(result)
    assert obj["splits"] == [2] and obj["tokens"] >= 1400 and set(obj["info"]["splits"]["2"]["r2"]) == {"3"}
    return out


def test_generate_with_ridgefill_maps(tiny_model_dir, tiny_maps):
    prompt = "the quick brown fox jumps over the lazy dog " * 2
    args = ("generate", "--model", tiny_model_dir, "--prompt", prompt, "-n", 5, "--method", "ridgefill", "--maps", tiny_maps)
    obj = _last_json(_run(*args, "--split", 2, "--tail", 8, "--exact-rows", "5,9", "--json"))
    assert obj["method"] == "ridgefill" and len(obj["token_ids"]) == 5
    fallback = _run(*args, "--split", 2, "--tail", 500)
    assert fallback.exit_code == 0 and "running exact prefill" in fallback.stderr


def test_ridgefill_bad_input_is_one_line(tiny_model_dir, tiny_maps, tmp_path):
    from conftest import char_tokenizer, tiny_hf_model

    other = tmp_path / "other-llama"
    tiny_hf_model("llama", seed=7).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    base = ("generate", "--model", tiny_model_dir, "--prompt", "hello world, hello", "--method", "ridgefill")
    cases = [
        ((*base, "--maps", tiny_maps, "--split", 1), "not split 1"),
        ((*base, "--maps", tiny_maps, "--split", 9), "outside 1..3"),
        ((*base, "--maps", tiny_maps, "--split", 2, "--exact-rows", "99"), "outside the 18-token prompt"),
        ((*base, "--maps", tmp_path / "none.safetensors", "--split", 2), "does not exist"),
        (("generate", "--model", other, "--prompt", "hi", "--method", "ridgefill", "--maps", tiny_maps, "--split", 2), "fitted for"),
        (("fit", "ridgefill", "--model", tiny_model_dir, "--split", "4"), "outside 1..3"),
    ]
    for args, message in cases:
        result = _run(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
