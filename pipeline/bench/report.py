"""The benchmark's figures: per-mode summary, the printed table and the plot."""

from __future__ import annotations

import numpy as np

from pipeline.bench.drivers import RequestTimes
from pipeline.common.trace import ROLES, cpu_per_step_us, device_spans, gap_metrics, token_gaps_us


def summarize(times: list[RequestTimes], spans: list, spec: dict | None = None) -> dict:
    """Per-mode figures from client-side token times, the worker's device spans and speculative counts (``spec``, or
    None).

    Wall time runs from the first submission to the last token; mean accepted length is vLLM's ``1 + accepted /
    drafts``; host CPU per output token sums every process's step CPU over output tokens.
    """
    wall_s = max(t.token_times[-1] for t in times if t.token_times) - min(t.submit for t in times)
    ttft = [t.token_times[0] - t.submit for t in times if t.token_times]
    itl = [b - a for t in times for a, b in zip(t.token_times, t.token_times[1:])]
    dev = device_spans(spans)
    cpu = {role: v for role, v in cpu_per_step_us(spans).items() if len(v)}
    tokens = sum(t.num_tokens for t in times)
    out = {
        **gap_metrics(dev),
        "output_tokens_per_s": tokens / wall_s,
        "ttft_ms": {"p50": float(np.percentile(ttft, 50) * 1e3), "p99": float(np.percentile(ttft, 99) * 1e3)},
        "itl_ms": (
            {"p50": float(np.percentile(itl, 50) * 1e3), "p99": float(np.percentile(itl, 99) * 1e3)} if itl else None
        ),
        "num_steps": int(len(dev)) if len(dev) else None,
        "cpu_per_step_us": {
            role: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))} for role, v in cpu.items()
        },
        "host_cpu_per_token_us": sum(float(v.sum()) for v in cpu.values()) / tokens if cpu and tokens else None,
        **_itl_by_kind(times),
        "num_requests": len(times),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "spec_decode": None,
    }
    if spec is not None:
        drafts, drafted = spec["spec_decode_num_drafts"], spec["spec_decode_num_draft_tokens"]
        accepted = spec["spec_decode_num_accepted_tokens"]
        out["spec_decode"] = {
            **spec,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        }
    turns = sorted({t.turn for t in times})
    if turns != [0]:
        out["ttft_p50_ms_by_turn"] = [
            float(
                np.percentile([t.token_times[0] - t.submit for t in times if t.turn == k and t.token_times], 50) * 1e3
            )
            for k in turns
        ]
    return out


def print_table(results: dict[str, dict]) -> None:
    """One row per figure, one column per mode (plus async/sync when both ran)."""
    rows = [
        ("token gap p50 (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["p50"]),
        ("token gap p90 (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["p90"]),
        ("token gap p99 (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["p99"]),
        ("token gap max (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["max"]),
        ("token gap mean (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["mean"]),
        ("device busy fraction", lambda r: r["device_busy_fraction"]),
        ("output tokens/s", lambda r: r["output_tokens_per_s"]),
        ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]),
        ("TTFT p99 (ms)", lambda r: r["ttft_ms"]["p99"]),
        *(
            (f"TTFT p50 turn {k + 1} (ms)", lambda r, k=k: r["ttft_p50_ms_by_turn"][k])
            for k in range(len(next(iter(results.values())).get("ttft_p50_ms_by_turn", ())))
        ),
        ("ITL p50 (ms)", lambda r: r["itl_ms"] and r["itl_ms"]["p50"]),
        ("ITL p99 (ms)", lambda r: r["itl_ms"] and r["itl_ms"]["p99"]),
        *(
            (f"{role} CPU/step {q} (us)", lambda r, role=role, q=q: r["cpu_per_step_us"].get(role, {}).get(q))
            for role in ROLES
            for q in ("p50", "p99")
            if any(role in r.get("cpu_per_step_us", {}) for r in results.values())
        ),
        ("host CPU per output token (us)", lambda r: r.get("host_cpu_per_token_us")),
        *(
            (
                ("bound: replay of the same steps (s)", lambda r: r["bound"]["replay_s"]),
                ("engine / bound throughput", lambda r: r["bound"]["engine_over_bound"]),
            )
            if all("bound" in r for r in results.values())
            else ()
        ),
        *(
            (
                ("speculation: acceptance rate", lambda r: r["spec_decode"] and r["spec_decode"]["acceptance_rate"]),
                (
                    "speculation: mean accepted length",
                    lambda r: r["spec_decode"] and r["spec_decode"]["mean_accepted_length"],
                ),
            )
            if any(r.get("spec_decode") for r in results.values())
            else ()
        ),
        ("steps", lambda r: r["num_steps"]),
        ("wall time (s)", lambda r: r["wall_s"]),
    ]
    modes = list(results)
    both = modes == ["async", "sync"]
    head = ["figure", *modes] + (["async/sync"] if both else [])
    lines = [head]
    for name, get in rows:
        vals = [get(results[m]) for m in modes]
        cells = [name] + ["-" if v is None else f"{v:.4g}" for v in vals]
        if both:
            cells.append(f"{vals[0] / vals[1]:.3g}" if vals[0] is not None and vals[1] else "-")
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    for i, r in enumerate(lines):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def plot(results: dict[str, dict], spans: dict[str, list], path: str) -> None:
    """Gap histogram of each mode and a strip of each mode's step timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, axes = plt.subplots(
        1 + len(modes), 1, figsize=(10, 3 + 1.6 * len(modes)), gridspec_kw={"height_ratios": [3] + [1] * len(modes)}
    )
    ax = axes[0]
    for m, color in zip(modes, ("tab:blue", "tab:orange")):
        gaps = token_gaps_us(device_spans(spans[m]))
        if len(gaps):
            bins = np.logspace(0, max(1.0, np.log10(gaps.max() + 1) + 0.1), 50)
            ax.hist(
                gaps + 1,
                bins=bins,
                alpha=0.6,
                color=color,
                label=f"{m}: p50 {np.percentile(gaps, 50):.0f} us, p99 {np.percentile(gaps, 99):.0f} us",
            )
    ax.set_xscale("log")
    ax.set_xlabel("token gap + 1 (us): device start of step N+1 - device end of step N")
    ax.set_ylabel("steps")
    ax.legend()
    for ax, m in zip(axes[1:], modes):
        dev = device_spans(spans[m])
        if not len(dev):
            continue
        mid = len(dev) // 2
        win = dev[mid : mid + 12]
        t0 = win[0, 0]
        ax.broken_barh(
            [((a - t0) / 1e6, (b - a) / 1e6) for a, b in win],
            (0, 1),
            facecolor="tab:green",
            edgecolor="black",
            linewidth=0.4,
        )
        ax.set_yticks([])
        ax.set_ylabel(m, rotation=0, ha="right", va="center")
        ax.set_xlabel("ms (12 steps from mid-run; white = device idle)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_ratios(results: dict[str, dict]) -> None:
    """With speculation on and off: output tokens/s of each "spec" run over its "no-spec" twin."""
    pairs = [(k, k.replace(" spec", " no-spec")) for k in results if k.endswith(" spec")]
    pairs = [(on, off) for on, off in pairs if off in results]
    if not pairs:
        return
    print("| run | spec tok/s | no-spec tok/s | spec / no-spec | acceptance rate | mean accepted length |")
    print("|---|---|---|---|---|---|")
    for on, off in pairs:
        a, b = results[on]["output_tokens_per_s"], results[off]["output_tokens_per_s"]
        sd = results[on]["spec_decode"] or {}
        rate, length = sd.get("acceptance_rate"), sd.get("mean_accepted_length")
        print(f"| {on.removesuffix(' spec')} | {a:.4g} | {b:.4g} | {a / b:.3g} | {_g(rate)} | {_g(length)} |")


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _itl_by_kind(times: list[RequestTimes]) -> dict:
    """With constrained requests (a ``response_format``) beside free ones: each kind's ITL p50 and p90, ms."""
    out = {}
    for kind, want in (("constrained", True), ("free", False)):
        itl = [b - a for t in times if t.constrained == want for a, b in zip(t.token_times, t.token_times[1:])]
        if itl:
            out[f"itl_ms_{kind}"] = {p: float(np.percentile(itl, int(p[1:])) * 1e3) for p in ("p50", "p90")}
    return out if len(out) == 2 else {}
