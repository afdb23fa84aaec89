"""The benchmark's markdown: one table per strategy, the scaling table and the findings.

render(meta, runs) takes what bench/run.py collected: meta (date, machine, command, ...) and one
entry per mpirun job, {"group", "ranks", "env", "result": the worker's JSON or None, "error"}.
Every ratio is paired: taken round by round between cases of the same job, then the median.
"""
import math
import statistics

OVERSUBSCRIBED = "†"


# -----------------------------------------------------------------------------
# Finding cases, and the few numbers made from them
# -----------------------------------------------------------------------------
def job(runs, group, ranks, env=None):
    """The entry of one job: the group at that world size, with exactly that extra environment."""
    return next((r for r in runs if r["group"] == group and r["ranks"] == ranks
                 and r["env"] == (env or {})), None)


def jobs_measured(runs, group, sizes=(2, 4)):
    """(N, job) for each world size at which the group's job ran and returned its results."""
    return [(n, j) for n, j in ((n, job(runs, group, n)) for n in sizes) if j and j["result"]]


def case(run, **tags):
    """The first case of a job whose tags hold all of `tags`; None when there is none."""
    if not run or not run["result"]:
        return None
    return next((c for c in run["result"]["cases"]
                 if all(c["tags"].get(k) == v for k, v in tags.items())), None)


def scaling_job(runs):
    """The scaling group's entry with the most ranks (its cases cover every N up to that)."""
    return max((r for r in runs if r["group"] == "scaling" and r["result"]), key=lambda r: r["ranks"],
               default=None)


def cases_of(j):
    """A job's cases but the bare replays of a strategy's exchanges and ours on gloo (they have tables of
    their own)."""
    return [c for c in j["result"]["cases"] if c["tags"]["kind"] not in ("bare", "on_gloo")]


def ok(c):
    return c is not None and "error" not in c["result"]


def rounds(c, key="step_time_s"):
    return c["result"].get(f"{key}_rounds") or [c["result"][key]]


def paired(a, b, op, key="step_time_s"):
    """op(a's time, b's time) in each round that both ran."""
    return [op(x, y) for x, y in zip(rounds(a, key), rounds(b, key))]


def ratio(a, b, key="step_time_s"):
    ok_both = ok(a) and ok(b) and key in a["result"] and key in b["result"]
    return statistics.median(paired(a, b, lambda x, y: x / y, key)) if ok_both else None


def excess(a, b):
    return statistics.median(paired(a, b, lambda x, y: x - y)) if ok(a) and ok(b) else None


def excess_spread(a, b):
    """The lowest and highest round of a - b: where the noise of this machine puts them."""
    values = paired(a, b, lambda x, y: x - y) if ok(a) and ok(b) else []
    return (min(values), max(values)) if values else None


def loss_diff(a, b):
    """Largest |difference| between two cases' loss curves: do they train the same thing?"""
    if not (ok(a) and ok(b)) or "losses" not in a["result"] or "losses" not in b["result"]:
        return None
    return max(abs(x - y) for x, y in zip(a["result"]["losses"], b["result"]["losses"]))


# -----------------------------------------------------------------------------
# Formatting
# -----------------------------------------------------------------------------
def ratio_cell(a, b):
    """The paired ratio, with its lowest and highest round."""
    x = ratio(a, b)
    if x is None:
        return "–"
    each = paired(a, b, lambda p, q: p / q)
    return times(x) + (f" ({min(each):.2f}–{max(each):.2f})" if len(each) > 1 and a is not b else "")


def ms(seconds):
    return "–" if seconds is None else f"{seconds * 1e3:.1f}"


def step_cell(c):
    """Median step in ms, with the range over rounds: how noisy the machine was."""
    if len(rounds(c)) == 1:
        return ms(c["result"]["step_time_s"])
    return f"{ms(c['result']['step_time_s'])} ({ms(min(rounds(c)))}–{ms(max(rounds(c)))})"


def times(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}×"


def pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def sci(x):
    return "–" if x is None else f"{x:.1e}"


def plural(count, noun):
    return f"{count:g} {noun}{'' if count == 1 else 's'}"


def per_rank(values, fmt=str):
    return "–" if not values else " / ".join(fmt(v) for v in values)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines + [""]


def ranks_label(n, cores):
    return f"{n} {OVERSUBSCRIBED}" if n > cores else str(n)


def failed_row(c, width):
    """A case that did not run: its label and the one line why, across the row."""
    return [c["label"], f"not measured: {c['result']['error']}"] + [""] * (width - 2)


def load_line(entries):
    """The load average around each job of a table: how much the machine was shared."""
    parts = [f"N = {e['ranks']}" + "".join(f", {k}={v}" for k, v in e["env"].items())
             + f": {e['load'][0]} → {e['load'][1]}" for e in entries if e.get("load")]
    if not parts:
        return []
    return [f"Load average (1 min) at the start → end of each job: {'; '.join(parts)}.", ""]


def check_cell(c):
    """The check's largest difference from single-process training, and the script's verdict."""
    d = c["result"].get("check_max_abs_diff")
    if d is None:
        return "–"
    return f"{d:.1e} " + ("pass" if c["result"].get("check_passed", True) else "FAIL")


# -----------------------------------------------------------------------------
# The sections
# -----------------------------------------------------------------------------
def header(meta, runs):
    m = meta["machine"]
    done = next((r["result"] for r in runs if r["result"]), {}) or {}
    lines = [f"# Benchmarks ({meta['mode']})", "",
             f"`{meta['command']}` on {m['cpu']}, {m['cores']} cores, {meta['date']}; "
             f"load average {m['load']} when it started (a shared machine); "
             f"Python {m['python']}, torch {meta['torch']}, {done.get('mpi_library', 'MPI')}; "
             f"{meta['seconds']:.0f} s in all"
             + "".join(f"; every job with {k}={v}" for k, v in meta.get("environment", {}).items())
             + ".", "",
             "Each number: per step, the median over the steps after the first, of the slowest rank; "
             "then the median over rounds in which all cases of one job take turns (range over rounds "
             "in brackets). Ratios are taken round by round between cases of the same job, then the "
             f"median. {OVERSUBSCRIBED}: more ranks than cores (oversubscribed; each rank gets "
             f"max(1, cores / ranks) torch threads, as the scripts set them).", ""]
    if meta["missing"]:
        lines += [f"Not in the repository when this ran, so not measured: "
                  f"{', '.join(s + '.py' for s in meta['missing'])}.", ""]
    failed = {}
    for r in runs:
        if r["error"]:
            key = (r["ranks"], tuple(r["env"].items()), r["error"])
            failed.setdefault(key, []).append(r["group"])
    for (ranks, env, error), groups in failed.items():
        lines.append(f"Job `{' '.join(groups)} -np {ranks}" + "".join(f" {k}={v}" for k, v in env)
                     + f"` failed: {error}.")
    trace_error = (meta.get("trace") or {}).get("error")
    if trace_error:
        lines.append(f"The pipeline_parallel.py --trace run for the timeline picture failed: {trace_error}.")
    return lines + ([""] if failed or trace_error else [])


def data_parallel(meta, runs, cores):
    lines = ["## Data parallelism: data_parallel.py, PyTorch DDP, the bare allreduce", ""]
    jobs = [(n, {}) for n in (2, 4)] + [(n, {"MPIR_CVAR_ASYNC_PROGRESS": "1"}) for n in (2, 4)]
    jobs = [(n, env, job(runs, "dp", n, env)) for n, env in jobs if job(runs, "dp", n, env)]
    jobs = [(n, env, j) for n, env, j in jobs if j["result"]]
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][2]["result"]
    cfg = first.get("config") or {}
    limit = case(jobs[0][2], kind="limit", variant="mpi")
    grad_bytes = limit["result"].get("bytes") if ok(limit) else None
    lines += [f"LeNet-5 with BatchNorm, global batch {cfg.get('batch_size')} split over the N ranks, "
              f"G = {grad_bytes:,} bytes of float32 gradients per step"
              f" ({plural(first['steps'], 'step')} per run, {plural(first['rounds'], 'round')}). "
              "*Exchange in MPI*: the script's own clock of the gradient exchange on the critical path: "
              "the blocking allreduce, or with overlap the start of each bucket's Iallreduce and the "
              "wait for it after backward (the polls during backward count as backward); "
              "*× bare*: that as a multiple of one bare MPI Allreduce of G bytes on the same ranks, "
              "the limit. *Step − compute alone*: the step time minus that of the same training with "
              "no exchange at all, every rank computing at once (so the cores are shared as in the "
              "real run), with the lowest and highest round.", ""]
    head = ["N", "run", "step ms (range)", "× DDP (range)", "exchange in MPI ms", "× bare",
            "step − compute alone ms (range)", "loss Δ vs DDP", "check"]
    rows = []
    for n, env, j in jobs:
        where = ranks_label(n, cores) + "".join(f", {k}={v}" for k, v in env.items())
        peer, floor = case(j, variant="ddp"), case(j, kind="floor")
        bare = case(j, kind="limit", variant="mpi")
        bare_s = bare["result"]["step_time_s"] if ok(bare) else None
        for c in cases_of(j):
            if not ok(c):
                rows.append([where] + failed_row(c, len(head) - 1))
                continue
            r, kind = c["result"], c["tags"]["kind"]
            label = c["label"] + (f" ({plural(r['buckets'], 'bucket')})" if "buckets" in r else "")
            if kind == "limit":
                rows.append([where, label, ms(r["step_time_s"]), "–", "–",
                             times(r["step_time_s"] / bare_s if bare_s else None), "–", "–", "–"])
                continue
            spread = excess_spread(c, floor) if kind != "floor" else None
            exposed = ms(excess(c, floor)) + (f" ({ms(spread[0])} to {ms(spread[1])})"
                                              if spread and spread[0] != spread[1] else "") \
                if spread else "–"
            comm = r.get("comm_s") if kind == "strategy" else None
            rows.append([where, label, step_cell(c), ratio_cell(c, peer), ms(comm),
                         times(comm / bare_s if comm is not None and bare_s else None, 1), exposed,
                         sci(loss_diff(c, peer)) if kind == "strategy" else "–",
                         check_cell(c) if kind == "strategy" else "–"])
    return lines + table(head, rows) + bare_table(runs, "dp", cores) + load_line([j for _, _, j in jobs])


def pipeline(meta, runs, cores):
    lines = ["## Pipeline and model parallelism: every schedule, a range of M, "
             "torch.distributed.pipelining", ""]
    jobs = jobs_measured(runs, "pp")
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    cfg = first.get("config") or {}
    lines += [f"GPT, {cfg.get('layers')} blocks × {cfg.get('hidden')} hidden × {cfg.get('heads')} heads, "
              f"global batch {cfg.get('batch_size')} sequences of {cfg.get('seq_len')} characters cut "
              f"into M micro-batches ({plural(first['steps'], 'step')} per run, "
              f"{plural(first['rounds'], 'round')}). "
              "*× 1F1B*: the step time over that of `--schedule 1f1b` at the same M, paired by round. "
              "*Bubble*: the share of the step a rank waits for a peer, mean over ranks; *theory*: the "
              "script's formula for its schedule at equal costs ((N−1)/(M+N−1) for gpipe and 1f1b, "
              "(N−1)/(VM+N−1) for interleaved with V = 2 chunks per rank, less for zb-h1 and zbv), "
              "and for model parallelism (the whole batch at once) M = 1. "
              "*Peak activations*: micro-batches held at once per rank, and the bytes autograd saved "
              "for them. The torch rows place their stages as ours of the same name (one per rank; two "
              "per rank round robin; two per rank in a V) and train the same model on the same "
              "batches; *× torch* is our step over theirs for the same schedule.", ""]
    head = ["N", "run", "M", "step ms (range)", "× 1F1B (range)", "bubble measured", "theory",
            "peak held per rank", "peak MB per rank", "× torch (range)", "check"]
    rows = []
    for n, j in jobs:
        where = ranks_label(n, cores)
        for c in cases_of(j):
            if not ok(c):
                rows.append([where] + failed_row(c, len(head) - 1))
                continue
            r, t = c["result"], c["tags"]
            base = case(j, kind="strategy", schedule="1f1b", m=t.get("m"))
            if t["kind"] == "peer":
                rows.append([where, c["label"], t["m"], step_cell(c), ratio_cell(c, base)] + ["–"] * 4
                            + ["1.00×" if t.get("schedule") else "–", "–"])
                continue
            m, label = t.get("m", 1), c["label"]
            if t["strategy"] == "model_parallel":  # waiting for a peer, as the pipeline's bubble
                measured = statistics.mean(r["idle_fraction"]) if r.get("idle_fraction") else None
                base = None
                if r.get("param_bytes"):
                    label += (" (holds parameters + optimizer state per rank: " + per_rank(
                        [a + b for a, b in zip(r["param_bytes"], r.get("optimizer_state_bytes") or
                                               [0] * len(r["param_bytes"]))], lambda b: f"{b / 1e6:.2f}")
                              + " MB)")
            else:
                measured = r.get("bubble_fraction")
            peer = case(j, kind="peer", schedule=t.get("schedule"), m=m) if t.get("schedule") else None
            rows.append([where, label, m, step_cell(c), ratio_cell(c, base) if base else "–", pct(measured),
                         pct(r.get("bubble_fraction_theory", (n - 1) / (m + n - 1))),
                         per_rank(r.get("peak_activations")),
                         per_rank(r.get("peak_activation_bytes"), lambda b: f"{b / 1e6:.2f}"),
                         ratio_cell(c, peer), check_cell(c)])
    return lines + table(head, rows) + bare_table(runs, "pp", cores) + load_line([j for _, j in jobs])


def tensor_parallel(meta, runs, cores):
    lines = ["## Tensor parallelism: tensor_parallel.py and torch.distributed.tensor.parallel", ""]
    jobs = jobs_measured(runs, "tp", (1, 2, 4))
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    cfg = first.get("config") or {}
    L, B, T, h = (cfg.get(k) for k in ("layers", "batch_size", "seq_len", "hidden"))
    calls, volume = 4 * L + 5, (4 * L + 2) * 4 * B * T * h + 3 * 4 * B * T
    lines += [f"GPT, {L} blocks × {h} hidden × {cfg.get('heads')} heads, batch {B} × {T} characters "
              f"({plural(first['steps'], 'step')} per run, {plural(first['rounds'], 'round')}). "
              "Formula per step, plain: "
              f"4L + 5 = {calls} allreduces, (4L + 2) × 4BTh + 3 × 4BT = {volume:,} bytes from each "
              f"rank; `--sequence-parallel`: 8L + 8 = {8 * L + 8} all-gathers and reduce-scatters, and the "
              "script's formula for their bytes (`comm_bytes_formula`). *Activation MB per rank*: what "
              "autograd saved for backward, measured by saved-tensor hooks (`activation_bytes_per_rank`), "
              "with the script's formula for its mode (`activation_bytes_formula`). The torch peers split "
              "the same layers the same way (Colwise: qkv, fc1, head; Rowwise: proj, fc2, embedding; "
              "loss_parallel); the one with SequenceParallel also runs the LayerNorms on the sequence's "
              "slices and cuts the stream between the parallel regions (Shard(1)), as "
              "`--sequence-parallel` does. *× torch* pairs each of our rows with the peer of its mode.", ""]
    head = ["N", "run", "step ms (range)", "× torch (range)", "collectives/step (formula)",
            "bytes/step (formula)", "activation MB per rank (formula)", "loss Δ vs ours", "check"]
    rows = []
    for n, j in jobs:
        where = ranks_label(n, cores)
        for c in cases_of(j):
            if not ok(c):
                rows.append([where] + failed_row(c, len(head) - 1))
                continue
            r, mine, mode = c["result"], c["tags"]["kind"] == "strategy", c["tags"].get("mode", "plain")
            peer = case(j, kind="peer", mode=mode) or (case(j, kind="peer") if mode == "plain" else None)
            ours = case(j, kind="strategy", mode=mode) or (case(j, kind="strategy") if mode == "plain" else None)
            saved = r.get("activation_bytes_per_rank")
            rows.append([where, c["label"], step_cell(c), ratio_cell(c, peer),
                         f"{r['collectives_per_step']:g} ({r.get('collectives_formula', calls)})" if mine else "–",
                         f"{r['comm_bytes_per_step']:,.0f} ({r.get('comm_bytes_formula', volume):,.0f})" if mine else "–",
                         (per_rank(saved, lambda b: f"{b / 1e6:.2f}")
                          + (f" ({mb(r['activation_bytes_formula'])})" if "activation_bytes_formula" in r else ""))
                         if mine and saved else "–",
                         "–" if mine else sci(loss_diff(c, ours)), check_cell(c) if mine else "–"])
    return lines + table(head, rows) + bare_table(runs, "tp", cores)


def slowest_share(pairs):
    """The share of the causal work (query-key pairs) that the busiest rank computes."""
    return max(pairs) / sum(pairs) if pairs and sum(pairs) else None


def context_parallel(meta, runs, cores):
    lines = ["## Context parallelism: ring, all-gather and all-to-all; zigzag against contiguous", ""]
    jobs = jobs_measured(runs, "cp")
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    cfg = first.get("config") or {}
    lines += [f"context_parallel.py, GPT, {cfg.get('layers')} blocks × {cfg.get('hidden')} hidden × "
              f"{cfg.get('heads')} heads, batch {cfg.get('batch_size')} sequences of {cfg.get('seq_len')} "
              f"characters, each sequence's positions split over the N ranks ({plural(first['steps'], 'step')} "
              f"per run, {plural(first['rounds'], 'round')}). *× ring zigzag*: the step time over that of "
              "the default (`--cp-comm ring --layout zigzag`), paired by round. *Causal pairs per rank*: "
              "the query-key pairs a rank's attention computes for one layer and sequence, summed over the "
              "heads it attends for (`causal_pairs_per_rank`), and the busiest rank's share of them (even: "
              "1/N). *Bytes/step*: handed to MPI per step and rank, with the script's formula "
              "(`comm_bytes_formula`); *messages + collectives*: the ring's Isends and the collectives "
              "per step. *Peak MB*: the largest over ranks of the peak each rank measured while training "
              "(`peak_memory_bytes_per_rank`: on the CPU the resident set, less the process before the "
              "model). *Loss Δ*: against the default's loss curve (the same training).", ""]
    head = ["N", "run", "step ms (range)", "× ring zigzag (range)", "causal pairs per rank: busiest's share",
            "bytes/step (formula)", "messages + collectives/step", "peak MB", "loss Δ", "check"]
    rows = []
    for n, j in jobs:
        where = ranks_label(n, cores)
        base = case(j, kind="strategy", cp_comm="ring", layout="zigzag")
        for c in j["result"]["cases"]:
            if not ok(c):
                rows.append([where] + failed_row(c, len(head) - 1))
                continue
            r, mine = c["result"], c["tags"]["kind"] == "strategy"
            pairs = r.get("causal_pairs_per_rank")
            rows.append([where, c["label"], step_cell(c), ratio_cell(c, base),
                         f"{per_rank(pairs, lambda p: f'{p:,}')}: {pct(slowest_share(pairs))} (even {pct(1 / n)})"
                         if pairs else "–",
                         f"{r['comm_bytes_per_step']:,.0f} ({r['comm_bytes_formula']:,.0f})"
                         if mine and "comm_bytes_formula" in r else "–",
                         f"{r.get('messages_per_step', 0):g} + {r['collectives_per_step']:g}" if mine else "–",
                         mb(max(r["peak_memory_bytes_per_rank"])) if r.get("peak_memory_bytes_per_rank") else "–",
                         sci(loss_diff(c, base)) if c is not base else "–", check_cell(c) if mine else "–"])
    return lines + table(head, rows) + load_line([j for _, j in jobs])


def all_to_all(r, key="comm_bytes_by_kind"):
    """The all-to-all bytes of an expert_parallel.py result: the rows (Alltoallv) and their counts (Alltoall)."""
    kinds = r.get(key) or {}
    return kinds["Alltoallv"] + kinds.get("Alltoall", 0) if "Alltoallv" in kinds else None


def busiest_expert(r):
    """Per block, the tokens of the busiest expert over an even share (1.00: balanced), last step."""
    return [max(load) / (sum(load) / len(load)) for load in r.get("tokens_per_expert") or [] if sum(load)]


def expert_parallel(meta, runs, cores):
    lines = ["## Expert parallelism: the experts spread over the ranks against every rank holding them all", ""]
    jobs = jobs_measured(runs, "ep")
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    cfg = first.get("config") or {}
    lines += [f"expert_parallel.py, GPT, {cfg.get('layers')} blocks × {cfg.get('hidden')} hidden × "
              f"{cfg.get('heads')} heads, each block's MLP {cfg.get('experts')} experts, top-{cfg.get('top_k')}, "
              f"global batch {cfg.get('batch_size')} sequences of {cfg.get('seq_len')} characters split over "
              f"the N ranks ({plural(first['steps'], 'step')} per run, {plural(first['rounds'], 'round')}). "
              "`--ep N`: each rank holds E/N experts and the all-to-alls carry every token's row to its "
              "expert's rank and back; `--ep 1`: every rank holds every expert (data parallelism: the "
              "all-to-alls hand each rank's rows back to itself); `--capacity-factor 1`: an expert takes "
              "at most its even share of a rank's (token, choice) pairs, the rest are dropped. *× --ep 1*: "
              "the step time over that of `--ep 1`, paired by round. *All-to-all bytes/step*: the rows "
              "(Alltoallv) and their counts (Alltoall) handed to MPI per step, mean over ranks, with the "
              "script's formula; *all bytes/step*: with the router's counts and the gradient allreduces. "
              "*Busiest expert*: per block, its tokens over an even share on the last step "
              f"(`tokens_per_expert`; 1.00 is balanced, E/k = {cfg.get('experts', 0) / (cfg.get('top_k') or 1):.2f} "
              "is every token choosing it). *Dropped*: (token, choice) pairs dropped over the run, all ranks "
              "and blocks. *Loss Δ*: against `--ep 1`'s loss curve (a run that drops pairs trains another "
              "model).", ""]
    head = ["N", "run", "step ms (range)", "× --ep 1 (range)", "all-to-all bytes/step (formula)",
            "all bytes/step (formula)", "busiest expert / even share, per block", "dropped", "loss Δ", "check"]
    rows = []
    for n, j in jobs:
        where = ranks_label(n, cores)
        base = case(j, kind="strategy", ep=1, capacity=None)
        for c in j["result"]["cases"]:
            if not ok(c):
                rows.append([where] + failed_row(c, len(head) - 1))
                continue
            r, cfg = c["result"], j["result"].get("config") or {}
            moved, formula = all_to_all(r), all_to_all(r, "comm_bytes_formula_by_kind")
            pairs = (cfg.get("layers", 0) * cfg.get("top_k", 0) * cfg.get("batch_size", 0) * cfg.get("seq_len", 0)
                     * j["result"]["steps"])
            dropped = r.get("tokens_dropped")
            rows.append([where, c["label"], step_cell(c), ratio_cell(c, base),
                         f"{moved:,.0f} ({formula:,.0f})" if moved is not None and formula is not None else "–",
                         f"{r['comm_bytes_per_step']:,.0f} ({r['comm_bytes_formula']:,.0f})"
                         if "comm_bytes_formula" in r else "–",
                         per_rank(busiest_expert(r), lambda x: f"{x:.2f}"),
                         "–" if dropped is None else f"{dropped:,}" + (f" of {pairs:,} ({pct(dropped / pairs)})"
                                                                      if pairs and dropped else ""),
                         sci(loss_diff(c, base)) if c is not base else "–", check_cell(c)])
    return lines + table(head, rows) + load_line([j for _, j in jobs])


# Each file's run that starts its exchanges under compute, and the same run with --no-overlap:
# (group, the tags of the overlapped run, of the run that waits).
OVERLAP_PAIRS = [("dp", {"variant": "small"}, {"variant": "no_overlap"}),
                 ("zero", {"kind": "strategy", "stage": 2, "overlap": None}, {"kind": "strategy", "stage": 2, "overlap": False}),
                 ("zero", {"kind": "strategy", "stage": 3, "overlap": None}, {"kind": "strategy", "stage": 3, "overlap": False}),
                 ("tp", {"kind": "strategy", "mode": "sequence_parallel", "overlap": None},
                  {"kind": "strategy", "mode": "sequence_parallel", "overlap": False}),
                 ("cp", {"kind": "strategy", "cp_comm": "ring", "layout": "zigzag", "overlap": None},
                  {"kind": "strategy", "cp_comm": "ring", "layout": "zigzag", "overlap": False})]


def overlap_pairs(runs):
    """(where, N, env, the run with overlap, the run with --no-overlap) from every job that holds both."""
    found = []
    for group, with_tags, without_tags in OVERLAP_PAIRS:
        for j in sorted((r for r in runs if r["group"] == group and r["result"]),
                        key=lambda r: (r["ranks"], sorted(r["env"].items()))):
            a, b = case(j, **with_tags), case(j, **without_tags)
            if ok(a) and ok(b) and "comm_s" in a["result"] and "comm_s" in b["result"]:
                found.append((j, a, b))
    return found


def hidden_share(a, b):
    """1 − (exposed exchange with overlap / without), paired by round: the share of the exchange hidden."""
    x = ratio(a, b, "comm_s")
    return None if x is None else 1 - x


def overlap_counts(r, baseline):
    """The script's `overlap` counts, [started in time, total] per name: 'name a/b (the baseline's a/b)'."""
    counts, without = r.get("overlap"), baseline.get("overlap")
    counts, without = (x if isinstance(x, dict) else {} for x in (counts, without))  # older scripts: a flag
    return "; ".join(f"{name.replace('_', ' ')} {a}/{b}" + (f" ({'/'.join(map(str, without[name]))})"
                                                           if name in without else "")
                     for name, (a, b) in counts.items()) or "–"


def overlap(meta, runs, cores):
    lines = ["## Overlap: the exchange time hidden, with and without --no-overlap", ""]
    found = overlap_pairs(runs)
    if not found:
        return lines + ["Not measured (see above).", ""]
    lines += ["Every file that has `--no-overlap`, run with and without it in the same job, taking turns (the "
              "rows come from the tables above). *Exposed exchange*: the time per step the slowest rank spent "
              "blocked in exchanges, by the script's own clock (`comm_s`), with overlap and with "
              "`--no-overlap`; it counts every exchange of the step, those no overlap concerns too (the "
              "gradients' allreduce of tensor and context parallelism). *Hidden*: 1 − with / without, paired "
              "round by round (0% or less: none hidden). *Step × without*: the whole step with overlap over "
              "the step with `--no-overlap`, paired by round. *Started in time*: the script's `overlap` "
              "counts of the first round, [in time, as each count's name says] / [all], with overlap (with "
              "`--no-overlap`).", ""]
    head = ["N", "run (against --no-overlap)", "exposed exchange ms: with / without", "hidden (range)",
            "step × without (range)", "started in time: with (without)"]
    rows = []
    for j, a, b in found:
        where = ranks_label(j["ranks"], cores) + "".join(f", {k}={v}" for k, v in j["env"].items())
        each = paired(a, b, lambda p, q: 1 - p / q, "comm_s")
        hidden = hidden_share(a, b)
        rows.append([where, a["label"], f"{ms(a['result']['comm_s'])} / {ms(b['result']['comm_s'])}",
                     pct(hidden) + (f" ({pct(min(each))} to {pct(max(each))})" if len(each) > 1 else ""),
                     ratio_cell(a, b), overlap_counts(a["result"], b["result"])])
    return lines + table(head, rows)


def hybrid_jobs(runs):
    return [j for j in sorted((r for r in runs if r["group"] == "hybrid" and r["result"]),
                              key=lambda r: r["ranks"])]


def hybrid(meta, runs, cores):
    lines = ["## Hybrid parallelism: the 2 × 2 × 2 grid beside the one-axis grids", ""]
    jobs = hybrid_jobs(runs)
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0]["result"]
    cfg = first.get("config") or {}
    lines += [f"hybrid_parallel.py, GPT, {cfg.get('layers')} blocks × {cfg.get('hidden')} hidden × "
              f"{cfg.get('heads')} heads, global batch {cfg.get('batch_size')} sequences of "
              f"{cfg.get('seq_len')} characters, M = 2 micro-batches per replica in every grid "
              f"({plural(first['steps'], 'step')} per run, {plural(first['rounds'], 'round')}); all grids "
              "in one job, taking turns. *× 2×2×2*: the step time over that of `--dp 2 --tp 2 --pp 2`, "
              "paired by round. *Bytes per step by axis*: summed over every rank of the grid, as the "
              "script counts them (`comm_bytes_per_step_by_axis`); *collectives* (tensor and data axes) "
              "and *messages* (pipeline axis) per step likewise. A grid the model cannot take says why "
              "in one line, and the largest grid on that axis that it can take follows.", ""]
    head = ["N", "run", "step ms (range)", "× 2×2×2 (range)", "tensor MB/step", "pipeline MB/step",
            "data MB/step", "collectives/step (tensor + data)", "messages/step (pipeline)", "bubble", "check"]
    rows = []
    for j in jobs:
        n, base = j["ranks"], case(j, grid="2x2x2")
        where = ranks_label(n, cores)
        for c in j["result"]["cases"]:
            if not ok(c):
                rows.append([where] + failed_row(c, len(head) - 1))
                continue
            r = c["result"]
            axis = r.get("comm_bytes_per_step_by_axis") or {}
            calls = r.get("collectives_per_step_by_axis") or {}
            rows.append([where, c["label"], step_cell(c), ratio_cell(c, base),
                         mb(axis.get("tensor")), mb(axis.get("pipeline")),
                         mb(axis.get("data")),
                         f"{calls.get('tensor', 0):g} + {calls.get('data', 0):g}" if calls else "–",
                         f"{r['messages_per_step']:g}" if "messages_per_step" in r else "–",
                         f"{pct(r.get('bubble_fraction'))} ({pct(r.get('bubble_fraction_theory'))})",
                         check_cell(c)])
    lines += table(head, rows) + load_line(jobs)
    for j in jobs:
        lines += [what_ranks_show(j, cores), ""]
    return lines


def what_ranks_show(j, cores):
    """What N ranks on this machine's cores can and cannot show, from the job's own numbers."""
    n, cases = j["ranks"], [c for c in j["result"]["cases"] if ok(c)]
    threads = j["result"].get("torch_threads")
    if n <= cores:
        return (f"{n} ranks on {cores} cores, each rank a core of its own: the step times compare "
                "the grids' parallel speed on this machine.")
    moved = sorted(((sum((c["result"].get("comm_bytes_per_step_by_axis") or {}).values()), c["label"])
                    for c in cases if c["result"].get("comm_bytes_per_step_by_axis")))
    fastest = min(cases, key=lambda c: c["result"]["step_time_s"], default=None)
    text = (f"What {n} ranks on {cores} cores can and cannot show: the ranks are {n / cores:g}× more than "
            f"the cores ({plural(threads or 1, 'torch thread')} each), so they take turns, and a step time "
            "measures the sum of every rank's work and exchanges (and the machine's other load), not "
            "how fast the grid would run with a core or a device per rank: the ratios rank the grids "
            "by total cost on this machine, not by parallel speed")
    if fastest is not None:
        text += f" (here {fastest['label']} has the shortest step, {ms(fastest['result']['step_time_s'])} ms)"
    text += (". The bytes and the counts of collectives and messages per step are exact, the same on "
             "any machine")
    if len(moved) > 1:
        text += (f": from {mb(moved[0][0])} MB per step ({moved[0][1]}) to {mb(moved[-1][0])} MB "
                 f"({moved[-1][1]})")
    return text + "."


def mb(n):
    return "–" if n is None else f"{n / 1e6:.2f}"


def memory_cell(memory):
    """Bytes a rank holds, in MB: parameters / gradients / optimizer state / whole layers gathered
    at once (their peak) = total."""
    if not memory:
        return "–"
    return (" / ".join(mb(memory.get(k, 0)) for k in ("parameters", "gradients", "optimizer", "gathered"))
            + f" = {mb(memory['total'])}")


def counterpart(j, c):
    """Whose loss curve a ZeRO row is compared with: ours with DDP + AdamW (unsharded), a peer with
    our run of its stage (DDP with stage 1)."""
    if c["tags"]["kind"] == "strategy":
        return case(j, kind="peer", variant="ddp")
    return case(j, kind="strategy", stage=max(1, c["tags"]["stage"]))


def sharded(meta, runs, cores):
    lines = ["## ZeRO: sharded_data_parallel.py against ZeroRedundancyOptimizer and FSDP2", ""]
    jobs = jobs_measured(runs, "zero")
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    cfg = first.get("config") or {}
    ours = next((c["result"] for _, j in jobs for c in j["result"]["cases"]
                 if c["tags"]["kind"] == "strategy" and ok(c)), {})
    lines += [f"GPT, {cfg.get('layers')} blocks × {cfg.get('hidden')} hidden × {cfg.get('heads')} heads"
              + (f", Psi = {ours['param_count']:,} parameters" if "param_count" in ours else "")
              + f", global batch {cfg.get('batch_size')} sequences of {cfg.get('seq_len')} characters "
              f"split over the N ranks, AdamW ({plural(first['steps'], 'step')} per run, "
              f"{plural(first['rounds'], 'round')}). The peers train the same model from the same seed "
              "on the same slices with the same AdamW, on gloo. *× peer*: our stage over PyTorch's "
              "of the same stage (1: ZeroRedundancyOptimizer with DDP; 2: FSDP2 with "
              "reshard_after_forward=False; 3: FSDP2). *Live tensors*: the bytes of the tensors a "
              "rank holds after the last step, each storage once (FSDP2: the local shards), the "
              "largest over ranks: parameters / gradients / optimizer state / the peak of whole layers "
              "gathered at once = total, in MB: what persists between steps, not the peak; *formula at "
              "the peak*: sharded_data_parallel.py's for its stage, with the whole layers in flight and "
              "the activations it measured. *Peak MB, measured*: the largest over ranks of the peak a "
              "rank held during training, measured from the process as the scripts measure it (on the "
              "CPU: the peak resident set less file-backed pages, less the process before the model). *Bytes/step*: the bytes of the vectors handed to "
              "the collectives per step and rank, and the number of calls (ours: with its "
              "formula). *Loss Δ*: largest difference between loss curves: ours against DDP + AdamW, "
              "a peer against our run of its stage (DDP against stage 1).", ""]
    head = ["N", "run", "step ms (range)", "× peer (range)", "× DDP + AdamW (range)",
            "live tensors MB: params / grads / optimizer / gathered = total", "formula at the peak MB",
            "peak MB, measured", "bytes/step", "loss Δ"]
    rows = []
    for n, j in jobs:
        where = ranks_label(n, cores)
        ddp = case(j, kind="peer", variant="ddp")
        for c in cases_of(j):
            if not ok(c):
                rows.append([where] + failed_row(c, len(head) - 1))
                continue
            r, t = c["result"], c["tags"]
            mine = t["kind"] == "strategy"
            peer = case(j, kind="peer", stage=t["stage"]) if mine else None
            sent = (f"{r['comm_bytes_per_step']:,.0f} in {plural(r['collectives_per_step'], 'call')}"
                    if "comm_bytes_per_step" in r else "–")
            if mine and "comm_bytes_formula" in r:
                sent += f" (formula {r['comm_bytes_formula']:,})"
            formula = r.get("memory_bytes_formula")
            rows.append([where, c["label"], step_cell(c), ratio_cell(c, peer) if mine else "–",
                         ratio_cell(c, ddp), memory_cell(r.get("live_bytes_after_last_step")),
                         mb(formula["total"]) if formula else "–",
                         mb(max(r["peak_memory_bytes_per_rank"])) if r.get("peak_memory_bytes_per_rank") else "–", sent,
                         sci(loss_diff(c, counterpart(j, c)))])
    return lines + table(head, rows) + bare_table(runs, "zero", cores) + load_line([j for _, j in jobs])


def scaling(meta, runs, cores):
    lines = ["## Scaling: the same global batch at N = 1, 2, 4", ""]
    j = scaling_job(runs)
    if j is None:
        return lines + ["Not measured (see above).", ""]
    cases = j["result"]["cases"]
    columns = sorted({(c["tags"]["n"], c["tags"]["threads"]) for c in cases}, key=lambda k: (k[0], k[1]))
    base = min(columns)  # one rank on the fewest threads: one core
    lines += [f"All sizes in one `mpirun -np {j['ranks']}` job, taking turns; at N < {j['ranks']} the "
              "other ranks sleep. Each strategy sets its torch threads from the N ranks it is given, "
              f"max(1, {cores} cores / N), as under `mpirun -np N`; the first column caps N = 1 at one "
              f"thread: one core, the baseline ({plural(j['result']['steps'], 'step')} per run, "
              f"{plural(j['result']['rounds'], 'round')}). Speedup: T(baseline)/T(N), paired round by "
              f"round; efficiency: speedup / N. This machine has {cores} cores, shared with other "
              f"work: at N > {cores} ({OVERSUBSCRIBED}) the ranks take turns on the cores, so the "
              f"efficiency there cannot exceed {cores}/N even for a perfect strategy.", ""]
    head = ["strategy (run)"] + [f"N = {ranks_label(n, cores)}, {plural(t, 'thread')}"
                                 + (" per rank" if n > 1 else "") + ": ms, speedup, efficiency"
                                 for n, t in columns]
    rows = []
    for label in dict.fromkeys(c["label"] for c in cases):
        found = {(c["tags"]["n"], c["tags"]["threads"]): c for c in cases if c["label"] == label}
        cells = []
        for n, t in columns:
            c = found.get((n, t))
            if not ok(c):
                cells.append("not measured" + (f": {c['result']['error']}" if c else ""))
                continue
            speedup = ratio(found.get(base), c)
            cells.append(step_cell(c) + ("" if speedup is None else f", {speedup:.2f}×, {pct(speedup / n)}"))
        rows.append([label] + cells)
    return lines + table(head, rows) + load_line([j])


def findings(meta, runs, cores):
    """What the numbers say, in sentences computed from them, so the prose cannot disagree."""
    out = []

    def faster(name_a, a, name_b, b, where):
        """A verdict by the bench's rule (verdict()): at least MIN_ROUNDS rounds, the median more
        than TIE from 1x, and the sign test over the rounds below ALPHA."""
        x = ratio(a, b)
        if x is None:
            return
        each = paired(a, b, lambda p, q: p / q)
        word, won_rounds, total, p = verdict(each)
        rounds_note = (f"median of {len(each)} rounds, {min(each):.2f} to {max(each):.2f}"
                       if len(each) > 1 else "one round: indicative only")
        won = (f"; {name_a} faster in {won_rounds} of {total} rounds, sign test {p_value(p)}"
               if len(each) > 1 else "")
        if len(each) < 2:  # nothing says how a second round would fall
            out.append(f"{where}: {name_a} takes {x:.2f}× the step time of {name_b} in the one round measured: "
                       "no verdict.")
        elif word == "too few rounds":
            out.append(f"{where}: {name_a} takes {x:.2f}× the step time of {name_b} ({rounds_note}){won}: "
                       f"fewer than {MIN_ROUNDS} rounds, no verdict.")
        elif abs(x - 1) <= TIE:
            out.append(f"{where}: {name_a} and {name_b} take the same time ({x:.2f}×; {rounds_note}){won}.")
        elif word == "tie":
            out.append(f"{where}: no clear winner between {name_a} and {name_b}: the rounds do not agree "
                       f"often enough ({x:.2f}×; {rounds_note}){won}.")
        elif x < 1:
            out.append(f"{where}: {name_a} is faster than {name_b}: {x:.2f}× its step time ({rounds_note}){won}.")
        else:
            out.append(f"{where}: {name_b} is faster than {name_a}: {name_a} takes {x:.2f}× its step "
                       f"time ({rounds_note}){won}.")

    def against_peer(j, name_a, a, name_b, b, where):
        """Ours against a peer as it ships (on MPI), then on the peer's transport (ours on gloo)."""
        faster(name_a, a, name_b, b, where)
        twin = case(j, kind="on_gloo", of=a["label"]) if a else None
        if ok(twin):
            faster(f"{name_a} on gloo", twin, name_b, b, where)

    for n in (2, 4):
        for env in ({}, {"MPIR_CVAR_ASYNC_PROGRESS": "1"}):
            j = job(runs, "dp", n, env)
            if not (j and j["result"]):
                continue
            where = (f"Data parallelism, N = {ranks_label(n, cores)}"
                     + "".join(f", {k}={v}" for k, v in env.items()))
            peer, floor = case(j, variant="ddp"), case(j, kind="floor")
            bare = case(j, kind="limit", variant="mpi")
            for variant in ("default", "small", "no_overlap"):
                c = case(j, variant=variant)
                matched = (variant == "small" and case(j, variant="ddp_small")) or peer  # its bucket size
                if ok(c) and not env and matched:
                    against_peer(j, c["label"], c, matched["label"], matched, where)
            blocking, small = case(j, variant="no_overlap"), case(j, variant="small")
            if ok(blocking) and ok(small) and ok(bare):
                kept, steps = ratio(small, blocking, "comm_s"), ratio(small, blocking)
                out.append(f"{where}: the exchange on the critical path, by the script's clock, is "
                           f"{ms(blocking['result']['comm_s'])} ms with one blocking allreduce "
                           f"({blocking['result']['comm_s'] / bare['result']['step_time_s']:.1f}× a bare "
                           f"MPI Allreduce of the same bytes, {ms(bare['result']['step_time_s'])} ms) and "
                           f"{ms(small['result']['comm_s'])} ms with "
                           f"{plural(small['result']['buckets'], 'bucket')} overlapped ("
                           + (f"{pct(kept)} of it stays exposed" if kept < 1 else "none of it hidden")
                           + f", paired by round); the whole step with overlap takes {steps:.2f}× the "
                           "step without.")
            if not env:
                faster("the bare MPI Allreduce", bare, "the bare gloo allreduce",
                       case(j, kind="limit", variant="gloo"), where)
            plain = job(runs, "dp", n)
            if env and ok(floor) and ok(case(plain, kind="floor")):
                out.append(f"{where}: compute alone takes {ms(floor['result']['step_time_s'])} ms per step "
                           f"against {ms(case(plain, kind='floor')['result']['step_time_s'])} ms in the job "
                           "without it: two jobs at two moments of a shared machine (see their load "
                           "averages), so not a paired ratio.")
    for n in (2, 4):
        j = job(runs, "pp", n)
        where = f"Pipeline, N = {ranks_label(n, cores)}"
        mine = [c for c in (j["result"]["cases"] if j and j["result"] else [])
                if c["tags"]["kind"] == "strategy" and c["tags"].get("schedule") and ok(c)]
        top = max((c["tags"]["m"] for c in mine), default=None)
        at_top = [c for c in mine if c["tags"]["m"] == top]
        for c in at_top:
            if c["tags"]["schedule"] != "1f1b":
                faster(f"--schedule {c['tags']['schedule']}", c, "1f1b",
                       case(j, kind="strategy", schedule="1f1b", m=top), f"{where}, M = {top}")
        ranked = sorted((c for c in at_top if c["result"].get("bubble_fraction") is not None),
                        key=lambda c: c["result"]["bubble_fraction"])
        if len(ranked) > 1:
            theory = sorted(ranked, key=lambda c: c["result"].get("bubble_fraction_theory", 1))
            out.append(f"{where}, M = {top}: the measured bubble orders the schedules "
                       + " < ".join(f"{c['tags']['schedule']} {pct(c['result']['bubble_fraction'])}"
                                    for c in ranked)
                       + "; theory orders them " + " < ".join(
                           f"{c['tags']['schedule']} {pct(c['result'].get('bubble_fraction_theory'))}"
                           for c in theory)
                       + (" (the same order)." if [c["label"] for c in ranked] == [c["label"] for c in theory]
                          else "."))
        same = []  # (torch's schedule, ours with the same placement, largest loss difference)
        for peer in (c for c in (j["result"]["cases"] if j and j["result"] else []) if c["tags"]["kind"] == "peer"):
            ours = case(j, kind="strategy", schedule=peer["tags"].get("placement"), m=peer["tags"]["m"])
            if ok(peer) and peer["tags"].get("schedule"):
                against_peer(j, f"pipeline_parallel.py --schedule {peer['tags']['schedule']}", ours,
                             peer["label"], peer, where)
            if ok(peer) and ok(ours) and loss_diff(peer, ours) is not None:
                same.append((peer["tags"].get("torch"), ours["tags"]["schedule"], loss_diff(peer, ours)))
        if same:
            out.append(f"{where}: torch's schedules train the losses of ours placed alike to within "
                       f"{sci(max(d for _, _, d in same))} ("
                       + ", ".join(f"{name} against {mine}" for name, mine, _ in same) + ").")
        j = job(runs, "tp", n)
        against_peer(j, "tensor_parallel.py", case(j, kind="strategy"), "torch.distributed.tensor.parallel",
                     case(j, kind="peer"), f"Tensor parallelism, N = {ranks_label(n, cores)}")
        out += sequence_parallel_findings(j, faster, f"Tensor parallelism, N = {ranks_label(n, cores)}")
    for n in (2, 4):
        j = job(runs, "zero", n)
        if not (j and j["result"]):
            continue
        where = f"ZeRO, N = {ranks_label(n, cores)}"
        for stage in (1, 2, 3):
            peer = case(j, kind="peer", stage=stage)
            if ok(peer):
                against_peer(j, f"sharded_data_parallel.py --zero-stage {stage}",
                             case(j, kind="strategy", stage=stage), peer["label"], peer, where)
        out += sharded_findings(j, where)
    for j in hybrid_jobs(runs):
        base = case(j, grid="2x2x2")
        for c in j["result"]["cases"]:
            if c is not base and ok(c):
                faster(c["label"], c, "the 2 × 2 × 2 grid", base,
                       f"Hybrid, N = {ranks_label(j['ranks'], cores)}")
    for n in (2, 4):
        out += context_findings(job(runs, "cp", n), faster, f"Context parallelism, N = {ranks_label(n, cores)}")
        out += expert_findings(job(runs, "ep", n), faster, f"Expert parallelism, N = {ranks_label(n, cores)}")
    out += overlap_findings(runs, cores)
    j = scaling_job(runs)
    for label in dict.fromkeys(c["label"] for c in (j["result"]["cases"] if j else [])):
        one = {c["tags"]["threads"]: c for c in j["result"]["cases"]
               if c["label"] == label and c["tags"]["n"] == 1}
        if len(one) == 2:
            x = ratio(one[max(one)], one[min(one)])
            if x is not None and x > 1.03:
                out.append(f"Scaling, N = 1: {label} on {max(one)} threads takes {x:.2f}× its time on one "
                           "thread: with the cores shared, torch's threads wait for each other.")
    return ["## Findings (computed from the tables above)", ""] + [f"- {line}" for line in out] + [""]


def sequence_parallel_findings(j, faster, where):
    """--sequence-parallel against plain tensor parallelism and against torch's SequenceParallel:
    the step, the activations saved per rank (measured, with the formula's ratio) and the bytes."""
    plain = case(j, kind="strategy", mode="plain")
    sp = case(j, kind="strategy", mode="sequence_parallel", overlap=None)
    if not ok(sp):
        return []
    out = []
    faster("tensor_parallel.py --sequence-parallel", sp, "torch's SequenceParallel",
           case(j, kind="peer", mode="sequence_parallel"), where)
    r = sp["result"]
    if ok(plain) and plain["result"].get("activation_bytes_per_rank") and r.get("activation_bytes_per_rank"):
        q = plain["result"]
        saved, before = max(r["activation_bytes_per_rank"]), max(q["activation_bytes_per_rank"])
        formula = (f" (the formulas: {r['activation_bytes_formula'] / q['activation_bytes_formula']:.2f}×)"
                   if r.get("activation_bytes_formula") and q.get("activation_bytes_formula") else "")
        out.append(f"{where}: --sequence-parallel saves {mb(saved)} MB of activations per rank against "
                   f"{mb(before)} MB plain, {saved / before:.2f}× measured{formula}; it hands MPI "
                   f"{r['comm_bytes_per_step'] / q['comm_bytes_per_step']:.2f}× the bytes per step in "
                   f"{r['collectives_per_step']:g} collectives against {q['collectives_per_step']:g}, and its "
                   f"step takes {ratio(sp, plain):.2f}× plain's (paired by round).")
    return out


def context_findings(j, faster, where):
    """Ring against all-gather and all-to-all, zigzag against contiguous: step, the busiest rank's
    causal work, bytes and peak memory."""
    base = case(j, kind="strategy", cp_comm="ring", layout="zigzag")
    if not ok(base):
        return []
    out = []
    gathered = case(j, kind="strategy", cp_comm="allgather")
    heads = case(j, kind="strategy", cp_comm="alltoall")
    contiguous = case(j, kind="strategy", layout="contiguous")
    faster("--cp-comm allgather", gathered, "the ring", base, where)
    faster("--cp-comm alltoall", heads, "the ring", base, where)
    faster("--layout contiguous", contiguous, "zigzag", base, where)
    if ok(contiguous) and contiguous["result"].get("causal_pairs_per_rank"):
        n = len(contiguous["result"]["causal_pairs_per_rank"])
        out.append(f"{where}: with --layout contiguous the busiest rank computes "
                   f"{pct(slowest_share(contiguous['result']['causal_pairs_per_rank']))} of the causal pairs, "
                   f"with zigzag {pct(slowest_share(base['result'].get('causal_pairs_per_rank')))} (even: "
                   f"{pct(1 / n)}).")
    mine = [c for c in j["result"]["cases"] if c["tags"]["kind"] == "strategy" and ok(c)
            and "comm_bytes_formula" in c["result"]]
    off = [c["label"] for c in mine if c["result"]["comm_bytes_per_step"] != c["result"]["comm_bytes_formula"]]
    sizes = {c["tags"]["cp_comm"]: c["result"]["comm_bytes_per_step"] for c in mine}
    if "ring" in sizes and len(sizes) > 1:
        ring = sizes["ring"]
        out.append(f"{where}: the ring hands MPI {ring:,.0f} bytes per step and rank, "
                   + ", ".join(f"--cp-comm {k} " + ("the same" if v == ring else f"{v:,.0f} ({v / ring:.2f}×)")
                               for k, v in sizes.items() if k != "ring")
                   + ("; every run's bytes equal its formula." if not off else
                      "; not the formula in " + ", ".join(off) + "."))
    peaks = {c["tags"]["cp_comm"]: max(c["result"]["peak_memory_bytes_per_rank"]) for c in mine
             if c["tags"].get("layout") == "zigzag" and c["tags"].get("overlap") is None
             and c["result"].get("peak_memory_bytes_per_rank")}
    if len(peaks) > 1:
        out.append(f"{where}: peak memory of the busiest rank, " + ", ".join(f"{k} {mb(v)} MB" for k, v in peaks.items())
                   + ".")
    return out


def expert_findings(j, faster, where):
    """--ep N against --ep 1: step, the all-to-all and gradient bytes, the load, the drops, the losses."""
    base = case(j, kind="strategy", ep=1, capacity=None)
    spread = next((c for c in (j["result"]["cases"] if j and j["result"] else [])
                   if c["tags"].get("ep", 1) > 1 and c["tags"].get("capacity") is None), None)
    if not (ok(base) and ok(spread)):
        return []
    out = []
    p = spread["tags"]["ep"]
    faster(f"--ep {p}", spread, "--ep 1", base, where)
    a, b = spread["result"], base["result"]
    kinds_a, kinds_b = a.get("comm_bytes_by_kind") or {}, b.get("comm_bytes_by_kind") or {}
    if all_to_all(a) is not None and all_to_all(b) is not None and "experts" in kinds_a and "experts" in kinds_b:
        out.append(f"{where}: the all-to-alls hand MPI {all_to_all(a):,.0f} bytes per step and rank at --ep {p} "
                   f"and {all_to_all(b):,.0f} at --ep 1 (there every row goes back to its own rank); the "
                   f"experts' gradient allreduce {kinds_a['experts']:,.0f} against {kinds_b['experts']:,.0f} "
                   f"bytes (a rank holds E/P experts, each summed over its N/P copies).")
    load = busiest_expert(a)
    if load:
        worst = max(range(len(load)), key=load.__getitem__)
        out.append(f"{where}: on the last step the busiest expert of block {worst} takes {load[worst]:.2f}× an even "
                   f"share (its tokens per expert: {' / '.join(map(str, a['tokens_per_expert'][worst]))}).")
    capped = next((c for c in j["result"]["cases"] if c["tags"].get("capacity") is not None and ok(c)), None)
    if capped and capped["result"].get("tokens_dropped") is not None:
        out.append(f"{where}: {capped['label'].split('.py ')[-1]} drops {capped['result']['tokens_dropped']:,} "
                   f"(token, choice) pairs over the run; its step takes {ratio(capped, spread):.2f}× that of the "
                   f"dropless --ep {p} (paired by round).")
    d = loss_diff(spread, base)
    if d is not None:
        out.append(f"{where}: --ep {p} and --ep 1 train loss curves "
                   + ("identical" if d == 0 else f"within {d:.1e} of each other")
                   + f" over {plural(j['result']['steps'], 'step')}.")
    return out


def overlap_findings(runs, cores):
    """Per file: the share of its exchange time that overlap hid on this machine, or plainly none."""
    out = []
    for j, a, b in overlap_pairs(runs):
        where = (f"Overlap, N = {ranks_label(j['ranks'], cores)}"
                 + "".join(f", {k}={v}" for k, v in j["env"].items()))
        hidden, each = hidden_share(a, b), paired(a, b, lambda p, q: 1 - p / q, "comm_s")
        spread = (f"rounds {pct(min(each))} to {pct(max(each))}" if len(each) > 1 else "one round: indicative only")
        exposed = (f"{ms(a['result']['comm_s'])} ms exposed a step against {ms(b['result']['comm_s'])} ms with "
                   f"--no-overlap")
        step = f"the step takes {ratio(a, b):.2f}× the step without"
        agree = max(sum(h > 0 for h in each), sum(h <= 0 for h in each)) / len(each)
        if len(each) > 1 and agree < 0.75:
            out.append(f"{where}: {a['label']}: the rounds disagree on whether any of its exchange time was hidden "
                       f"(median {pct(hidden)}: {exposed}; {spread}); {step}.")
        elif hidden > 0:
            out.append(f"{where}: {a['label']} hides {pct(hidden)} of its exchange time ({exposed}; {spread}); {step}.")
        else:
            mpich = ("MPICH" in (j["result"].get("mpi_library") or "")
                     and "MPIR_CVAR_ASYNC_PROGRESS" not in j["env"])
            out.append(f"{where}: {a['label']} hides none of its exchange time ({exposed}"
                       + (f": {pct(-hidden)} more with overlap" if hidden < 0 else "") + f"; {spread}); {step}"
                       + (". MPICH without its progress thread moves a non-blocking exchange on only inside an "
                          "MPI call, so what was started waits for the next one." if mpich else "."))
    return out


def sharded_findings(j, where):
    """Memory and loss curves of the ZeRO job: the measured bytes against the formula and against
    the unsharded baseline, and how far apart the loss curves are."""
    out = []
    def peak(c):
        return max(c["result"].get("peak_memory_bytes_per_rank") or [0]) if ok(c) else 0
    ours = [c for c in j["result"]["cases"] if c["tags"]["kind"] == "strategy" and peak(c)
            and "memory_bytes_formula" in c["result"] and c["tags"].get("overlap") is not False]
    ddp = case(j, kind="peer", variant="ddp")
    if ours:
        worst = max(abs(peak(c) / c["result"]["memory_bytes_formula"]["total"] - 1) for c in ours)
        held = "; ".join(f"stage {c['tags']['stage']}: {mb(peak(c))} MB" for c in ours)
        base = f" against {mb(peak(ddp))} MB for DDP + AdamW, measured alike" if peak(ddp) else ""
        out.append(f"{where}: a rank of sharded_data_parallel.py peaks at {held}{base}; each measured "
                   f"peak is within {worst:.0%} of its stage's formula.")
        fsdp = case(j, kind="peer", stage=3)
        three = next((c for c in ours if c["tags"]["stage"] == 3), None)
        if peak(fsdp) and three and "live_bytes_after_last_step" in fsdp["result"]:
            a, b = three["result"]["live_bytes_after_last_step"], fsdp["result"]["live_bytes_after_last_step"]
            # the script keeps no gathered layer after the last step: its count of them is its formula's
            ours_gathered = a.get("gathered", three["result"]["memory_bytes_formula"].get("gathered"))
            out.append(f"{where}: FSDP2 peaks at {mb(peak(fsdp))} MB per rank against {mb(peak(three))} MB "
                       f"for stage 3 (whole layers gathered at once: {mb(b['gathered'])} against "
                       f"{mb(ours_gathered)} MB" + ("" if "gathered" in a else ", stage 3's by its formula") + ").")
    diffs = [d for d in (loss_diff(c, counterpart(j, c)) for c in cases_of(j)) if d is not None]
    if diffs:
        agree = "are identical to" if max(diffs) == 0 else f"agree to within {max(diffs):.1e} with"
        out.append(f"{where}: the loss curves of {plural(len(diffs), 'run')} {agree} their "
                   f"counterpart's over {plural(j['result']['steps'], 'step')}: the same training, whichever "
                   "implementation shards it.")
    return out

# -----------------------------------------------------------------------------
# Transport against strategy: each comparison beside the bare cost of its exchanges
# -----------------------------------------------------------------------------
# The bench's rule: one of two runs is faster only where, over at least MIN_ROUNDS rounds, the median
# ratio is more than TIE from 1x and a two-sided sign test over the rounds gives p below ALPHA; else a tie.
TIE = 0.03
MIN_ROUNDS = 8  # the fewest rounds whose sign test can go below 0.05 with one round against (9 of 10 can)
ALPHA = 0.05


def sign_test(won, total):
    """Two-sided sign test: the chance of a split at least as lopsided as `won` of `total` rounds if
    each round were as likely to fall either way."""
    if total == 0:
        return 1.0
    tail = sum(math.comb(total, k) for k in range(min(won, total - won) + 1)) / 2 ** total
    return min(1.0, 2 * tail)


def verdict(each):
    """The bench's rule on per-round ratios a / b: ('faster' | 'slower' | 'tie' | 'too few rounds', rounds
    a was faster in, rounds, the sign test's p). Rounds of exactly 1x take no side in the sign test."""
    x, won, lost = statistics.median(each), sum(r < 1 for r in each), sum(r > 1 for r in each)
    p = sign_test(won, won + lost)
    word = ("too few rounds" if len(each) < MIN_ROUNDS else "tie" if abs(x - 1) <= TIE or p >= ALPHA
            else "faster" if x < 1 else "slower")
    return word, won, len(each), p


def p_value(p):
    return f"p = {p:.3f}" if p >= 0.001 else "p < 0.001"


def rounds_cell(each):
    """A paired ratio: median (lowest–highest round; rounds in which ours was faster; the sign test's p)."""
    if not each:
        return "–"
    _, won, total, p = verdict(each)
    spread = f"{min(each):.2f}–{max(each):.2f}; " if total > 1 else ""
    return f"{statistics.median(each):.2f}× ({spread}faster in {won} of {total}, {p_value(p)})"


def verdict_cell(each):
    if not each:
        return "–"
    word, _, total, _ = verdict(each)
    return {"tie": "tie", "faster": "ours faster", "slower": "PyTorch's faster",
            "too few rounds": f"{plural(total, 'round')}: no verdict"}[word]


def at_gloo_cost(ours, bare, peer):
    """Per round: our step with its exchanges charged at gloo's bare cost instead of MPI's (our step
    + gloo's bare replay − MPI's), over the peer's step: an estimate, from replays with nothing else
    to do, of the ratio had ours run on the peer's transport; the rows "ours on gloo" measure it."""
    if not (ok(ours) and ok(bare) and ok(peer)):
        return []
    return [(a + g - m) / b for a, b, m, g in zip(rounds(ours), rounds(peer), rounds(bare, "bare_mpi_s"),
                                                    rounds(bare, "bare_gloo_s"))]


def fastest(cases):
    """The case of the shortest median step among those that ran; None when none did."""
    return min((c for c in cases if ok(c)), key=lambda c: c["result"]["step_time_s"], default=None)


def comparisons(runs):
    """Every pairing of one of our runs with PyTorch's, as dicts: section, N, label, ours (on MPI),
    twin (the same run of ours on gloo), peer, bare (our step's exchanges replayed bare)."""
    out = []
    for n, j in jobs_measured(runs, "dp"):
        for v in ("default", "small", "no_overlap"):
            ours = case(j, variant=v)
            peer = (v == "small" and case(j, variant="ddp_small")) or case(j, variant="ddp")
            if ours:
                out.append(("dp", n, f"{ours['label']} / {peer['label'] if peer else 'DDP'}", ours, peer, j))
    for n, j in jobs_measured(runs, "pp"):
        peers = [c for c in cases_of(j) if c["tags"]["kind"] == "peer" and c["tags"].get("schedule")]
        for peer in peers:
            ours = case(j, kind="strategy", schedule=peer["tags"]["schedule"], m=peer["tags"]["m"])
            if ours:
                out.append(("pp", n, f"--schedule {peer['tags']['schedule']}, M = {peer['tags']['m']} / "
                            f"{peer['tags'].get('torch') or peer['label']}", ours, peer, j))
        m = peers[0]["tags"]["m"] if peers else None
        ours_best = fastest(c for c in cases_of(j) if c["tags"]["kind"] == "strategy" and c["tags"].get("m") == m
                            and c["tags"].get("schedule"))
        schedule = {c["label"]: c["tags"].get("schedule") for c in cases_of(j) if c["tags"].get("m") == m}
        twin_best = fastest(c for c in j["result"]["cases"] if c["tags"]["kind"] == "on_gloo"
                            and c["tags"]["of"] in schedule)
        peer_best = fastest(c for c in cases_of(j) if c["tags"]["kind"] == "peer" and c["tags"].get("m") == m)
        if ours_best and peer_best:
            label = (f"the fastest of ours (on MPI {ours_best['tags']['schedule']}"
                     + (f", on gloo {schedule[twin_best['tags']['of']]}" if twin_best else "")
                     + f"), M = {m} / the fastest of torch's ({peer_best['tags'].get('torch')})")
            out.append(("pp", n, label, ours_best, peer_best, j, twin_best))
    for n, j in jobs_measured(runs, "tp"):
        for mode, name in (("plain", "tensor_parallel.py / torch.distributed.tensor.parallel (DTensor, eager)"),
                           ("sequence_parallel", "--sequence-parallel / SequenceParallel (DTensor, eager)")):
            ours = case(j, kind="strategy", mode=mode)
            if ours:
                out.append(("tp", n, name, ours, case(j, kind="peer", mode=mode), j))
    for n, j in jobs_measured(runs, "zero"):
        for k in (1, 2, 3):
            ours = case(j, kind="strategy", stage=k)
            for peer in (c for c in cases_of(j) if c["tags"]["kind"] == "peer" and c["tags"].get("stage") == k):
                if ours:
                    out.append(("zero", n, f"--zero-stage {k} / {peer['label'].split(' (gloo')[0]}", ours, peer, j))
    for n, j in jobs_measured(runs, "large", (2, 4)):
        for ours in (c for c in cases_of(j) if c["tags"]["kind"] == "strategy"):
            peers = [c for c in cases_of(j)
                     if c["tags"]["kind"] == "peer" and c["tags"].get("pair") == ours["tags"]["pair"]]
            for peer in peers or [None]:
                out.append(("large", n, f"{ours['label']} / {peer['label'] if peer else 'none'}", ours, peer, j))
    return [{"section": c[0], "n": c[1], "label": c[2], "ours": c[3], "peer": c[4], "fastest": len(c) > 6,
             "twin": c[6] if len(c) > 6 else case(c[5], kind="on_gloo", of=c[3]["label"]),
             "bare": None if len(c) > 6 else case(c[5], kind="bare", of=c[3]["label"])} for c in out]


def kinds_cell(bare):
    """One step's exchanges by kind: calls and the bytes handed over (the most of any rank)."""
    if not ok(bare) or "kinds" not in bare["result"]:
        return "–"
    return "; ".join(f"{kind} {calls} × = {nbytes:,} B" for kind, (calls, nbytes) in bare["result"]["kinds"].items())


def bare_table(runs, section, cores):
    """Each comparison of a section beside what its exchanges cost bare, on MPI and on gloo."""
    rows = []
    for c in comparisons(runs):
        ours, peer, bare = c["ours"], c["peer"], c["bare"]
        if c["section"] != section or c["fastest"]:  # no replay of its own: its two rows are above
            continue
        n, label = c["n"], c["label"]
        if bare is not None and not ok(bare):
            rows.append([ranks_label(n, cores), label, f"not measured: {bare['result']['error']}"] + [""] * 6)
            continue
        r = bare["result"] if bare else {}
        mpi, gloo = r.get("bare_mpi_s"), r.get("bare_gloo_s")
        rows.append([ranks_label(n, cores), label, kinds_cell(bare), ms(mpi), ms(gloo),
                     times(gloo / mpi if mpi and gloo else None, 1), rounds_cell(pairing(ours, peer)),
                     rounds_cell(at_gloo_cost(ours, bare, peer)), rounds_cell(pairing(c["twin"], peer))])
    if not rows:
        return []
    return ["**Transport against strategy.** Each comparison beside the exchanges of one step of ours, "
            "written down at the MPI call (kind, calls, bytes) and replayed bare, back to back, on MPI "
            "(shared memory) and on gloo (TCP, the peers' transport) in the same job, in turns: "
            "what they cost with nothing else to do. *× peer*: our step over PyTorch's, paired by round, "
            "and the rounds ours was faster in; *at gloo's cost*: the same with our step charged the bare "
            "gloo time of its exchanges instead of the bare MPI time (our step + gloo − MPI, paired by "
            "round): an estimate that assumes none of the difference is hidden; *ours on gloo × peer*: "
            "what the estimate tries to tell, measured: the same script with its exchanges carried by gloo. "
            "The peer's own calls may differ from ours in kind and number (its group's table says where).",
            ""] + table(["N", "comparison", "our exchanges per step (kind, calls, bytes)", "bare MPI ms",
                         "bare gloo ms", "gloo ÷ MPI", "× peer (range; rounds)",
                         "× peer, ours at gloo's cost (range; rounds)", "ours on gloo × peer (range; rounds)"], rows)


def pairing(ours, peer):
    """Our step over the peer's, round by round; [] where either did not run."""
    return paired(ours, peer, lambda p, q: p / q) if ok(ours) and ok(peer) else []


def peaks_cell(c):
    """The measured peak of each rank, in MB (the strategy scripts' peak_memory_bytes_per_rank)."""
    peaks = c["result"].get("peak_memory_bytes_per_rank") if ok(c) else None
    return ", ".join(f"{p / 2 ** 20:.1f}" for p in peaks) if peaks else "–"


def summary(meta, runs, cores):
    """Every pairing of ours with PyTorch's on one transport (ours on gloo), with the bench's verdict and
    both peaks, beside the same pairing with ours on MPI."""
    rows = []
    for c in comparisons(runs):
        ours, twin, peer = c["ours"], c["twin"], c["peer"]
        if peer is not None and not ok(peer):
            rows.append([SECTION_NAMES[c["section"]], ranks_label(c["n"], cores), c["label"],
                         f"PyTorch's not measured: {peer['result']['error']}"] + [""] * 5)
            continue
        if twin is not None and not ok(twin):
            gloo_cells = [f"ours on gloo not measured: {twin['result']['error']}", ""]
        else:
            gloo_cells = [rounds_cell(pairing(twin, peer)), verdict_cell(pairing(twin, peer))]
        rows.append([SECTION_NAMES[c["section"]], ranks_label(c["n"], cores), c["label"], *gloo_cells,
                     peaks_cell(twin) if ok(twin) else f"{peaks_cell(ours)} (on MPI)" if ok(ours) else "–",
                     peaks_cell(peer),
                     rounds_cell(pairing(ours, peer)), verdict_cell(pairing(ours, peer))])
    if not rows:
        return []
    return ["## Summary: ours against PyTorch's on one transport", "",
            "Every pairing of one of our runs with PyTorch's in the tables below, both on gloo: *ours on "
            "gloo* is the same script, unchanged, handed a communicator whose buffer exchanges (every "
            "collective and message of the step) go through torch.distributed's gloo group of the same "
            "ranks, the peers' transport (bench/worker.py's GlooComm; the check's and the report's "
            "pickled objects and the barriers stay on MPI). *× PyTorch*: our step over theirs, paired "
            "round by round (median; lowest–highest round; the rounds ours was faster in; a two-sided "
            f"sign test's p over the rounds). *Verdict*, the bench's rule: a winner only with at least "
            f"{MIN_ROUNDS} rounds, the median more than {TIE:.0%} from 1× and p below {ALPHA}; otherwise a "
            "tie. *Peak MB per rank*: each rank's peak while training, measured alike in both (the "
            "resident set's peak less code, less the process before the model; on CUDA the allocator's). "
            "*On MPI*: ours as it ships, on MPICH's shared memory, against the same peer. The pipeline's "
            "*fastest* rows set the fastest of our schedules (by median) against the fastest of torch's.", ""
            ] + table(["strategy", "N", "ours / PyTorch's", "ours on gloo × PyTorch (range; rounds; p)", "verdict",
                       "peak MB per rank: ours (on gloo)", "peak MB per rank: PyTorch's",
                       "ours on MPI × PyTorch (range; rounds; p)", "verdict"], rows)


SECTION_NAMES = {"dp": "data", "pp": "pipeline", "tp": "tensor", "zero": "ZeRO", "large": "larger GPT"}


def transport(meta, runs, cores):
    """Every kind of exchange the strategies use, bare on both transports, and gloo's bytes."""
    lines = ["## Transport: MPI over shared memory against gloo over TCP, bare", ""]
    jobs = jobs_measured(runs, "transport")
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    lines += ["Each kind of exchange the strategies use, on one float32 vector (the whole vector: an "
              "all-gather's output, a reduce-scatter's input, what each rank sends to all in an "
              "all-to-all; a message from each even rank to the next), back to back, MPI and gloo in "
              f"turns ({plural(first['rounds'], 'round')}), then one step's exchanges of the strategies "
              "that have no PyTorch peer here. *Gloo wrote*: the bytes the process handed to its "
              "sockets per call (`wchar` of /proc/self/io, mean over ranks; MPICH's shared memory "
              "writes none), over the vector's bytes. A ring allreduce sends 2(N−1)/N of the vector per "
              "rank, a reduce-scatter or an all-gather (N−1)/N.", ""]
    head = ["N", "exchange", "bytes", "bare MPI ms (range)", "bare gloo ms (range)", "gloo ÷ MPI",
            "gloo wrote per rank ÷ bytes"]
    rows = []
    for n, j in jobs:
        for c in j["result"]["cases"]:
            if not ok(c):
                rows.append([ranks_label(n, cores)] + failed_row(c, len(head) - 1))
                continue
            r = c["result"]
            size = r.get("bytes") or sum(b for _, b in r.get("kinds", {}).values())
            cells = [f"{ms(r[k])} ({ms(min(rounds(c, k)))}–{ms(max(rounds(c, k)))})" if len(rounds(c, k)) > 1
                     else ms(r[k]) for k in ("bare_mpi_s", "bare_gloo_s")]
            rows.append([ranks_label(n, cores), c["label"] if "bytes" in r else f"{c['label']}: {kinds_cell(c)}",
                         f"{size:,}", *cells, times(r["bare_gloo_s"] / r["bare_mpi_s"], 1),
                         f"{r['gloo_bytes_written'] / size:.2f}" if r.get("gloo_bytes_written") is not None and size
                         else "–"])
    return lines + table(head, rows) + transport_findings(jobs, cores) + load_line([j for _, j in jobs])


def transport_findings(jobs, cores):
    """Is gloo's reduce-scatter an allreduce underneath? Its bytes and time against both."""
    out = []
    for n, j in jobs:
        rs, ar, ag = (case(j, op=k) for k in ("reduce_scatter", "allreduce", "allgather"))
        if not (ok(rs) and ok(ar)) or rs["result"].get("gloo_bytes_written") is None:
            continue
        size = rs["result"]["bytes"]
        wrote = {k: c["result"]["gloo_bytes_written"] / size for k, c in (("rs", rs), ("ar", ar), ("ag", ag)) if ok(c)}
        time_ratio = statistics.median(paired(rs, ar, lambda p, q: p / q, "bare_gloo_s"))
        like = abs(wrote["rs"] - wrote["ar"]) < 0.1 * wrote["ar"]
        out.append(f"N = {ranks_label(n, cores)}: gloo's reduce-scatter wrote {wrote['rs']:.2f}× its vector per rank, "
                   f"its allreduce {wrote['ar']:.2f}×"
                   + (f", its all-gather {wrote['ag']:.2f}×" if "ag" in wrote else "")
                   + f" (a ring reduce-scatter sends {(n - 1) / n:.2f}×, a ring allreduce {2 * (n - 1) / n:.2f}×); "
                   f"it took {time_ratio:.2f}× the allreduce's time, paired by round. "
                   + ("It moves what an allreduce moves: an allreduce underneath, of which each rank keeps its part."
                      if like else "It does not move what an allreduce moves."))
        if ok(rs):
            mpi_ratio = statistics.median(paired(rs, ar, lambda p, q: p / q, "bare_mpi_s"))
            out[-1] += f" MPI's reduce-scatter took {mpi_ratio:.2f}× MPI's allreduce."
    return [f"- {line}" for line in out] + ([""] if out else [])


def larger_model(meta, runs, cores):
    lines = ["## A larger GPT: where compute, not overhead, decides", ""]
    jobs = jobs_measured(runs, "large", (2, 4))
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    cfg = first.get("config") or {}
    lines += [f"The GPT of the toy rows at {cfg.get('layers')} blocks × {cfg.get('hidden')} hidden × "
              f"{cfg.get('heads')} heads, sequences of {cfg.get('seq_len')} characters, each script's default "
              f"batch ({plural(first['steps'], 'step')} per run, {plural(first['rounds'], 'round')}); the "
              "peers configured as in their groups. *× peer*: our step over the peer's beside it, paired "
              "by round; *loss Δ*: between the two loss curves.", ""]
    head = ["N", "run", "step ms (range)", "× peer (range; rounds)", "loss Δ"]
    rows = []
    for n, j in jobs:
        for c in cases_of(j):
            if not ok(c):
                rows.append([ranks_label(n, cores)] + failed_row(c, len(head) - 1))
                continue
            mine = c["tags"]["kind"] == "strategy"
            peer = case(j, kind="peer", pair=c["tags"]["pair"]) if mine else None
            each = paired(c, peer, lambda p, q: p / q) if mine and ok(peer) else []
            rows.append([ranks_label(n, cores), c["label"], step_cell(c), rounds_cell(each),
                         sci(loss_diff(c, peer)) if mine else "–"])
    return lines + table(head, rows) + bare_table(runs, "large", cores) + load_line([j for _, j in jobs])



def precision(meta, runs, cores):
    lines = ["## Precision and recomputation: bf16 against fp32, and what recomputation costs", ""]
    jobs = jobs_measured(runs, "precision", (2, 4))
    if not jobs:
        return lines + ["Not measured (see above).", ""]
    first = jobs[0][1]["result"]
    lines += [f"Each script at its defaults ({plural(first['steps'], 'step')} per run, "
              f"{plural(first['rounds'], 'round')}, every case taking turns on the same ranks). *bf16*: "
              "autocast's bfloat16 matmuls on float32 master weights; *× fp32*: its step over the fp32 "
              "step, paired by round (a CPU without bf16 matrix units converts instead of gaining). "
              "*Peak*: the largest rank's measured peak, MB. *Selective* recomputes attention's scores and "
              "softmax in backward, *full* each whole block; *× none*: the step over fp32 without "
              "recomputation; *activations*: what autograd saved for backward in one forward, largest "
              "rank, MB; *loss Δ*: against the fp32 run without recomputation (0 is bit for bit).", ""]
    head = ["N", "script", "fp32 step ms", "bf16 × fp32 (range)", "peak MB fp32 → bf16", "check fp32 / bf16",
            "selective × none", "full × none", "activations MB none / selective / full", "loss Δ sel. / full"]
    rows = []
    for n, j in jobs:
        scripts = list(dict.fromkeys(c["tags"]["strategy"] for c in j["result"]["cases"]))
        for module in scripts:
            base = case(j, strategy=module, precision="fp32", recompute="none")
            bf16 = case(j, strategy=module, precision="bf16", recompute="none")
            sel = case(j, strategy=module, precision="fp32", recompute="selective")
            full = case(j, strategy=module, precision="fp32", recompute="full")
            peak = lambda c: mb(max(c["result"]["peak_memory_bytes_per_rank"])) if ok(c) else "–"
            saved = lambda c: (mb(max(c["result"]["activation_bytes_per_rank"]))
                               if ok(c) and c["result"].get("activation_bytes_per_rank") else "–")
            rows.append([ranks_label(n, cores), f"{module}.py", step_cell(base) if ok(base) else "–",
                         ratio_cell(bf16, base), f"{peak(base)} → {peak(bf16)}",
                         f"{check_cell(base) if ok(base) else '–'} / {check_cell(bf16) if ok(bf16) else '–'}",
                         ratio_cell(sel, base) if sel else "–", ratio_cell(full, base) if full else "–",
                         " / ".join(saved(c) for c in (base, sel, full)) if sel else saved(base),
                         f"{sci(loss_diff(sel, base))} / {sci(loss_diff(full, base))}" if sel else "–"])
            errors = [c for c in (base, bf16, sel, full) if c is not None and not ok(c)]
            rows += [[ranks_label(n, cores)] + failed_row(c, len(head) - 1) for c in errors]
    return lines + table(head, rows) + load_line([j for _, j in jobs])


def norm_difference(c):
    """The largest |difference| of a grid's gradient norms, step by step, from its one-process reference's."""
    d = c["result"].get("norm_max_abs_diff")
    return "–" if d is None else f"{d:.1e}"


def matrix(meta, runs, cores):
    lines = ["## The exactness matrix: hybrid_parallel.py against one process on every grid", ""]
    j = next((r for r in sorted(runs, key=lambda r: -r["ranks"]) if r["group"] == "matrix" and r["result"]), None)
    if j is None:
        return lines + ["Not measured (see above).", ""]
    r0, cfg, cases = j["result"], j["result"].get("config") or {}, j["result"]["cases"]
    recipe = next((c["tags"]["recipe"] for c in cases if c["tags"].get("recipe")), None)
    lines += [f"Every grid trains the same GPT ({cfg.get('layers')} blocks × {cfg.get('hidden')} hidden × "
              f"{cfg.get('heads')} heads, global batch {cfg.get('batch_size')} sequences of {cfg.get('seq_len')} "
              f"characters, M = {cfg.get('micro_batches')} micro-batches, {plural(r0['steps'], 'step')}"
              + (f", `{' '.join(recipe)}`" if recipe else "") + ") with "
              "--check: one process trains the unsplit model from the same seed on the same batches, and "
              "*largest |Δ|* is the largest difference over every loss, gradient norm and parameter (each "
              "rank's piece against the same piece of the reference), with the script's verdict against its "
              "tolerance in that precision. *Norms |Δ|*: the largest of them alone, the gradient norms' "
              "difference step by step from the same reference's. The grids ran one after another "
              f"in one job of {j['ranks']} ranks on {cores} cores, each on the job's first N ranks: the step "
              "times say what a tiny model costs on an oversubscribed CPU, not what a grid is worth. *Bytes "
              "by axis*: per step, summed over the grid's ranks, MB.", ""]
    head = ["N", "grid", "precision", "largest \\|Δ\\| (losses, norms, parameters)", "norms \\|Δ\\|", "step ms",
            "peak MB per rank (largest)", "bytes by axis: data / tensor / pipeline / context / expert"]
    rows = []
    for c in cases:
        n, precision = ranks_label(c["tags"]["n"], cores), c["tags"].get("precision", "fp32")
        grid = c["label"].replace("hybrid_parallel.py ", "").replace(f" [{precision}]", "")
        if not ok(c):
            rows.append([n] + failed_row({**c, "label": grid}, len(head) - 1))
            continue
        r, axis = c["result"], c["result"].get("comm_bytes_per_step_by_axis") or {}
        rows.append([n, grid, precision, check_cell(c), norm_difference(c), ms(r["step_time_s"]),
                     mb(max(r["peak_memory_bytes_per_rank"])),
                     " / ".join(mb(axis[a]) if a in axis else "–"
                                for a in ("data", "tensor", "pipeline", "context", "expert"))])
    return lines + table(head, rows) + load_line([j])


def render(meta, runs):
    cores = meta["machine"]["cores"]
    lines = header(meta, runs)
    for section in (summary, transport, data_parallel, pipeline, tensor_parallel, sharded, larger_model, hybrid,
                    matrix, context_parallel, expert_parallel, precision, overlap, scaling, findings):
        lines += section(meta, runs, cores)
    return "\n".join(lines)
