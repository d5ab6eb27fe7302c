"""The ppo-fast command as a newcomer meets it: every user error is one `ppo-fast: error:` line
naming the option or file (before any model is loaded), prompt files are read as written,
config files accept what people write, and custom models get held-out evaluations."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppo_fast.cli import main
from ppo_fast.trainer import ConfigError, PPOTrainer, TrainerConfig, checkpoint, command_line, default_task
from ppo_fast.trainer import config as config_module
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.prompts import Columns, read_prompts
from ppo_fast.trainer.scoring import FunctionScorer, load_reward_fn

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- the command line itself


def test_console_script_points_at_the_launcher():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'ppo-fast = "ppo_fast_cli:main"' in pyproject and 'py-modules = ["ppo_fast_cli"]' in pyproject


def test_the_config_module_repeats_the_contract_names():
    from ppo_fast import spec as contract

    assert config_module.AGG_MODES == contract.AGG_MODES
    assert config_module.KL_ESTIMATORS == contract.KL_ESTIMATORS
    assert config_module.ROLLOUT_CORRECTION_MODES == contract.ROLLOUT_CORRECTION_MODES


# ---------------------------------------------------------------------- config files


def test_yaml_numbers_written_as_people_write_them(tmp_path):
    path = tmp_path / "c.yaml"
    # PyYAML reads 1e-4 (no dot) as a string; '100' quoted is a string too.
    path.write_text("learning_rate: 1e-4\nsteps: '100'\nkl_coef: 1\nsave_every: 1e2\nbf16: false\n")
    cfg = TrainerConfig.from_file(path)
    assert (cfg.learning_rate, cfg.steps, cfg.kl_coef, cfg.save_every, cfg.bf16) == (1e-4, 100, 1.0, 100, False)
    assert isinstance(cfg.kl_coef, float) and isinstance(cfg.save_every, int)
    path.write_text("steps: 1.5\n")
    with pytest.raises(ConfigError, match=r"steps must be an integer \(int\), got 1.5"):
        TrainerConfig.from_file(path)
    path.write_text("learning_rate: fast\n")
    with pytest.raises(ConfigError, match="learning_rate must be a number"):
        TrainerConfig.from_file(path)


# ---------------------------------------------------------------------- prompt files


def test_prompt_file_formats(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    assert read_prompts(str(txt)).texts == ["first", "second"]
    array = tmp_path / "p.json"
    array.write_text(json.dumps(["1+1=", {"prompt": "2+2=", "answer": 4}]))
    prompts = read_prompts(str(array))
    assert prompts.texts == ["1+1=", "2+2="] and prompts.answers == [None, "4"] and not prompts.all_answered
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a", "answer": "x"}\n"b"\n')
    prompts = read_prompts(str(jsonl))
    assert prompts.texts == ["a", "b"] and prompts.answers == ["x", None]


@pytest.mark.parametrize(
    "option, name, text, expected",
    [
        ("--config", "missing.yaml", None, ": no such file"),
        ("--config", "bad.yaml", "steps: [1\n", ": not valid YAML"),
        ("--config", "list.yaml", "- steps\n", ": expected a mapping of option names"),
        ("--config", "bad.json", "{steps: 1}", ": not valid JSON"),
        ("--config", "typo.yaml", "kl_coeff: 0.1\n", ": unknown option(s) kl_coeff"),
        (
            "--prompts-file",
            "p.jsonl",
            '{"prompt": "a"}\n{"question": "b", "answer": "c"}\n',
            ", line 2: no 'prompt' field (its keys: 'question', 'answer')",
        ),
        ("--prompts-file", "p.jsonl", '{"prompt": "a"}\nnot json\n', ", line 2: not valid JSON"),
        ("--prompts-file", "p.json", '{"prompt": "a"}', ": expected a JSON list of prompts"),
        ("--prompts-file", "p.json", '[{"prompt": ""}]', ", item 0: 'prompt' must be a non-empty string"),
        ("--prompts-file", "p.tsv", "prompt\ta\n", ": unknown file type .tsv"),
        ("--prompts-file", "p.txt", "\n\n", ": holds no prompts"),
        ("--prompts-file", "absent.txt", None, ": no such file"),
        ("--eval-prompts-file", "eval.jsonl", '{"text": "a"}\n', ", line 1: no 'prompt' field"),
    ],
)
def test_file_errors_are_one_line_naming_the_option_before_loading_models(
    tmp_path, error_line, option, name, text, expected
):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    argv = ["train", option, str(path), "--output-dir", str(tmp_path / "out")]
    if option == "--prompts-file":  # a custom model's, its folder never read: the prompt file fails first
        (tmp_path / "model").mkdir()
        for file in ("config.json", "tokenizer.json"):
            (tmp_path / "model" / file).write_text("{}")
        argv += ["--model-name-or-path", str(tmp_path / "model"), "--reward-fn", "json:dumps"]
    assert main(argv) == 1
    assert f"{option} {path}{expected}" in error_line()
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- models, rewards, backends


@pytest.mark.parametrize("option", ["--model-name-or-path", "--reward-model"])
def test_a_missing_model_folder_is_one_line(tmp_path, error_line, option):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    argv = ["train", option, "./no-such-model", "--output-dir", str(tmp_path / "out")]
    if option == "--model-name-or-path":
        argv += ["--prompts-file", str(prompts), "--reward-fn", "json:dumps"]
    assert main(argv) == 1
    line = error_line()
    assert f"{option} ./no-such-model: no such directory" in line
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("x")
    assert main([a if a != "./no-such-model" else str(not_a_model) for a in argv]) == 1
    assert "is a file; give the folder written by save_pretrained()" in error_line()
    (tmp_path / "empty").mkdir()
    assert main([a if a != "./no-such-model" else str(tmp_path / "empty") for a in argv]) == 1
    assert "no config.json in this folder" in error_line()


def test_a_hub_name_that_is_neither_cached_nor_reachable_is_one_line(tmp_path, error_line, monkeypatch):
    """A bare name (`--reward-model my-rm`, meant as a folder or a hub id): no minutes of retries."""
    from ppo_fast.trainer import models

    monkeypatch.setattr(models, "_hub_reachable", lambda: False)
    assert main(["train", "--reward-model", "no-such-rm-xyz", "--output-dir", str(tmp_path / "out")]) == 1
    line = error_line()
    assert "--reward-model no-such-rm-xyz: no such directory" in line and "the hub cannot be reached" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path, error_line):
    assert main(["train", "--device", "cuda", "--output-dir", str(tmp_path / "out")]) == 1
    assert "--device cuda: no CUDA GPU is visible to torch" in error_line()


def test_backend_that_cannot_serve_the_device_fails_before_loading(tmp_path, error_line, monkeypatch):
    """--backend triton on a CPU (tests run Triton in its interpreter, so make it unavailable as for a user)."""
    from ppo_fast import backends

    monkeypatch.setitem(backends._INFO, "triton", backends.BackendInfo(False, "no CUDA device", None))
    assert main(["train", "--backend", "triton", "--device", "cpu", "--output-dir", str(tmp_path / "out")]) == 1
    line = error_line()
    assert (
        "--backend triton cannot run this job on cpu: token_logprobs: backend 'triton' is unavailable: no CUDA device"
        in line
    )
    assert "use --backend auto" in line and not (tmp_path / "out").exists()


def test_console_script_finds_the_reward_module_in_the_working_directory(tmp_path):
    """The launcher runs as the console script does (its own folder on sys.path, not the working
    directory): --reward-fn my_rewards:... is imported from the working directory."""
    (tmp_path / "my_rewards.py").write_text(
        "def exact_match(prompts, responses, answers):\n    return [0.0] * len(responses)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A function name that does not exist: the module was found if the error lists what it defines.
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "ppo_fast_cli.py"),
            *"train --reward-fn my_rewards:exact --output-dir out".split(),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr
    assert (
        out.stderr.strip() == "ppo-fast: error: --reward-fn my_rewards:exact: 'my_rewards' has no function 'exact' "
        "(it defines: exact_match)"
    )
    assert not (tmp_path / "out").exists()


def test_reward_fn_import_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(
        ConfigError,
        match=r"no module 'nowhere_rewards' in the working directory .* --reward-fn path/to/nowhere_rewards.py:f",
    ):
        load_reward_fn("nowhere_rewards:f")
    (tmp_path / "broken_rewards.py").write_text("import not_a_package_anywhere\n\n\ndef f(p, r):\n    return [0.0]\n")
    with pytest.raises(
        ConfigError,
        match="importing 'broken_rewards' failed: ModuleNotFoundError: No module named 'not_a_package_anywhere'",
    ):
        load_reward_fn("broken_rewards:f")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file_rewards.py").write_text("def score(p, r):\n    return [1.0] * len(r)\n")
    fn = load_reward_fn("sub/file_rewards.py:score")
    assert fn(["a"], ["b"]) == [1.0]
    assert load_reward_fn("ppo_fast.trainer.default_task:addition_reward") is default_task.addition_reward
    with pytest.raises(ConfigError, match="no such file"):
        load_reward_fn("sub/none.py:score")
    with pytest.raises(ConfigError, match="must look like 'module:function'"):
        load_reward_fn("my_rewards")


def test_reward_functions_get_the_answers_when_they_take_them():
    seen = []

    def with_answers(prompts, responses, answers):
        seen.append(answers)
        return [float(r == a) for r, a in zip(responses, answers)]

    scorer = FunctionScorer(with_answers)
    scores = scorer(["p", "q"], ["x", "y"], torch.device("cpu"), ["x", None])
    assert scores.tolist() == [1.0, 0.0] and seen == [["x", None]]
    assert FunctionScorer(lambda p, r: [0.0] * len(r)).takes_answers is False


# ---------------------------------------------------------------------- resume


def test_resume_with_another_critic_mode_is_one_line(run, error_line):
    resume = ["train", "--output-dir", str(run), "--resume", "--steps", "3"]
    assert main([*resume, "--critic", "shared"]) == 1
    line = error_line()
    assert "--resume: the checkpoint" in line and "was trained with --critic separate (" in line
    assert "resume with --critic separate" in line
    assert main([*resume, "--advantage-method", "grpo", "--group-size", "2"]) == 1
    assert "was trained with --advantage-method gae (with a critic); resume with --advantage-method gae" in error_line()


def test_resume_of_a_finished_run_changes_nothing(run):
    def saved() -> list:
        return [(p.name, (p / checkpoint.STATE_FILE).stat().st_mtime_ns) for p in sorted(run.glob("checkpoints/*"))]

    before, messages = saved(), []
    cfg = TrainerConfig(
        output_dir=str(run), steps=2, resume=True, sft_steps=10, eval_size=16, batch_size=4, num_mini_batches=1
    )
    summary = PPOTrainer(cfg, log=messages.append).train()
    assert summary["stop_reason"] == "done" and summary["steps_done"] == 2 and "eval_after" in summary
    assert any("already did 2 steps (--steps 2); nothing to do" in m for m in messages)
    assert not any(m.startswith("time per phase") for m in messages)
    assert saved() == before


# ---------------------------------------------------------------------- custom models: evals, lengths


def test_custom_model_with_eval_prompts_gets_before_after_and_periodic_scores(finished_run, tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(json.dumps({"prompt": default_task.prompt(a, 11), "answer": str(a + 11)}) + "\n" for a in range(10, 40))
    )
    held_out = tmp_path / "eval.json"
    held_out.write_text(json.dumps([{"prompt": default_task.prompt(a, 12), "answer": a + 12} for a in range(40, 48)]))
    (tmp_path / "answer_rewards.py").write_text(
        "def exact(prompts, responses, answers):\n"
        "    return [float(a is not None and r.strip() == a) for r, a in zip(responses, answers)]\n"
    )
    out = tmp_path / "custom"
    argv = ["train", "--model-name-or-path", str(finished_run / "warmup"), "--prompts-file", str(train)]
    argv += ["--eval-prompts-file", str(held_out), "--reward-fn", f"{tmp_path / 'answer_rewards.py'}:exact"]
    argv += ["--output-dir", str(out), *"--steps 2 --eval-every 1 --batch-size 4 --num-mini-batches 1".split()]
    code = main([*argv, *"--num-ppo-epochs 1 --sample-every 0".split()])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_before", "eval_after", "exact_match_before", "exact_match_after"):
        assert 0.0 <= summary[key] <= 1.0, key
    # The reward is exact match against the answers, so both held-out metrics agree.
    assert summary["eval_before"] == summary["exact_match_before"]
    rows = read_metrics(out / METRICS_FILE)
    assert "eval/score" in rows[0] and "eval/exact_match" in rows[0] and "eval/score" not in rows[1]
    saved = checkpoint.load_state(checkpoint.latest(out)).config
    assert saved["eval_prompts_file"] == str(held_out)
    # --resume from another base model of the same architecture (one weight changed): one line, no run.
    other = tmp_path / "other_base"
    shutil.copytree(finished_run / "warmup", other)
    weights = bytearray((other / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (other / "model.safetensors").write_bytes(bytes(weights))
    argv[argv.index(str(finished_run / "warmup"))] = str(other)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert main([*argv, "--resume", "--steps", "3"]) == 1
    assert "is another model" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_trl_style_data_and_several_rewards(finished_run, tmp_path, capsys):
    """A TRL user's dataset and rewards as they are: conversational prompts (a mapped column, or
    ``messages`` with the reply dropped) through a chat template, TRL-signature reward functions
    that read the rows' columns, several rewards weighted, each logged as rewards/<name>/mean, and
    the prompts over --max-prompt-length left out and counted."""
    rows = [
        {"question": [{"role": "user", "content": default_task.prompt(a, 11)}], "solution": str(a + 11), "level": a % 3}
        for a in range(10, 30)
    ]
    rows.append(
        {
            "messages": [{"role": "user", "content": "13+11="}, {"role": "assistant", "content": "24"}],
            "solution": "24",
            "level": 2,
        }
    )
    rows.append({"question": [{"role": "user", "content": "100+100+1="}], "solution": "201", "level": 0})  # 10 tokens
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "rewards.py").write_text(
        "def exact(prompts, completions, solution, **kwargs):\n"
        "    assert set(kwargs) == {'level'} and all(p.endswith('=') for p in prompts)\n"
        "    return [float(c.strip() == s) for c, s in zip(completions, solution)]\n\n\n"
        "def level(prompts, completions, level):\n"
        "    return [float(x) for x in level]\n\n\n"
        "def length(prompts, responses):\n"
        "    return [len(r) for r in responses]\n"
    )
    rewards = ",".join(f"{tmp_path / 'rewards.py'}:{name}" for name in ("exact", "level", "length"))
    out = tmp_path / "trl"
    argv = ["train", "--model-name-or-path", str(finished_run / "warmup"), "--prompts-file", str(train)]
    argv += [
        "--prompt-column",
        "question",
        "--answer-column",
        "solution",
        "--chat-template",
        str(tmp_path / "template.jinja"),
    ]
    argv += ["--reward-fn", rewards, "--reward-weights", "1,0.5,0", "--max-prompt-length", "7"]
    argv += ["--output-dir", str(out), *"--steps 2 --batch-size 4 --num-mini-batches 1 --num-ppo-epochs 1".split()]
    assert main([*argv, "--sample-every", "0"]) == 0, capsys.readouterr().err
    assert (
        "--prompts-file: 1 of 22 prompts are longer than --max-prompt-length 7 tokens: left out"
        in (out / "train.log").read_text()
    )
    for row in read_metrics(out / METRICS_FILE):
        parts = [row[f"rewards/{name}/mean"] for name in ("exact", "level", "length")]
        assert 0 <= parts[0] <= 1 and 0 <= parts[1] <= 2 and parts[2] > 0 and "rewards/length/std" in row
        assert row["objective/scores"] == pytest.approx(parts[0] + 0.5 * parts[1], abs=1e-5)


def test_prompts_from_datasets_files_map_columns(tmp_path):
    """.parquet and a save_to_disk folder through the datasets package, with the column mapping."""
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list([{"q": "1+2=", "a": 3, "topic": "sum"}, {"q": "2+2=", "a": 4, "topic": "sum"}])
    data.to_parquet(str(tmp_path / "p.parquet"))
    data.save_to_disk(str(tmp_path / "saved"))
    columns = Columns(prompt="q", answer="a")
    for path in (tmp_path / "p.parquet", tmp_path / "saved"):
        prompts = read_prompts(str(path), "--prompts-file", columns)
        assert prompts.texts == ["1+2=", "2+2="] and prompts.answers == ["3", "4"]
        assert prompts.columns == {"topic": ["sum", "sum"]}
    with pytest.raises(ConfigError, match="no 'prompt' field"):
        read_prompts(str(tmp_path / "p.parquet"), "--prompts-file")


def test_response_length_defaults(finished_run, tmp_path):
    fresh = tmp_path / "b"  # a new run (the finished run's folder is refused without --resume), its warm-up cached
    shutil.copytree(finished_run / "warmup", fresh / "warmup")
    builtin = PPOTrainer(TrainerConfig(output_dir=str(fresh), sft_steps=10, eval_size=16))
    assert builtin.response_length == config_module.BUILTIN_RESPONSE_LENGTH == 4
    tokenizer, messages = default_task.build_tokenizer(), []

    def custom(name: str, prompt: str, n_positions: int = 16, **options) -> PPOTrainer:
        """The built-in model (16 positions) as a custom one, on the one prompt ``prompt``."""
        model = default_task.build_model(tokenizer, 0)
        model.config.n_positions = n_positions
        given = dict(tokenizer=tokenizer, reward_fn=default_task.addition_reward, prompts=[prompt], log=messages.append)
        return PPOTrainer(TrainerConfig(output_dir=str(tmp_path / name), **options), policy=model, **given)

    assert custom("c", "1+2=", 512).response_length == config_module.CUSTOM_RESPONSE_LENGTH == 64  # the default fits
    assert custom("s", "12+34=").response_length == 16 - 6 and any("response length 10" in m for m in messages)
    with pytest.raises(
        ConfigError,
        match="--response-length 30 does not fit: the longest prompt has 6 tokens and the model 16 positions",
    ):
        custom("t", "12+34=", response_length=30)


def test_renamed_options_keep_working_for_a_release_with_a_warning(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("policy_loss: gspo\nloss_agg: token-sum\n")
    parser, _ = command_line.build_parser()
    argv = ["train", "--config", str(old), "--ent-coef", "0.01", "--num-samples-per-prompt", "2"]
    cfg = command_line.config_from_args(parser.parse_args(argv + ["--cliprange-value", "0.3"]))
    renamed = (cfg.loss_mode, cfg.agg, cfg.entropy_coef, cfg.group_size, cfg.value_clip)
    assert renamed == ("gspo", "token-sum", 0.01, 2, 0.3)
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [
        "ppo-fast: warning: --ent-coef is now --entropy-coef; the old name goes in the next release",
        "ppo-fast: warning: --num-samples-per-prompt is now --group-size; the old name goes in the next release",
        "ppo-fast: warning: --cliprange-value is now --value-clip; the old name goes in the next release",
        f"ppo-fast: warning: --config {old}: policy_loss is now loss_mode; the old name goes in the next release",
        f"ppo-fast: warning: --config {old}: loss_agg is now agg; the old name goes in the next release",
    ]
    assert "--policy-loss" not in parser._subparsers._group_actions[0].choices["train"].format_help()


def test_trls_cliprange_sets_both_ratio_clips_with_a_warning(tmp_path, capsys):
    parser, _ = command_line.build_parser()
    cfg = command_line.config_from_args(parser.parse_args(["train", "--cliprange", "0.1"]))
    assert (cfg.clip_eps_low, cfg.clip_eps_high) == (0.1, 0.1)
    from_file = tmp_path / "trl.yaml"
    from_file.write_text("cliprange: 0.15\ngrpo_norm_by_std: false\n")
    cfg = command_line.config_from_args(parser.parse_args(["train", "--config", str(from_file)]))
    assert (cfg.clip_eps_low, cfg.clip_eps_high, cfg.norm_by_std) == (0.15, 0.15, False)
    cfg = command_line.config_from_args(parser.parse_args(["train", "--no-grpo-norm-by-std"]))
    assert cfg.norm_by_std is False
    warnings = capsys.readouterr().err.splitlines()
    assert (
        warnings.count("ppo-fast: warning: --cliprange (TRL's name) sets --clip-eps-low and --clip-eps-high; use those")
        == 2
    )
    assert (
        warnings.count(
            "ppo-fast: warning: --grpo-norm-by-std is now --norm-by-std; the old name goes in the next release"
        )
        == 1
    )


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("--cliprange-valu", "--value-clip"),  # an old name is answered with its current one
        ("--clip-range", "--cliprange"),
        ("--kl-coeff", "--kl-coef"),
        ("--clip-eps", None),  # --clip-eps-low adds a word: another option, not a typo
        ("--value", None),
    ],
)
def test_did_you_mean_never_suggests_another_concept(typed, meant):
    assert command_line.did_you_mean(typed) == meant
