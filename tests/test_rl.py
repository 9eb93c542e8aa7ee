"""RL across epochs: the generated tasks and their rewards, the GRPO update, and `bench rl` on a
tiny model (plain and drafted rollouts token-identical every epoch, the policy moved between
epochs and loaded in place)."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import char_tokenizer, tiny_hf_model
from kvforge.cli import app
from kvforge.data.rl_tasks import problems, reward
from kvforge.grpo import GrpoConfig, GrpoTrainer, Rollout, advantages

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def test_problems_are_reproducible_and_the_held_out_split_is_apart():
    for task in ("sql", "arith"):
        train, again, held = problems(task, "train", 20), problems(task, "train", 20), problems(task, "heldout", 20)
        assert train == again and not {p.prompt for p in train} & {p.prompt for p in held}
        assert len({p.key for p in train + held}) == 40
    with pytest.raises(ValueError, match="unknown task"):
        problems("chess", "train", 1)


def test_sql_reward_gives_partial_credit_and_full_credit_for_equal_results():
    problem = problems("sql", "train", 1)[0]
    _, _, table, needed = problem.schema
    assert reward(problem, problem.answer) == 1.0
    assert reward(problem, f"```sql\n{problem.answer}\n```") == 1.0
    assert reward(problem, "I do not know.") == 0.0
    assert reward(problem, "SELECT nonsense FROM nowhere;") == 0.0  # does not run
    assert reward(problem, "SELECT 12345;") == pytest.approx(0.2)  # runs, wrong table and columns
    partial = reward(problem, f"SELECT {', '.join(needed)} FROM {table} WHERE 1 = 0;")
    assert partial == pytest.approx(0.6) or partial == 1.0  # the right table and columns (an empty gold result would match)


def test_arith_reward_wants_the_answer_line():
    problem = problems("arith", "train", 1)[0]
    assert reward(problem, f"so it is {problem.answer}.\nAnswer: {problem.answer}") == 1.0
    assert reward(problem, f"the answer is {problem.answer}") == pytest.approx(0.1)
    assert reward(problem, "Answer: -999999") == pytest.approx(0.2)
    assert reward(problem, "no idea") == 0.0


def test_group_advantages_are_normalised_and_zero_when_rewards_tie():
    a = advantages([1.0, 0.0, 0.0, 1.0])
    assert a == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_a_grpo_step_raises_the_rewarded_samples_likelihood_and_reports_its_kl():
    model = tiny_hf_model("llama", seed=0)
    trainer = GrpoTrainer(model, GrpoConfig(lr=1e-3))
    prompt, good, bad = [1, 5, 9, 4], [7, 7, 8], [30, 31, 32]
    group = [Rollout(prompt, good, 1.0), Rollout(prompt, bad, 0.0)]

    def logp(tokens):
        with torch.no_grad():
            return float(trainer._log_softmax([Rollout(prompt, tokens, 0.0)]).gather(1, torch.tensor(tokens).view(-1, 1)).sum())

    before_good, before_bad = logp(good), logp(bad)
    update = trainer.step([group])
    assert logp(good) > before_good and logp(bad) < before_bad
    assert update["trained_rollouts"] == 2 and update["kl_per_token"] > 0 and math.isfinite(update["loss"])
    tied = trainer.step([[Rollout(prompt, good, 0.5), Rollout(prompt, bad, 0.5)]])  # no advantage: nothing trained
    assert tied["trained_rollouts"] == 0 and tied["kl_per_token"] == pytest.approx(0.0, abs=1e-9)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "llama"
    model = tiny_hf_model("llama")
    model.generation_config.eos_token_id = 2
    model.config.max_position_embeddings = 1024  # a character per token: the task prompts are long
    model.save_pretrained(path)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("noise, lr, repeats, ungated", [("fresh", "1e-3", "1", False), ("coupled", "1e-6", "2", True)])
def test_bench_rl_runs_epochs_with_updates_loaded_in_place(model_dir, tmp_path, noise, lr, repeats, ungated, monkeypatch):
    # a random tiny model earns no task reward: a reward that varies with the text gives the groups advantages
    monkeypatch.setattr("kvforge.bench.rl.reward", lambda problem, text: (sum(map(ord, text)) % 5) / 4)
    result = CliRunner().invoke(app, ["bench", "rl", "-m", str(model_dir), "--task", "sql", "--epochs", "3", "-G", "4", "--prompts", "2",
                                      "-n", "12", "--noise", noise, "--lr", lr, "--heldout", "2", "--dtype", "fp32",
                                      "--repeats", repeats, "--plot", str(tmp_path / "rl.png"), "--json", *(["--ungated"] if ungated else [])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    rows = report["results"]
    arms = ("plain", "drafted", "ungated") if ungated else ("plain", "drafted")
    assert [(r["epoch"], r["arm"]) for r in rows] == [(e, a) for e in (1, 2, 3) for a in arms]
    assert all(r["token_identical"] for r in rows) and all(r["noise"] == noise for r in rows)  # every repeat too
    assert report["repeats"] == int(repeats)
    assert rows[0]["kl_to_previous"] is None and all(r["kl_to_previous"] > 0 for r in rows if r["epoch"] > 1)  # the policy moved
    drafted = [r for r in rows if r["arm"] == "drafted"]
    assert all(set(r["match_by_source"]) <= {"rollout", "chain", "lookup"} for r in drafted)
    assert "rollout" not in drafted[0]["match_by_source"]  # no earlier epoch to draft from
    if noise == "coupled":  # a policy that barely moved replays its samples: last epoch's rollouts land
        assert all(r["match_by_source"]["rollout"] > 0.5 for r in drafted[1:])
    if ungated:  # every proposal verified, drafting from the same history as the drafted arm
        every = [r for r in rows if r["arm"] == "ungated"]
        assert all(r["rows_drafted"] > 0 for r in every) and report["ungated"] is True
    assert (tmp_path / "rl.png").stat().st_size > 0


def test_bench_rl_bad_settings_are_one_line_errors(model_dir):
    for args, message in ((["--task", "chess"], "unknown task"), (["--noise", "warm"], "unknown noise"), (["--epochs", "0"], ">= 1"),
                          (["--engines", "sglang"], "unknown engines"), (["--repeats", "0"], ">= 1"),
                          (["--ungated", "--engines", "vllm"], "--ungated")):
        result = CliRunner().invoke(app, ["bench", "rl", "-m", str(model_dir), *args])
        assert result.exit_code == 2 and message in result.output, result.output
