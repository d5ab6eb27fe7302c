"""Test setup: Triton kernels run on the CPU through the interpreter unless a GPU is present."""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zlib

import torch

# Must be set before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# One pytest-xdist worker per core (pyproject.toml): each worker's torch on its share of the cores, not on
# all of them (two workers of two threads each on 2 cores wait on each other's spinning threads).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def _interpreter_patches_triton_language_once_a_launch():
    """Triton's interpreter patches ``triton.language`` at each launch, and again at every call of a
    ``@triton.jit`` helper inside it, once per program: thousands of identical patches in a launch with
    a grid of rows, a quarter of some tests' time.  Here a helper's call inside a launch that patched its
    modules already (the launch, or a helper before it) patches nothing; the launch's patch and its
    restore are Triton's own.  (Where the interpreter lacks this shape, nothing is changed.)"""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    real = getattr(interpreter, "_patch_lang", None)
    if real is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    launches: list[set] = []  # the modules each launch in progress patched

    def patch_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if launches:  # a helper's call inside a launch
            if langs and langs <= launches[-1]:
                return interpreter._LangPatchScope()
            launches[-1] |= langs  # Triton's helpers (tl.sum: triton.language.core) patch it for the launch
            return real(fn)
        scope = real(fn)
        launches.append(langs)
        restore = scope.restore

        def restore_and_end():
            try:
                restore()
            finally:
                launches.pop()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_triton_language_once_a_launch()


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="also run the full tier: the exhaustive cross-products (tests marked `full`) that the default, "
        "fast tier samples (same as PPO_FAST_FULL=1; docs/testing.md)",
    )
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        metavar="N",
        help="tests/test_fuzz.py: N random examples per fuzz test (a nightly budget, e.g. 2000) instead of "
        "the fixed, derandomized CI budget (same as PPO_FAST_FUZZ_EXAMPLES=N)",
    )


def pytest_configure(config):
    examples = config.getoption("--fuzz-examples", default=None)
    if examples:  # read by tests/test_fuzz.py when it is imported (after this hook)
        os.environ["PPO_FAST_FUZZ_EXAMPLES"] = str(examples)
    if full_tier(config):  # read by tests/test_fuzz.py (its CI budget) and by subprocesses
        os.environ["PPO_FAST_FULL"] = "1"


def pytest_sessionstart(session):
    """``PPO_FAST_REQUIRE_BACKENDS=native,triton`` (CI): a backend that should be available here and
    is not (its import failed, the extension is missing) stops the run with why, instead of every
    test of that backend dropping out of the parametrization."""
    required = [name for name in os.environ.get("PPO_FAST_REQUIRE_BACKENDS", "").split(",") if name.strip()]
    if required:
        from ppo_fast.backends import BackendUnavailableError, require_available

        try:
            require_available([name.strip() for name in required])
        except (BackendUnavailableError, ValueError) as err:
            pytest.exit(f"PPO_FAST_REQUIRE_BACKENDS: {err}", returncode=pytest.ExitCode.USAGE_ERROR)


def full_tier(config) -> bool:
    """Whether the full tier runs: ``--full``, ``PPO_FAST_FULL=1``, or a ``-m`` that names it."""
    return bool(
        config.getoption("--full") or os.environ.get("PPO_FAST_FULL") == "1" or "full" in (config.getoption("-m") or "")
    )


def pytest_collection_modifyitems(config, items):
    """The Triton tests (files named test_triton_*, in any folder: tests/backends/) run on CUDA
    tensors when a GPU is present (else in the interpreter): mark them so that the GPU check
    (bench/gpu_check.sh) selects them with the CUDA tests.  The full tier's tests are deselected
    unless asked for (counted in the summary), and so is the sm_90 compile unless asked for (below)."""
    for item in items:
        if item.path.name.startswith("test_triton_"):
            item.add_marker(pytest.mark.triton_on_gpu)
    full = [] if full_tier(config) else [item for item in items if item.get_closest_marker("full")]
    static = [] if static_tests_asked(config) else [item for item in items if item.path.name == STATIC_TESTS]
    dropped = {id(item) for item in full + static}
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
        items[:] = [item for item in items if id(item) not in dropped]
    if full:
        config.stash[_FULL_DESELECTED] = len(full)
    # The sm_90 compile's tests last: their compile runs in the background from the start (below).
    # Under pytest-xdist first instead: the worker that takes them compiles while the other runs tests.
    items.sort(key=lambda item: (item.path.name == STATIC_TESTS) != _XDIST)


def static_tests_asked(config) -> bool:
    """The sm_90 / sm_100 compile of the Triton kernels (minutes of CPU on 2 cores) runs when its file
    is named, in the full tier, and in the compat cells (``PPO_FAST_STATIC_EVERY=1``); CI's bench static
    step names it.  The README's pytest leaves it out (its summary says so)."""
    named = any(STATIC_TESTS in str(arg) for arg in config.args)
    return named or full_tier(config) or os.environ.get("PPO_FAST_STATIC_EVERY") == "1"


_FULL_DESELECTED = pytest.StashKey[int]()
STATIC_TESTS = "test_triton_compiles_for_gpu.py"
_XDIST = "PYTEST_XDIST_WORKER" in os.environ
_STATIC = pytest.StashKey[tuple]()


def pytest_collection_finish(session):
    """The sm_90 compile of every Triton kernel (``python -m bench static``, a subprocess: it cannot
    run under TRITON_INTERPRET=1) starts as soon as its tests are selected, so that it runs on the
    other core while the suite runs; the ``static_report`` fixture waits for it."""
    if not _XDIST and any(item.path.name == STATIC_TESTS for item in session.items):
        _start_static_compile(session.config)


def _start_static_compile(config) -> tuple:
    if _STATIC not in config.stash:
        root = pathlib.Path(__file__).resolve().parents[1]
        out = pathlib.Path(os.environ.get("PPO_FAST_STATIC_REPORT") or tempfile.mkdtemp(prefix="ppo-fast-static-"))
        out = out / "triton.json" if out.is_dir() else out
        out.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        # sm_90 with its budgets; sm_100 (B200) compiled too, where Triton takes other paths.
        command = [sys.executable, "-m", "bench", "static", "--no-cuda", "--also-for", "100", "--json", str(out)]
        if os.environ.get("PPO_FAST_STATIC_EVERY") == "1" and not full_tier(config):
            command.append("--also-sample")  # the compat cells: every variant for sm_90, sm_100 sampled
        elif not full_tier(config):  # the fast tier: one variant of each kernel, pointer dtypes and budget
            command += ["--sample", "--also-sample"]
        log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (read and closed by static_report)
        proc = subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, text=True)
        config.stash[_STATIC] = (proc, out, log)
    return config.stash[_STATIC]


@pytest.fixture(scope="session")
def static_report(request):
    """``(path of the JSON report, the compile's output)`` once the background compile has ended."""
    proc, out, log = _start_static_compile(request.config)
    try:
        proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    with log:
        log.seek(0)
        return out, log.read()


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """A fresh but reproducible seed per test (printed on failure through the test id)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield


# ---------------------------------------------------------------------- tiny runs of the trainer and the command

TINY_FLAGS = "--batch-size 4 --num-mini-batches 1 --num-ppo-epochs 1 --sample-every 0 --sft-steps 10 --eval-size 16"


@pytest.fixture
def tiny_flags() -> list[str]:
    """``ppo-fast train`` flags of a built-in run small enough for a test (a later flag overrides one)."""
    return TINY_FLAGS.split()


@pytest.fixture
def tiny_config(tmp_path):
    """``make(name="run", **overrides)``: the TrainerConfig of a built-in run in ``tmp_path / name``,
    two steps of two minibatches of 4, at a learning rate a tiny model moves at."""
    from ppo_fast.trainer import TrainerConfig

    base = dict(steps=2, batch_size=8, num_mini_batches=2, num_ppo_epochs=1, sft_steps=10, eval_size=16)
    base.update(sample_every=0, save_every=0, learning_rate=1e-3)

    def make(name: str = "run", **overrides) -> TrainerConfig:
        return TrainerConfig(**{**base, "output_dir": str(tmp_path / name), **overrides})

    return make


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> pathlib.Path:
    """A built-in run of two steps by the command (tiny_flags), a checkpoint after each (both kept),
    and its warm-up model; made once: a test changes a copy (``run``)."""
    from ppo_fast.cli import main
    from ppo_fast.trainer import checkpoint

    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--output-dir", str(out), "--steps", "2", "--save-every", "1", *TINY_FLAGS.split()]) == 0
    assert [p.name for p in checkpoint.candidates(out)] == ["step-000002", "step-000001"]
    return out


@pytest.fixture
def run(finished_run, tmp_path) -> pathlib.Path:
    """A copy of ``finished_run`` in ``tmp_path / "run"`` (with its mtimes)."""
    return pathlib.Path(shutil.copytree(finished_run, tmp_path / "run"))


@pytest.fixture
def error_line(capsys):
    """``read(progress=False)``: the one ``ppo-fast: error: ...`` line the command wrote to stderr, with
    nothing else there (``progress``: after progress bars), and no traceback."""

    def read(progress: bool = False) -> str:
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip() and (not progress or line.startswith("ppo-fast: "))]
        assert len(lines) == 1 and lines[0].startswith("ppo-fast: error: ") and "Traceback" not in err, err
        assert err.rstrip().endswith(lines[0]), err
        return lines[0]

    return read


def pytest_terminal_summary(terminalreporter, config):
    """One line per reason why tests skipped (no GPU, a peer or vLLM not installed, ...), with its
    count; and how many tests of the full tier were left out."""
    if not full_tier(config):  # (under pytest-xdist the workers deselect, and only they know how many)
        left_out = config.stash.get(_FULL_DESELECTED, 0)
        count = f"{left_out} tests of the full tier" if left_out else "the full tier's tests"
        terminalreporter.write_sep("-", f"fast tier: {count} not run (run them with --full)")
    if not static_tests_asked(config):
        terminalreporter.write_sep(
            "-", f"the Triton kernels' sm_90 compile not run (name tests/backends/{STATIC_TESTS})"
        )
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_sep("-", "why tests skipped")
        for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:5d}  {reason}")
