"""Render every built deck, English and Chinese (slides/zh), in headless Chromium: right slide count, first and middle
slides not blank, no slide overflowing its canvas (the zh decks with Debian's fonts-noto-cjk)."""
import re
from pathlib import Path

import pytest

from support import CHROMIUM_ARGS, sync_playwright

from dslab import course
from tools import slides, slides_html, slides_source

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = slides_html.find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium for headless rendering: apt-get install -y chromium")
DECKS = slides_source.deck_paths() + slides_source.deck_paths(slides_source.ZH_SLIDES_DIR)
W, H = slides_html.WIDTH, slides_html.HEIGHT
SHOTS = ROOT / "tests" / "browser" / "screenshots"  # kept (gitignored) so a failure can be looked at


def key(path):
    """'04_zero' for an English deck, 'zh/04_zero' for its Chinese twin."""
    return f"zh/{path.stem}" if path.parent.name == "zh" else path.stem


def expected_slides(source):
    """Slides in a deck source, counted here independently of the builder: `---` lines outside fences."""
    count, fence, body = 0, None, False
    for line in source.splitlines():
        m = re.match(r"\s*(```|~~~)", line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
        if fence is None and re.fullmatch(r"---\s*", line):
            count, body = count + body, False
        elif line.strip():
            body = True
    return count + body


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every deck built from source into a fresh folder, strictly: every figure and table function runs."""
    out = tmp_path_factory.mktemp("decks")
    return {key(p): slides.build_deck(p, out / ("zh" if "/" in key(p) else ""), strict=True).output for p in DECKS}


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for every render (a page each): starting one per slide cost 2 s and a core's second."""
    if sync_playwright is None:
        pytest.skip("needs playwright: pip install -e '.[browser]'")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, "--hide-scrollbars"])
        yield chromium
        chromium.close()


def render(browser, html_path, slide, shot):
    """Open deck#slide in a fresh page (no state shared with the last one); screenshot to shot; return <body>'s
    data-* attributes once the deck's script has set them."""
    page = browser.new_page(viewport={"width": W, "height": H})
    try:
        page.goto(f"{html_path.as_uri()}#{slide}", wait_until="load")
        page.wait_for_selector("body[data-overflow]", state="attached", timeout=60_000)   # the script's last step
        page.screenshot(path=str(shot))
        return page.evaluate("() => Object.fromEntries([...document.body.attributes]"
                             ".filter(a => a.name.startsWith('data-')).map(a => [a.name.slice(5), a.value]))")
    finally:
        page.close()


def ink(png):
    """(share of the window covered by the slide's paper colour, share of 'ink' pixels on it)."""
    import numpy as np
    from PIL import Image

    img = Image.open(png).convert("RGB")
    assert img.size == (W, H)
    px = np.asarray(img, dtype=np.int16).reshape(-1, 3)
    paper = np.array([0xFD, 0xFD, 0xFB])
    near = (np.abs(px - paper).max(axis=1) <= 6).mean()
    dark = (px.sum(axis=1) < 3 * 160).mean()  # text, lines, bars
    return float(near), float(dark)


def test_the_decks_built_are_the_chapters_notebooks(built):
    """One deck per chapter of the course map (dslab/course.py) in each edition, no stray or missing one: the render
    tests below cover every chapter."""
    notebooks = [ch.notebook for ch in course.CHAPTERS]
    assert sorted(k for k in built if "/" not in k) == notebooks
    assert sorted(k for k in built if k.startswith("zh/")) == [f"zh/{n}" for n in notebooks]


@pytest.mark.parametrize("path", DECKS, ids=[key(p) for p in DECKS])
def test_deck_renders(path, built, browser):
    n = expected_slides(path.read_text(encoding="utf-8"))
    html_path = built[key(path)]
    assert f'data-slides="{n}"' in html_path.read_text(encoding="utf-8")
    SHOTS.mkdir(parents=True, exist_ok=True)
    middle = n // 2 + 1
    shots = {}
    for slide in (1, middle):
        shot = SHOTS / f"{key(path).replace('/', '_')}_{slide}.png"
        shot.unlink(missing_ok=True)
        state = render(browser, html_path, slide, shot)
        # The page's own script saw every slide, opened the one the URL asked for, and fit each on its canvas.
        assert state.get("rendered-slides") == str(n), state
        assert state.get("current") == str(slide), state
        assert state.get("overflow") == "", f"{path.name}: content overflows slide(s) {state.get('overflow')}"
        paper, dark = ink(shot)
        assert paper > 0.5, f"{shot.name}: the slide is not on screen (paper covers {paper:.0%})"
        assert dark > 0.004, f"{shot.name}: slide {slide} looks blank ({dark:.2%} ink)"
        shots[slide] = shot.read_bytes()
    assert shots[1] != shots[middle], "the first and the middle slide look the same: #N navigation broken"


def test_pdf_export_one_page_per_slide(built, tmp_path):
    """Print one deck to PDF (offline, Chromium's print-to-PDF): one 16:9 page per slide."""
    name = sorted(k for k in built if "/" not in k)[0]
    html_path = tmp_path / f"{name}.html"
    html_path.write_bytes(built[name].read_bytes())
    pdf = slides_html.export_pdf(html_path).read_bytes()
    assert pdf.startswith(b"%PDF")
    pages = len(re.findall(rb"/Type\s*/Page\b", pdf))
    assert pages == expected_slides((ROOT / "slides" / f"{name}.md").read_text(encoding="utf-8"))
    assert set(re.findall(rb"/MediaBox\s*\[([^\]]*)\]", pdf)) == {b"0 0 960 540"}  # 1280x720 px at 96 dpi
