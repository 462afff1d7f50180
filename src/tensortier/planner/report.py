"""The plan as a picture and a page: memory timeline (plain vs plan), Gantt chart, action table.

``write_report("plan.html", profile, choice, others)`` writes ``plan.html`` and ``plan.png`` next
to it (the page embeds the picture, so it can be mailed alone). matplotlib is imported here only,
with the Agg backend, so ``import tensortier`` never pays for it.
"""

from __future__ import annotations

import base64
import html
import io
import os

from tensortier._units import format_size
from tensortier.errors import ConfigError
from tensortier.planner.policies import Choice
from tensortier.planner.profile import Profile
from tensortier.planner.simulator import Plan, simulate

LANES = ("compute", "d2h", "h2d", "h2disk", "disk2h")
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
    for row, lane in enumerate(LANES):
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
    ax_gantt.set_yticks(range(len(LANES)), LANES)
    ax_gantt.invert_yaxis()
    ax_gantt.set_xlabel("seconds")
    ax_gantt.set_title(
        f"{choice.plan.policy}: step {res.step_s:.3g}s, exposed transfer {res.exposed_s:.3g}s, "
        f"codec/recompute {res.overhead_s:.3g}s"
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def action_rows(profile: Profile, plan: Plan) -> list[dict]:
    """Per unit: action, bytes saved, codecs used, forward/backward seconds."""
    rows = []
    for u in profile.units:
        ts = profile.tensors_of(u.name)
        codecs = sorted({plan.codecs.get(t.index) or "raw" for t in ts}) if ts else []
        rows.append(
            {
                "unit": u.name or "(outside units)",
                "action": plan.action(u.name).label(),
                "saved": format_size(sum(t.nbytes for t in ts)),
                "tensors": len(ts),
                "codecs": ",".join(codecs) if plan.action(u.name).compress else "",
                "fwd_ms": f"{u.fwd_s * 1e3:.2f}",
                "bwd_ms": f"{u.bwd_s * 1e3:.2f}",
            }
        )
    return rows


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
) -> tuple[str, str]:
    """Writes ``path`` (HTML) and the PNG beside it; returns both paths."""
    path = os.fspath(path)
    png_path = os.path.splitext(path)[0] + ".png"
    png = render_png(profile, choice, budget)
    with open(png_path, "wb") as f:
        f.write(png)
    bw = profile.bandwidth
    bw_rows = [
        {"channel": c, "GB/s": f"{bw.of(c) / 1e9:.2f}"} for c in ("d2h", "h2d", "h2disk", "disk2h")
    ]
    policy_rows = [
        {
            "policy": name,
            "peak": format_size(c.result.peak_bytes),
            "step_s": f"{c.result.step_s:.4g}",
            "exposed_s": f"{c.result.exposed_s:.3g}",
            "overhead_s": f"{c.result.overhead_s:.3g}",
            "meets budget": "" if budget is None else ("yes" if c.meets(budget) else "no"),
        }
        for name, c in (others or {}).items()
    ]
    title = f"tensortier plan: {html.escape(choice.plan.policy)}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head><body>
<h1>{title}</h1>
<p>Device {html.escape(profile.device)}; budget {format_size(budget) if budget else "none"};
predicted peak {format_size(choice.result.peak_bytes)}, step {choice.result.step_s:.4g}s
(exposed transfer {choice.result.exposed_s:.3g}s). Saved activations
{format_size(profile.saved_bytes)} in {len(profile.tensors)} tensors.</p>
<img src="data:image/png;base64,{base64.b64encode(png).decode()}" width="100%">
<h2>Per-module actions</h2>{_table(action_rows(profile, choice.plan))}
<h2>Every policy (simulated)</h2>{_table(policy_rows)}
<h2>Measured bandwidth</h2>{_table(bw_rows)}
</body></html>"""
    with open(path, "w") as f:
        f.write(page)
    return path, png_path
