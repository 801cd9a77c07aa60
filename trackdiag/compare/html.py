"""``comparison.html``: one self-contained page (inline CSS, images as data URIs, no scripts).

It previews inline in MLflow's artifact viewer and opens from disk without a server.
"""
from __future__ import annotations

import base64
import datetime as _dt
from html import escape
from typing import TYPE_CHECKING

from trackdiag.compare.table import cells, headers

if TYPE_CHECKING:
    from trackdiag.compare.comparison import Comparison

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222}
h1{font-size:1.4em;margin-bottom:0}.sub{color:#666;margin-top:4px}
table{border-collapse:collapse;font-size:13px;margin:12px 0}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right;white-space:nowrap}
th{background:#f4f4f4;position:sticky;top:0}td.l,th.l{text-align:left}
tr.critical td.h{background:#fdd;color:#a00;font-weight:bold}tr.warning td.h{background:#fff1d6;color:#a60}
tr.failed td.h{background:#eedff5;color:#729}tr.unknown td.h{color:#888}tr.ok td.h{background:#e3f5e1;color:#270}
tr.none td{color:#888}tr.none td.h{font-style:italic}
ul.risk li{font-family:ui-monospace,Menlo,monospace;font-size:13px;margin:2px 0}
img{max-width:100%;border:1px solid #eee;margin:8px 0}.note{color:#777;font-size:12px}
"""
_TITLES = {"anomalies_by_param": "Anomalous runs per hyperparameter value",
           "first_anomaly_vs_param": "First anomaly step vs swept parameter",
           "loss_curves": "Loss curves"}


def render_html(comparison: "Comparison", images: dict[str, bytes] | None = None) -> str:
    """The whole page as a string: headline, table, risk summary, images, notes."""
    images = images or {}
    head = headers(comparison.swept, comparison.kinds, comparison.has_trials)
    left = {"run", "status", "health"}
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>trackdiag compare</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>trackdiag sweep comparison</h1>",
        f"<p class='sub'>{escape(comparison.headline)} &middot; source <code>{escape(comparison.source)}</code>"
        f" &middot; {escape(_dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S'))}</p>",
        "<h2>Runs</h2><table><thead><tr>",
        "".join(f"<th class='{'l' if h in left else ''}'>{escape(h)}</th>" for h in head),
        "</tr></thead><tbody>",
    ]
    for r in comparison.runs:
        row = cells(r, comparison.swept, comparison.kinds, comparison.has_trials)
        tds = []
        for i, (h, c) in enumerate(zip(head, row)):
            cls = "l h" if h == "health" else ("l" if h in left else "")
            title = f" title='{escape(r.name)}'" if i == 0 else ""
            tds.append(f"<td class='{cls}'{title}>{escape(c)}</td>")
        css = "none" if not r.diagnosed else r.display_health  # "no trackdiag": one class name
        parts.append(f"<tr class='{escape(css)}'>{''.join(tds)}</tr>")
    parts.append("</tbody></table>")
    if comparison.has_trials:
        parts.append(f"<p class='stops'>{escape(comparison.stop_line)}</p>")
    if comparison.risk_lines:
        parts.append("<h2>Anomaly rate per swept value</h2><ul class='risk'>")
        parts += [f"<li>{escape(line)}</li>" for line in comparison.risk_lines]
        parts.append("</ul>")
    elif len(comparison.runs) > 1:
        parts.append("<p class='note'>No hyperparameter differs between these runs.</p>")
    for name, png in images.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<h2>{escape(_TITLES.get(name, name))}</h2><img alt='{escape(name)}' "
                     f"src='data:image/png;base64,{data}'>")
    notes = [r for r in comparison.runs if r.note]
    if notes:
        parts.append("<h2>Notes</h2><ul class='note'>")
        parts += [f"<li><b>{escape(r.label)}</b> ({escape(r.status)}): {escape(r.note)}"
                  + (f" &middot; overrides <code>{escape(' '.join(r.overrides))}</code>" if r.overrides else "")
                  + "</li>" for r in notes]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
