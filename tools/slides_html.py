"""HTML for tools/slides.py: a directive's result as a figure, table, code block or glossary terms; the
slide page with its CSS and viewer script; and printing a built deck to PDF with headless Chromium.

Everything a page needs is inline (figures as base64 PNG, CSS, script), so a deck opens offline.
"""
import base64
import html
import inspect
import io
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tools.slides_source import SlideError, glossary_terms, plain

WIDTH, HEIGHT = 1280, 720  # the slide canvas; the viewer scales it to the window
FIGURE_DPI = 144


def figure_html(fig, caption):
    """A matplotlib Figure as an inline PNG <figure>."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    # No Software/date metadata: the same figure gives the same bytes, so builds are reproducible.
    fig.savefig(buf, format="png", dpi=FIGURE_DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    cap = f"<figcaption>{inline(caption)}</figcaption>" if caption else ""
    return f'<figure class="dsfig"><img alt="{html.escape(plain(caption) or "figure")}" src="data:image/png;base64,{data}">{cap}</figure>'


def format_cell(v):
    """A table cell: thousands separators up to millions, then 3-digit scientific; 4 significant digits below."""
    if isinstance(v, bool) or v is None:
        return {None: "", True: "yes", False: "no"}[v]
    if isinstance(v, (list, tuple)):
        return ", ".join(format_cell(x) for x in v) or "—"
    if isinstance(v, (int, float)) and abs(v) >= 1e7:
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "—"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


UNITS = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20, "KiB": 2**10, "%": 0.01}


def _unit_columns(columns):
    """['total:GB', 'setup'] -> (['total', 'setup'], {'total': 'GB'}): a unit divides the column's numbers."""
    names, units = [], {}
    for c in columns:
        name, _, unit = c.partition(":")
        if unit and unit not in UNITS:
            raise SlideError(f"unknown unit {unit!r} in column {c!r}; use one of {', '.join(UNITS)}")
        names.append(name.strip())
        if unit:
            units[name.strip()] = unit
    return names, units


def table_rows(data, columns=()):
    """(header, rows) from a list of dicts, a dict of lists, a dict of scalars or a list of lists.

    columns picks (and orders) columns; 'name:GB' (GiB, MB, MiB, KiB, %) also converts its numbers.
    """
    columns, units = _unit_columns(columns)
    header, rows = _table_rows(data, columns)
    for i, h in enumerate(header):
        if h in units:
            factor = UNITS[units[h]]
            header[i] = f"{h} ({units[h]})"
            for r in rows:
                if isinstance(r[i], (int, float)) and not isinstance(r[i], bool):
                    r[i] = r[i] / factor
    return header, rows


def _table_rows(data, columns):
    if hasattr(data, "to_dict"):  # a pandas DataFrame, if a chapter returns one
        data = data.to_dict(orient="records")
    if isinstance(data, dict) and len(columns) == 2 and not any(c in data for c in columns):
        return list(columns), [[k, v] for k, v in data.items()]  # two new names: key and value columns
    if isinstance(data, dict) and data and all(isinstance(v, (list, tuple)) for v in data.values()):
        keys = list(data)
        data = [dict(zip(keys, vals)) for vals in zip(*data.values())]  # a dict of columns
    if isinstance(data, dict):
        if columns and all(c in data for c in columns):  # pick these keys
            return ["", ""], [[k, data[k]] for k in columns]
        if columns:
            raise SlideError(f"no key(s) {[c for c in columns if c not in data]} in the data; keys are {list(data)}")
        return ["", ""], [[k, v] for k, v in data.items()]
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, dict) for r in data):
        header = list(columns) or list(dict.fromkeys(k for r in data for k in r))
        missing = [c for c in header if not any(c in r for r in data)]
        if missing:
            raise SlideError(f"no column(s) {missing} in the table data; columns are {list(data[0])}")
        return header, [[r.get(c) for c in header] for r in data]
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, (list, tuple)) for r in data):
        return list(columns) or [""] * len(data[0]), [list(r) for r in data]
    raise SlideError(f"cannot show {type(data).__name__} as a table: return a list of dicts or a dict")


def table_html(data, caption="", columns=()):
    """Data as an HTML table (numbers right-aligned)."""
    header, rows = table_rows(data, columns)
    out = ['<table class="dstable">']
    if any(header):
        numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows)
                   for i in range(len(header))]  # right-align the heading of a numbers column
        out.append("<thead><tr>" + "".join(f'<th{" class=num" if num else ""}>{html.escape(str(h))}</th>'
                                           for h, num in zip(header, numeric)) + "</tr></thead>")
    out.append("<tbody>")
    for r in rows:
        cells = []
        for v in r:
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            text = html.escape(format_cell(v)) if num else inline(format_cell(v))  # `code` in a string cell shows as code
            cells.append(f'<td{" class=num" if num else ""}>{text}</td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if caption:  # below the table, as wide as the slide (a <caption> would wrap at the table's width)
        out.append(f'<p class="caption">{inline(caption)}</p>')
    return "".join(out)


def terms_html(target, rows, lang="en"):
    """The named glossary rows as an English / 中文 / meaning table (a zh deck: 中文 first, the 说明 column)."""
    terms = glossary_terms(target, rows)
    if lang == "zh":
        body = "".join(f"<tr><td>{html.escape(r['zh'])}</td><td lang=en>{html.escape(r['en'])}</td>"
                       f"<td>{inline(r.get('meaning_zh') or r['meaning'])}</td></tr>" for r in terms)
        head = "<th>中文</th><th>English</th><th>说明</th>"
    else:
        body = "".join(f"<tr><td>{html.escape(r['en'])}</td><td lang=zh>{html.escape(r['zh'])}</td>"
                       f"<td>{inline(r['meaning'])}</td></tr>" for r in terms)
        head = "<th>English</th><th>中文</th><th>meaning</th>"
    return f'<table class="dstable terms"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def inline(text):
    """Glossary cell Markdown (code, bold) as inline HTML."""
    s = html.escape(text)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)


def code_html(data, caption="", name="the expression"):
    """A string (or a list of lines) as a wrapped code block: command lines, hostfiles, configs."""
    if isinstance(data, (list, tuple)) and all(isinstance(x, str) for x in data):
        data = "\n".join(data)
    if not isinstance(data, str):
        raise SlideError(f"{name} gave {type(data).__name__}; ![code] shows a string or a list of lines")
    cap = f'<p class="caption">{inline(caption)}</p>' if caption else ""
    text = inspect.cleandoc(data)  # a docstring's indentation goes, other text is unchanged
    return f'<pre class="wrap"><code>{html.escape(text)}</code></pre>{cap}'


def split_result(result):
    """(Figure or None, data) from what a plot or table function returned."""
    def is_fig(x):
        return hasattr(x, "savefig") and hasattr(x, "axes")

    if isinstance(result, tuple) and len(result) == 2 and is_fig(result[0]):
        return result
    if is_fig(result):
        return result, None
    return None, result


def markdown_renderer():
    """The Markdown renderer: mistune with tables, code blocks highlighted by Pygments when present."""
    import mistune

    class Renderer(mistune.HTMLRenderer):
        def block_code(self, code, info=None):
            lang = (info or "").split()[0] if info else ""
            try:
                from pygments import highlight
                from pygments.formatters import HtmlFormatter
                from pygments.lexers import get_lexer_by_name

                return highlight(code, get_lexer_by_name(lang or "text"), HtmlFormatter(nowrap=False, cssclass="hl"))
            except Exception:  # no Pygments, or a language it does not know: plain code
                return f"<pre><code>{html.escape(code)}</code></pre>\n"

    return mistune.create_markdown(renderer=Renderer(escape=False), plugins=["table", "strikethrough"])


def pygments_css():
    """The code-highlighting CSS (from the Pygments package at build time), or '' without it."""
    try:
        from pygments.formatters import HtmlFormatter

        return HtmlFormatter(style="friendly").get_style_defs(".hl")
    except ImportError:
        return ""


def page_html(deck, sections):
    """The whole self-contained HTML document (lang zh-CN for a zh deck: Chinese fonts and line breaking)."""
    lang = "zh-CN" if deck.lang == "zh" else "en"
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="{lang}"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">\n'
        f"<title>{html.escape(deck.title)}</title>\n<style>\n{CSS}\n{pygments_css()}\n</style></head>\n"
        f'<body data-slides="{len(sections)}" data-deck="{html.escape(deck.name)}">\n'
        f'<main id="deck">\n' + "\n".join(sections) + "\n</main>\n"
        f"<script>\n{JS}\n</script>\n</body></html>\n"
    )


CSS = f"""
@page {{ size: {WIDTH}px {HEIGHT}px; margin: 0; }}
html, body {{ margin: 0; height: 100%; background: #1d2330; overflow: hidden; }}
body {{ font-family: "Noto Sans", "DejaVu Sans", "Noto Sans CJK SC", "WenQuanYi Zen Hei", sans-serif; color: #1b1f27; }}
html:lang(zh-CN) body {{ font-family: "Noto Sans CJK SC", "Noto Sans SC", "WenQuanYi Zen Hei", "Noto Sans", sans-serif; }}
#deck {{ position: absolute; left: 50%; top: 50%; width: {WIDTH}px; height: {HEIGHT}px;
        transform-origin: center center; transform: translate(-50%, -50%); }}
section.slide {{ display: none; position: absolute; inset: 0; box-sizing: border-box; width: {WIDTH}px;
                height: {HEIGHT}px; background: #fdfdfb; padding: 44px 64px 56px; overflow: hidden; }}
section.slide.current, section.slide.measure {{ display: block; }}
section.slide.measure {{ visibility: hidden; }}
.content {{ height: 100%; overflow: hidden; font-size: 26px; line-height: 1.38; }}
h1 {{ font-size: 44px; margin: 0 0 18px; color: #18406b; }}
h2 {{ font-size: 36px; margin: 0 0 18px; color: #18406b; border-bottom: 3px solid #e3a13b; padding-bottom: 6px; }}
h3 {{ font-size: 28px; margin: 10px 0 8px; color: #28507a; }}
p {{ margin: 8px 0; }}
ul, ol {{ margin: 6px 0; padding-left: 34px; }}
li {{ margin: 5px 0; }}
code {{ font-family: "DejaVu Sans Mono", "Noto Sans Mono", monospace; font-size: 0.86em; background: #eef1f5;
        padding: 1px 5px; border-radius: 4px; }}
pre, .hl pre {{ font-family: "DejaVu Sans Mono", "Noto Sans Mono", monospace; font-size: 19px; line-height: 1.35;
       background: #f3f5f8; border-left: 4px solid #18406b; padding: 10px 16px; margin: 10px 0; white-space: pre; }}
.hl {{ background: transparent; }}
pre code {{ background: none; padding: 0; font-size: inherit; }}
pre.wrap {{ white-space: pre-wrap; overflow-wrap: anywhere; font-size: 17px; }}
table {{ border-collapse: collapse; margin: 10px 0; font-size: 21px; }}
th, td {{ border-bottom: 1px solid #cfd6df; padding: 5px 14px; text-align: left; vertical-align: top; }}
th {{ background: #e8eef5; }}
td.num, th.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
table.terms {{ font-size: 18px; }} table.terms td {{ padding: 3px 12px; }} table.terms td:nth-child(2) {{ white-space: nowrap; }}
p.caption {{ font-size: 17px; color: #5a6270; margin: -4px 0 10px; }}
figure.dsfig {{ margin: 6px 0; text-align: center; }}
figure.dsfig img {{ max-width: 100%; max-height: 500px; }}
figcaption {{ font-size: 17px; color: #5a6270; }}
.pending {{ border: 3px dashed #c0392b; color: #7b241c; background: #fdf0ee; padding: 18px; font-size: 20px; }}
.cols {{ display: flex; gap: 36px; }} .cols > div {{ flex: 1; min-width: 0; }}
.small {{ font-size: 21px; }}
blockquote {{ margin: 10px 0; padding: 6px 18px; border-left: 5px solid #e3a13b; background: #fbf5ea; }}
section.title .content {{ display: flex; flex-direction: column; justify-content: center; }}
section.title h1 {{ font-size: 56px; }}
footer {{ position: absolute; left: 64px; right: 64px; bottom: 16px; display: flex; justify-content: space-between;
         font-size: 15px; color: #8a93a1; }}
@media print {{
  html, body {{ background: #fff; overflow: visible; height: auto; }}
  #deck {{ position: static; transform: none !important; width: auto; height: auto; }}
  section.slide {{ display: block; position: relative; break-after: page; page-break-after: always; }}
}}
"""

# The viewer: one slide at a time; arrows/space/PageUp/PageDown/Home/End or a click to move; #N opens
# slide N. It records what it rendered in <body data-*> so a headless browser test can read it back.
JS = f"""
(function () {{
  var deck = document.getElementById('deck');
  var slides = deck.querySelectorAll('section.slide');
  var n = slides.length, cur = -1;
  document.body.setAttribute('data-rendered-slides', String(n));
  function fit() {{
    var s = Math.min(window.innerWidth / {WIDTH}, window.innerHeight / {HEIGHT});
    deck.style.transform = 'translate(-50%, -50%) scale(' + s + ')';
  }}
  function show(i) {{
    i = Math.max(0, Math.min(n - 1, i));
    if (cur >= 0) slides[cur].classList.remove('current');
    cur = i;
    slides[cur].classList.add('current');
    document.body.setAttribute('data-current', String(cur + 1));
    if (location.hash !== '#' + (cur + 1)) {{
      try {{ history.replaceState(null, '', '#' + (cur + 1)); }} catch (e) {{ location.hash = '#' + (cur + 1); }}
    }}
  }}
  function fromHash() {{
    var m = /^#(\\d+)$/.exec(location.hash);
    show(m ? parseInt(m[1], 10) - 1 : 0);
  }}
  function overflowing() {{
    var bad = [];
    for (var i = 0; i < n; i++) {{
      var s = slides[i], c = s.querySelector('.content'), was = s.classList.contains('current');
      if (!was) s.classList.add('measure');
      if (c.scrollHeight > c.clientHeight + 1 || c.scrollWidth > c.clientWidth + 1) bad.push(i + 1);
      if (!was) s.classList.remove('measure');
    }}
    return bad;
  }}
  document.addEventListener('keydown', function (e) {{
    var k = e.key;
    if (k === 'ArrowRight' || k === 'ArrowDown' || k === 'PageDown' || k === ' ' || k === 'n') show(cur + 1);
    else if (k === 'ArrowLeft' || k === 'ArrowUp' || k === 'PageUp' || k === 'Backspace' || k === 'p') show(cur - 1);
    else if (k === 'Home') show(0);
    else if (k === 'End') show(n - 1);
    else return;
    e.preventDefault();
  }});
  deck.addEventListener('click', function (e) {{
    if (e.target.closest('a') || String(window.getSelection())) return;
    show(e.clientX < window.innerWidth / 3 ? cur - 1 : cur + 1);
  }});
  window.addEventListener('hashchange', fromHash);
  window.addEventListener('resize', fit);
  fit();
  fromHash();
  document.body.setAttribute('data-overflow', overflowing().join(','));
}})();
"""


# ----------------------------------------------------------------------------------------------------
# PDF (Chromium's print-to-PDF, offline)
# ----------------------------------------------------------------------------------------------------
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


def find_chromium():
    """Path of a Chromium binary (Debian's `chromium` first), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def export_pdf(html_path, chromium=None, timeout=120):
    """Print a built deck to PDF next to it (one slide per page) with headless Chromium."""
    chromium = chromium or find_chromium()
    if not chromium:
        raise SlideError("PDF export needs Chromium: apt-get install -y chromium")
    html_path = Path(html_path).resolve()
    pdf = html_path.with_suffix(".pdf")
    with tempfile.TemporaryDirectory(prefix="dslab-chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--no-pdf-header-footer",
               f"--print-to-pdf={pdf}", html_path.as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not pdf.exists():
        raise SlideError(f"Chromium could not print {html_path.name}: {proc.stderr.strip()[-500:]}")
    return pdf


