"""Render spans as a waterfall: one row per service, one bar per span, as self-contained HTML or PNG."""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from deployment.otlp_receiver import ReceivedSpan

# Bar colours by span name (prefix match); anything else is grey.
COLOURS = [
    ("client.", "#7f7f7f"),
    ("coordinator.generate", "#c7d7ea"),
    ("coordinator.queue_wait", "#f2c14e"),
    ("coordinator.prefill", "#9c6ade"),
    ("coordinator.round", "#4e79a7"),
    ("draft.prefill", "#b07aa1"),
    ("draft.propose", "#59a14f"),
    ("target.prefill", "#d37295"),
    ("target.verify", "#e15759"),
    ("target.accept", "#f28e2b"),
]
SERVICE_ORDER = ("client", "coordinator", "draft", "target")
SKIP_ATTRIBUTES = {"gen_ai.system"}


def colour(name: str) -> str:
    """The bar colour of a span name."""
    for prefix, value in COLOURS:
        if name.startswith(prefix):
            return value
    return "#bab0ac"


def _service_key(service: str) -> tuple[int, str]:
    for index, word in enumerate(SERVICE_ORDER):
        if word in service:
            return index, service
    return len(SERVICE_ORDER), service


def lanes(spans: Sequence[ReceivedSpan]) -> dict[str, list[list[ReceivedSpan]]]:
    """Spans grouped by service (in display order), each service's spans packed into non-overlapping lanes
    (a span goes to the first lane whose last bar ended before it starts: nested spans stack down)."""
    by_service: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        by_service[span.service].append(span)
    packed: dict[str, list[list[ReceivedSpan]]] = {}
    for service in sorted(by_service, key=_service_key):
        rows: list[list[ReceivedSpan]] = []
        for span in sorted(by_service[service], key=lambda s: (s.start_ns, -s.end_ns)):
            for row in rows:
                if row[-1].end_ns <= span.start_ns:
                    row.append(span)
                    break
            else:
                rows.append([span])
        packed[service] = rows
    return packed


def summary(spans: Sequence[ReceivedSpan]) -> list[tuple[str, str, int, float]]:
    """(service, span name, count, total seconds) per span name, largest total first: where the time goes."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for span in spans:
        totals[(span.service, span.name)].append(span.duration_s)
    rows = [(service, name, len(d), sum(d)) for (service, name), d in totals.items()]
    return sorted(rows, key=lambda r: -r[3])


def _label(span: ReceivedSpan) -> str:
    a = span.attributes
    if span.name == "coordinator.round":
        return f"round k={a.get('specserve.draft_len', 0)} {a.get('specserve.tokens_accepted', 0)}/" \
               f"{a.get('specserve.tokens_proposed', 0)}"
    return span.name.split(".", 1)[-1]


def _title(span: ReceivedSpan, origin_ns: int) -> str:
    lines = [f"{span.name} ({span.service})",
             f"start +{(span.start_ns - origin_ns) / 1e6:.2f} ms, duration {span.duration_s * 1e3:.2f} ms"]
    lines += [f"{k} = {v}" for k, v in sorted(span.attributes.items()) if k not in SKIP_ATTRIBUTES]
    if span.links:
        lines.append(f"links: {len(span.links)} request span(s)")
    if span.status_code == 2:
        lines.append(f"ERROR {span.status_message}")
    return "\n".join(lines)


def _ticks(total_ms: float) -> list[float]:
    step = 10 ** len(str(int(max(total_ms, 1) / 5))) / 10
    while total_ms / step > 10:
        step *= 2
    return [i * step for i in range(int(total_ms / step) + 1)]


def render_html(spans: Sequence[ReceivedSpan], path: str | Path, title: str = "specserve trace") -> Path:
    """Write a self-contained HTML waterfall of ``spans`` (no scripts or external assets) and return its path.

    Every service gets a row (labelled with its service.name), every span a bar whose hover title lists
    its attributes; a table below sums the time per span name.
    """
    if not spans:
        raise ValueError("no spans to render")
    origin = min(s.start_ns for s in spans)
    total_ns = max(max(s.end_ns for s in spans) - origin, 1)
    lane_px = 22
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>",
        "body{font:13px system-ui,sans-serif;margin:16px;color:#222}"
        ".svc{display:flex;border-top:1px solid #ddd}.name{width:190px;flex:none;padding:4px;font-weight:600}"
        ".track{position:relative;flex:1}.bar{position:absolute;height:18px;border-radius:2px;overflow:hidden;"
        "white-space:nowrap;font-size:11px;line-height:18px;padding-left:2px;box-sizing:border-box;"
        "border:1px solid rgba(0,0,0,.25)}.bar.err{outline:2px solid #d00}"
        ".axis{position:relative;height:18px;margin-left:190px;font-size:11px;color:#666}"
        ".axis span{position:absolute;border-left:1px solid #bbb;padding-left:2px}"
        "table{border-collapse:collapse;margin-top:16px}td,th{padding:2px 10px;text-align:right}"
        "td:first-child,td:nth-child(2),th:first-child,th:nth-child(2){text-align:left}",
        "</style></head><body>",
        f"<h2>{html.escape(title)}</h2>",
        f"<p>{len(spans)} spans, {total_ns / 1e6:.1f} ms. Hover a bar for its attributes.</p>",
        "<div class='axis'>",
    ]
    for tick in _ticks(total_ns / 1e6):
        parts.append(f"<span style='left:{tick * 1e6 / total_ns * 100:.3f}%'>{tick:g} ms</span>")
    parts.append("</div>")
    for service, rows in lanes(spans).items():
        parts.append(f"<div class='svc'><div class='name'>{html.escape(service)}</div>"
                     f"<div class='track' style='height:{len(rows) * lane_px + 4}px'>")
        for lane, row in enumerate(rows):
            for span in row:
                left = (span.start_ns - origin) / total_ns * 100
                width = max((span.end_ns - span.start_ns) / total_ns * 100, 0.05)
                css = "bar err" if span.status_code == 2 else "bar"
                parts.append(
                    f"<div class='{css}' style='left:{left:.3f}%;width:{width:.3f}%;top:{lane * lane_px + 2}px;"
                    f"background:{colour(span.name)}' title='{html.escape(_title(span, origin), quote=True)}'>"
                    f"{html.escape(_label(span))}</div>")
        parts.append("</div></div>")
    parts.append("<table><tr><th>service</th><th>span</th><th>count</th><th>total ms</th><th>mean ms</th></tr>")
    for service, name, count, seconds in summary(spans):
        parts.append(f"<tr><td>{html.escape(service)}</td><td>{html.escape(name)}</td><td>{count}</td>"
                     f"<td>{seconds * 1e3:.2f}</td><td>{seconds * 1e3 / count:.2f}</td></tr>")
    parts.append("</table></body></html>\n")
    out = Path(path)
    out.write_text("".join(parts), encoding="utf-8")
    return out


def render_png(spans: Sequence[ReceivedSpan], path: str | Path, title: str = "specserve trace") -> Path:
    """Write the same waterfall as a PNG with matplotlib (Agg backend) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not spans:
        raise ValueError("no spans to render")
    origin = min(s.start_ns for s in spans)
    packed = lanes(spans)
    labels, y = [], 0
    height = sum(len(rows) for rows in packed.values())
    fig, ax = plt.subplots(figsize=(14, 1.5 + 0.3 * max(height, 8)))
    for service, rows in packed.items():
        for lane, row in enumerate(rows):
            bars = [((s.start_ns - origin) / 1e6, max((s.end_ns - s.start_ns) / 1e6, 1e-3)) for s in row]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=[colour(s.name) for s in row],
                           edgecolor="black", linewidth=0.3)
            labels.append(service if lane == 0 else "")
            y += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first span")
    ax.set_title(title)
    names = sorted({s.name for s in spans})
    ax.legend(handles=[Patch(color=colour(n), label=n) for n in names], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
