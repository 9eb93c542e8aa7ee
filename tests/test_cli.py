"""The `kvforge` command: help, JSON contract, and one-line errors with exit code 2."""

import json
from pathlib import Path
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvforge.cli import app
from kvforge.provenance import portable_path

runner = CliRunner()
SUBCOMMANDS = ["models", "generate", "demo", "bench", "eval", "fit", "rollout", "handoff", "serve"]


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _last_json(result):
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_one_line_errors(cases):
    """Each (args, message): exit code 2 and one line on stderr that contains the message."""
    for args, message in cases:
        result = _run(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr


def test_help_lists_every_subcommand_and_each_has_help():
    result = subprocess.run([sys.executable, "-m", "kvforge", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for name in SUBCOMMANDS:
        assert name in result.stdout
    for args in (["models"], ["generate"], ["demo"], ["bench", "exact"], ["bench", "ridgefill"], ["eval", "exact"], ["eval", "ridgefill"], ["fit", "ridgefill"],
                 ["bench", "speed"], ["eval", "speed"], ["fit", "speed"], ["bench", "ngram"], ["rollout"], ["handoff"], ["fit", "lingo"], ["eval", "lingo"], ["bench", "lingo"], ["serve"], ["bench", "serve"]):
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


def test_generate_with_ridgefill_maps_says_what_ran(tiny_model_dir, tiny_maps):
    prompt = "the quick brown fox jumps over the lazy dog " * 2  # 88 tokens
    args = ("generate", "--model", tiny_model_dir, "--prompt", prompt, "-n", 5, "--method", "ridgefill", "--maps", tiny_maps)
    obj = _last_json(_run(*args, "--split", 2, "--tail", 8, "--exact-rows", "5,9", "--json"))
    assert obj["method"] == obj["prefill"] == "ridgefill" and obj["reason"] is None and len(obj["token_ids"]) == 5
    # the tail's attended rows are chosen during the prefill; the count is read off the cache after it
    assert 0 < obj["filled_rows"] < 88 - 4 - 8 - 2
    assert obj["setting"]["split"] == 2 and obj["setting"]["tail"] == 8 and obj["setting"]["rows"] == [5, 9]
    plain = _last_json(_run(*args, "--split", 2, "--tail", 8, "--attended-rows", 0, "--json"))
    assert plain["prefill"] == "ridgefill" and plain["filled_rows"] == 88 - 4 - 8
    fallback = _run(*args, "--split", 2, "--tail", 500)
    assert fallback.exit_code == 0 and "running exact prefill" in fallback.stderr
    obj = _last_json(_run(*args, "--split", 2, "--tail", 500, "--json"))
    assert obj["method"] == "ridgefill" and obj["prefill"] == "exact" and "no longer than RidgeFill's exact rows" in obj["reason"]


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
    _assert_one_line_errors(cases)


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir, tmp_path_factory):
    """A SPEED LoRA adapter trained for two steps through the CLI on the tiny model, under a policy
    that is not the default: cut 2, anchors first:2, tail 3."""
    out = tmp_path_factory.mktemp("adapter") / "tiny-speed.safetensors"
    result = _run("fit", "speed", "--model", tiny_model_dir, "--cut", 2, "--anchors", "first:2", "--tail", 3, "--steps", 2, "--max-tokens", 200,
                  "--lora-rank", 2, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    obj = _last_json(result)
    assert obj["cut"] == 2 and obj["anchors_first"] == 2 and obj["tail"] == 3 and obj["training"]["rank"] == 2 and obj["out"] == portable_path(str(out))
    return out


def test_generate_with_speed_applies_the_adapters_whole_policy(tiny_model_dir, tiny_adapter):
    prompt = "the quick brown fox jumps over the lazy dog"  # 43 tokens
    args = ("generate", "--model", tiny_model_dir, "--prompt", prompt, "-n", 5, "--method", "speed", "--json")
    plain = _last_json(_run(*args, "--cut", "0.5", "--tail", 8))
    assert plain["setting"] == {"cut": 2, "first": 1, "rows": [], "tail": 8} and plain["shallow_rows"] == 43 - 9
    default = _last_json(_run(*args, "--cut", "0.5"))  # the default tail (64) covers this short prompt: it runs exact, and says why
    assert default["setting"]["tail"] == 64 and default["prefill"] == "exact" and "tail of 64" in default["reason"]
    adapted = _last_json(_run(*args, "--adapter", tiny_adapter))  # cut, anchors and tail: the adapter's
    assert plain["method"] == adapted["method"] == adapted["prefill"] == "speed"
    assert adapted["setting"] == {"cut": 2, "first": 2, "rows": [], "tail": 3} and adapted["shallow_rows"] == 43 - 5
    assert len(plain["token_ids"]) == len(adapted["token_ids"]) == 5 and adapted["adapter"] == portable_path(str(tiny_adapter))
    same = _last_json(_run(*args, "--adapter", tiny_adapter, "--cut", 2, "--anchors", "first:2", "--tail", 3))  # restating it is fine
    assert same["token_ids"] == adapted["token_ids"]
    short = _last_json(_run("generate", "--model", tiny_model_dir, "--prompt", "hi", "-n", 2, "--method", "speed", "--tail", 4, "--json"))
    assert short["prefill"] == "exact" and "in the tail of 4" in short["reason"]


def test_speed_bad_input_is_one_line(tiny_model_dir, tiny_adapter, tmp_path):
    from conftest import char_tokenizer, tiny_hf_model

    other = tmp_path / "other-llama"
    tiny_hf_model("llama", seed=7).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    base = ("generate", "--model", tiny_model_dir, "--prompt", "hello world", "--method", "speed")
    cases = [
        ((*base, "--cut", 5), "outside 1..4"),
        ((*base, "--cut", "0"), "outside 1..4"),
        ((*base, "--anchors", "3,40"), "anchor row 40 is past the 11-token prompt"),
        ((*base, "--adapter", tiny_adapter, "--cut", 3), "trained for SPEED cut 2"),
        ((*base, "--adapter", tiny_adapter, "--anchors", "bos"), "trained with SPEED anchors first:2, not bos"),
        ((*base, "--adapter", tiny_adapter, "--tail", 1), "trained with SPEED tail 3, not 1"),
        (("generate", "--model", tiny_model_dir, "--prompt", "hello world", "--adapter", tiny_adapter), "use it with --method speed"),
        (("generate", "--model", other, "--prompt", "hi", "--method", "speed", "--adapter", tiny_adapter), "trained on"),
        ((*base, "--adapter", tmp_path / "none.safetensors"), "does not exist"),
        (("fit", "speed", "--model", tiny_model_dir, "--cut", "9"), "outside 1..4"),
    ]
    _assert_one_line_errors(cases)


def test_bench_and_eval_speed_json(tiny_model_dir, tiny_adapter, tmp_path):
    bench = _run("bench", "speed", "--model", tiny_model_dir, "--tokens", 40, "--cuts", "2,0.75", "--tail", 1, "--runs", 1, "--decode-tokens", 3, "--plot", tmp_path / "s.png", "--json")
    assert bench.exit_code == 0, bench.output
    rows = _last_json(bench)["results"]
    assert [(r["tokens"], r["cut"]) for r in rows] == [(40, 2), (40, 3)]
    for r in rows:
        for key in ("cut_fraction", "ttft_speedup", "tpot_speedup", "kv_reduction_pct", "ttft_ceiling", "tpot_ceiling"):
            assert key in r
    assert rows[0]["kv_reduction_pct"] > rows[1]["kv_reduction_pct"] > 0
    assert (tmp_path / "s.png").is_file()
    ev = _run("eval", "speed", "--model", tiny_model_dir, "--adapter", tiny_adapter, "--samples", 2, "--max-tokens", 200, "--needles", 1, "--needle-tokens", 16, "--json")
    assert ev.exit_code == 0, ev.output
    obj = _last_json(ev)
    assert set(obj["ppl_gap_pct"]) == set(obj["ppl_gap_ci"]) == {"speed", "adapted_exact", "adapted_speed"}
    assert set(obj["needle"]) == {"exact", "speed", "adapted_exact", "adapted_speed"} and obj["cut"] == 2
    assert set(obj["policy_gap_pct"]) == {"training_free", "adapted"}


ENGINE_COMMANDS = [["generate"], ["rollout"], ["demo"], ["bench", "exact"], ["eval", "exact"], ["fit", "ridgefill"], ["bench", "ridgefill"],
                   ["eval", "ridgefill"], ["fit", "speed"], ["bench", "speed"], ["eval", "speed"], ["bench", "ngram"], ["fit", "lingo"],
                   ["handoff"], ["eval", "lingo"], ["bench", "lingo"], ["serve"], ["bench", "serve"]]


def test_every_command_that_builds_an_engine_takes_dtype():
    for args in ENGINE_COMMANDS:
        assert "--dtype" in _run(*args, "--help").stdout, args


def test_dtype_bf16_runs_fp32_artifacts_and_is_recorded(tiny_model_dir, tiny_maps, tiny_adapter):
    """The default (`auto`) is bf16 where the CPU multiplies bf16 natively, else fp32; bf16 loads
    maps and adapters fitted in fp32; JSON says which ran."""
    from kvforge.cpu import multiplies_natively

    prompt = "the quick brown fox jumps over the lazy dog " * 2
    base = ("generate", "--model", tiny_model_dir, "--prompt", prompt, "-n", 4, "--json")
    assert _last_json(_run(*base))["dtype"] == ("bfloat16" if multiplies_natively("bfloat16") else "float32")
    for extra in ((), ("--method", "ridgefill", "--maps", tiny_maps, "--split", 2, "--tail", 8), ("--method", "speed", "--adapter", tiny_adapter),
                  ("--draft", "ngram")):
        result = _run(*base, "--dtype", "bf16", *extra)
        assert result.exit_code == 0, (extra, result.output)
        obj = _last_json(result)
        assert obj["dtype"] == "bfloat16" and len(obj["token_ids"]) == 4, extra
        if extra:
            assert obj["prefill"] == (extra[1] if extra[0] == "--method" else "exact"), extra
    bench = _run("bench", "exact", "--model", tiny_model_dir, "--tokens", 40, "--runs", 1, "--decode-tokens", 2, "--dtype", "bfloat16", "--json")
    assert bench.exit_code == 0, bench.output
    obj = _last_json(bench)
    assert obj["dtype"] == "bfloat16" and obj["results"][0]["kv_bytes"] == obj["results"][0]["kv_bytes_expected"]
    assert obj["results"][0]["max_abs_logit_diff"] < 0.1  # against transformers in bf16 too
    parity = _run("eval", "exact", "--model", tiny_model_dir, "--prompts", 1, "-n", 4, "--dtype", "bf16", "--json")
    assert parity.exit_code == 0, parity.output
    obj = _last_json(parity)  # both engines' bf16 measured against transformers' fp32: bf16's own rounding
    assert obj["dtype"] == "bfloat16" and 0 < obj["transformers_diff_vs_fp32"] < 0.1 and 0 < obj["max_abs_logit_diff_vs_fp32"] < 0.1
    _assert_one_line_errors([(("generate", "--model", tiny_model_dir, "--prompt", "hi", "--dtype", "int8"), "unknown dtype 'int8'")])


def test_generate_with_ngram_drafting_equals_plain_greedy(tiny_model_dir):
    args = ("generate", "--model", tiny_model_dir, "--prompt", "abcabcabcabcabc abcabc", "-n", 20, "--json")
    plain = _last_json(_run(*args))
    for extra in (("--draft", "ngram"), ("--draft", "ngram", "--prefetch", "--budget", 4), ("--draft", "prompt-lookup", "--k", 3)):
        obj = _last_json(_run(*args, *extra))
        assert obj["token_ids"] == plain["token_ids"] and obj["draft"] == extra[1]
        assert obj["speculative"]["steps"] <= len(obj["token_ids"])


def test_rollout_writes_one_jsonl_line_per_sample(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello hello hello"}) + "\n\n" + json.dumps({"prompt": "abc abc abc"}) + "\n")
    out = tmp_path / "rollouts.jsonl"
    result = _run("rollout", "--model", tiny_model_dir, "--prompts", prompts, "-G", 3, "-n", 8, "--seed", 1, "--no-chat", "--out", out, "--json")
    assert result.exit_code == 0, result.output
    summary = _last_json(result)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {(r["prompt_index"], r["sample"]) for r in rows} == {(p, s) for p in range(2) for s in range(3)}
    assert summary["tokens"] == sum(len(r["token_ids"]) for r in rows) and summary["samples_per_prompt"] == 3


def test_drafting_bad_input_is_one_line(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    cases = [
        (("generate", "--model", tiny_model_dir, "--prompt", "hi", "--draft", "medusa"), "unknown draft"),
        (("generate", "--model", tiny_model_dir, "--prompt", "hi", "--draft", "prompt-lookup", "--prefetch"), "--prefetch needs --draft ngram"),
        (("generate", "--model", tiny_model_dir, "--prompt", "hi", "--draft", "ngram", "--k", 0), "must be >= 1"),
        (("rollout", "--model", tiny_model_dir, "--prompts", bad), "bad.jsonl:1"),
        (("rollout", "--model", tiny_model_dir, "--prompts", tmp_path / "none.txt"), "does not exist"),
        (("bench", "ngram", "--model", tiny_model_dir, "--workload", "chat"), "unknown workload"),
    ]
    _assert_one_line_errors(cases)


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory):
    """A tiny Gemma 3 (k-norm, sliding layers) sharing the llama fixture's tokenizer."""
    from conftest import char_tokenizer, tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-gemma")
    tiny_hf_model("gemma3", seed=3).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_translator(tiny_gemma_dir, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lingo") / "t.safetensors"
    result = _run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--assign", "r2", "--nu", 2,
                  "--conversations", 2, "--max-chars", 300, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    obj = _last_json(result)
    assert obj["command"] == "fit lingo" and obj["tokens"] > 0 and len(obj["sources"]["k"]) == 4
    assert all(len(chosen) == 2 for chosen in obj["sources"]["v"])
    return out


def test_fit_lingo_writes_snapshots_and_moments_and_solves_from_them(tiny_gemma_dir, tiny_model_dir, tmp_path):
    out, moments = tmp_path / "t.safetensors", tmp_path / "m.safetensors"
    pair = ("--source", tiny_gemma_dir, "--target", tiny_model_dir)
    obj = _last_json(_run("fit", "lingo", *pair, "--nu", 1, "--conversations", 3, "--max-chars", 300, "--snapshots", "1,2",
                          "--save-moments", moments, "--out", out, "--json"))
    assert [s["conversations"] for s in obj["snapshots"]] == [1, 2] and obj["moments"] == portable_path(str(moments))
    assert obj["snapshots"][0]["tokens"] < obj["snapshots"][1]["tokens"] < obj["tokens"]
    assert [s["out"] for s in obj["snapshots"]] == ["t-1conv.safetensors", "t-2conv.safetensors"]  # reports name no machine path
    assert all((tmp_path / s["out"]).is_file() for s in obj["snapshots"])
    again = _last_json(_run("fit", "lingo", *pair, "--moments", moments, "--nu", 1, "--out", tmp_path / "again.safetensors", "--json"))
    assert again["tokens"] == obj["tokens"] and again["from_moments"] and again["sources"] == obj["sources"]
    r2 = _last_json(_run("fit", "lingo", *pair, "--moments", moments, "--assign", "r2", "--nu", 2, "--out", tmp_path / "r2.safetensors", "--json"))
    assert r2["assign"] == "r2" and all(len(chosen) == 2 for chosen in r2["sources"]["k"])
    _assert_one_line_errors([
        (("fit", "lingo", "--source", tiny_model_dir, "--target", tiny_gemma_dir, "--moments", moments), "accumulated for"),
        (("fit", "lingo", *pair, "--moments", moments, "--snapshots", "1"), "need a fit that prefills"),
        (("fit", "lingo", *pair, "--conversations", 2, "--snapshots", "2"), "between 0 and --conversations (2)"),
        (("fit", "lingo", *pair, "--snapshots", "a,b"), "comma-separated conversation counts"),
        (("fit", "lingo", *pair, "--moments", tmp_path / "none.safetensors"), "no moments at"),
        (("fit", "lingo", *pair, "--stage", 2, "--moments", moments), "are stage-1 options"),
    ])


def test_handoff_generates_from_the_translated_cache(tiny_gemma_dir, tiny_model_dir, tiny_translator):
    obj = _last_json(_run("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator,
                          "--prompt", "the cat sat on the mat. the cat", "-n", 5, "--json"))
    assert obj["command"] == "handoff" and obj["tokens"] == obj["source_tokens"] == 31
    assert len(obj["token_ids"]) == 5 and obj["ttft_s"] >= obj["translate_s"] > 0
    tailed = _last_json(_run("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator,
                             "--prompt", "the cat sat on the mat. the cat", "-n", 5, "--native-tail", 6, "--json"))
    assert tailed["native_tail"] == 6 and len(tailed["token_ids"]) == 5


def test_handoff_turns_alternates_models_and_translates_only_new_tokens(tiny_gemma_dir, tiny_model_dir, tiny_translator, tmp_path, monkeypatch):
    back = tmp_path / "back.safetensors"
    assert _run("fit", "lingo", "--source", tiny_model_dir, "--target", tiny_gemma_dir, "--nu", 1, "--conversations", 2,
                "--max-chars", 300, "--out", back).exit_code == 0
    turns = tmp_path / "turns.txt"
    turns.write_text("hello there\n\nhow are you\nand then?\n")
    args = ("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator,
            "--back-translator", back, "--turns", turns, "-n", 4)
    obj = _last_json(_run(*args, "--json"))
    rows = obj["turns"]
    assert rows[0]["speaker"] == rows[2]["speaker"] != rows[1]["speaker"]
    assert rows[0]["translated_rows"] == 0 and 0 < rows[1]["translated_rows"] <= rows[1]["caught_up_rows"]
    assert rows[2]["translated_rows"] == rows[2]["caught_up_rows"]  # mid-conversation: every caught-up row translated
    naive = _last_json(_run(*args, "--mode", "naive", "--json"))["turns"]
    assert naive[2]["translated_rows"] > rows[2]["translated_rows"]  # the whole prefix again
    # bf16: the maps of both directions run in bf16 on each turn's new rows, the same rows as in fp32
    import torch

    from kvforge.translate.translator import Translator

    ran_in, in_dtype = [], Translator.in_dtype
    monkeypatch.setattr(Translator, "in_dtype", lambda self, dtype: ran_in.append((self.target.name, dtype)) or in_dtype(self, dtype))
    rows16 = _last_json(_run(*args, "--dtype", "bf16", "--json"))["turns"]
    assert [r["translated_rows"] for r in rows16] == [r["translated_rows"] for r in rows]
    assert {dtype for _, dtype in ran_in} == {torch.bfloat16} and len({name for name, _ in ran_in}) == 2  # both directions
    bad = _run(*args, "--mode", "relay")
    assert bad.exit_code == 2 and "--mode must be one of" in bad.stderr


def empty_turns(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n")
    return path


def test_lingo_bad_input_is_one_line(tiny_gemma_dir, tiny_model_dir, tiny_translator, tmp_path):
    base = ("--translator", tiny_translator, "--prompt", "hello there")
    cases = [
        (("handoff", "--source", tiny_model_dir, "--target", tiny_gemma_dir, *base), "other direction"),
        (("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, *base, "--capture", "post-rope"), "reads keys at pre-norm, not post-rope"),
        (("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator, "--prompt", " "), "empty prompt"),
        (("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tmp_path / "no.safetensors", "--prompt", "x"), "no translator"),
        (("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator, "--turns", empty_turns(tmp_path)), "holds no user message"),
        (("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator, "--turns", empty_turns(tmp_path),
          "--native-tail", 4), "--native-tail applies to one text"),
        (("handoff", "--source", tiny_gemma_dir, "--target", tiny_model_dir, *base, "--native-tail", -1), "native tail must be >= 0 tokens"),
        (("eval", "lingo", "--translator", tiny_translator, "--samples", 0, "--multiturn", 2, "--native-tail", 4), "with --multiturn each new message"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--assign", "magic"), "unknown layer assignment"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--capture", "mid-rope"), "unknown capture point"),
    ]
    _assert_one_line_errors(cases)


def test_eval_lingo_compares_translators_asks_questions_and_replays_turns(tiny_gemma_dir, tiny_model_dir, tiny_translator, tmp_path):
    back = tmp_path / "back.safetensors"
    assert _run("fit", "lingo", "--source", tiny_model_dir, "--target", tiny_gemma_dir, "--nu", 1, "--conversations", 2,
                "--max-chars", 300, "--out", back).exit_code == 0
    ev = _run("eval", "lingo", "--translator", tiny_translator, "--compare", tiny_translator, "--samples", 2, "--prefix-chars", 150,
              "--continuation-chars", 40, "--plot", tmp_path / "cka.png", "--qa", 2, "--qa-prefix-chars", 200, "--multiturn", 2,
              "--turns", 3, "--turn-chars", 20, "--back-translator", back, "--native-tail", 2, "--json")
    assert ev.exit_code == 0, ev.output
    obj = _last_json(ev)
    assert obj["native_tail"] == 2 and obj["multiturn"]["native_tail"] == 0  # the tail is the single-text arms'; turns prefill their own
    same = obj["compare"]["t"]  # the same translator again: the same numbers
    assert same["bpb"] == pytest.approx(obj["bpb_target_translated"]) and same["kl"] == pytest.approx(obj["kl"], abs=1e-9)
    assert obj["kl_ci"][0] <= obj["kl"] <= obj["kl_ci"][1]
    assert obj["qa"]["questions"] == 2 and set(obj["qa"]["accuracy"]) == {"target_native", "translated", "t", "source_native"}
    assert all(a in (0, 50, 100) for a in obj["qa"]["accuracy"].values())  # percent of 2 questions
    mt = obj["multiturn"]
    assert mt["conversations"] == 2 and len(mt["native"]["bpb_per_turn"]) == 3 and mt["speakers"][0] != mt["speakers"][1]
    assert mt["alternated"]["bpb_per_turn"][0] == pytest.approx(mt["native"]["bpb_per_turn"][0])  # turn 1: no switch yet
    assert mt["naive"]["translated_rows_per_switch"][2] > mt["alternated"]["translated_rows_per_switch"][2]
    assert Path(mt["plot"]).is_file() and mt["tokens"] > 0 and len(mt["alternated"]["gap_to_native_percent"]) == 3
    Path(mt["plot"]).unlink()


def test_eval_and_bench_lingo_json(tiny_gemma_dir, tiny_model_dir, tiny_translator, tmp_path):
    ev = _run("eval", "lingo", "--translator", tiny_translator, "--samples", 2, "--prefix-chars", 200, "--continuation-chars", 60,
              "--plot", tmp_path / "cka.png", "--json")
    assert ev.exit_code == 0, ev.output
    obj = _last_json(ev)
    for key in ("bpb_target_native", "bpb_target_translated", "bpb_source_native", "bpb_target_zero", "kl", "r2_keys_mean", "r2_values_mean"):
        assert obj[key] == obj[key], key  # a number, not NaN
    assert obj["kl"] >= 0 and len(obj["cka_keys"]) == 4 and len(obj["cka_keys"][0]) == 4
    assert all(0 <= c <= 1 + 1e-9 for row in obj["cka_values"] for c in row)
    assert (tmp_path / "cka.png").is_file()
    for arm in ("source_native", "target_native"):
        paired = obj["paired"][f"target_translated_minus_{arm}"]  # the difference of the two arms, its interval around it
        assert paired["bpb"] == pytest.approx(obj["bpb_target_translated"] - obj[f"bpb_{arm}"], abs=1e-9)
        assert paired["ci"][0] <= paired["bpb"] <= paired["ci"][1]
    kinds = obj["error_by_alignment"]
    assert sum(k["rows"] for k in kinds.values()) == obj["translated_rows"]
    for share in ("row_share", "key_error_share", "value_error_share"):
        assert sum(k[share] for k in kinds.values()) == pytest.approx(1.0)
    # bf16: the maps run in bf16, the zero baseline's too (made under inference mode)
    ev16 = _run("eval", "lingo", "--translator", tiny_translator, "--samples", 1, "--prefix-chars", 200, "--continuation-chars", 60,
                "--dtype", "bf16", "--plot", tmp_path / "cka16.png", "--json")
    assert ev16.exit_code == 0, ev16.output
    assert 0 < _last_json(ev16)["bpb_target_translated"] < float("inf")
    bench = _run("bench", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator,
                 "--tokens", 40, "--runs", 1, "--json")
    assert bench.exit_code == 0, bench.output
    report = _last_json(bench)
    assert report["translator"] == portable_path(str(tiny_translator)) and report["stage"] == 1  # the report names the maps it timed
    row = report["results"][0]
    # keys and values x 4 layers x (2 source layers of 32 + 2 own tokens of 64 (the hidden size)) x 32
    assert row["tokens"] == 40 and row["speedup"] > 0 and row["translator_macs_per_token"] == 2 * 4 * (64 + 2 * 64) * 32
    # own-token terms once per distinct token: fewer MACs per row than the per-row bound, more than the source part
    assert 2 * 4 * 64 * 32 < row["translator_macs_per_translated_row"] < row["translator_macs_per_token"]
    tailed = _run("bench", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--translator", tiny_translator,
                  "--tokens", 40, "--runs", 1, "--native-tail", 8, "--json")
    assert tailed.exit_code == 0, tailed.output
    tail_row = _last_json(tailed)["results"][0]
    assert tail_row["native_tail"] == 8 and tail_row["ceiling"] < row["ceiling"]  # the tail's rows cost a prefill, not a map


def test_a_native_tail_over_the_whole_prefix_scores_as_the_native_cache(tiny_model_dir, tiny_translator, tmp_path):
    ev = _run("eval", "lingo", "--translator", tiny_translator, "--samples", 2, "--prefix-chars", 200, "--continuation-chars", 60,
              "--native-tail", 1000, "--plot", tmp_path / "cka.png", "--json")
    assert ev.exit_code == 0, ev.output
    obj = _last_json(ev)
    assert obj["native_tail"] == 1000 and obj["kl"] == pytest.approx(0, abs=1e-6)
    assert obj["bpb_target_translated"] == pytest.approx(obj["bpb_target_native"], rel=1e-5) == obj["bpb_target_zero"]
    short = _run("eval", "lingo", "--translator", tiny_translator, "--samples", 2, "--prefix-chars", 200, "--continuation-chars", 60,
                 "--native-tail", 16, "--plot", tmp_path / "cka.png", "--json")
    assert _last_json(short)["kl"] > 1e-4  # most rows still translated


def test_fit_lingo_stage_2_distills_from_a_stage_1_translator(tiny_gemma_dir, tiny_model_dir, tiny_translator, tmp_path, monkeypatch):
    out, ckpt = tmp_path / "t2.safetensors", tmp_path / "ckpt.pt"
    result = _run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator,
                  "--steps", 2, "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--checkpoint", ckpt, "--out", out, "--plot", tmp_path / "kl.png",
                  "--heldout-every", 1, "--heldout-samples", 2, "--json")
    assert result.exit_code == 0, result.output
    obj = _last_json(result)
    assert obj["stage"] == 2 and obj["steps"] == 2 and obj["validation_kl"][-1][0] == 2 and ckpt.is_file()
    assert [step for step, _ in obj["heldout_bpb"]] == [0, 1, 2] and obj["heldout_samples"] == 2
    assert set(obj["heldout_reference"]) == {"target_native", "source_native"} and all(b > 0 for _, b in obj["heldout_bpb"])
    assert (tmp_path / "kl.png").stat().st_size > 0
    from kvforge.translate.translator import Translator

    assert Translator.load(out).info["stage"] == 2
    # Without --out: beside stage 1's default, the model paths made file-safe (the run resumes the finished checkpoint).
    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path / "home"))
    default = _run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator,
                   "--steps", 2, "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--checkpoint", ckpt, "--plot", tmp_path / "kl.png", "--json")
    assert default.exit_code == 0, default.output
    reported = _last_json(default)["out"]  # reports name $KVFORGE_HOME, not the machine's path
    assert reported.startswith("$KVFORGE_HOME/translators/") and reported.endswith("-stage2.safetensors")
    written = tmp_path / "home" / reported.removeprefix("$KVFORGE_HOME/")
    assert written.is_file()
    bad = _run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2)
    assert bad.exit_code == 2 and "needs --init" in bad.stderr
    # In pieces: paused at step 1 (its translator beside the final file's name), then on without the held-out flags
    pieces, ckpt2 = tmp_path / "long.safetensors", tmp_path / "long.pt"
    stage2 = ("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator, "--steps", 3,
              "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--checkpoint", ckpt2, "--out", pieces, "--plot", tmp_path / "long.png")
    first = _last_json(_run(*stage2, "--pause-at", 1, "--heldout-every", 1, "--heldout-samples", 2, "--json"))
    assert first["steps"] == 1 and first["planned_steps"] == 3 and first["out"].endswith("long-step1.safetensors") and not pieces.exists()
    assert [step for step, _ in first["heldout_bpb"]] == [0, 1]
    rest = _run(*stage2)  # the scores taken so far come back from the checkpoint
    assert rest.exit_code == 0, rest.output
    assert "held-out bits per byte [(0," in rest.stderr and pieces.is_file()
    other = _run(*stage2, "--heldout-every", 1, "--heldout-samples", 3)
    assert other.exit_code == 2 and "same held-out settings" in other.stderr
    tailed = _last_json(_run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator,
                             "--steps", 1, "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--native-tail", 8, "--out", tmp_path / "tail.safetensors",
                             "--plot", tmp_path / "kl.png", "--json"))
    assert tailed["native_tail"] == 8 and Translator.load(tmp_path / "tail.safetensors").info["distill"]["native_tail"] == 8
    nonlinear = _last_json(_run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator,
                                "--steps", 1, "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--residual", 4, "--out", tmp_path / "mlp.safetensors",
                                "--plot", tmp_path / "kl.png", "--json"))
    assert nonlinear["residual"] == 4 and Translator.load(tmp_path / "mlp.safetensors").residual == 4
    # an init with a branch goes on training it; another width is refused before anything loads
    again = _last_json(_run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tmp_path / "mlp.safetensors",
                            "--steps", 1, "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--out", tmp_path / "mlp2.safetensors",
                            "--plot", tmp_path / "kl.png", "--json"))
    assert again["residual"] == 4 and Translator.load(tmp_path / "mlp2.safetensors").residual == 4
    other = _run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tmp_path / "mlp.safetensors",
                 "--residual", 8)
    assert other.exit_code == 2 and "width 4, not --residual 8" in other.stderr
    streamed = _last_json(_run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator,
                               "--steps", 2, "--lr", 1e-3, "--accumulate", 2, "--stream", "--out", tmp_path / "streamed.safetensors",
                               "--plot", tmp_path / "kl.png", "--json"))
    assert streamed["stream"] and streamed["samples"] == 4 and streamed["samples_drawn"] == 4 and len(streamed["losses"]) == 2
    assert Translator.load(tmp_path / "streamed.safetensors").info["distill"]["stream"]
    layered = _last_json(_run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator,
                              "--steps", 1, "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--layer-weight", 0.5,
                              "--out", tmp_path / "layered.safetensors", "--plot", tmp_path / "kl.png", "--json"))
    assert layered["layer_weight"] == 0.5 and Translator.load(tmp_path / "layered.safetensors").info["distill"]["layer_weight"] == 0.5
    _assert_one_line_errors([
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stream"), "is a stage-2 option"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--layer-weight", 1), "is a stage-2 option"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator, "--stream", "--lr-sweep"),
         "leave out --stream"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator, "--stream", "--samples", 8),
         "leave out --samples"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator, "--stream",
          "--steps", 100000), "the training conversations hold"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--native-tail", 8), "is a stage-2 option"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--heldout-every", 8), "is a stage-2 option"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--residual", 8), "is a stage-2 option"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator, "--heldout-samples", 0),
         "--heldout-samples >= 1"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator, "--pause-at", 3),
         "--pause-at needs"),
        (("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator, "--native-tail", -1),
         "must be >= 0"),
    ])


def test_fit_lingo_lr_sweep_reports_every_rate_and_picks_an_interior_one(tiny_gemma_dir, tiny_model_dir, tiny_translator):
    result = _run("fit", "lingo", "--source", tiny_gemma_dir, "--target", tiny_model_dir, "--stage", 2, "--init", tiny_translator,
                  "--steps", 1, "--lr", 1e-3, "--accumulate", 1, "--samples", 2, "--lr-sweep", "--json")
    assert result.exit_code == 0, result.output
    obj = _last_json(result)
    rates = [r["lr"] for r in obj["lr_sweep"]]
    assert len(rates) >= 5 and rates == sorted(rates) and rates[0] < obj["lr_selected"] < rates[-1]


def test_bench_vllm_handoff_refuses_bad_settings_before_loading_anything():
    pytest.importorskip("vllm")
    _assert_one_line_errors([
        (("bench", "vllm-handoff", "--runs", 0), "--runs must be >= 1"),
        (("bench", "vllm-handoff", "--source-engine", "tgi"), "unknown --source-engine"),
        (("bench", "vllm-handoff", "--native-tail", -1), "--native-tail must be >= 0"),
    ])


def test_speed_in_vllm_refuses_bad_settings_and_non_llama_checkpoints(tiny_gemma_dir):
    pytest.importorskip("vllm")
    _assert_one_line_errors([
        (("bench", "vllm-speed", "--runs", 0), "--runs and --decode-tokens must be >= 1"),
        (("bench", "vllm-speed", "--decode-tokens", 0), "--runs and --decode-tokens must be >= 1"),
        (("eval", "speed", "--engine", "tgi"), "unknown --engine"),
        (("bench", "vllm-speed", "--model", tiny_gemma_dir, "--cut", 1, "--tail", 2, "--tokens", 16), "serves Llama checkpoints"),
        (("eval", "speed", "--engine", "vllm", "--model", tiny_gemma_dir, "--cut", 1, "--tail", 2), "serves Llama checkpoints"),
    ])


def test_bench_ridgefill_refuses_a_decode_length_with_no_speed_before_loading_anything():
    _assert_one_line_errors([
        (("bench", "ridgefill", "--decode-tokens", 1), "--decode-tokens must be 0 or >= 2"),
        (("bench", "ridgefill", "--decode-tokens", -3), "--decode-tokens must be 0 or >= 2"),
    ])


def test_a_figure_is_named_by_a_model_directory_not_its_whole_path(tmp_path):
    from kvforge.paths import figure_name

    (tmp_path / "llama-1b").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"")
    assert figure_name(str(tmp_path / "llama-1b")) == "llama-1b" and figure_name(str(tmp_path / "m.gguf")) == "m"
    assert figure_name("smollm2-135m") == "smollm2-135m" and figure_name("org/model") == "org_model"
