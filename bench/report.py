"""Render benchmark results: the stdout table, the README markdown and the PNG plots.

``python -m bench.report bench/results/cpu.json [more.json ...]`` prints the README
performance section (markdown) for the given result files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MIB = 1 << 20


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _times(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def result_rows(results: dict) -> list[dict]:
    """One flat row per (case, mode, implementation), with display strings."""
    rows = []
    for case in results["cases"]:
        if case.get("skipped"):
            rows.append({"op": case["op"], "shape": case["shape"], "mode": "", "impl": "", "time": "", "spread": "",
                         "speedup": "", "vs_reference": "", "memory": "", "gbps": "", "copy": "", "note": f"skipped: {case['skipped']}"})
            continue
        for r in case["results"]:
            ok = r["status"] == "ok"
            rows.append({
                "op": case["op"],
                "shape": case["shape"],
                "mode": r["mode"],
                "impl": r["impl"] + (" *" if r["kind"] == "ppo_fast" else ""),
                "time": _fmt(r.get("median_ms"), ".4g") if ok else r["status"].upper(),
                "spread": f"{r['q25_ms']:.4g}-{r['q75_ms']:.4g}" if ok else "",
                "speedup": _times(r.get("speedup")),
                "vs_reference": _times(r.get("speedup_vs_reference")),
                "memory": _fmt(r["peak_extra_bytes"] / MIB if "peak_extra_bytes" in r else None, ".1f"),
                "gbps": _fmt(r.get("gbps"), ".0f"),
                "copy": _fmt(100 * r["copy_fraction"] if "copy_fraction" in r else None, ".0f"),
                "note": r.get("detail", ""),
            })
    return rows


_COLUMNS = [
    ("op", "op"), ("shape", "shape"), ("mode", "mode"), ("impl", "implementation"), ("time", "median ms"),
    ("spread", "IQR ms"), ("speedup", "vs eager"), ("vs_reference", "vs reference"),
    ("memory", "peak extra MiB"), ("gbps", "GB/s"),
    ("copy", "% copy BW"), ("note", "note"),
]


def _columns(results: dict) -> list[tuple[str, str]]:
    on_gpu = results["device"] == "cuda"
    return [(key, title) for key, title in _COLUMNS if on_gpu or key not in ("gbps", "copy")]


def header_lines(results: dict) -> list[str]:
    machine, versions = results["machine"], results["versions"]
    hardware = machine.get("gpu") or f"{machine['cpu']} ({machine['cores']} cores, {machine['torch_threads']} threads)"
    lines = [
        f"device {results['device']}: {hardware}; {results['date']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"command: {results['command']}",
        "backends: " + "; ".join(f"{k} {v}" for k, v in results["backends"].items()),
        f"peak memory method: {results['memory_method']}",
        "vs eager: speedup over the eager baseline of the same case and mode (python-loop for gae); "
        "vs reference: over our reference backend; * marks ppo_fast backends",
    ]
    if results.get("copy_bandwidth_gbps"):
        lines.append(f"device-to-device copy bandwidth: {results['copy_bandwidth_gbps']:.0f} GB/s (read + write)")
    lines += results.get("notes", [])
    for case in results["cases"]:
        lines += [f"{case['op']}: {note}" for note in case.get("notes", [])]
    return list(dict.fromkeys(lines))  # an op's notes repeat for each of its shapes


def text_table(results: dict) -> str:
    columns = _columns(results)
    rows = result_rows(results)
    widths = {key: max([len(title)] + [len(row[key]) for row in rows]) for key, title in columns}
    lines = ["  ".join(title.ljust(widths[key]) for key, title in columns)] if rows else []
    lines += ["  ".join(row[key].ljust(widths[key]) for key, _ in columns).rstrip() for row in rows]
    return "\n".join(header_lines(results) + [""] + lines + e2e_lines(results))


def e2e_lines(results: dict) -> list[str]:
    e2e = results.get("e2e")
    if not e2e:
        return []
    if e2e.get("skipped"):
        return ["", f"end to end: skipped: {e2e['skipped']}"]
    if e2e.get("error"):
        return ["", f"end to end: ERROR: {e2e['error']}"]
    lines = ["", f"end to end: {e2e['description']}"]
    for ops_name, run in e2e["runs"].items():
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in run["phase_s"].items())
        lines.append(f"  ops={ops_name}: {run['tokens_per_s']:.0f} tokens/s; {phases}")
    return lines


def markdown(results: dict) -> str:
    """The README performance section for one result file."""
    columns = [c for c in _columns(results) if c[0] != "op"]
    title = {"cpu": "CPU", "cuda": "GPU"}[results["device"]]
    machine = results["machine"]
    hardware = machine.get("gpu") or f"{machine['cpu']}, {machine['cores']} cores"
    out = [f"### {title}: {hardware} ({results['date'][:10]})", "", f"Produced by `{results['command']}` "
           f"({', '.join(f'{k} {v}' for k, v in results['versions'].items())}).", ""]
    out += [f"- {line}" for line in header_lines(results)[3:]]
    rows = result_rows(results)
    for op in dict.fromkeys(row["op"] for row in rows):
        out += ["", f"#### {op}", "", "| " + " | ".join(t for _, t in columns) + " |", "|" + "---|" * len(columns)]
        out += ["| " + " | ".join(row[k].replace("|", "/") for k, _ in columns) + " |" for row in rows if row["op"] == op]
    out += e2e_markdown(results)
    return "\n".join(out)


def e2e_markdown(results: dict) -> list[str]:
    e2e = results.get("e2e")
    if not e2e or "runs" not in e2e:
        return e2e_lines(results)
    auto = ", ".join(f"{op} -> {name}" for op, name in results.get("auto", {}).items())
    phases = list(next(iter(e2e["runs"].values()))["phase_s"])
    out = ["", "#### end to end", "", f"{e2e['description']}. `auto` picks: {auto}.", "",
           "| ops | response tokens/s | " + " | ".join(f"{p} ms" for p in phases) + " |", "|" + "---|" * (len(phases) + 2)]
    for name, run in e2e["runs"].items():
        out.append(f"| {name} | {run['tokens_per_s']:.0f} | " + " | ".join(f"{run['phase_s'][p] * 1e3:.1f}" for p in phases) + " |")
    return out


def plot(results: dict, out_dir: str, stem: str) -> list[str]:
    """Speedup (and on GPU, GB/s) against size, one panel per op; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    metrics = [("speedup", "speedup vs eager (x)")]
    if results["device"] == "cuda":
        metrics.append(("gbps", "achieved GB/s"))
    ops = list(dict.fromkeys(case["op"] for case in results["cases"]))
    columns = min(3, max(1, len(ops)))
    grid_rows = (len(ops) + columns - 1) // columns or 1
    written = []
    for metric, label in metrics:
        fig, axes = plt.subplots(grid_rows, columns, figsize=(5 * columns, 3.8 * grid_rows), squeeze=False)
        for ax in list(axes.flat)[len(ops):]:
            ax.axis("off")
        for ax, op in zip(axes.flat, ops):
            series = {}
            for case in results["cases"]:
                if case["op"] != op:
                    continue
                dtype = case.get("params", {}).get("dtype")  # one line per input dtype
                for r in case["results"]:
                    if r["status"] == "ok" and r.get(metric) is not None and r["impl"] != case["eager_baseline"]:
                        name = " ".join(part for part in (r["impl"], r["mode"], dtype) if part)
                        series.setdefault(name, []).append((case["size"], r[metric]))
            for name, points in sorted(series.items()):
                points.sort()
                style = "--" if "fwd+bwd" in name else "-"
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=name)
            if metric == "gbps" and results.get("copy_bandwidth_gbps"):
                ax.axhline(results["copy_bandwidth_gbps"], color="grey", linestyle="--", label="copy bandwidth")
            if metric == "speedup":
                ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(op, fontsize=9)
            ax.set_xlabel("logit elements (N x V)" if op == "token_logprobs" else "tokens (B x T)")
            ax.set_ylabel(label)
            if series:
                ax.legend(fontsize=6)
        fig.suptitle(f"{results['device']} {results['date'][:10]}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}-{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="result JSON files written by python -m bench")
    parser.add_argument("--plots", action="store_true", help="also (re)draw each file's PNG plots beside it")
    args = parser.parse_args(argv)
    sections = []
    for path in args.results:
        with open(path) as f:
            results = json.load(f)
        sections.append(markdown(results))
        if args.plots:
            stem = os.path.splitext(os.path.basename(path))[0]
            plot(results, os.path.dirname(os.path.abspath(path)), stem)
    print("## Performance\n\n" + "\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
