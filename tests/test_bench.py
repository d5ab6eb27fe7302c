"""The benchmark suite's plumbing: baselines are correct, memory probe and mismatch check work, a tiny run end to end."""

import ast
import graphlib
import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from bench import baselines, cases, report, runner, timing
from bench.__main__ import main as bench_main
from ppo_fast import spec as contract
from ppo_fast.backends import reference

IGNORE = baselines.IGNORE_INDEX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, baselines.TRL_SEQUENCE_TOKENS + 37])  # one and two TRL sequences
def test_logprob_baselines_match_reference(dtype, n):
    logits = (torch.randn(n, 53) * 3).to(dtype)
    labels = torch.randint(0, 53, (n,))
    labels[torch.rand(n) < 0.3] = IGNORE
    want = reference.token_logprobs(logits, labels, 0.7, False, IGNORE)[0]
    for fn in (baselines.eager_logprobs, baselines.trl_chunked_logprobs):
        got = fn(logits, labels, 0.7)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=fn.__name__)
        assert (got[labels == IGNORE] == 0).all()


def _right_padded(batch, length, empty_row=True):
    lengths = torch.randint(1, length + 1, (batch, 1))
    if empty_row:
        lengths[0] = 0
    return torch.arange(length) < lengths


def test_gae_loop_matches_reference_with_gaps_inside_rows():
    rewards, values = torch.randn(5, 23), torch.randn(5, 23)
    mask = torch.rand(5, 23) > 0.3  # masked tokens inside rows are skipped, not terminal
    want = reference.gae(rewards, values, mask, 0.99, 0.9)
    torch.testing.assert_close(baselines.loop_gae(rewards, values, mask, 0.99, 0.9), want, atol=1e-5, rtol=1e-5)


def test_kl_reward_baseline_matches_reference_on_right_padded_rows():
    mask = _right_padded(6, 17)
    logp, ref = -torch.rand(6, 17) * 4, -torch.rand(6, 17) * 4
    scores = torch.randn(6)
    got = baselines.eager_kl_rewards(scores, logp, ref, mask, 0.05)
    want = reference.kl_penalized_rewards(scores, logp, ref, mask, 0.05, "k3")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("agg", contract.AGG_MODES)
def test_loss_baselines_match_reference(agg):
    mask = _right_padded(4, 19)
    logp, old, adv = -torch.rand(4, 19) * 3, -torch.rand(4, 19) * 3, torch.randn(4, 19)
    got = baselines.eager_policy_loss(logp, old, adv, mask, clip_eps=0.2, dual_clip=3.0, agg=agg)
    want = reference.clipped_policy_loss(
        logp, old, adv, mask, None, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0, agg=agg
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    values, old_values, returns = torch.randn(4, 19), torch.randn(4, 19), torch.randn(4, 19)
    got = baselines.eager_value_loss(values, old_values, returns, mask, 0.3, agg)
    want = reference.value_loss(values, old_values, returns, mask, 0.3, agg)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_cpu_peak_memory_sees_a_known_allocation():
    supported, why = timing.cpu_memory_supported()
    if not supported:
        pytest.skip(why)
    mib = 1 << 20

    def allocate_48_mib():
        return torch.ones(48 * mib, dtype=torch.uint8)

    allocate_48_mib()  # as in the suite, a warm call first (thread pools start on first use)
    assert 46 * mib <= timing.peak_extra_bytes(allocate_48_mib, "cpu") <= 52 * mib
    assert timing.peak_extra_bytes(lambda: torch.ones(16), "cpu") < 4 * mib


def _measure(case, impl, kind, fn, mode, inputs, *, expected, memory=False):
    """``runner.measure`` on the CPU, timed briefly."""
    settings = runner.Settings(
        torch.device("cpu"), compile=False, measure_memory=memory, cpu_min_run_time=0.01, cuda_rep_ms=10
    )
    return runner.measure(case, impl, kind, fn, mode=mode, inputs=inputs, expected=expected, settings=settings)


def test_a_wrong_answer_is_reported_as_mismatch_not_timed():
    case = cases.value_loss_case(2, 8)
    inputs = case.make_inputs(torch.device("cpu"))
    want, eager = runner._reference(case, inputs), case.baselines["eager"]

    def gradient_off_by_one_percent(x):  # the right loss, a gradient 1.01 times the right one
        loss = eager(x)[0]
        return loss.detach() + 1.01 * (loss - loss.detach())

    row = _measure(case, "wrong", "ppo_fast", lambda x: eager(x)[0] * 1.01, "fwd", inputs, expected=(want[0], None))
    assert row["status"] == "mismatch" and "median_ms" not in row
    row = _measure(case, "wrong-grad", "baseline", gradient_off_by_one_percent, "fwd+bwd", inputs, expected=want)
    assert row["status"] == "mismatch" and "gradient of values" in row["detail"] and "median_ms" not in row
    good = _measure(case, "eager", "baseline", eager, "fwd+bwd", inputs, expected=want)
    assert good["status"] == "ok" and good["median_ms"] > 0 and good["grad_rel_err"] < 1e-6
    assert not inputs["values"].requires_grad  # the fwd+bwd mode leaves the inputs as it found them


def test_a_baseline_is_held_to_its_inputs_precision_and_ours_to_tol():
    bf16 = {"logits": torch.ones(2, dtype=torch.bfloat16), "labels": torch.ones(2, dtype=torch.long)}
    assert runner.tolerance("ppo_fast", bf16) == runner.TOL
    assert runner.tolerance("baseline", bf16) == torch.finfo(torch.bfloat16).eps
    assert runner.tolerance("baseline", {"logits": torch.ones(2)}) == runner.TOL
    want = torch.tensor([-11.78, 0.5], dtype=torch.float64)
    rounded = want.to(torch.bfloat16)  # -11.75: what a head that returns bf16 gives
    assert not runner._mismatch(rounded, want, runner.tolerance("baseline", bf16))[1]
    assert runner._mismatch(rounded, want, runner.TOL)[1]
    assert runner._mismatch(want * 1.05, want, runner.tolerance("baseline", bf16))[1]


def test_every_serving_backend_is_measured():
    case = cases.value_loss_case(2, 8)
    implementations, _ = runner.implementations(case, "cpu", compile_enabled=False)
    names = [name for name, kind, _ in implementations if kind == "ppo_fast"]
    assert names == runner.serving_backends("value_loss", "cpu") and "reference" in names


def test_quick_run_writes_json_table_and_plot(tmp_path, capsys):
    status = bench_main(
        ["--quick", "--device", "cpu", "--ops", "value_loss,kl_penalized_rewards", "--out", str(tmp_path)]
    )
    assert status == 0
    with open(tmp_path / "cpu-quick.json") as f:
        results = json.load(f)
    assert [c["op"] for c in results["cases"]] == ["kl_penalized_rewards", "value_loss"]
    value_rows = {(r["impl"], r["mode"]): r for r in results["cases"][1]["results"]}
    assert set(value_rows) >= {("reference", "fwd"), ("reference", "fwd+bwd"), ("eager", "fwd"), ("eager", "fwd+bwd")}
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in value_rows.values())
    assert value_rows[("eager", "fwd")]["speedup"] == 1.0
    assert value_rows[("reference", "fwd")]["speedup_vs_reference"] == 1.0
    ref_fwd = value_rows[("reference", "fwd")]
    assert ref_fwd["speedup"] == pytest.approx(value_rows[("eager", "fwd")]["median_ms"] / ref_fwd["median_ms"])
    assert results["versions"]["torch"] == torch.__version__ and results["machine"]["cores"] == os.cpu_count()
    assert os.path.getsize(tmp_path / "cpu-quick.png") > 0
    assert "value_loss" in capsys.readouterr().out
    md = report.markdown(results)
    assert "#### value_loss" in md and "python -m bench --quick" in md and "| reference * |" in md


def test_budget_skips_cases_and_says_so(tmp_path):
    assert bench_main(["--quick", "--device", "cpu", "--ops", "gae", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "cpu-quick.json") as f:
        results = json.load(f)
    assert results["cases"] and all("time budget" in c["skipped"] for c in results["cases"])


def test_fwd_bwd_memory_counts_the_new_gradient():
    supported, why = timing.cpu_memory_supported()
    if not supported:
        pytest.skip(why)
    case = cases.logprob_case(512, 8192, torch.float32)
    inputs = case.make_inputs(torch.device("cpu"))

    def row_sums(x):  # its backward allocates exactly one thing: the 16 MiB gradient
        return x["logits"].sum(-1)

    gradient = inputs["grad_out"][:, None].expand_as(inputs["logits"])
    row = _measure(
        case, "row-sums", "baseline", row_sums, "fwd+bwd", inputs, expected=(row_sums(inputs), gradient), memory=True
    )
    assert row["status"] == "ok"
    assert 15 * (1 << 20) <= row["peak_extra_bytes"] <= 20 * (1 << 20)


def test_fused_head_baselines_match_reference():
    """The fused-LM-head case's baselines (eager, TRL's real fused head when installed, torch's
    linear_cross_entropy where torch has it) give
    the reference's log-probs, 0 at ignored rows; the linear-layer yardstick is timed, not compared."""
    case = cases.linear_logprob_case(37, 24, 301, torch.float32)
    inputs = case.make_inputs(torch.device("cpu"))
    want = reference.linear_token_logprobs(
        inputs["hidden"], inputs["weight"].detach(), inputs["labels"], temperature=cases.TEMPERATURE
    )[0]
    for name, fn in case.baselines.items():
        if name in case.yardsticks:
            continue
        got = fn(inputs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        assert (got[inputs["labels"] == IGNORE] == 0).all(), name
    assert "eager" in case.baselines and "linear-layer" in case.yardsticks
    assert ("torch-linear-ce" in case.baselines) == hasattr(torch.nn.functional, "linear_cross_entropy")
    row = _measure(
        case,
        "linear-layer",
        "baseline",
        case.baselines["linear-layer"],
        "fwd+bwd",
        inputs,
        expected=(want.detach(), None),
    )
    assert row["status"] == "ok" and row["max_abs_err"] is None and row["tflops"] > 0


def test_advantages_bench_checks_and_times_every_method():
    from bench import advantages

    rows = advantages.measure([(12, 5, 3)], 0.0, 1)
    methods = [name for name, entry in advantages.REGISTRY.items() if entry.fn is not None]
    assert [r["method"] for r in rows] == methods
    for r in rows:
        assert r["reference_ms"] > 0 and r["auto_ms"] > 0
    assert "| `grpo` |" in advantages.markdown(rows)


def test_policy_losses_bench_checks_and_times_every_mode():
    """Every mode's call binds from the spec alone (a required parameter at its example)."""
    from bench import policy_losses

    rows = policy_losses.measure(2, 8, "cpu", 0.0)
    assert [r["mode"] for r in rows] == list(contract.POLICY_LOSS_MODES)
    assert all(r["fast_ms"] > 0 and r["reference_ms"] > 0 for r in rows)


def test_cpu_vs_trl_cpu_info_and_table():
    """bench.cpu_vs_trl: the clone it names needs the CPU's flags; the table renders a sample."""
    from bench import cpu_vs_trl

    info = cpu_vs_trl.cpu_info()
    flags = set(info["vector_flags"])
    assert info["native_clone"] in ("x86-64-v4", "x86-64-v3", "default")
    assert (info["native_clone"] == "x86-64-v4") <= ("avx512f" in flags)
    row = {"threads": 1, "dtype": "float32", "ms": {"native": 10.0, "trl": 20.0, "eager": 40.0}}
    row["speedup"] = {"trl": 2.0, "eager": 4.0}
    exp = {"n": 16, "ns_per_exp": {"ppo_fast": 0.5, "torch.exp": 1.0}, "speedup_vs_torch": 2.0, "max_rel_err": 1e-7}
    text = cpu_vs_trl.table({"cpu": info, "rows": [row], "exp": {**exp, "torch_cpu_capability": "AVX2"}})
    assert "| 1 | float32 | 10.0 | 20.0 | 40.0 | 2.00x | 4.00x |" in text
    assert "ppo_fast 0.500 ns, torch.exp (AVX2) 1.000 ns: 2.00x" in text


def test_overhead_bench_times_every_public_op(tmp_path):
    from bench import overhead
    from ppo_fast import ops

    assert overhead.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "overhead-cpu.json").read_text())["rows"]
    public = set(ops.__all__) - overhead.NOT_OPS
    floor = [r for r in rows if r["op"].startswith("torch-floor")]  # torch's own cost, beside ours
    assert {r["mode"] for r in floor} == {"fwd", "fwd+bwd"}
    rows = [r for r in rows if r not in floor]
    assert {r["public"] for r in rows} == public
    assert {"gae (float mask)", "policy_loss vanilla"} <= {r["op"] for r in rows}
    backward = {r["public"] for r in rows if r["mode"] == "fwd+bwd"}
    assert public - backward == {"group_advantages", "rollout_correction_weights"}
    for r in rows:
        assert r["eager_us"] > 0 and r["cpu_us"] > 0 and r["samples"] >= timing.MIN_SAMPLES
        assert r["eager_iqr_us"][0] <= r["eager_us"] <= r["eager_iqr_us"][1]
        if "backend_cpu_us" in r:
            assert r["overhead_us"] == pytest.approx(r["cpu_us"] - r["backend_cpu_us"], abs=0.02)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton backend on CPU: the interpreter")
def test_triton_host_bench_stubs_every_launch_of_every_triton_op():
    """Each Triton op's path runs with its launches stubbed and counted (a forward launches, its backward
    launches again) and no kernel: a stubbed call that interpreted a kernel would take seconds, not us."""
    from bench import triton_host

    rows = triton_host.measure(rounds=2, number=2)
    ops = [r for r in rows if "mode" in r]
    assert {r["op"] for r in ops} == set(triton_host.CASES)
    launches = {(r["op"], r["mode"]): r["triton_launches"] for r in ops}
    for (op, mode), count in launches.items():
        assert count >= 1, (op, mode)
        if mode == "fwd+bwd":
            assert count > launches[op, "fwd"], op
    assert all(r["triton_stubbed_cpu_us"] < 20_000 for r in ops)
    assert sum("layer" in r["op"] for r in rows) == 5


def test_a_timing_without_a_spread_is_refused():
    """One sample (a cold call, say) is no headline: the timer takes at least MIN_SAMPLES blocks after a
    warm-up, and a Timing of fewer is an error."""
    calls = []
    t = timing.time_eager(lambda: calls.append(1), min_run_time=0.0)
    assert t.samples >= timing.MIN_SAMPLES and len(calls) >= t.runs + timing.WARMUP_CALLS
    assert t.q25_ms <= t.median_ms <= t.q75_ms
    with pytest.raises(timing.TimingError, match="samples"):
        timing.Timing(11.2, 11.2, 11.2, 1, 1, "one cold call")


# ---------------------------------------------------------------------- the package's structure

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _bench_imports() -> dict[str, set[str]]:
    """``{module: bench modules it imports}`` from the AST of bench/*.py (function-level imports included)."""
    modules = {name[:-3] for name in os.listdir(BENCH_DIR) if name.endswith(".py")}
    graph = {}
    for module in modules:
        with open(os.path.join(BENCH_DIR, module + ".py")) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
            elif isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").split(".")[0] == "bench"):
                base = (node.module or "") if node.level else node.module.removeprefix("bench").lstrip(".")
                found |= {base.split(".")[0]} if base else {a.name for a in node.names}
        graph[module] = {m for m in found if m in modules and m != module}
    return graph


def test_bench_imports_have_no_cycle_and_nothing_imports_main():
    graph = _bench_imports()
    assert not [m for m, deps in graph.items() if "__main__" in deps], graph
    assert {"cases", "common", "ops", "peers"} <= set(graph) and "common" in graph["peers"]
    graphlib.TopologicalSorter(graph).prepare()  # an import cycle raises CycleError, naming its modules


def test_no_bench_function_is_over_80_lines():
    long = []
    for name in sorted(os.listdir(BENCH_DIR)):
        if name.endswith(".py"):
            with open(os.path.join(BENCH_DIR, name)) as f:
                tree = ast.parse(f.read())
            long += [
                f"{name}:{n.name} {n.end_lineno - n.lineno + 1} lines"
                for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80
            ]
    assert not long, long


def test_every_suite_has_a_main_and_help_lists_them(capsys):
    from bench.__main__ import SUITES

    for suite in SUITES:
        module = importlib.import_module(f"bench.{suite}")
        assert inspect.signature(module.main).parameters, suite  # main(argv)
    assert bench_main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(f"  {suite} " in text for suite in SUITES), text
    assert bench_main(["no_such_suite"]) == 2
    with pytest.raises(SystemExit) as exit_:
        bench_main(["peers", "--help"])
    assert exit_.value.code == 0 and "python -m bench peers" in capsys.readouterr().out


def test_python_m_bench_runs_a_suite_once(tmp_path):
    """``python -m bench <suite>`` and the module form run the suite's module once (no import cycle re-running it)."""
    root = os.path.dirname(BENCH_DIR)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    for cmd in (["-m", "bench", "targets", "--help"], ["-m", "bench.targets", "--help"], ["-m", "bench", "--help"]):
        out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("usage:") == 1, out.stdout


def test_bytes_moved_count_only_the_rows_a_kernel_reads():
    """The bandwidth figures' bytes, counted by hand: the ignored rows' logits (hidden states) are
    never read; the gradient is written whole.  10 rows, 3 of them ignored, V = 7, H = 5, float32."""
    logits = cases.logprob_case(10, 7, torch.float32)
    labels = logits.make_inputs(torch.device("cpu"))["labels"]
    assert int((labels == -100).sum()) == 3
    assert logits.fwd_bytes == 7 * 7 * 4 + 10 * (8 + 4)  # 7 rows of logits read; labels in, log-probs out
    assert logits.bwd_bytes == 7 * 7 * 4 + 10 * 7 * 4 + 10 * (8 + 4)  # read again, the gradient out
    head = cases.linear_logprob_case(10, 5, 7, torch.float32)
    assert int((head.make_inputs(torch.device("cpu"))["labels"] == -100).sum()) == 3
    assert head.fwd_bytes == (7 + 7) * 5 * 4 + 10 * 12
    assert head.bwd_bytes == (7 + 7) * 5 * 4 + (10 + 7) * 5 * 4 + 10 * 12


def test_head_plans_skips_liger_grpo_without_cuda_with_its_reason():
    """Liger-Kernel's fused GRPO loss runs on CUDA only: elsewhere the row is a reason, never a time."""
    from bench import head_plans

    with pytest.raises(RuntimeError, match="skipped: Liger-Kernel is a CUDA package"):
        head_plans.liger_grpo({"hidden": torch.zeros(1, 2, 3)}, compiled=False)


@pytest.mark.full  # 30 s under the interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU runs it in bench/gpu_check.sh")
def test_head_plans_times_each_plan_and_skips_liger_without_cuda(tmp_path, monkeypatch):
    """bench head_plans (GPU-only in use) whole under the interpreter on a tiny head, one log-probs plan and
    two loss budgets: the linear layer, each plan checked against the first, the loss's plan and its
    gradients against the default budget's, and Liger's GRPO loss skipped with its reason, no number."""
    from bench import head_plans

    monkeypatch.setattr(head_plans, "GEMM_PLANS", ((384, 4),))
    out = tmp_path / "plans.json"
    argv = "--device cpu --rows 8 --length 4 --hidden 8 --vocab 20 --rep-ms 1 --out".split()
    assert head_plans.main([*argv, str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["linear"]) == {"fwd", "fwd_bwd"} and all(r["ms"] > 0 for r in data["linear"].values())
    assert [(r["chunk_rows"], "error" in r) for r in data["logprobs"]] == [(384, False)]
    ours, liger = data["loss"][:-1], data["loss"][-1]
    assert [r["budget"] for r in ours] == [0.05, 1.0] and all("error" not in r and r["ms"] > 0 for r in ours)
    assert ours[1]["d_weight_max_rel_diff"] < 1e-6
    assert "ms" not in liger and "CUDA" in liger["skipped"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU runs it in bench/gpu_check.sh")
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.full)])  # every one: 13 s
def test_head_tiles_runs_every_candidate(tmp_path, monkeypatch, every):
    """The fused head's tile sweep (GPU-only in use) runs whole here, under the interpreter, on a tiny
    head: the epilogue's candidates against the 2-D plan at two hidden sizes, each tile candidate checked
    against the first and timed, the split compared, the file written (the fast tier: 16 rows, one hidden
    size, one small epilogue candidate, the first and last tiles and the last plan, a 2-D one, each case
    called once, not timed).
    The timer takes 2 blocks after one warm-up call, not 10 after 3 (its rules are
    test_a_timing_without_a_spread_is_refused's): its calls were nine tenths of this test's time."""
    from bench import head_tiles

    monkeypatch.setattr(timing, "MIN_SAMPLES", 2)
    monkeypatch.setattr(timing, "WARMUP_CALLS", 1)
    monkeypatch.setattr(timing, "WARMUP_S", 0.0)
    if not every:
        monkeypatch.setattr(head_tiles, "CANDIDATES", head_tiles.CANDIDATES[:: len(head_tiles.CANDIDATES) - 1])
        monkeypatch.setattr(head_tiles, "GEMM_PLANS", head_tiles.GEMM_PLANS[-1:])
        monkeypatch.setattr(head_tiles, "EPILOGUE_CANDIDATES", [(16, 16, 16, 4, 2, 2, 32)])
        monkeypatch.setattr(head_tiles, "_ms", lambda fn, rep_ms: [fn(), 1.0][1])  # one call a case, untimed
    out = tmp_path / "tiles.json"
    # the fast tier: 16 rows at one hidden size (the interpreter's cost is per program)
    shape = "--rows 40 --also-hidden 24" if every else "--rows 16"
    argv = f"--device cpu {shape} --hidden 32 --vocab 300 --split-rows 20 --rep-ms 1 --out".split()
    assert head_tiles.main([*argv, str(out)]) == 0
    data = json.loads(out.read_text())
    # the epilogue's forward against the 2-D plan, at each hidden size, first
    assert [e["shape"]["hidden"] for e in data["epilogue"]] == ([32, 24] if every else [32])
    for e in data["epilogue"]:
        assert [r["config"] for r in e["epilogue"]] == [list(c) for c in head_tiles.EPILOGUE_CANDIDATES]
        assert all("error" not in r and r["max_abs_diff"] < 1e-5 for r in e["epilogue"])
        assert set(e["fwd_ms"]) == {"epilogue", "gemm-2d", "linear layer"} and "bwd_ms" in e["gemm_2d"]
    assert [r["config"] for r in data["results"]] == [list(c) for c in head_tiles.CANDIDATES]
    assert all("error" not in r and r["max_abs_diff"] < 1e-5 for r in data["results"][1:])
    assert set(data["split_fwd_ms"]) == {"split", "one share"} and len(data["scratch_bwd_ms"]) == 3
    assert [r["chunk_rows"] for r in data["gemm_results"]] == [plan[0] for plan in head_tiles.GEMM_PLANS]
    assert all("error" not in r and r["max_abs_diff"] < 1e-5 for r in data["gemm_results"])
    assert data["chosen"]["design"] in ("gemm", "tiles", "epilogue") and "epilogue" in data["chosen"]


def test_trainer_e2e_runs_its_set_ups_and_switches_the_fused_head_off(tmp_path):
    """The GPU run's end-to-end stage, as a smoke run on CPU: our set-ups run a timed step each, the
    two-pass one really runs without the fused head, and TRL's rows say why they are missing."""
    from bench import trainer_e2e

    setups = "ours-grpo,ours-grpo-two-pass,trl-grpo"
    assert trainer_e2e.main(["--quick", "--device", "cpu", "--setups", setups, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "trainer-e2e-cpu-quick.json").read_text())["trainer_e2e"]["results"]
    for name in ("ours-grpo", "ours-grpo-two-pass"):
        assert results[name]["steps"] == 2 and results[name]["step_s"] > 0
    assert "in two passes" in results["ours-grpo-two-pass"]["decided"]["loss_path"]
    assert "step_s" in results["trl-grpo"] or "trl" in results["trl-grpo"]["skipped"]
