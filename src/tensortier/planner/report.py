"""The plan as a picture and a page: memory timeline (plain vs plan), Gantt chart, action table.

``write_report("plan.html", profile, choice, others)`` writes ``plan.html`` and ``plan.png`` next
to it (the page embeds the picture, so it can be mailed alone). matplotlib is imported here only,
with the Agg backend, so ``import tensortier`` never pays for it.
"""

from __future__ import annotations

import base64
import errno
import html
import io
import os

from tensortier._units import format_size, parse_size
from tensortier.errors import ConfigError
from tensortier.planner.policies import Choice
from tensortier.planner.profile import Profile
from tensortier.planner.simulator import (
    OVERHEADS,
    SWAPS,
    Mode,
    Plan,
    SimResult,
    selective_sets,
    simulate,
)

LANES = ("compute", "d2h", "h2d", "h2disk", "disk2h")
REMOTE_LANES = ("h2remote", "remote2h")  # drawn when the profile measured a remote pool
COLORS = {
    "fwd": "#4c72b0",
    "bwd": "#55a868",
    "recompute": "#c44e52",
    "encode": "#8172b2",
    "decode": "#8172b2",
    "wait": "#dddddd",
    "loss": "#937860",
}


def _matplotlib():
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "the planner report needs matplotlib: pip install 'tensortier[report]'"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render_png(profile: Profile, choice: Choice, budget: int | None = None) -> bytes:
    """Two panels: device memory over the step (plain vs plan, budget line) and the Gantt chart."""
    plt = _matplotlib()
    plain = simulate(profile, Plan("keep", {}))
    res = choice.result
    fig, (ax_mem, ax_gantt) = plt.subplots(
        2, 1, figsize=(11, 7), gridspec_kw={"height_ratios": [1.2, 1]}
    )
    gib = 2**30
    for r, label, style in ((plain, "plain (keep)", "--"), (res, choice.plan.policy, "-")):
        xs = [t for t, _ in r.timeline]
        ys = [b / gib for _, b in r.timeline]
        ax_mem.step(
            xs,
            ys,
            where="post",
            linestyle=style,
            label=f"{label}: peak {format_size(r.peak_bytes)}",
        )
    if budget:
        ax_mem.axhline(
            budget / gib, color="red", linewidth=1, label=f"budget {format_size(budget)}"
        )
    ax_mem.set_ylabel("device memory (GiB)")
    ax_mem.set_xlabel("seconds")
    ax_mem.set_title("Device memory over one iteration")
    ax_mem.legend(loc="upper right", fontsize=8)
    lanes = LANES + (REMOTE_LANES if profile.bandwidth.remote else ())
    for row, lane in enumerate(lanes):
        for s in (s for s in res.spans if s.lane == lane):
            kind = s.label.split()[0]
            color = COLORS.get(kind, "#dd8452")
            if lane == "compute" and s.label.startswith(("fwd", "bwd")) and "(ckpt)" not in s.label:
                color = COLORS[kind]
            ax_gantt.barh(
                row,
                s.end - s.start,
                left=s.start,
                color=color,
                edgecolor="white",
                linewidth=0.3,
                height=0.7,
            )
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in COLORS.items() if k != "decode"]
    handles.append(Patch(color="#dd8452", label="copy"))
    ax_gantt.legend(handles=handles, loc="lower right", fontsize=7, ncol=4)
    ax_gantt.set_yticks(range(len(lanes)), lanes)
    ax_gantt.invert_yaxis()
    ax_gantt.set_xlabel("seconds")
    ax_gantt.set_title(
        f"{choice.plan.policy}: step {res.step_s:.3g}s, exposed transfer {res.exposed_s:.3g}s, "
        f"added {added_text(res)}"
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def action_rows(profile: Profile, plan: Plan) -> list[dict]:
    """Per unit: action, bytes saved and moved, codecs used, forward/backward seconds."""
    from tensortier.planner.simulator import ordinals

    rows = []
    ordinal = ordinals(profile)
    for u in profile.units:
        ts = profile.tensors_of(u.name)
        codecs = sorted({plan.codecs.get(t.index) or "raw" for t in ts}) if ts else []
        moved = sum(t.nbytes for t in ts if plan.tier_of(t, ordinal[t.index]) != "keep")
        rows.append(
            {
                "unit": u.name or "(outside units)",
                "action": _short(plan.action(u.name).label()),
                "saved": format_size(sum(t.nbytes for t in ts)),
                "moved": format_size(moved),
                "tensors": len(ts),
                "codecs": ",".join(codecs) if plan.action(u.name).compress else "",
                "fwd_ms": f"{u.fwd_s * 1e3:.2f}",
                "bwd_ms": f"{u.bwd_s * 1e3:.2f}",
            }
        )
    return rows


def _short(label: str, limit: int = 40) -> str:
    return label if len(label) <= limit else label[: limit - 1] + "…]"


def added_text(result: SimResult) -> str:
    """What the plan adds to the compute stream, by cause: ``copies 0.01s, codecs 0s, ...``."""
    by = result.overhead_by or {}
    return ", ".join(f"{k} {by.get(k, 0.0):.3g}s" for k in OVERHEADS)


COLUMNS = (
    "saved: bytes the unit's forward saves for its backward (tensors: how many); moved: of "
    "those, the bytes sent to a tier; (outside units): tensors saved outside every block "
    "(embeddings, the loss)"
)
LEGEND = {  # action notation -> what it means, in the words of a reader of the table
    "keep": "keep: the unit's saved tensors stay on the device until its backward",
    "swap": "host / disk / remote: after the unit's forward its saved tensors move to pinned "
    "host RAM / NVMe spill files / other machines' RAM, and come back, prefetched, for its "
    "backward",
    "part": "disk[0,3,7] (or host[...], remote[...]): only the saved tensors at these positions "
    "move, counted from 0 in the order the unit's forward saved them; the others stay",
    "codec": "+codec: compressed losslessly on the way (sparse, zstd or lz4; fp16/bf16 only "
    "with --lossy), where encode + move + decode beats moving raw; the codecs column names it",
    "recompute": "recompute: nothing is saved; backward reruns the unit's forward "
    "(torch.utils.checkpoint)",
    "selective": "selective[2,5]: backward reruns only the operators at these positions of the "
    "unit's forward (counted from 0 in dispatch order; cheap ones such as norms and "
    "activations); the other operators' outputs are kept (see the per-operator table)",
}


def legend(plan: Plan) -> list[str]:
    """The notation of the action column, for the kinds of action this plan uses."""
    acts = list(plan.actions.values())
    used = {"keep"}
    used |= {"swap" for a in acts if a.mode in SWAPS}
    used |= {"part" for a in acts if a.mode in SWAPS and a.part is not None}
    used |= {"codec" for a in acts if a.compress}
    used |= {a.mode.value for a in acts if a.mode in (Mode.RECOMPUTE, Mode.SELECTIVE)}
    return [text for key, text in LEGEND.items() if key in used]


def _exact_size(nbytes: int) -> str:
    """``nbytes`` as a size string that parses back to exactly it: ``format_size`` rounds
    (``7GB`` prints as 6.52GiB, 0.01% more), and the hint must run the budget that was planned."""
    decimal = [f"{nbytes // f}{u}" for u, f in _DECIMAL if nbytes and nbytes % f == 0]
    for text in (format_size(nbytes), *decimal):
        if parse_size(text) == nbytes:
            return text
    return str(nbytes)


_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


def apply_hint(budget: int, policy: str = "auto") -> str:
    """How to run a model under this budget: the verb that profiles the model it wraps at its
    first step and plans like this (``plan_cache=`` keeps the plan for the next run)."""
    extra = "" if policy.split(":")[0] == "auto" else f', policy="{policy.split(":")[0]}"'
    return (
        f"import tensortier as tt\n"
        f'with tt.offload(budget="{_exact_size(budget)}"{extra}, spill_dir="/path/on/nvme",\n'
        f'                plan_cache="plans/"):   # profiles your model at its first step\n'
        f"    loss = model(batch)\n"
        f"loss.backward()"
    )


def op_rows(profile: Profile, plan: Plan) -> list[dict]:
    """Per selective unit and operator kind: how many are recomputed and how many cached, with
    the bytes the cached ones keep and the seconds the recomputed ones cost in backward."""
    rows = []
    for unit, rerun in selective_sets(profile, plan).items():
        kinds: dict[str, dict] = {}
        for o in profile.unit(unit).ops:
            if o.view:
                continue
            k = kinds.setdefault(
                o.name.removeprefix("aten."),
                {"unit": unit, "op": o.name.removeprefix("aten."), "recomputed": 0, "cached": 0,
                 "cached_bytes": 0, "rerun_ms": 0.0},
            )  # fmt: skip
            if o.index in rerun:
                k["recomputed"] += 1
                k["rerun_ms"] += o.seconds * 1e3
            else:
                k["cached"] += 1
                k["cached_bytes"] += o.out_bytes
        for k in kinds.values():
            k["cached_bytes"] = format_size(k["cached_bytes"])
            k["rerun_ms"] = f"{k['rerun_ms']:.2f}"
            rows.append(k)
    return rows


def policy_rows(choice: Choice, others: dict[str, Choice] | None, goal: int | None) -> list:
    """One row per policy, the chosen plan marked; ``choice.considered`` wins over ``others``."""
    rows, chosen = [], choice.plan.policy.split(":")[-1]  # "auto:fine" was fine's plan
    for name, c in {**(others or {}), **choice.considered}.items():
        by = c.result.overhead_by or {}
        rows.append(
            {
                "policy": name,
                "peak": format_size(c.result.peak_bytes),
                "step_s": f"{c.result.step_s:.4g}",
                "exposed_s": f"{c.result.exposed_s:.3g}",
                **{f"{k}_s": f"{by.get(k, 0.0):.3g}" for k in OVERHEADS},
                **({} if goal is None else {f"under {format_size(goal)}": _yes(c.meets(goal))}),
                "chosen": "<- chosen" if name == chosen else "",
            }
        )
    return rows


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _table(rows: list[dict]) -> str:
    if not rows:
        return "<p>(none)</p>"
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(
    path: str | os.PathLike,
    profile: Profile,
    choice: Choice,
    others: dict[str, Choice] | None = None,
    *,
    budget: int | None = None,
    planned_for: int | None = None,
    trials: list[dict] | None = None,
) -> tuple[str, str]:
    """Writes ``path`` (HTML) and the PNG beside it; returns both paths.

    ``others``: more policies' plans for the table, for ``planned_for`` (the budget less the
    margin ``choose`` took off); the plans ``choose`` compared (``choice.considered``) replace
    theirs, so the chosen row and the header are the same numbers. ``trials``: the rows of the
    plans run for real (:meth:`.trials.Trials.rows`), ``choice`` being the one they kept."""
    path = os.fspath(path)
    if os.path.isdir(path):  # else a stray PNG beside it (or ".png" inside it), then a failure
        raise IsADirectoryError(
            errno.EISDIR, "the report path is a directory; pass a file name such as plan.html", path
        )
    png_path = os.path.splitext(path)[0] + ".png"
    png = render_png(profile, choice, budget)
    with open(png_path, "wb") as f:
        f.write(png)
    bw = profile.bandwidth
    bw_rows = [
        {"channel": c, "GB/s": f"{bw.of(c) / 1e9:.2f}"}
        for c in LANES[1:] + (REMOTE_LANES if bw.remote else ())
    ]
    res = choice.result
    goal = planned_for or budget
    planned = (
        f", planned for {format_size(planned_for)} (the rest is margin: measured speeds drift)"
        if planned_for and budget and planned_for != budget
        else ""
    )
    items = "".join(f"<li>{html.escape(t)}</li>" for t in [*legend(choice.plan), COLUMNS])
    how = ""
    if budget:
        code = html.escape(apply_hint(budget, choice.plan.policy))
        how = f"<p>To run your model under this budget:</p><pre>{code}</pre>"
    title = f"tensortier plan: {html.escape(choice.plan.policy)}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head><body>
<h1>{title}</h1>
<p>Device {html.escape(profile.device)}; budget {format_size(budget) if budget else "none"}{planned};
predicted peak {format_size(res.peak_bytes)}, step {res.step_s:.4g}s
(exposed transfer {res.exposed_s:.3g}s; added to the compute stream: {added_text(res)}).
Saved activations {format_size(profile.saved_bytes)} in {len(profile.tensors)} tensors.</p>
{how}
<img src="data:image/png;base64,{base64.b64encode(png).decode()}" width="100%">
<h2>Per-module actions</h2><ul>{items}</ul>{_table(action_rows(profile, choice.plan))}
<h2>Per-operator actions (selective recompute)</h2>{_table(op_rows(profile, choice.plan))}
{_trials_section(trials)}<h2>Every policy (simulated)</h2>{_table(policy_rows(choice, others, goal))}
<h2>Measured bandwidth</h2>{_table(bw_rows)}
</body></html>"""
    with open(path, "w") as f:
        f.write(page)
    return path, png_path


def _trials_section(trials: list[dict] | None) -> str:
    """The measured trials, when ``auto`` ran some: the plan above is the one they kept."""
    if not trials:
        return ""
    return (
        "<h2>Measured trials</h2><p>These plans ran for real, one training step each (its peak); "
        "then the plans under the budget ran in interleaved rounds, one step each; the one "
        "with the least mean step of those rounds (compared_s) is the plan kept (above).</p>"
        + _table(trials)
    )


# ------------------------------------------------------------------ the budget sweep
def render_sweep_png(model: str, rows: list[dict], plain_peak: int | None = None) -> bytes:
    """Measured (solid) and predicted (dashed) peak and step time per policy against the budget
    fraction; the budget itself as a grey line."""
    plt = _matplotlib()
    fig, (ax_mem, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    mib = 2**20
    policies = sorted({r["policy"] for r in rows if "step_s" in r})
    cmap = plt.get_cmap("tab10")
    for i, policy in enumerate(policies):
        rs = sorted((r for r in rows if r["policy"] == policy and "step_s" in r),
                    key=lambda r: r["frac"])  # fmt: skip
        xs = [r["frac"] for r in rs]
        c = cmap(i % 10)
        ax_mem.plot(xs, [r["peak_bytes"] / mib for r in rs], "-o", color=c, label=policy, ms=3)
        ax_mem.plot(xs, [r["pred_peak_bytes"] / mib for r in rs], "--", color=c, lw=0.8)
        ax_t.plot(xs, [r["step_s"] for r in rs], "-o", color=c, label=policy, ms=3)
        ax_t.plot(xs, [r["pred_step_s"] for r in rs], "--", color=c, lw=0.8)
    fracs = sorted({r["frac"] for r in rows})
    budgets = {r["frac"]: r["budget_bytes"] for r in rows}
    ax_mem.plot(fracs, [budgets[f] / mib for f in fracs], color="grey", lw=2, label="budget")
    ax_mem.set_xlabel("budget / plain peak")
    ax_mem.set_ylabel("peak over all steps (MiB)")
    ax_mem.set_title(f"{model}: peak, measured (solid) and predicted (dashed)")
    ax_t.set_xlabel("budget / plain peak")
    ax_t.set_ylabel("step (s)")
    ax_t.set_title("step time, measured (solid) and predicted (dashed)")
    ax_mem.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def write_sweep_report(path: str | os.PathLike, rows: list[dict], summary: list[dict]) -> str:
    """One HTML page for a ``python -m benchmarks planner`` sweep: per model the two charts, the
    per-budget summary, and the chosen (``auto``) plan's per-unit and per-operator actions."""
    path = os.fspath(path)
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        png = render_sweep_png(model, mine)
        summ = [
            {
                "budget": f"{s['frac']:.2f} ({format_size(s['budget_bytes'])})",
                "fastest meeting": s.get("fastest_meeting"),
                "auto meets": s.get("auto_meets_budget", s.get("error", "")),
                "auto / fastest": f"{s['auto_vs_fastest']:.3f}" if "auto_vs_fastest" in s else "",
                "best global": s.get("best_global"),
                "auto speed-up": (
                    f"{s['auto_speedup_vs_best_global']:.3f}"
                    if "auto_speedup_vs_best_global" in s
                    else ""
                ),
                "max pred err %": (
                    f"{s['max_pred_err_pct']:.1f}" if s.get("max_pred_err_pct") is not None else ""
                ),
            }
            for s in summary
            if s["model"] == model
        ]
        autos = sorted((r for r in mine if r["policy"] == "auto" and "actions" in r),
                       key=lambda r: r["frac"])  # fmt: skip
        units = list(dict.fromkeys(u for r in autos for u in r["actions"]))
        plan_rows = [
            {"unit": u or "(outside units)",
             **{f"{r['frac']:.2f}": _short(r["actions"].get(u, "keep"), 28) for r in autos}}
            for u in units
        ]  # fmt: skip
        op_tables = "".join(
            f"<h4>budget {r['frac']:.2f}</h4>{_table(r['op_actions'])}"
            for r in autos
            if r.get("op_actions")
        )
        parts.append(
            f"""<h2>{html.escape(model)}</h2>
<img src="data:image/png;base64,{base64.b64encode(png).decode()}" width="100%">
<h3>Per budget</h3>{_table(summ)}
<h3>The auto plan per budget: per-unit actions</h3>{_table(plan_rows)}
<h3>The auto plan per budget: per-operator actions of selective units</h3>
{op_tables or "<p>(no selective recompute chosen)</p>"}"""
        )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tensortier budget sweep
</title><style>body{{font-family:sans-serif;max-width:1200px;margin:auto}}
table{{border-collapse:collapse;font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 6px;
text-align:right}}</style></head><body><h1>tensortier planner: budget sweep</h1>
<p>Peaks are over every step, the first included (see <code>python -m benchmarks planner</code>).
Solid lines: measured; dashed: the simulator's prediction.</p>{"".join(parts)}</body></html>"""
    with open(path, "w") as f:
        f.write(page)
    return path
