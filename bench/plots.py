"""The benchmark's pictures: the pipeline bubble over M, step time and speedup over N, one step.

draw(meta, runs, trace, stem) writes three PNGs beside the tables, named after them:
  STEM-bubble.png    measured bubble against its schedule's theory over M, for every pipeline schedule
                     found in the results (any name the pipeline's cases carry), one panel per N;
  STEM-scaling.png   step time and speedup over N for every strategy of the scaling job;
  STEM-timeline.png  one step of a pipeline_parallel.py --trace run, rank by rank.
The numbers are picked by the same functions as the tables (report.py). matplotlib is needed here
alone: run.py measures and writes the tables without it, and says that the pictures were skipped.
The functions that pick the numbers need no matplotlib, so the tests run them anywhere.
"""
import collections
import json

import report

# One colour per kind of span in the timeline; a weight-gradient pass (W) for the zero-bubble
# schedules, which split a backward into the input gradient (B) and the weight gradient (W).
SPAN_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "weight gradient": "#55a868",
                "optimizer": "#8172b3", "waiting for a peer": "#e8a0a0", "send / receive": "#222222"}


# -----------------------------------------------------------------------------
# The numbers of each picture (no matplotlib)
# -----------------------------------------------------------------------------
def bubble_series(runs):
    """{N: {schedule: [(M, measured, theory)] sorted by M}} from the pipeline jobs, and
    {N: (measured, theory)} for model parallelism, which runs the whole batch at once (M = 1)."""
    series, model = {}, {}
    for run in sorted((r for r in runs if r["group"] == "pp" and r["result"] and not r["env"]),
                      key=lambda r: r["ranks"]):
        n = run["ranks"]
        for c in run["result"]["cases"]:
            tags = c["tags"]
            if tags.get("kind") != "strategy" or not report.ok(c):
                continue
            r = c["result"]
            if tags.get("strategy") == "model_parallel" and r.get("idle_fraction"):
                model[n] = (sum(r["idle_fraction"]) / len(r["idle_fraction"]), (n - 1) / n)
            elif r.get("bubble_fraction") is not None:
                schedule = tags.get("schedule") or r.get("schedule")
                m = tags.get("m") or r.get("micro_batches")
                theory = r.get("bubble_fraction_theory", (n - 1) / (m + n - 1))
                series.setdefault(n, {}).setdefault(schedule, []).append((m, r["bubble_fraction"], theory))
    for schedules in series.values():
        for points in schedules.values():
            points.sort()
    return series, model


def scaling_series(runs):
    """{label: [(N, threads, ms, lowest ms, highest ms, speedup)]} from the scaling job; speedup
    against one rank on the fewest threads, paired round by round as in the table."""
    j = report.scaling_job(runs)
    if j is None:
        return {}
    cases = j["result"]["cases"]
    base_key = min((c["tags"]["n"], c["tags"]["threads"]) for c in cases)
    series = {}
    for label in dict.fromkeys(c["label"] for c in cases):
        found = {(c["tags"]["n"], c["tags"]["threads"]): c for c in cases if c["label"] == label}
        points = []
        for (n, threads), c in sorted(found.items()):
            if not report.ok(c):
                continue
            each = report.rounds(c)
            points.append((n, threads, 1e3 * c["result"]["step_time_s"], 1e3 * min(each), 1e3 * max(each),
                           report.ratio(found.get(base_key), c)))
        series[label] = points
    return series


def span_kind(name, cat):
    """What a trace event is, as the timeline's colours tell it."""
    if cat == "idle":
        return "waiting for a peer"
    if cat == "comm":
        return "send / receive"
    if name == "optimizer":
        return "optimizer"
    return {"F": "forward", "B": "backward", "W": "weight gradient"}.get(name[:1], "optimizer")


def median_step(trace):
    """One step of every rank from a Chrome trace: the median by length of the steps after the
    first (the lower of the two middle ones). A rank's step k runs from the end of its optimizer
    update k - 1 to the end of update k, its waits for a peer included; a step lasts from the
    first start to the last end over the ranks. Returns ({rank: [(name, kind, start ms, end ms)]}
    with times from that first start, k counted from 1, how many steps the trace holds)."""
    per_rank = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            per_rank[e["pid"]].append((e["ts"], e["ts"] + e["dur"], e["name"], e.get("cat", "")))
    updates = {rank: sorted(end for start, end, name, cat in events if name == "optimizer")
               for rank, events in per_rank.items()}
    count = min((len(ends) for ends in updates.values()), default=0)
    if count == 0:
        return {}, 0, 0

    def step(k):  # k counted from 0
        return {rank: sorted(e for e in per_rank[rank]
                             if e[0] >= (updates[rank][k - 1] if k else float("-inf"))
                             and e[1] <= updates[rank][k]) for rank in sorted(per_rank)}

    def length(events):
        spans = [e for rank_events in events.values() for e in rank_events]
        return max(e[1] for e in spans) - min(e[0] for e in spans)

    later = sorted(range(1, count) if count > 1 else [0], key=lambda k: length(step(k)))
    k = later[(len(later) - 1) // 2]
    events = step(k)
    origin = min(e[0] for rank_events in events.values() for e in rank_events)
    return ({rank: [(name, span_kind(name, cat), (s - origin) / 1e3, (e - origin) / 1e3)
                    for s, e, name, cat in rank_events] for rank, rank_events in events.items()},
            k + 1, count)


# -----------------------------------------------------------------------------
# The pictures
# -----------------------------------------------------------------------------
def oversubscribed(n, cores):
    return f"N = {n}" + (f" {report.OVERSUBSCRIBED} ({n} ranks on {cores} cores)" if n > cores else "")


def draw_bubble(plt, runs, cores, path):
    series, model = bubble_series(runs)
    sizes = sorted(set(series) | set(model))
    if not sizes:
        return None
    schedules = list(dict.fromkeys(s for n in sizes for s in series.get(n, {})))
    colour = {s: f"C{i}" for i, s in enumerate(schedules)}
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.6), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], sizes):
        ticks = {1} if n in model else set()
        for s, points in series.get(n, {}).items():
            m, measured, theory = zip(*points)
            ticks |= set(m)
            ax.plot(m, [100 * x for x in measured], "o-", color=colour[s], label=f"{s} measured")
            ax.plot(m, [100 * x for x in theory], "--", color=colour[s], lw=1, alpha=0.8,
                    label=f"{s} theory")
        if n in model:
            ax.plot([1], [100 * model[n][0]], "D", color="black", label="model_parallel.py measured")
            ax.plot([1], [100 * model[n][1]], "D", mfc="none", color="black",
                    label="model_parallel.py theory")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.minorticks_off()
        ax.set_ylim(0, 100)
        ax.set_title(oversubscribed(n, cores), fontsize=10)
        ax.set_xlabel("micro-batches per step (M)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bubble: % of the step waiting")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # every entry once, whichever panel drew it
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle("Pipeline bubble, measured (solid) against each schedule's theory (dashed)", fontsize=11)
    fig.tight_layout(rect=(0, 0.05 + 0.04 * ((len(labels) + 3) // 4), 1, 1))
    return save(fig, path, tight=False)


def draw_scaling(plt, runs, cores, path):
    series = scaling_series(runs)
    if not series:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4.2))
    sizes = sorted({p[0] for points in series.values() for p in points})
    for i, (label, points) in enumerate(series.items()):
        fewest = {}
        for p in points:  # the line: at each N, the run on the fewest threads (N = 1: one core)
            fewest.setdefault(p[0], p)
        line = sorted(fewest.values())
        more = [p for p in points if p not in line]
        n, _, step, lo, hi, speedup = zip(*line)
        left.errorbar(n, step, yerr=[[s - a for s, a in zip(step, lo)], [b - s for s, b in zip(step, hi)]],
                      fmt="o-", color=f"C{i}", capsize=3, label=label)
        right.plot(n, speedup, "o-", color=f"C{i}")
        for p in more:  # N = 1 on all the cores' threads: a hollow marker
            left.plot([p[0]], [p[2]], "o", mfc="none", color=f"C{i}")
            right.plot([p[0]], [p[5]], "o", mfc="none", color=f"C{i}")
    right.plot(sizes, sizes, ":", color="grey", label="ideal: N")
    right.plot(sizes, [min(n, cores) for n in sizes], "--", color="grey",
               label=f"ideal on {cores} cores: min(N, {cores})")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{n}{report.OVERSUBSCRIBED}" if n > cores else str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel(f"ranks (N; {report.OVERSUBSCRIBED}: more ranks than cores)")
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("step time, ms (range over rounds)")
    left.set_title("Step time, same global batch", fontsize=10)
    right.set_ylabel("speedup over one rank on one thread")
    right.set_title("Speedup (hollow: N = 1 on every core's thread)", fontsize=10)
    right.legend(fontsize=7, loc="upper left")
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.subplots_adjust(bottom=0.25, top=0.86, wspace=0.3)
    fig.suptitle("Scaling every strategy from one rank to N", fontsize=11)
    return save(fig, path, tight=False)


def draw_timeline(plt, trace, path):
    steps, k, count = median_step(trace)
    if not steps:
        return None
    about = trace.get("otherData", {})
    command = about.get("command", "pipeline_parallel.py --trace")
    if about.get("load"):
        command += f"  (load average {about['load'][0]} → {about['load'][1]})"
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(steps) + 1.8))
    seen = set()
    end = max(e for spans in steps.values() for _, _, _, e in spans)
    order = ("waiting for a peer", "send / receive")  # drawn over compute, should they overlap
    for rank, spans in steps.items():
        for name, kind, s, e in sorted(spans, key=lambda x: x[1] in order):
            thin = kind == "send / receive"
            ax.broken_barh([(s, max(e - s, end / 1500))],
                           (rank - (0.15 if thin else 0.4), 0.3 if thin else 0.8),
                           color=SPAN_COLOURS[kind], label=None if kind in seen else kind)
            seen.add(kind)
            if kind in ("forward", "backward", "weight gradient") and e - s > end / 60:
                ax.text((s + e) / 2, rank, name[1:] if name[1:].isdigit() else name, ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(list(steps), [f"rank {r}" for r in steps])
    ax.set_ylim(max(steps) + 0.6, min(steps) - 0.6)
    ax.set_xlim(0, end)
    ax.set_xlabel("ms from the start of the step (numbers: the micro-batch; white: between recorded spans)")
    handles, labels = ax.get_legend_handles_labels()
    keep = [k for k in SPAN_COLOURS if k in labels]
    ax.legend([handles[labels.index(k)] for k in keep], keep, fontsize=7, ncol=len(keep),
              loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    waits = [sum(e - s for _, kind, s, e in spans if kind == "waiting for a peer")
             for spans in steps.values()]
    waiting = " / ".join(f"{100 * w / end:.0f}%" for w in waits)
    ax.set_title(f"One pipeline step as measured, rank by rank: step {k} of {count} (the median after the "
                 f"first), {end:.0f} ms, waiting for a peer {waiting} of it\n{command}", fontsize=9)
    return save(fig, path)


def save(fig, path, tight=True):
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def draw(meta, runs, trace_path, stem):
    """Every picture that the results hold the numbers for; returns the files written.
    Raises ImportError when matplotlib is not installed."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    cores = meta["machine"]["cores"]
    trace = json.loads(trace_path.read_text()) if trace_path and trace_path.is_file() else None
    written = []
    for name, picture in (("bubble", lambda path: draw_bubble(plt, runs, cores, path)),
                          ("scaling", lambda path: draw_scaling(plt, runs, cores, path)),
                          ("timeline", lambda path: trace and draw_timeline(plt, trace, path))):
        path = stem.with_name(f"{stem.name}-{name}.png")
        if picture(path):
            written.append(path)
        else:  # no numbers for it in these results: no picture of an older run in its place
            path.unlink(missing_ok=True)
    return written
