"""Render benchmark results: the stdout table, the markdown tables and the PNG plots.

``python -m bench report bench/results/cpu.json [more.json ...]`` prints the performance
tables (markdown) of the given result files; ``--plot out.png`` draws their ops into one PNG.
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
                    "device": "",
                    "device_spread": "",
                    "speedup": "",
                    "speedup_device": "",
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
                    "device": _fmt(r.get("device_median_ms"), ".4g") if ok else "",
                    "device_spread": (
                        f"{r['device_q25_ms']:.4g}-{r['device_q75_ms']:.4g}" if ok and "device_q25_ms" in r else ""
                    ),
                    "speedup": _times(r.get("speedup")),
                    "speedup_device": _times(r.get("speedup_device")),
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
    ("time", "eager ms"),
    ("spread", "eager IQR ms"),
    ("device", "device ms"),
    ("device_spread", "device IQR ms"),
    ("speedup", "vs eager"),
    ("speedup_device", "vs eager, device"),
    ("vs_reference", "vs reference"),
    ("memory", "peak extra MiB"),
    ("gbps", "GB/s"),
    ("copy", "% copy BW"),
    ("tflops", "TFLOP/s"),
    ("note", "note"),
]


TIMER_LINE = (
    "eager ms: wall time per call as a user's loop pays it (host overhead included), warmed, median and IQR "
    "over blocks of calls; device ms (CUDA): CUDA graph replay, L2 flushed before each (bench.timing); every "
    "implementation of a row takes both"
)


def current_timers(results: dict) -> bool:
    """Whether a result file was timed by bench.timing's current rule (its rows count their samples)."""
    return any("samples" in r for case in results["cases"] for r in case.get("results", []))


def _columns(results: dict) -> list[tuple[str, str]]:
    if not current_timers(results):
        titles = {"time": "median ms", "spread": "IQR ms"}
        return [(key, titles.get(key, title)) for key, title in _columns_current(results)]
    return _columns_current(results)


def _columns_current(results: dict) -> list[tuple[str, str]]:
    on_gpu = results["device"] == "cuda"
    gpu_only = ("device", "device_spread", "speedup_device", "gbps", "copy", "tflops")
    return [(key, title) for key, title in _COLUMNS if on_gpu or key not in gpu_only]


def header_lines(results: dict) -> list[str]:
    machine, versions = results["machine"], results["versions"]
    hardware = machine.get("gpu") or f"{machine['cpu']} ({machine['cores']} cores, {machine['torch_threads']} threads)"
    lines = [
        f"device {results['device']}: {hardware}; {results['date']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"command: {results['command']}",
        "backends: " + "; ".join(f"{k} {v}" for k, v in results["backends"].items()),
        f"peak memory method: {results['memory_method']}",
        TIMER_LINE
        if current_timers(results)
        else "median ms: as this file's suite timed it then (CPU: torch.utils.benchmark's blocked autorange; "
        "CUDA: triton's do_bench, a CUDA graph replay without an L2 flush for calls under 1 ms), not "
        "bench.timing's current rule",
        "vs eager: speedup over the eager baseline of the same case and mode (python-loop for gae), eager wall "
        "time (and device time); vs reference: over our reference backend; * marks ppo_fast backends",
        "MISMATCH (no time): the output differs from our reference backend by more than the tolerance (the "
        "note says by how much; a bf16 baseline's own rounding, say), so it is not timed: a time for another "
        "answer is no comparison, and says nothing of that implementation's speed; ERROR and OOM likewise",
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
    """The performance tables of one result file (markdown)."""
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
BAR_HEIGHT_IN = 0.17  # inches per bar; a group's header and gap add a little more
METRICS = {
    "ms": ("eager wall time per call, median ms (log scale: shorter is faster)", "median_ms"),
    "device-ms": ("device time per call (CUDA graph replay, L2 flushed), median ms (log scale)", "device_median_ms"),
    "gbps": ("achieved GB/s (longer is faster)", "gbps"),
}


def impl_color(name: str, assigned: dict) -> str:
    if name in IMPL_COLORS:
        return IMPL_COLORS[name]
    if name not in assigned:
        assigned[name] = _SPARE_COLORS[len(assigned) % len(_SPARE_COLORS)]
    return assigned[name]


def yardsticks(case: dict) -> set[str]:
    """Implementations timed as yardsticks of a case: they compute something else, so they are not compared."""
    return set(case.get("yardsticks", ()))


def machine_label(results: dict) -> str:
    """The machine and date a result file was measured on, as a plot or page says it."""
    machine = results["machine"]
    hardware = machine.get("gpu") or f"{machine['cpu']}, {machine['cores']} cores"
    return f"{results['device']}: {hardware}, {results['date'][:10]}"


def bar_groups(results: dict, op: str, key: str) -> list[dict]:
    """One group per (shape, mode) of ``op``: its compared bars (ours first, then the eager baseline and the
    other baselines) and, apart, its yardsticks."""
    groups = {}
    for case in results["cases"]:
        if case["op"] != op or case.get("skipped"):
            continue
        marks = yardsticks(case)
        for r in case["results"]:
            if r["status"] != "ok" or r.get(key) is None:
                continue
            group = groups.setdefault((case["shape"], r["mode"]), {"label": f"{case['shape']}, {r['mode']}"})
            bar = {
                "impl": r["impl"],
                "ours": r["kind"] == "ppo_fast",
                "baseline": r["impl"] == case["eager_baseline"],
                "value": r[key],
                "speedup": r.get("speedup_device" if key == "device_median_ms" else "speedup"),
            }
            group.setdefault("yardsticks" if r["impl"] in marks else "compared", []).append(bar)
    for group in groups.values():
        group.setdefault("compared", []).sort(key=lambda b: (not b["ours"], not b["baseline"], b["impl"]))
        group.setdefault("yardsticks", [])
    return list(groups.values())


def _panels(runs: list[dict], key: str) -> list[tuple[dict, str, list[dict]]]:
    panels = []
    for results in runs:
        for op in dict.fromkeys(case["op"] for case in results["cases"]):
            groups = bar_groups(results, op, key)
            if groups:
                panels.append((results, op, groups))
    return panels


def _panel_height(groups: list[dict]) -> float:
    bars = sum(len(g["compared"]) + len(g["yardsticks"]) for g in groups)
    return 0.55 + BAR_HEIGHT_IN * bars + 0.3 * len(groups) + 0.12 * sum(bool(g["yardsticks"]) for g in groups)


def plot(results: dict | list[dict], out_dir: str, stem: str) -> list[str]:
    """Horizontal bars of the median milliseconds per call, one panel per op of every result file given
    (on GPU also a second figure of the achieved GB/s); returns the files written (``{stem}.png``,
    ``{stem}-gbps.png``).

    Each bar is named on the axis and labelled with its milliseconds and its speed-up over the eager
    baseline of its shape and mode.  Yardsticks (timed, not compared: e.g. ``linear-layer``, the head's
    products alone) are drawn apart, hollow, after their group's compared bars.  Each panel names the
    machine and the date of its result file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results if isinstance(results, list) else [results]
    written = []
    for metric, (label, key) in METRICS.items():
        if metric == "gbps" and not any(r["device"] == "cuda" for r in runs):
            continue
        panels = _panels(runs, key)
        if not panels:
            continue
        heights = [_panel_height(groups) for _, _, groups in panels]
        fig, axes = plt.subplots(
            len(panels), 1, figsize=(10, sum(heights) + 1.1), squeeze=False, gridspec_kw={"height_ratios": heights}
        )
        assigned: dict[str, str] = {}
        for ax, (run, op, groups) in zip(axes[:, 0], panels):
            _bar_panel(ax, groups, metric, assigned)
            ax.set_title(f"{op}  ({machine_label(run)})", fontsize=10, loc="left")
            ax.set_xlabel(label, fontsize=8)
            if metric == "gbps" and run.get("copy_bandwidth_gbps"):
                ax.axvline(run["copy_bandwidth_gbps"], color="grey", linestyle=":", linewidth=1)
        title = "ppo_fast ops (* ours) against what users run instead: milliseconds per call, speed-up over the eager baseline"
        if any(r.get("settings", {}).get("quick") for r in runs):
            title += "\n--quick: tiny shapes, timings dominated by per-call overhead: a smoke test, not a speed result"
        fig.suptitle(title, fontsize=9)
        fig.text(
            0.01, 0.003, "hollow bars: yardsticks, timed but not compared (they compute something else)", fontsize=7
        )
        total = sum(heights) + 1.1
        fig.tight_layout(rect=(0, 0.25 / total, 1, 1 - 0.3 / total), h_pad=1.5)
        path = os.path.join(out_dir, f"{stem}.png" if metric == "ms" else f"{stem}-{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _bar_text(bar: dict, metric: str, yardstick: bool) -> str:
    value = bar["value"]
    text = f" {value:,.0f}" if value >= 100 else f" {value:.3g}"
    text += " GB/s" if metric == "gbps" else " ms"
    if yardstick:
        return text
    if bar["baseline"]:
        return text + "  (eager baseline)"
    return text + (f"  {bar['speedup']:.2f}x" if bar["speedup"] is not None else "")


def _bar_panel(ax, groups: list[dict], metric: str, assigned: dict) -> None:
    """The bars of one op: groups top to bottom, compared bars, then its yardsticks apart."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    y, ticks, labels, values = 0.0, [], [], []
    for group in groups:
        ax.text(0.0, y - 0.15, group["label"], transform=ax.get_yaxis_transform(), fontsize=8, weight="bold")
        y += 0.75
        for kind in ("compared", "yardsticks"):
            if kind == "yardsticks" and group[kind]:
                y += 0.4
            for bar in group[kind]:
                yardstick = kind == "yardsticks"
                colour = impl_color(bar["impl"], assigned)
                style = (
                    {"facecolor": "none", "edgecolor": "#555555", "linestyle": "--"} if yardstick else {"color": colour}
                )
                ax.barh(y, bar["value"], height=0.75, linewidth=1.2, **style)
                ax.text(bar["value"], y, _bar_text(bar, metric, yardstick), va="center", fontsize=7)
                ticks.append(y)
                labels.append(bar["impl"] + (" *" if bar["ours"] else "") + (" (yardstick)" if yardstick else ""))
                values.append(bar["value"])
                y += 1
        y += 0.35
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    for tick, label in zip(ax.get_yticklabels(), labels):
        tick.set_color("black" if label.endswith("*") else "#444444")
    ax.set_ylim(y - 0.3, -0.8)
    if metric != "gbps":
        ax.set_xscale("log")
        lo, hi = min(values), max(values)
        ax.set_xlim(lo / 1.6, hi * 5)  # room on the right for the longest bar's label
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_xlim(0, max(values) * 1.45)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(labelsize=7)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="result JSON files written by python -m bench")
    parser.add_argument(
        "--plot", metavar="PNG", help="also draw every op of the given files into this PNG (one panel per op)"
    )
    args = parser.parse_args(argv)
    runs = []
    for path in args.results:
        with open(path) as f:
            runs.append(json.load(f))
    print("## Performance\n\n" + "\n\n".join(markdown(results) for results in runs))
    if args.plot:
        stem = os.path.splitext(os.path.basename(args.plot))[0]
        written = plot(runs, os.path.dirname(os.path.abspath(args.plot)), stem)
        print("wrote " + ", ".join(written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
