"""The Chinese edition (中文版): notebooks/zh, slides/zh, README.zh.md, docs/instructor_guide.zh.md, `make lab-zh`.

A zh chapter is the English chapter with its Markdown translated: the same code (comments may be Chinese), the
same stored outputs, the same cells in the same order (tools/zh_sync.py rebuilds it). Its prose must be Chinese and
keep the English text's numbers; its terms come from docs/glossary.md.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import course
from tools import slides_source, zh_lab, zh_sync

ROOT = Path(__file__).resolve().parent.parent
ENGLISH = zh_sync.english_notebooks()
IDS = [p.stem for p in ENGLISH]
ZH_DECKS = slides_source.deck_paths(ROOT / "slides" / "zh")
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
# Numbers a translation must keep: measured figures, sizes, versions. Single digits are left out: Chinese often
# writes small counts as words (两个进程), and section numbers are corrected where the English cites the wrong one.
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


# English cells that state a number their own chapter's outputs contradict (to be fixed in the English): the Chinese
# states what the outputs show. {(chapter, English cell id): numbers the zh text need not repeat}


def numbers(text):
    return {n for n in NUMBER.findall(text) if len(n) > 1}


def load(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def prose(markdown):
    """Markdown without what is not prose: code, HTML tags and comments, link targets, math, slide directives."""
    markdown = re.sub(r"^(```|~~~).*?^\1\s*$", " ", markdown, flags=re.S | re.M)
    markdown = re.sub(r"<!--.*?-->", " ", markdown, flags=re.S)
    # a deck's directive line (![table: caption](dslab.module:call(...))) counts as its caption
    markdown = re.sub(r"^!\[\w+(?::([^\]]*))?\]\(.*\)\s*$", r"\1", markdown, flags=re.M)
    markdown = re.sub(r"(`+).+?\1", " ", markdown, flags=re.S)
    markdown = re.sub(r"\]\([^)]*\)", "]", markdown)
    markdown = re.sub(r"<[^>]+>", " ", markdown)
    return re.sub(r"\$[^$]+\$", " ", markdown)


def cjk_share(markdown):
    """Share of the prose's letters that are Chinese characters (Latin letters are the rest)."""
    text = prose(markdown)
    cjk = len(CJK.findall(text))
    latin = sum(1 for ch in text if ch.isascii() and ch.isalpha())
    return cjk / (cjk + latin) if cjk + latin else 1.0


def markdown_pairs(english):
    """(position, id, English Markdown, zh Markdown) for each Markdown cell of a chapter, paired by cell id."""
    en, zh = load(english), load(zh_sync.twin_path(english))
    zh_md = {c["id"]: zh_sync.text(c) for c in zh["cells"] if c["cell_type"] == "markdown"}
    return [(i, c["id"], zh_sync.text(c), zh_md.get(c["id"])) for i, c in enumerate(en["cells"])
            if c["cell_type"] == "markdown"]


# ----------------------------------------------------------------------------------------------------
# The notebooks: one twin per chapter, same code and outputs, Chinese prose
# ----------------------------------------------------------------------------------------------------
def test_every_english_chapter_has_a_zh_twin():
    assert IDS == [ch.notebook for ch in course.CHAPTERS], "tools.zh_sync's chapters are not dslab/course.py's"
    missing = [p.name for p in ENGLISH if not zh_sync.twin_path(p).exists()]
    assert not missing, (f"no Chinese twin for {missing}: run `python -m tools.zh_sync` (creates it with the English "
                         "Markdown), then translate its Markdown cells")
    strays = sorted({p.name for p in zh_sync.ZH_DIR.glob("*.ipynb")} - {p.name for p in ENGLISH})
    assert not strays, f"notebooks/zh has chapters with no English original: {strays}"


@pytest.mark.parametrize("english", ENGLISH, ids=IDS)
def test_code_and_outputs_are_the_english_ones(english):
    twin = zh_sync.twin_path(english)
    if not twin.exists():
        pytest.fail(f"no {twin.name} in notebooks/zh: run `python -m tools.zh_sync {english.stem[:2]}`")
    en, zh = load(english), load(twin)
    fix = f"run `python -m tools.zh_sync {english.stem[:2]}` to refresh notebooks/zh/{twin.name} from the English"
    assert [(c["cell_type"], c.get("id")) for c in zh["cells"]] == [(c["cell_type"], c["id"]) for c in en["cells"]], \
        f"{twin.name}: cells differ from the English chapter's in kind, id or order; {fix}"
    for i, (a, b) in enumerate(zip(en["cells"], zh["cells"])):
        if a["cell_type"] != "code":
            continue
        assert zh_sync.same_code(zh_sync.text(b), zh_sync.text(a)), \
            f"{twin.name} cell {i}: the code differs from the English (comments aside; a %%writefile cell line for " \
            f"line); {fix}"
        assert b["outputs"] == a["outputs"], f"{twin.name} cell {i}: stored outputs differ from the English; {fix}"
        assert b.get("execution_count") == a.get("execution_count"), f"{twin.name} cell {i}: {fix}"
    assert zh["metadata"] == en["metadata"], f"{twin.name}: notebook metadata (kernel) differs; {fix}"
    rebuilt, report = zh_sync.rebuild(en, zh, english.stem)
    assert rebuilt == zh and not report.blocking, "\n".join(report.lines()) or fix


def twin_markdown_pairs(english):
    """markdown_pairs of a chapter that must have its Chinese twin (the test fails, naming it, when it has none)."""
    if not zh_sync.twin_path(english).exists():
        pytest.fail(f"no Chinese twin for {english.name}")
    return markdown_pairs(english)


@pytest.mark.parametrize("english", ENGLISH, ids=IDS)
def test_markdown_is_chinese_and_keeps_the_numbers(english):
    problems = []
    for pos, _, en, zh in twin_markdown_pairs(english):
        if zh is None:
            problems.append(f"cell {pos}: no zh cell")
            continue
        share = cjk_share(zh)
        if share < 0.5:
            problems.append(f"cell {pos}: only {share:.0%} of its letters are Chinese: translate it ({zh[:60]!r})")
        lost = numbers(en) - numbers(zh)
        lost = sorted(lost, key=lambda n: (len(n), n))
        if lost:
            problems.append(f"cell {pos}: numbers of the English text missing from the Chinese: {lost}")
    assert not problems, f"notebooks/zh/{english.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("english", ENGLISH, ids=IDS)
def test_chinese_lines_are_not_broken_mid_sentence(english):
    """A line break between two Chinese characters renders as a stray space: a zh paragraph is one source line."""
    bad = []
    for pos, _, _, zh in twin_markdown_pairs(english):
        broken = r"([\u4e00-\u9fff，。、；：])\n[ \t]*(?![-*|#>\d])([\u4e00-\u9fff])"  # CJK, newline, CJK
        for m in re.finditer(broken, prose(zh or "")):
            bad.append(f"cell {pos}: …{m.group(0)!r}…")
    assert not bad, f"notebooks/zh/{english.name}: join these lines:\n" + "\n".join(bad)


def test_cjk_share_counts_letters_outside_code():
    assert cjk_share("梯度累积（gradient accumulation）") < 0.5
    assert cjk_share("用 `deepspeed.initialize(model=model, config=ds_config)` 初始化引擎") == 1.0
    assert cjk_share("```python\nprint('hello world')\n```\n## 小结") == 1.0
    assert cjk_share("## Summary") == 0.0


# ----------------------------------------------------------------------------------------------------
# The sync tool: what it keeps, what it refuses
# ----------------------------------------------------------------------------------------------------
def test_comments_are_stripped_but_code_is_compared():
    en = "x = f(a)  # why\n# a note\ny = '#not a comment'\n!ls runs  # shell\n"
    zh = "x = f(a)  # 原因\n\n# 说明\ny = '#not a comment'\n!ls runs  # shell\n"
    assert zh_sync.code_without_comments(zh) == zh_sync.code_without_comments(en) == \
        ["x = f(a)", "y = '#not a comment'", "!ls runs  # shell"]
    assert zh_sync.code_without_comments("x = f(b)  # why") != zh_sync.code_without_comments(en)
    assert zh_sync.code_without_comments("y = '#changed'") != zh_sync.code_without_comments("y = '#not a comment'")
    assert zh_sync.code_without_comments("%%px\nengine.step()  # 每个进程\n") == ["%%px", "engine.step()"]
    assert zh_sync.code_without_comments("%%bash\necho 1  # a\n") == ["%%bash", "echo 1  # a"]  # not Python


def test_a_writefile_cell_keeps_the_english_line_numbers():
    """The script a %%writefile cell writes is run, and its tracebacks and stacks name lines: a translated comment
    stays on its line, so the zh script's code sits on the same lines as the English one's."""
    en = "%%writefile run.py\nimport os  # the OS\n\nx = 1  # why,\n       # and more why\nprint(x)\n"
    zh = "%%writefile run.py\nimport os  # 操作系统\n\nx = 1  # 原因，\n       # 还有更多原因\nprint(x)\n"
    assert zh_sync.code_lines(zh) == zh_sync.code_lines(en) == ["%%writefile run.py", "import os", "", "x = 1", "",
                                                                "print(x)"]
    assert zh_sync.same_code(zh, en)
    joined = "%%writefile run.py\nimport os  # 操作系统\n\nx = 1  # 原因，还有更多原因\nprint(x)\n"  # one line fewer
    assert not zh_sync.same_code(joined, en)
    assert zh_sync.same_code(joined.replace("%%writefile run.py", "%%px"), en.replace("%%writefile run.py", "%%px"))
    nb = _nb(("code", en))
    zh_nb = json.loads(json.dumps(nb))
    zh_nb["cells"][0]["source"] = joined
    rebuilt, report = zh_sync.rebuild(nb, zh_nb, "demo")
    assert zh_sync.text(rebuilt["cells"][0]) == en and report.code_reset == [(0, "c0")]


@pytest.mark.parametrize("chapters", [("05_lora_sft", "08_cli_and_multinode")])
def test_zh_chapters_05_and_08_write_the_same_training_script(chapters):
    """As the English chapters do (tests/test_sft.py): the script is one, whichever chapter writes it."""
    scripts = [[zh_sync.text(c).split("\n", 1)[1] for c in load(zh_sync.ZH_DIR / f"{name}.ipynb")["cells"]
                if c["cell_type"] == "code" and zh_sync.text(c).startswith("%%writefile")] for name in chapters]
    assert len(scripts[0]) == 1 and scripts[0] == scripts[1]


def _nb(*cells):
    out = []
    for i, (kind, src) in enumerate(cells):
        cell = {"cell_type": kind, "id": f"c{i}", "metadata": {}, "source": src}
        if kind == "code":
            cell.update(outputs=[{"output_type": "stream", "name": "stdout", "text": f"out {i}\n"}], execution_count=i)
        out.append(cell)
    return {"cells": out, "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}


def test_rebuild_takes_code_and_outputs_from_english_and_keeps_the_translation():
    en = _nb(("markdown", "# Title"), ("code", "x = 1  # one"), ("markdown", "Text 2"))
    zh, report = zh_sync.rebuild(en, None, "demo")
    assert report.created and [zh_sync.text(c) for c in zh["cells"]] == ["# Title", "x = 1  # one", "Text 2"]
    zh["cells"][0]["source"], zh["cells"][2]["source"] = "# 标题", "正文 2"
    zh["cells"][1]["source"] = "x = 1  # 一"
    en["cells"][1]["outputs"][0]["text"] = "new output\n"  # the English chapter was re-run
    again, report = zh_sync.rebuild(en, zh, "demo")
    assert not report.blocking and not report.stale
    assert [zh_sync.text(c) for c in again["cells"]] == ["# 标题", "x = 1  # 一", "正文 2"]
    assert again["cells"][1]["outputs"] == en["cells"][1]["outputs"]
    en["cells"][1]["source"] = "x = 2  # one"  # the English code changed: the zh comments cannot be kept
    again, report = zh_sync.rebuild(en, zh, "demo")
    assert zh_sync.text(again["cells"][1]) == "x = 2  # one" and report.code_reset == [(1, "c1")]
    en["cells"][2]["source"] = "Text 3"  # the English prose changed: the translation is stale
    again, report = zh_sync.rebuild(en, zh, "demo")
    assert [pos for pos, _, _ in report.stale] == [2] and "Text 3" in "\n".join(report.lines())
    again, report = zh_sync.rebuild(en, again, "demo", reviewed=True)
    assert not report.stale and zh_sync.text(again["cells"][2]) == "正文 2"


def test_rebuild_names_added_removed_and_moved_markdown_cells():
    en = _nb(("markdown", "# A"), ("code", "x = 1"), ("markdown", "B"), ("markdown", "C"))
    zh, _ = zh_sync.rebuild(en, None, "demo")
    grown = _nb(("markdown", "# A"), ("code", "x = 1"), ("markdown", "B"), ("markdown", "C"), ("markdown", "New D"))
    _, report = zh_sync.rebuild(grown, zh, "demo")
    assert report.blocking and report.gained == [(4, "c4", "New D")]
    assert "cell 4 (id c4) is new" in "\n".join(report.lines())
    shrunk = _nb(("markdown", "# A"), ("code", "x = 1"), ("markdown", "B"))
    _, report = zh_sync.rebuild(shrunk, zh, "demo")
    assert report.lost == [("c3", "C")]
    swapped = json.loads(json.dumps(en))
    swapped["cells"][2], swapped["cells"][3] = swapped["cells"][3], swapped["cells"][2]
    _, report = zh_sync.rebuild(swapped, zh, "demo")
    assert report.blocking and report.moved
    renamed = json.loads(json.dumps(en))
    renamed["cells"][3]["id"] = "fresh"  # same English text under a new id: the translation follows it
    rebuilt, report = zh_sync.rebuild(renamed, zh, "demo")
    assert not report.blocking and rebuilt["cells"][3]["id"] == "fresh"


def test_sync_check_fails_and_names_the_cell(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(zh_sync, "EN_DIR", tmp_path)
    monkeypatch.setattr(zh_sync, "ZH_DIR", tmp_path / "zh")
    monkeypatch.setattr(zh_sync, "ROOT", tmp_path)
    monkeypatch.setattr(zh_sync, "SLIDES_DIR", tmp_path / "slides")
    en = _nb(("markdown", "# 42 · Demo"), ("code", "x = 1"))
    (tmp_path / "42_demo.ipynb").write_text(json.dumps(en))
    (tmp_path / "slides").mkdir()
    (tmp_path / "slides" / "42_demo.md").write_text("# 42 · Demo\n---\n## Goals\n")
    assert zh_sync.main(["--check"]) == 1  # no twin yet
    assert zh_sync.main([]) == 0 and (tmp_path / "zh" / "42_demo.ipynb").exists()
    assert (tmp_path / "slides" / "zh" / "42_demo.md").read_text() == "# 42 · Demo\n---\n## Goals\n"  # to translate
    assert zh_sync.main(["--check"]) == 0
    en["cells"].append({"cell_type": "markdown", "id": "late", "metadata": {}, "source": "## Later"})
    (tmp_path / "42_demo.ipynb").write_text(json.dumps(en))
    capsys.readouterr()
    assert zh_sync.main([]) == 1
    assert "(id late) is new" in capsys.readouterr().err
    assert zh_sync.main(["--force"]) == 0
    exported = zh_sync.export(tmp_path / "42_demo.ipynb")
    assert "<!-- zh_sync cell late -->\n<!-- en\n## Later\n-->\n## Later" in exported
    zh_sync.import_text(exported.replace("-->\n## Later", "-->\n## 稍后"))
    assert zh_sync.text(load(tmp_path / "zh" / "42_demo.ipynb")["cells"][-1]) == "## 稍后"


# ----------------------------------------------------------------------------------------------------
# Glossary terms everywhere in the Chinese edition
# ----------------------------------------------------------------------------------------------------
def _zh_texts():
    for p in [ROOT / "README.zh.md", *sorted((ROOT / "docs").glob("*.zh.md")), *ZH_DECKS]:
        yield str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")
    for p in sorted(zh_sync.ZH_DIR.glob("*.ipynb")):
        for i, cell in enumerate(load(p)["cells"]):
            yield f"{p.relative_to(ROOT)} cell {i}", zh_sync.text(cell)


def test_chinese_text_uses_the_glossary_terms():
    rows = slides_source.load_glossary()
    found = [f"{where}: '{bad}' -> write '{r['zh']}' ({r['en']})"
             for where, text in _zh_texts() for r in rows for bad in r["avoid"] if bad in text]
    assert not found, "\n".join(found)


# ----------------------------------------------------------------------------------------------------
# Decks, README, instructor guide
# ----------------------------------------------------------------------------------------------------
# the zh headings of every deck's fixed slides (Goals, Run it, Takeaways, Common mistakes, Exercises)
ZH_SECTIONS = ["本章目标", "动手运行", "要点", "常见错误", "练习"]


def test_every_chapter_has_a_zh_deck():
    english = {p.name for p in slides_source.deck_paths()}
    assert english and {p.name for p in ZH_DECKS} == english, "slides/zh needs one deck per English deck, same name"


@pytest.mark.parametrize("path", ZH_DECKS, ids=[p.stem for p in ZH_DECKS])
def test_zh_deck_shape_follows_the_english_deck(path):
    deck = slides_source.load_deck(path)
    english = slides_source.load_deck(ROOT / "slides" / path.name)
    assert deck.title.startswith(path.name[:2])
    headings = [h for s in deck.slides for h in re.findall(r"^##\s+(.+)$", s, re.M)]
    for section in ZH_SECTIONS:
        assert any(h.startswith(section) for h in headings), f"{path.name}: no '## {section}' slide"
    # the same figures, tables and terms as the English deck: the same code computes them
    assert [d[::2] for s in deck.slides for d in slides_source.directives(s)] == \
        [d[::2] for s in english.slides for d in slides_source.directives(s)]
    assert abs(len(deck.slides) - len(english.slides)) <= 1
    # Slides are dense with API names and exercise ids: the deck's prose as a whole is mostly Chinese, and no slide
    # is left in English (an untranslated slide scores below 10 %).
    assert cjk_share("\n".join(deck.slides)) > 0.6, f"{path.name}: the deck is mostly not in Chinese"
    low = [(i, f"{cjk_share(s):.0%}") for i, s in enumerate(deck.slides, 1) if cjk_share(s) < 0.3]
    assert not low, f"{path.name}: slides not in Chinese: {low}"
    problems = slides_source.check_deck(path)
    assert not problems, problems


def test_readme_zh_and_instructor_guide_zh():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](README.zh.md)" in "\n".join(readme.splitlines()[:3]), "README.md links README.zh.md at the top"
    zh = (ROOT / "README.zh.md").read_text(encoding="utf-8")
    for needed in ("make lab", "make test", "make lab-zh", "](docs/instructor_guide.zh.md)", "](docs/glossary.md)"):
        assert needed in zh, f"README.zh.md lacks {needed!r}"
    for p in ENGLISH:  # every chapter is described
        assert f"zh/{p.name}" in zh or p.stem in zh, f"README.zh.md does not list {p.name}"
    guide = (ROOT / "docs" / "instructor_guide.zh.md").read_text(encoding="utf-8")
    assert cjk_share(zh) > 0.5 and cjk_share(guide) > 0.5


# ----------------------------------------------------------------------------------------------------
# The Chinese lab and the notebook test run
# ----------------------------------------------------------------------------------------------------
def test_kernels_of_zh_chapters_start_beside_the_english_ones(tmp_path):
    """The code cells use paths relative to notebooks/ (runs/05, ../data, ../pyproject.toml): a zh chapter's kernel
    starts there too; other folders, and a `zh` folder without chapters beside it, are left alone."""
    chapters = tmp_path / "notebooks"
    (chapters / "zh").mkdir(parents=True)
    (chapters / "00_setup.ipynb").write_text("{}")
    (tmp_path / "other" / "zh").mkdir(parents=True)
    assert zh_lab.english_folder(chapters / "zh") == chapters
    assert zh_lab.english_folder(tmp_path / "other" / "zh") == tmp_path / "other" / "zh"
    manager = zh_lab.KernelManager(root_dir=str(chapters))
    assert Path(manager.cwd_for_path("zh")) == chapters and Path(manager.cwd_for_path("")) == chapters


def test_lab_zh_sets_the_chinese_locale_with_an_installed_language_pack():
    from jupyterlab_server.translation_utils import get_language_packs

    packs, _ = get_language_packs("en")
    assert zh_lab.LOCALE in packs, "the zh_CN language pack is missing: pip install -e '.[dev]'"
    overrides = load(zh_lab.SETTINGS_DIR / "overrides.json")
    assert overrides["@jupyterlab/translation-extension:plugin"]["locale"] == zh_lab.LOCALE
    argv = zh_lab.lab_argv(["--port=1"])
    assert f"--LabApp.app_settings_dir={zh_lab.SETTINGS_DIR}" in argv and argv[-1] == "--port=1"
    assert "--ServerApp.kernel_manager_class=tools.zh_lab.KernelManager" in argv
    pins = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'"jupyterlab-language-pack-zh-cn==[\w.]+"', pins), "pin the language pack in the dev extras"


def test_lab_zh_makes_dslab_speak_chinese_whatever_the_locale(monkeypatch):
    """`make lab-zh` sets DSLAB_LANG=zh in the server's environment, which every kernel and terminal inherits."""
    from jupyterlab.labapp import LabApp

    from dslab import messages

    for var in ("DSLAB_LANG", "LC_ALL", "LC_MESSAGES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LANG", "en_US.UTF-8")  # an English (or C) OS locale
    monkeypatch.setenv("DSLAB_LANG", "en")     # even one left over from `dslab --lang en`
    started = []
    monkeypatch.setattr(LabApp, "launch_instance", classmethod(lambda cls, argv=None: started.append(argv)))
    zh_lab.main(["--port=1"])
    assert started == [zh_lab.lab_argv(["--port=1"])]
    assert messages.language() == "zh" and zh_lab.LAB_ENV == {messages.LANG_ENV: "zh"}
    assert messages.say("env.memory") == "内存"


def test_make_test_notebooks_leaves_zh_out():
    """`make test-notebooks` collects every English chapter and nothing from notebooks/zh (same CI time)."""
    dry = subprocess.run(["make", "-n", "-o", "setup", "test-notebooks"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    line = next(ln for ln in dry.stdout.splitlines() if "--nbval" in ln)
    cmd = line.split() + ["--collect-only", "-q"]
    cmd[0] = sys.executable if cmd[0].endswith("python") else cmd[0]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    files = {re.split(r"::|: ", ln)[0] for ln in out.splitlines() if re.search(r"\.ipynb(::|: \d)", ln)}
    assert files == {f"notebooks/{p.name}" for p in ENGLISH}, out[-2000:]
