"""What dslab says to a learner, in English and in Chinese: one catalogue, one lookup (`say`).

The language: `dslab --lang zh|en` (which sets DSLAB_LANG), else $DSLAB_LANG, else the locale the way POSIX
programs read it for messages (LC_ALL, then LC_MESSAGES, then LANG): zh_* means Chinese, anything else English.
Only the words change: keys, values, commands and numbers are the same in both languages.
"""
import json
import os
from pathlib import Path

LANGUAGES = ("en", "zh")
LANG_ENV = "DSLAB_LANG"


def language():
    """"zh" or "en", as the module docstring says."""
    chosen = os.environ.get(LANG_ENV, "").strip().lower()
    if chosen in LANGUAGES:
        return chosen
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(var, "")
        if value:  # the first one set decides, as for any POSIX program
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def set_language(lang):
    """Use `lang` ("en" or "zh") from now on, in this process and in the processes it starts."""
    if lang not in LANGUAGES:
        raise ValueError(f"language {lang!r} is not one of {', '.join(LANGUAGES)}")
    os.environ[LANG_ENV] = lang


def say(key, /, **fields):
    """The catalogue's text for `key` in the current language, with `fields` filled in (a field may be named key)."""
    return CATALOGUE[key][language()].format(**fields)


# The catalogue is data (messages.json): each key holds its English and its Chinese text, with {name} fields that
# say() fills. Chinese follows docs/glossary.md's terms; DeepSpeed's keys and values stay as a config writes them.
CATALOGUE = json.loads(Path(__file__).with_name("messages.json").read_text(encoding="utf-8"))
