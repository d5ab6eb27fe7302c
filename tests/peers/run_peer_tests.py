"""Run a peer's own test files unpatched and with ``ppo_fast.integrations.<peer>.patch()``, and compare.

    python tests/peers/run_peer_tests.py verl --tests DIR [--modes unpatched,native,triton] [--json OUT]

DIR holds the peer's own test files, fetched at test time from its source distribution
(``.ci/peers.sh`` does that; they are never committed).  Each mode runs in a fresh
process (``--one-mode``): ``unpatched`` runs the peer's own code, ``native`` and
``triton`` apply ``patch(backend=...)`` before any test module is imported (Triton on
the CPU through ``TRITON_INTERPRET=1``).  Exit status 1 when a test that passes
unpatched does not pass in a patched mode, unless it is listed in ``DEVIATIONS`` with
its reason (docs/integrations.md lists the same), and when no test passes unpatched.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

# nodeid (relative to DIR) -> why it may not pass patched.  Keep docs/integrations.md in step.
DEVIATIONS: dict[str, dict[str, str]] = {
    "verl": {},
}


class _PatchPlugin:
    """Applies the patch when pytest configures, before the test modules import the peer."""

    def __init__(self, peer: str, backend: str):
        self.peer, self.backend, self.handle = peer, backend, None

    def pytest_configure(self, config):
        import importlib

        module = importlib.import_module(f"ppo_fast.integrations.{self.peer}")
        self.handle = module.patch(backend=self.backend)

    def pytest_unconfigure(self, config):
        if self.handle is not None:
            from ppo_fast.integrations import _patching

            counts = {k: v for k, v in _patching.COUNTS.items() if k.startswith(self.peer + ".")}
            served = sum(v for k, v in counts.items() if ":" not in k)
            detail = ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in sorted(counts.items()))
            print(f"\nppo_fast.integrations.{self.peer} calls served: {served} ({detail})")
            self.handle.unpatch()


class _Outcomes:
    def __init__(self):
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            previous = self.outcomes.get(report.nodeid)
            if previous in (None, "passed"):
                self.outcomes[report.nodeid] = report.outcome

    def pytest_collectreport(self, report):
        if report.outcome == "failed":
            self.outcomes[report.nodeid] = "error"


def _one_mode(peer: str, tests: str, mode: str, out: str, pytest_args: list[str]) -> int:
    if mode == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import pytest

    ini = os.path.join(tempfile.mkdtemp(prefix="peer-ini-"), "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    outcomes = _Outcomes()
    plugins = [outcomes] + ([] if mode == "unpatched" else [_PatchPlugin(peer, mode)])
    files = sorted(glob.glob(os.path.join(tests, "test_*_on_cpu.py")))
    args = ["-q", "-p", "no:cacheprovider", "-c", ini, "--rootdir", tests, "-W", "ignore::DeprecationWarning"]
    args += [*pytest_args, *files]
    print(f"== {peer} own tests, {mode}: pytest {' '.join(os.path.basename(a) for a in args)}", flush=True)
    code = pytest.main(args, plugins=plugins)
    base = os.path.abspath(tests)
    rel = {k.replace(base + os.sep, ""): v for k, v in outcomes.outcomes.items()}
    with open(out, "w") as f:
        json.dump({"mode": mode, "exit": int(code), "outcomes": rel}, f)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("peer")
    parser.add_argument("--tests", required=True, help="folder with the peer's own *_on_cpu.py test files")
    parser.add_argument("--modes", default="unpatched,native,triton")
    parser.add_argument("--json", default=None, help="write every mode's outcomes here")
    parser.add_argument("--one-mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args, pytest_args = parser.parse_known_args(argv)
    if args.one_mode:
        return _one_mode(args.peer, args.tests, args.one_mode, args.out, pytest_args)

    results = {}
    workdir = tempfile.mkdtemp(prefix="peer-runs-")
    for mode in args.modes.split(","):
        out = os.path.join(workdir, f"{mode}.json")
        cmd = [sys.executable, os.path.abspath(__file__), args.peer, "--tests", args.tests, "--one-mode", mode]
        subprocess.run([*cmd, "--out", out, *pytest_args], check=False)
        if not os.path.exists(out):
            print(f"{args.peer} {mode}: the run produced no result", file=sys.stderr)
            return 1
        with open(out) as f:
            results[mode] = json.load(f)["outcomes"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    deviations = DEVIATIONS.get(args.peer, {})
    baseline = results.get("unpatched", {})
    passed_unpatched = {k for k, v in baseline.items() if v == "passed"}
    regressions = []
    print(f"\n== {args.peer} own tests: pass sets")
    for mode, outcomes in results.items():
        n_pass = sum(v == "passed" for v in outcomes.values())
        n_fail = sum(v in ("failed", "error") for v in outcomes.values())
        n_skip = sum(v == "skipped" for v in outcomes.values())
        line = f"{args.peer} {mode}: {n_pass} passed, {n_fail} failed, {n_skip} skipped"
        if mode != "unpatched" and baseline:
            lost = sorted(k for k in passed_unpatched if outcomes.get(k) != "passed")
            allowed = [k for k in lost if k in deviations]
            bad = [k for k in lost if k not in deviations]
            regressions += [(mode, k, outcomes.get(k, "missing")) for k in bad]
            line += f" (of the {len(passed_unpatched)} passing unpatched: {len(lost)} not passing, {len(allowed)} listed deviations)"
            for k in allowed:
                print(f"  deviation ({mode}) {k}: {deviations[k]}")
        print(line)
    for mode, k, outcome in regressions:
        print(f"REGRESSION ({mode}) {k}: {outcome}")
    if not passed_unpatched:  # nothing to compare (a collection error, say): never a pass
        print("no test passed unpatched: nothing was compared")
        return 1
    print(f"{len(results) * len(passed_unpatched) - len(regressions)} passed, {len(regressions)} failed")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
