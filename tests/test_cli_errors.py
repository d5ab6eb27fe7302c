"""The ppo-fast command's answers to mistakes: no abbreviated flags (a hint instead), negative
numbers as values, and errors in the options, config file, prompts files and model folders
reported before torch is imported (--help does not import it either)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ppo_fast_cli
from ppo_fast.cli import main
from ppo_fast.trainer import command_line
from ppo_fast.trainer.scoring import FunctionScorer, RewardError, load_reward_fn

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--steps", "three"], "argument --steps: invalid int value: 'three'"),
        (["train", "--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
        (["trian"], "invalid choice: 'trian'"),
        (["train", "--learning-rat", "1e-4"], "--learning-rat: did you mean --learning-rate?"),
        (["train", "--learning-rat=1e-4"], "--learning-rat: did you mean --learning-rate?"),
        (["train", "--lr", "1e-4"], "unrecognized arguments: --lr 1e-4"),
        (["train", "--kl-coeff", "0.1"], "--kl-coeff: did you mean --kl-coef?"),
    ],
)
def test_a_bad_command_line_is_one_line_with_a_hint(argv, expected, error_line):
    """A prefix (--learning-rat, --lr) is no longer taken for the flag it starts."""
    with pytest.raises(SystemExit) as stop:
        ppo_fast_cli.main(argv)
    assert stop.value.code == 2
    line = error_line()
    assert expected in line and "--help` lists the options" in line


@pytest.mark.parametrize(
    "text, value", [("-1e-4", -1e-4), ("-1E+2", -100.0), ("-0.5", -0.5), ("-.5", -0.5), ("-2", -2.0)]
)
def test_negative_numbers_are_values(text, value):
    parser, _ = command_line.build_parser()
    args = parser.parse_args(["train", "--learning-rate", text, "--kl-coef", text, "--seed", "-3"])
    assert args.learning_rate == value and args.kl_coef == value and args.seed == -3


@pytest.mark.parametrize("entry", [ppo_fast_cli.main, main], ids=["console-script", "python-m-ppo_fast"])
@pytest.mark.parametrize(
    "flag, message",
    [
        ("--learning-rate", "learning_rate (--learning-rate) must be > 0"),
        ("--kl-coef", "kl_coef (--kl-coef) must be >= 0"),
    ],
)
def test_a_negative_value_meets_the_options_own_check(entry, flag, message, tmp_path, error_line):
    """The console script (ppo_fast_cli) and python -m ppo_fast (ppo_fast.cli) share one parser and check."""
    assert entry(["train", flag, "-1e-4", "--output-dir", str(tmp_path / "x")]) == 1
    assert message in error_line()
    assert not (tmp_path / "x").exists()


# One subprocess runs every case: each must answer while torch (or anything heavy) is still not imported.
_FAST_ERRORS = """
import json, sys
import ppo_fast_cli
results = []
for argv in json.loads(sys.argv[1]):
    try:
        code = ppo_fast_cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    results.append([code, sorted(m for m in ('torch', 'transformers', 'ppo_fast', 'numpy') if m in sys.modules)])
print('RESULTS', json.dumps(results))
"""


def console_script(argvs: list[list[str]], **env: str) -> tuple[list, str, list[str]]:
    """Each command line through ppo_fast_cli.main, in one new interpreter: ``([exit status, the heavy
    modules imported] per command, what it printed before, its stderr's lines)``."""
    command = [sys.executable, "-c", _FAST_ERRORS, json.dumps(argvs)]
    out = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert "RESULTS" in out.stdout, out.stderr
    said, results = out.stdout.split("RESULTS", 1)
    return json.loads(results), said, [line for line in out.stderr.splitlines() if line.strip()]


def test_help_answers_without_importing_torch():
    """`ppo-fast --help` (the console script runs ppo_fast_cli) loads no torch and no transformers."""
    results, said, _ = console_script([["--help"], ["train", "--help"], ["options"]])
    assert results == [[0, []]] * 3
    assert "--eval-prompts-file" in said and "Ratio clip below 1 (1 - clip_eps_low)" in said


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """`ppo-fast options --markdown | head`: the reader gone before the first write is exit 141
    and nothing on stderr, not a BrokenPipeError traceback."""
    command = [sys.executable, str(ROOT / "ppo_fast_cli.py"), "options", "--markdown"]
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # before the child has parsed its command line, so its first write fails
    assert child.wait(timeout=60) == 141
    assert child.stderr.read() == b""


def test_input_errors_are_reported_before_torch_is_imported(tmp_path):
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"answer": "b"}\n')
    (tmp_path / "good.txt").write_text("1+1=\n")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text("{}")
    half_bpe = tmp_path / "half_bpe"
    half_bpe.mkdir()
    (half_bpe / "config.json").write_text("{}")
    (half_bpe / "vocab.json").write_text("{}")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "import math\n\n\ndef score(prompts, responses):\n    return [math.pi] * len(responses)\n\n\n"
        "def one(prompts):\n    return [1.0] * len(prompts)\n"
    )
    (tmp_path / "broken.py").write_text("def score(:\n")
    custom = ["--prompts-file", str(tmp_path / "good.txt"), "--reward-fn", f"{rewards}:score"]
    out = str(tmp_path / "out")
    resumed = tmp_path / "resumed"  # a run that started from another base model than no_tokenizer
    resumed.mkdir()
    (resumed / "base_model.json").write_text(json.dumps({"model_name_or_path": "/elsewhere", "fingerprint": "0" * 16}))
    cases = [
        (["train", "--config", str(tmp_path / "bad.yaml")], "not valid YAML"),
        (["train", "--steps", "0", "--output-dir", out], "steps (--steps) must be >= 1"),
        (["train", "--prompts-file", str(tmp_path / "bad.jsonl"), "--output-dir", out], "line 2: no 'prompt' field"),
        (["train", "--eval-prompts-file", str(tmp_path / "none.txt"), "--output-dir", out], "none.txt: no such file"),
        (
            ["train", "--model-name-or-path", str(tmp_path / "nowhere"), *custom, "--output-dir", out],
            "no such directory",
        ),
        (
            ["train", "--model-name-or-path", str(no_tokenizer), *custom, "--output-dir", out],
            "no tokenizer in this folder: tokenizer.json (or another tokenizer's files",
        ),
        (
            ["train", "--model-name-or-path", str(half_bpe), *custom, "--output-dir", out],
            "merges.txt (next to vocab.json) is missing",
        ),
        (["train", "--reward-model", str(no_tokenizer), "--output-dir", out], "--reward-model"),
        (
            ["train", "--reward-fn", f"{rewards}:exact", "--output-dir", out],
            "has no function 'exact' (it defines: one, score)",
        ),
        (["train", "--reward-fn", f"{tmp_path / 'none.py'}:f", "--output-dir", out], "none.py:f: no such file"),
        (["train", "--reward-fn", f"{tmp_path / 'broken.py'}:f", "--output-dir", out], "SyntaxError: "),
        (
            ["train", "--reward-fn", f"{rewards}:score,{rewards}:one", "--output-dir", out],
            f"{rewards}:8: one() takes 1 positional argument(s), 1 required; a reward function is called as",
        ),
        (
            ["train", "--reward-fn", f"{rewards}:score", "--reward-weights", "1,2", "--output-dir", out],
            "must be 1 finite number(s) separated by commas",
        ),
        (["train", "--loss-mode", "dro", "--output-dir", out], "needs dro_beta"),
        (["train", "--loss-mode", "sapo", "--loss-mode-params", "tau_pos=-1", "--output-dir", out], "tau_pos"),
        (
            ["train", "--resume", "--output-dir", str(resumed), "--model-name-or-path", str(no_tokenizer), *custom],
            "started from /elsewhere (fingerprint 0000000000000000), and",
        ),
        (["eval", str(tmp_path / "no_run")], "no_run: no such file or directory"),
        (["eval", str(tmp_path), "--best"], "no best/ (the run was not made with --keep-best)"),
        (["generate", str(no_tokenizer)], "generate: give --prompt TEXT"),
        (["generate", str(no_tokenizer), "--prompts-file", str(tmp_path / "bad.jsonl")], "line 2: no 'prompt' field"),
        (["eval", str(no_tokenizer), "--reward-fn", f"{rewards}:exact"], "has no function 'exact'"),
    ]
    results, _, errors = console_script([argv for argv, _ in cases])
    assert len(errors) == len(cases), errors
    for (argv, expected), (code, heavy), line in zip(cases, results, errors):
        assert code == 1, (argv, line)
        assert line.startswith("ppo-fast: error: ") and expected in line, (argv, line)
        assert heavy == [], argv
    assert not Path(out).exists()


def test_device_cuda_where_no_gpu_can_be_visible_is_refused_before_torch_is_imported(tmp_path):
    argv = [["train", "--device", "cuda", "--output-dir", str(tmp_path / "out")]]
    results, _, errors = console_script(argv, CUDA_VISIBLE_DEVICES="")
    assert results == [[1, []]] and errors == [
        "ppo-fast: error: --device cuda: no GPU is visible (CUDA_VISIBLE_DEVICES hides every GPU); use --device cpu "
        "(or auto)"
    ]


def test_resume_of_a_finished_run_says_nothing_to_do_before_torch_is_imported(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000003").mkdir(parents=True)
    (run / "summary.json").write_text('{"stop_reason": "done", "steps_done": 3}')
    results, said, _ = console_script(
        [["train", "--resume", "--steps", str(n), "--output-dir", str(run)] for n in (3, 2)]
    )
    assert results == [[0, []], [0, []]]
    assert said.splitlines() == [
        f"--resume: the run in {run} already did 3 steps (--steps {steps}); nothing to do. Give a larger --steps "
        "to train on, or another --output-dir for a new run."
        for steps in (3, 2)
    ]


# ---------------------------------------------------------------------- reward functions


def _scorer_error(fn, count: int = 2) -> str:
    with pytest.raises(RewardError) as caught:
        FunctionScorer(fn)(["p"] * count, ["r"] * count, torch.device("cpu"))
    return str(caught.value)


def test_a_reward_function_that_raises_is_named_with_its_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "server_rewards.py").write_text(
        "def helper():\n    raise RuntimeError('my reward server is down')\n\n\ndef raises(prompts, responses):\n"
        "    return helper()\n"
    )
    monkeypatch.chdir(tmp_path)
    message = _scorer_error(load_reward_fn(str(tmp_path / "server_rewards.py") + ":raises"))
    # The innermost line of the reward function's own file: where it raised (helper's line 2).
    assert message == (
        "reward function raises() raised RuntimeError: my reward server is down "
        f"(at {tmp_path / 'server_rewards.py'}:2)"
    )


@pytest.mark.parametrize(
    "returned, expected",
    [
        (lambda n: ["0.5"] * n, "returned a str ('0.5') as the score of response 0; expected a list of 2 numbers"),
        (lambda n: [1.0, None], "returned None as the score of response 1; expected a list of 2 numbers"),
        (lambda n: None, "returned None; expected a list of 2 numbers (one per response)"),
        (lambda n: "1", "returned a str ('1'); expected a list of 2 numbers"),
        (lambda n: [1.0] * (n + 1), "returned 3 scores; expected a list of 2 numbers"),
        (lambda n: [[1.0]] * n, "returned a list ([1.0]) as the score of response 0"),
        (lambda n: 1.0, "returned a float (1.0); expected a list of 2 numbers"),
    ],
)
def test_non_numeric_scores_name_what_was_returned(returned, expected):
    def score(prompts, responses):
        return returned(len(responses))

    assert expected in _scorer_error(score)


def test_numbers_of_every_kind_are_scores():
    for raw in ([1, 0.5], (1.0, 2), np.array([1.0, 0.5]), torch.tensor([1, 0]), [torch.tensor(1.0), np.float32(2)]):
        scores = FunctionScorer(lambda p, r, *, raw=raw: raw)(["p", "q"], ["x", "y"], torch.device("cpu"))
        assert scores.dtype == torch.float32 and scores.tolist() == [float(v) for v in raw]


def test_debug_prints_the_reward_functions_traceback(tmp_path, monkeypatch, capsys, tiny_flags):
    (tmp_path / "down.py").write_text("def raises(prompts, responses):\n    raise RuntimeError('server down')\n")
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--reward-fn", "down.py:raises", "--steps", "1", *tiny_flags, "--eval-size", "0"]
    assert main([*argv, "--output-dir", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    line = f"ppo-fast: error: reward function raises() raised RuntimeError: server down (at {tmp_path / 'down.py'}:2)"
    assert line in err.splitlines() and "Traceback" not in err and err.count("server down") == 1
    assert main([*argv, "--output-dir", str(tmp_path / "b"), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'down.py", line 2, in raises' in err
    assert err.splitlines()[-1] == line


# ---------------------------------------------------------------------- quiet by default


def test_transformers_output_only_with_verbose(tmp_path, capsys, tiny_flags):
    """The warm-up model's save ("Writing model shards") and load bars, and transformers'
    warnings, appear with --verbose only; tensorboard is not mentioned unless asked for."""
    argv = ["train", "--steps", "1", "--save-every", "0", *tiny_flags, "--eval-size", "0"]
    assert main([*argv, "--output-dir", str(tmp_path / "quiet")]) == 0
    quiet = capsys.readouterr()
    assert "Writing model shards" not in quiet.err and "Loading weights" not in quiet.err
    assert "tensorboard" not in (quiet.out + quiet.err).lower()
    assert main([*argv, "--output-dir", str(tmp_path / "verbose"), "--verbose"]) == 0
    assert "Writing model shards" in capsys.readouterr().err


def test_report_to_tensorboard_without_tensorboard_is_one_line(tmp_path, monkeypatch, error_line):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(["train", "--report-to", "tensorboard", "--output-dir", str(tmp_path / "run")]) == 1
    line = error_line()
    assert line == "ppo-fast: error: --report-to tensorboard: tensorboard is not installed (pip install tensorboard)"
    assert not (tmp_path / "run").exists()
