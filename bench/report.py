"""Render benchmark results: the stdout table, the README markdown and the PNG plots.

``python -m bench report bench/results/cpu.json [more.json ...]`` prints the README
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
            rows.append(
                {
                    "op": case["op"],
                    "shape": case["shape"],
                    "mode": "",
                    "impl": "",
                    "time": "",
                    "spread": "",
                    "speedup": "",
                    "vs_reference": "",
                    "memory": "",
                    "gbps": "",
                    "copy": "",
                    "tflops": "",
                    "note": f"skipped: {case['skipped']}",
                }
            )
            continue
        for r in case["results"]:
            ok = r["status"] == "ok"
            rows.append(
                {
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
                    "tflops": _fmt(r.get("tflops"), ".1f"),
                    "note": r.get("detail", ""),
                }
            )
    return rows


_COLUMNS = [
    ("op", "op"),
    ("shape", "shape"),
    ("mode", "mode"),
    ("impl", "implementation"),
    ("time", "median ms"),
    ("spread", "IQR ms"),
    ("speedup", "vs eager"),
    ("vs_reference", "vs reference"),
    ("memory", "peak extra MiB"),
    ("gbps", "GB/s"),
    ("copy", "% copy BW"),
    ("tflops", "TFLOP/s"),
    ("note", "note"),
]


def _columns(results: dict) -> list[tuple[str, str]]:
    on_gpu = results["device"] == "cuda"
    return [(key, title) for key, title in _COLUMNS if on_gpu or key not in ("gbps", "copy", "tflops")]


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
    note = e2e_note(results)
    return lines + ([f"  {note}"] if note else [])


def e2e_note(results: dict) -> str | None:
    """Why the end-to-end numbers of a --quick run say nothing about speed (when they do not)."""
    e2e = results.get("e2e") or {}
    runs = e2e.get("runs") or {}
    if not results.get("settings", {}).get("quick") or "auto" not in runs or "reference" not in runs:
        return None
    ratio = runs["auto"]["tokens_per_s"] / max(runs["reference"]["tokens_per_s"], 1e-9)
    return (
        f"--quick: auto/reference = {ratio:.2f}x on one timed iteration of a tiny batch (a few milliseconds per "
        "phase), where Python overhead and machine noise dominate and the PPO ops are a small part of the time; "
        "not a speed comparison (run without --quick for that)"
    )


def markdown(results: dict) -> str:
    """The README performance section for one result file."""
    columns = [c for c in _columns(results) if c[0] != "op"]
    title = {"cpu": "CPU", "cuda": "GPU"}[results["device"]]
    machine = results["machine"]
    hardware = machine.get("gpu") or f"{machine['cpu']}, {machine['cores']} cores"
    out = [
        f"### {title}: {hardware} ({results['date'][:10]})",
        "",
        f"Produced by `{results['command']}` ({', '.join(f'{k} {v}' for k, v in results['versions'].items())}).",
        "",
    ]
    out += [f"- {line}" for line in header_lines(results)[3:]]
    rows = result_rows(results)
    for op in dict.fromkeys(row["op"] for row in rows):
        out += ["", f"#### {op}", "", "| " + " | ".join(t for _, t in columns) + " |", "|" + "---|" * len(columns)]
        out += [
            "| " + " | ".join(row[k].replace("|", "/") for k, _ in columns) + " |" for row in rows if row["op"] == op
        ]
    out += e2e_markdown(results)
    return "\n".join(out)


def e2e_markdown(results: dict) -> list[str]:
    e2e = results.get("e2e")
    if not e2e or "runs" not in e2e:
        return e2e_lines(results)
    auto = ", ".join(f"{op} -> {name}" for op, name in results.get("auto", {}).items())
    phases = list(next(iter(e2e["runs"].values()))["phase_s"])
    out = [
        "",
        "#### end to end",
        "",
        f"{e2e['description']}. `auto` picks: {auto}.",
        "",
        "| ops | response tokens/s | " + " | ".join(f"{p} ms" for p in phases) + " |",
        "|" + "---|" * (len(phases) + 2),
    ]
    for name, run in e2e["runs"].items():
        out.append(
            f"| {name} | {run['tokens_per_s']:.0f} | "
            + " | ".join(f"{run['phase_s'][p] * 1e3:.1f}" for p in phases)
            + " |"
        )
    note = e2e_note(results)
    return out + (["", note] if note else [])


# One colour per implementation, the same in every panel and every plot; ours are the
# saturated ones, the baselines greys and muted colours.
IMPL_COLORS = {
    "reference": "#1f77b4",
    "native": "#ff7f0e",
    "triton": "#2ca02c",
    "auto": "#d62728",
    "eager": "#7f7f7f",
    "python-loop": "#7f7f7f",
    "trl": "#c49c94",
    "trl-chunked": "#8c564b",
    "compile(eager)": "#9467bd",
    "liger-ce": "#e377c2",
    "flash-attn-ce": "#bcbd22",
}
_SPARE_COLORS = ["#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d"]
MODE_STYLES = {"fwd": "-", "fwd+bwd": "--"}
DTYPE_MARKERS = {None: "o", "float32": "o", "bfloat16": "s", "float16": "^", "float64": "D"}
LINE_MIN_SIZES = 3  # an op measured at fewer sizes is drawn as bars (a line needs a few points)


def impl_color(name: str, assigned: dict) -> str:
    if name in IMPL_COLORS:
        return IMPL_COLORS[name]
    if name not in assigned:
        assigned[name] = _SPARE_COLORS[len(assigned) % len(_SPARE_COLORS)]
    return assigned[name]


def _plot_points(results: dict, op: str, metric: str) -> list[dict]:
    """Every measured value of ``metric`` for ``op`` (the eager baseline itself excluded)."""
    points = []
    for case in results["cases"]:
        if case["op"] != op:
            continue
        for r in case["results"]:
            if r["status"] == "ok" and r.get(metric) is not None and r["impl"] != case["eager_baseline"]:
                points.append(
                    {
                        "impl": r["impl"],
                        "mode": r["mode"],
                        "dtype": case.get("params", {}).get("dtype"),
                        "shape": case["shape"],
                        "size": case["size"],
                        "value": r[metric],
                        "ours": r["kind"] == "ppo_fast",
                    }
                )
    return points


def plot(results: dict, out_dir: str, stem: str) -> list[str]:
    """Speedup (and on GPU, GB/s) per op, one panel per op; returns the files written.

    An op measured at several sizes is drawn as lines against size (colour: implementation,
    line style: fwd / fwd+bwd, marker: dtype); an op measured at one or two sizes (``--quick``,
    the CPU subset) as horizontal bars per shape and mode.  Colours are fixed per implementation.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("speedup", "speedup over the eager baseline (1x = eager; python loop for gae)")]
    if results["device"] == "cuda":
        metrics.append(("gbps", "achieved GB/s"))
    ops = list(dict.fromkeys(case["op"] for case in results["cases"] if not case.get("skipped")))
    quick = bool(results.get("settings", {}).get("quick"))
    written = []
    for metric, label in metrics:
        per_op = {op: _plot_points(results, op, metric) for op in ops}
        per_op = {op: pts for op, pts in per_op.items() if pts}
        if not per_op:
            continue
        bars = {op: len({p["size"] for p in pts}) < LINE_MIN_SIZES for op, pts in per_op.items()}
        heights = [max(1.9, 0.16 * len(pts) + 1.2) if bars[op] else 3.4 for op, pts in per_op.items()]
        fig, axes = plt.subplots(
            len(per_op), 1, figsize=(9, sum(heights) + 1.4), squeeze=False, gridspec_kw={"height_ratios": heights}
        )
        assigned: dict[str, str] = {}
        used_impls, used_modes, used_dtypes = {}, set(), set()
        for ax, (op, pts) in zip(axes[:, 0], per_op.items()):
            for p in pts:
                used_impls.setdefault(p["impl"], p["ours"])
                used_modes.add(p["mode"])
            if bars[op]:
                _bar_panel(ax, pts, assigned, impl_color)
            else:
                used_dtypes |= _line_panel(ax, op, pts, metric, results, assigned)
            _style_panel(ax, op, metric, label, bars[op])
        handles = _legend_handles(
            assigned, used_impls, used_modes, used_dtypes, lines=any(not b for b in bars.values())
        )
        fig.legend(
            handles=handles,
            loc="upper center",
            ncol=min(5, len(handles)),
            fontsize=7,
            frameon=False,
            bbox_to_anchor=(0.5, 1 - 0.55 / (sum(heights) + 1.4)),
        )
        machine = results["machine"]
        hardware = machine.get("gpu") or f"{machine['cpu']}, {machine['cores']} cores"
        title = f"ppo_fast ops vs eager baselines: {results['device']} ({hardware}), {results['date'][:10]}"
        if quick:
            title += "\n--quick: tiny shapes, timings dominated by per-call overhead: a smoke test, not a speed result"
        fig.suptitle(title, fontsize=9, y=0.995)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.95 / (sum(heights) + 1.4)))
        path = os.path.join(out_dir, f"{stem}-{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _line_panel(ax, op: str, pts: list[dict], metric: str, results: dict, assigned: dict) -> set:
    """Lines against size: colour per implementation, style per mode, marker per dtype; returns the dtypes drawn."""
    from matplotlib.ticker import NullFormatter

    series, dtypes = {}, set()
    for p in pts:
        series.setdefault((p["impl"], p["mode"], p["dtype"]), []).append((p["size"], p["value"]))
        dtypes.add(p["dtype"])
    for (impl, mode, dtype), xy in sorted(series.items(), key=lambda kv: [str(k) for k in kv[0]]):
        xy.sort()
        ax.plot(
            [x for x, _ in xy],
            [y for _, y in xy],
            MODE_STYLES.get(mode, ":"),
            marker=DTYPE_MARKERS.get(dtype, "x"),
            color=impl_color(impl, assigned),
            linewidth=1.4,
            markersize=4,
        )
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("logit elements (N x V)" if op == "token_logprobs" else "tokens (B x T)", fontsize=8)
    if metric == "gbps" and results.get("copy_bandwidth_gbps"):
        ax.axhline(results["copy_bandwidth_gbps"], color="grey", linestyle=":", linewidth=1)
        ax.text(
            ax.get_xlim()[0], results["copy_bandwidth_gbps"], " copy bandwidth", fontsize=7, va="bottom", color="grey"
        )
    return dtypes


def _style_panel(ax, op: str, metric: str, label: str, bars: bool) -> None:
    """Axis scales, the 1x line of a speedup, labels, title and grid of one panel."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if metric == "speedup":
        (ax.axvline if bars else ax.axhline)(1.0, color="black", linewidth=0.8)
        axis = ax.xaxis if bars else ax.yaxis
        (ax.set_xscale if bars else ax.set_yscale)("log")
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        axis.set_minor_formatter(NullFormatter())
    (ax.set_xlabel if bars else ax.set_ylabel)(label, fontsize=8)
    ax.set_title(op, fontsize=10, loc="left")
    ax.grid(alpha=0.3, which="both" if not bars else "major")
    ax.tick_params(labelsize=7)


def _legend_handles(assigned: dict, used_impls: dict, used_modes: set, used_dtypes: set, lines: bool) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=impl_color(name, assigned), label=name + (" (ppo_fast)" if ours else ""))
        for name, ours in sorted(used_impls.items(), key=lambda kv: (not kv[1], kv[0]))
    ]
    if lines:
        handles += [
            Line2D([], [], color="black", linestyle=MODE_STYLES.get(m, ":"), label=m) for m in sorted(used_modes)
        ]
        handles += [
            Line2D([], [], color="black", marker=DTYPE_MARKERS.get(d, "x"), linestyle="", label=d)
            for d in sorted(used_dtypes, key=str)
            if d
        ]
    elif "fwd+bwd" in used_modes:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="fwd+bwd (hatched)"))
    return handles


def _bar_panel(ax, pts: list[dict], assigned: dict, color_of) -> None:
    """Horizontal bars, grouped by (shape, mode), one bar per implementation, value labels."""
    groups = {}
    for p in pts:
        groups.setdefault((p["shape"], p["mode"]), []).append(p)
    y, ticks, labels = 0.0, [], []
    for (shape, mode), members in groups.items():
        members.sort(key=lambda p: (not p["ours"], p["impl"]))
        start = y
        for p in members:
            ax.barh(
                y,
                p["value"],
                height=0.8,
                color=color_of(p["impl"], assigned),
                hatch="///" if mode == "fwd+bwd" else None,
                edgecolor="white" if mode == "fwd+bwd" else None,
                linewidth=0,
            )
            ax.text(
                p["value"],
                y,
                " " + (f"{p['value']:.0f}" if p["value"] >= 100 else f"{p['value']:.3g}"),
                va="center",
                fontsize=6,
            )
            y += 1
        ticks.append((start + y - 1) / 2)
        labels.append(f"{shape}  {mode}")
        y += 0.6
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.margins(x=0.15)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.splitlines()[0])
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
