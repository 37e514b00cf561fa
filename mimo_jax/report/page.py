"""A self-contained HTML page: headings, tables, text and matplotlib figures embedded as PNG data URIs.

Nothing is fetched when the page opens (no scripts, fonts or stylesheets from elsewhere), so a
report can be mailed, archived with its run, or opened on a machine with no network.  Every piece of
text from a run (prompts, completions, config values) is escaped.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mimo_jax.files import write_atomic

__all__ = ["Page", "fmt"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em auto;max-width:1180px;
  color:#1d1d1f;padding:0 1em;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;
  margin-top:1.6em} h3{font-size:1em;margin-bottom:.3em}
.sub{color:#666;margin-top:0} .grid{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0;flex:0 1 calc(50% - 6px);min-width:480px;max-width:100%} figure img{width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85em;color:#555}
table{border-collapse:collapse;font-size:.85em;margin:.4em 0} td,th{border:1px solid #ddd;padding:3px 7px;
  text-align:left;vertical-align:top} th{background:#f5f5f7} td.num{text-align:right;font-variant-numeric:tabular-nums}
td.text{white-space:pre-wrap;word-break:break-word}
pre{background:#f5f5f7;padding:.6em;overflow-x:auto;font-size:.8em;white-space:pre-wrap;word-break:break-word}
.alarm{color:#b00020;font-weight:600} .ok{color:#0a7d32;font-weight:600} .warn{color:#a15c00;font-weight:600}
details{margin:.4em 0} summary{cursor:pointer;font-weight:600}
"""


def fmt(v: Any) -> str:
  """A value as a table shows it (4 significant digits for floats)."""
  if isinstance(v, bool) or v is None:
    return "" if v is None else str(v)
  if isinstance(v, float):
    return f"{v:.4g}"
  if isinstance(v, (list, tuple)):
    return ", ".join(fmt(x) for x in v)
  return str(v)


class Page:
  """An HTML page built part by part; :meth:`html` renders it."""

  def __init__(self, title: str, subtitle: str = ""):
    self.title = title
    self.parts: list[str] = [f"<h1>{html.escape(title)}</h1>"]
    if subtitle:
      self.parts.append(f'<p class="sub">{html.escape(subtitle)}</p>')
    self._grid: list[str] | None = None
    self.images: list[tuple[str, bytes]] = []  # (caption, PNG) of every figure, for a notebook to show inline

  def heading(self, text: str, level: int = 2, anchor: str = "") -> None:
    self._end_grid()
    ident = f' id="{html.escape(anchor)}"' if anchor else ""
    self.parts.append(f"<h{level}{ident}>{html.escape(text)}</h{level}>")

  def paragraph(self, text: str, cls: str = "") -> None:
    self._end_grid()
    c = f' class="{cls}"' if cls else ""
    self.parts.append(f"<p{c}>{html.escape(text)}</p>")

  def raw(self, markup: str) -> None:
    """Markup the caller built (and escaped) itself."""
    self._end_grid()
    self.parts.append(markup)

  def pre(self, text: str) -> None:
    self._end_grid()
    self.parts.append(f"<pre>{html.escape(text)}</pre>")

  def figure(self, fig: Any, caption: str = "", alt: str = "") -> None:
    """Embeds a matplotlib figure as a PNG; consecutive figures share a row."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    self.images.append((caption, buf.getvalue()))
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    if self._grid is None:
      self._grid = []
    self._grid.append(
      f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(alt or caption)}">{cap}</figure>'
    )

  def table(
    self,
    rows: Iterable[Mapping[str, Any]] | Iterable[Sequence[Any]],
    columns: Sequence[str],
    *,
    classes: Sequence[str] | None = None,
  ) -> None:
    """A table of dict rows (keyed by ``columns``) or of sequences (in ``columns``' order)."""
    self._end_grid()
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
      values = [row.get(c) for c in columns] if isinstance(row, Mapping) else list(row)
      cells = []
      for i, v in enumerate(values):
        cls = classes[i] if classes and i < len(classes) and classes[i] else ""
        if not cls and isinstance(v, (int, float)) and not isinstance(v, bool):
          cls = "num"
        c = f' class="{cls}"' if cls else ""
        cells.append(f"<td{c}>{html.escape(fmt(v))}</td>")
      body.append("<tr>" + "".join(cells) + "</tr>")
    self.parts.append(f"<table><tr>{head}</tr>{''.join(body)}</table>")

  def details(self, summary: str, build) -> None:
    """A collapsible section whose content ``build(page)`` adds."""
    self._end_grid()
    self.parts.append(f"<details><summary>{html.escape(summary)}</summary>")
    build(self)
    self._end_grid()
    self.parts.append("</details>")

  def _end_grid(self) -> None:
    if self._grid:
      self.parts.append('<div class="grid">' + "".join(self._grid) + "</div>")
    self._grid = None

  def html(self) -> str:
    self._end_grid()
    body = "\n".join(self.parts)
    return (
      '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
      '<meta name="viewport" content="width=device-width, initial-scale=1">'
      f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )

  def write(self, path: str) -> str:
    write_atomic(path, self.html())
    return path
