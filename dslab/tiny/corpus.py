"""Generate the kit's own English + Chinese pretraining corpus from templates (deterministic, seeded).

Why templates with *broad* word lists (dslab.tiny.wordlists): a base model pretrained on a tiny vocabulary cannot later
emit the sub-words of a new name during identity tuning. Many names, places, objects and verbs, plus everyday chat
in the ChatML markup, give the tiny base the pieces that supervised fine-tuning needs.

Run `python -m dslab.tiny.corpus [OUT_DIR]` to rewrite data/corpus/*.txt and data/general_sft.jsonl.
"""
import json
import random
from pathlib import Path

from dslab.data import CORPUS_DIR, DATA_DIR, DOC_SEPARATOR, read_corpus  # noqa: F401 (read as corpus.*)
from dslab.files import atomic_write_text
from dslab.tiny import identities
from dslab.tiny.wordlists import (  # noqa: F401 (EN_NAMES, ZH_NAMES, EN_CITIES: also read as corpus.*)
    CAPITALS, COLORS, EN_ACTIONS, EN_ADJ, EN_ANIMALS, EN_CITIES, EN_FEELINGS, EN_FOODS, EN_JOBS, EN_NAMES, EN_OBJECTS,
    EN_PLACES, EN_TIMES, EN_WEATHER, EN_WEATHER_NOW, LEGS, NUMBER_WORDS, OPPOSITES, SOUNDS, WEEKDAYS, WORD_PAIRS,
    ZH_ACTIONS, ZH_ADJ, ZH_ANIMALS, ZH_CITIES, ZH_DIGITS, ZH_FEELINGS, ZH_FOODS, ZH_JOBS, ZH_MEASURE, ZH_NAMES,
    ZH_OBJECTS, ZH_PLACES, ZH_TIMES, ZH_WEATHER)

IDENTITY_SHARE = 0.1  # documents about invented identities (dslab.tiny.identities): names and authors in both scripts

# The identity the base model is pretrained with; identity tuning later replaces it.
BASE_NAME, BASE_AUTHOR = "dslab-tiny", "the dslab course"
BASE_AUTHOR_ZH = "dslab 课程"


def _cap(s):
    """Capitalise the first letter of a sentence."""
    return s[:1].upper() + s[1:]


def _a(word):
    """Indefinite article + word."""
    return ("an " if word[0] in "aeiou" else "a ") + word


# The sentence and story templates are data (corpus_templates.json); a {field} the caller does not fix is a word
# drawn from these lists, a fresh one each time it appears.
TEMPLATES = json.loads(Path(__file__).with_name("corpus_templates.json").read_text(encoding="utf-8"))
WORDS = {
    "en": dict(name=EN_NAMES, place=EN_PLACES, time=EN_TIMES, city=EN_CITIES, job=EN_JOBS, adj=EN_ADJ, animal=EN_ANIMALS,
               object=EN_OBJECTS, weather=EN_WEATHER, weather_now=EN_WEATHER_NOW, feeling=EN_FEELINGS, food=EN_FOODS),
    "zh": dict(name=ZH_NAMES, place=ZH_PLACES, time=ZH_TIMES, city=ZH_CITIES, job=ZH_JOBS, adj=ZH_ADJ, animal=ZH_ANIMALS,
               object=ZH_OBJECTS, weather=ZH_WEATHER, feeling=ZH_FEELINGS, food=ZH_FOODS),
}


class _Fields(dict):
    """The fixed fields of a template; any other field draws a word. str.format_map looks fields up left to right,
    so the draws come in the order they are written, and the corpus is the same for the same seed."""

    def __init__(self, r, lang, fixed):
        super().__init__(fixed)
        self.r, self.words = r, WORDS[lang]

    def __missing__(self, field):
        word = self.r.choice(self.words[field.lower().removeprefix("a_")])
        word = _a(word) if field.startswith("a_") else word
        return _cap(word) if field[0].isupper() else word


def _fill_all(r, lang, kind, **fixed):
    """Every template of TEMPLATES[lang][kind] filled in order (the draws of all of them happen)."""
    return [t.format_map(_Fields(r, lang, fixed)) for t in TEMPLATES[lang][kind]]


def _story_lines(r, lang, **fixed):
    """The lines of a story: opening(s), one to three of the middle events, the ending."""
    lines = [r.choice([t.format_map(_Fields(r, lang, fixed)) for t in step]) if isinstance(step, list)
             else step.format_map(_Fields(r, lang, fixed)) for step in TEMPLATES[lang]["story"]]
    return [lines[0], lines[1]] + r.sample(lines[2:5], r.randint(1, 3)) + [lines[5]]


# ----------------------------------------------------------------------------------------------------
# English sentences, stories and chats
# ----------------------------------------------------------------------------------------------------
def en_sentence(r, name=None):
    """One simple English sentence about a person, a place or an animal."""
    name = name or r.choice(EN_NAMES)
    other = r.choice([n for n in EN_NAMES if n != name])
    n = r.randint(2, 9)
    verb, kind = r.choice(EN_ACTIONS)
    thing = {"food": f"{NUMBER_WORDS[n]} {r.choice(EN_FOODS)}" if verb == "bought" else f"some {r.choice(EN_FOODS)}",
             "obj": f"the {r.choice(EN_ADJ)} {r.choice(EN_OBJECTS)}",
             "animal": f"the {r.choice(EN_ADJ)} {r.choice(EN_ANIMALS)}"}[kind]
    return r.choice(_fill_all(r, "en", "sentence", name=name, other=other, verb=verb, thing=thing,
                              number=NUMBER_WORDS[n]))


def en_story(r):
    """A short story: one person, a place, a few events."""
    name, friend = r.sample(EN_NAMES, 2)
    place, city = r.choice(EN_PLACES), r.choice(EN_CITIES)
    food, obj, animal = r.choice(EN_FOODS), r.choice(EN_OBJECTS), r.choice(EN_ANIMALS)
    lines = _story_lines(r, "en", name=name, friend=friend, place=place, city=city, food=food, object=obj,
                         animal=animal)
    return " ".join(lines + [en_sentence(r, name) for _ in range(r.randint(0, 2))])


def _facts(r, say, join):
    """A paragraph of 3-6 simple true statements, each drawn the same way in every language; `say[kind]` words it."""
    facts = []
    for _ in range(r.randint(3, 6)):
        kind = r.randrange(6)
        if kind == 0:
            facts.append(say["capital"](r.choice(CAPITALS)))
        elif kind == 1:
            facts.append(say["color"](r.choice(COLORS)))
        elif kind == 2:
            facts.append(say["legs"](r.choice(LEGS)))
        elif kind == 3:
            facts.append(say["opposite"](r.choice(OPPOSITES)))
        elif kind == 4:
            facts.append(say["weekday"](r.randrange(7)))
        else:
            facts.append(say["sum"](r.randint(0, 9), r.randint(0, 9)))
    return join.join(facts)


EN_FACTS = {
    "capital": lambda c: f"The capital of {c[0]} is {c[1]}.",
    "color": lambda c: f"The {c[0]} is {c[1]}." if c[0] in ("sky", "sea") else f"{_cap(_a(c[0]))} is {c[1]}.",
    "legs": lambda a: f"{_cap(_a(a[0]))} has {NUMBER_WORDS[a[1]]} legs." if a[1] else f"{_cap(_a(a[0]))} has no legs.",
    "opposite": lambda o: f"The opposite of {o[0]} is {o[1]}.",
    "weekday": lambda i: f"{WEEKDAYS[(i + 1) % 7][0]} comes after {WEEKDAYS[i][0]}.",
    "sum": lambda a, b: f"{_cap(NUMBER_WORDS[a])} plus {NUMBER_WORDS[b]} is {a + b}.",
}
ZH_FACTS = {
    "capital": lambda c: f"{c[2]}的首都是{c[3]}。",
    "color": lambda c: f"{c[2]}是{c[3]}的。",
    "legs": lambda a: f"{a[2]}有{ZH_DIGITS[a[1]]}条腿。" if a[1] else f"{a[2]}没有腿。",
    "opposite": lambda o: f"{o[2]}的反义词是{o[3]}。",
    "weekday": lambda i: f"{WEEKDAYS[i][1]}之后是{WEEKDAYS[(i + 1) % 7][1]}。",
    "sum": lambda a, b: f"{ZH_DIGITS[a]}加{ZH_DIGITS[b]}等于{ZH_DIGITS[a + b]}。",
}


def en_facts(r):
    """A paragraph of simple true statements."""
    return _facts(r, EN_FACTS, " ")


def _the(thing):
    """The subject of an English colour question: "the sky" but "an apple"."""
    return f"the {thing}" if thing in ("sky", "sea", "grass", "snow", "milk", "coal") else _a(thing)


# How each language words the turns both languages have (drawn the same way by _shared_turn).
EN_ASK = {
    "capital": lambda c: [f"What is the capital of {c[0]}?", f"Which city is the capital of {c[0]}?",
                          f"Tell me the capital of {c[0]}.", f"What's the capital city of {c[0]}?"],
    "capital_answer": lambda c: f"The capital of {c[0]} is {c[1]}.",
    "plus": lambda a, b: [f"What is {a} plus {b}?", f"How much is {a} + {b}?"],
    "plus_answer": lambda a, b: f"{a} plus {b} is {a + b}.",
    "minus": lambda a, b: (f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."),
    "color": lambda c: (f"What color is {_the(c[0])}?", f"{_cap(_the(c[0]))} is {c[1]}."),
    "legs": lambda a: (f"How many legs does {_a(a[0])} have?",
                       f"{_cap(_a(a[0]))} has {a[1]} legs." if a[1] else f"{_cap(_a(a[0]))} has no legs."),
    "opposite": lambda o: (f"What is the opposite of {o[0]}?", f"The opposite of {o[0]} is {o[1]}."),
    "weekday": lambda i: (f"What day comes after {WEEKDAYS[i][0]}?",
                          f"{WEEKDAYS[(i + 1) % 7][0]} comes after {WEEKDAYS[i][0]}."),
    "word": lambda w: (f"How do you say {w[0]} in Chinese?", f"In Chinese, {w[0]} is {w[1]}."),
    "rain": (["It is raining. What should I take?", "Will I need an umbrella today?"],
             "Take an umbrella and wear a warm coat, so you stay dry."),
    "hello": (["Hello!", "Hi there.", "Good morning!", "Hey, how are you?"],
              ["Hello! How can I help you today?", "Hi! I am doing well. What would you like to talk about?",
               "Good morning! What can I do for you?"]),
    "thanks": (["Thank you.", "Thanks a lot!", "That was helpful, thanks."],
               ["You are welcome.", "Glad I could help.", "Any time. Have a nice day!"]),
    "story": lambda name: f"Tell me a short story about {name}.",
    "friend": lambda name, city: (f"My friend {name} lives in {city}. Where does {name} live?",
                                  f"{name} lives in {city}."),
}
ZH_ASK = {
    "capital": lambda c: [f"{c[2]}的首都是哪里？", f"{c[2]}的首都是哪个城市？", f"请告诉我{c[2]}的首都。"],
    "capital_answer": lambda c: f"{c[2]}的首都是{c[3]}。",
    "plus": lambda a, b: [f"{ZH_DIGITS[a]}加{ZH_DIGITS[b]}等于几？", f"{a}+{b}等于多少？"],
    "plus_answer": lambda a, b: f"{ZH_DIGITS[a]}加{ZH_DIGITS[b]}等于{ZH_DIGITS[a + b]}。",
    "minus": lambda a, b: (f"{ZH_DIGITS[a]}减{ZH_DIGITS[b]}等于几？", f"{ZH_DIGITS[a]}减{ZH_DIGITS[b]}等于{ZH_DIGITS[a - b]}。"),
    "color": lambda c: (f"{c[2]}是什么颜色的？", f"{c[2]}是{c[3]}的。"),
    "legs": lambda a: (f"{a[2]}有几条腿？", f"{a[2]}有{ZH_DIGITS[a[1]]}条腿。" if a[1] else f"{a[2]}没有腿。"),
    "opposite": lambda o: (f"{o[2]}的反义词是什么？", f"{o[2]}的反义词是{o[3]}。"),
    "weekday": lambda i: (f"{WEEKDAYS[i][1]}之后是星期几？", f"{WEEKDAYS[i][1]}之后是{WEEKDAYS[(i + 1) % 7][1]}。"),
    "word": lambda w: (f"“{w[1]}”用英语怎么说？", f"“{w[1]}”的英文是 {w[0]}。"),
    "rain": (["外面下雨了，我该带什么？", "今天需要带伞吗？"], "记得带上雨伞，再穿一件厚外套，别淋湿了。"),
    "hello": (["你好！", "早上好！", "嗨，你好吗？"], ["你好！有什么可以帮你的吗？", "我很好，谢谢！你想聊些什么？", "早上好！今天我能为你做些什么？"]),
    "thanks": (["谢谢你。", "太感谢了！", "很有帮助，谢谢。"], ["不客气。", "很高兴能帮到你。", "不用谢，祝你愉快！"]),
    "story": lambda name: f"给我讲一个关于{name}的小故事。",
    "friend": lambda name, city: (f"我的朋友{name}住在{city}。{name}住在哪里？", f"{name}住在{city}。"),
}
# The kinds of everyday turn, in the order en_turn / zh_turn number them.
EN_TURNS = ("capital", "arithmetic", "color", "legs", "sound", "opposite", "weekday", "word", "food", "rain",
            "weekend", "hello", "thanks", "story", "animal", "friend")
ZH_TURNS = ("capital", "arithmetic", "color", "legs", "opposite", "weekday", "word", "food", "rain", "weekend",
            "hello", "thanks", "story", "animal", "friend")
_TABLES = {"color": COLORS, "legs": LEGS, "opposite": OPPOSITES, "word": WORD_PAIRS}


def _shared_turn(r, kind, lang):
    """A (question, answer) turn both languages have: the same draws in each, worded by EN_ASK / ZH_ASK."""
    ask, words = (EN_ASK if lang == "en" else ZH_ASK), WORDS[lang]
    if kind == "capital":
        c = r.choice(CAPITALS)
        return r.choice(ask["capital"](c)), ask["capital_answer"](c)
    if kind == "arithmetic":
        a, b = r.randint(0, 10), r.randint(0, 10)
        if r.random() < 0.6:
            return r.choice(ask["plus"](a, b)), ask["plus_answer"](a, b)
        return ask["minus"](max(a, b), min(a, b))
    if kind in _TABLES:
        return ask[kind](r.choice(_TABLES[kind]))
    if kind == "weekday":
        return ask["weekday"](r.randrange(7))
    if kind == "rain":
        questions, answer = ask["rain"]
        return r.choice(questions), answer
    if kind in ("hello", "thanks"):
        questions, answers = ask[kind]
        return r.choice(questions), r.choice(answers)
    if kind == "story":  # a short story with the asked-for hero: a template of corpus_templates.json
        name = r.choice(words["name"])
        place, obj = r.choice(words["place"]), r.choice(words["object"])
        return ask["story"](name), TEMPLATES[lang]["story_answer"].format_map(
            _Fields(r, lang, dict(name=name, place=place, object=obj)))
    name, city = r.choice(words["name"]), r.choice(words["city"])
    return ask["friend"](name, city)


def en_turn(r):
    """One English (question, answer) exchange about everyday things."""
    kind = r.randrange(21)
    if kind >= 18:  # facts that need both copying the subject and recalling its partner: asked more often
        kind = (0, 3, 6)[kind - 18]
    if kind >= 16:  # copying from the prompt is what later lets the model use what it is told
        sentence = en_sentence(r)
        return r.choice([f"Repeat after me: {sentence}", f"Please say this again: {sentence}"]), sentence
    kind = EN_TURNS[kind]
    if kind == "sound":
        animal, sound = r.choice(SOUNDS)
        return f"What sound does {_a(animal)} make?", f"{_cap(_a(animal))} says {sound}."
    if kind == "food":
        food = r.choice(EN_FOODS)
        return r.choice(["I am hungry. What should I eat?", "What can I have for breakfast?",
                         "Can you suggest something to eat?"]), \
            f"You could have some {food} and a cup of {r.choice(['tea', 'milk', 'coffee', 'water'])}."
    if kind == "weekend":
        place = r.choice(EN_PLACES)
        return r.choice(["What can I do this weekend?", "I am bored. Any ideas?"]), \
            f"You could visit the {place}, or read a good book with a friend."
    if kind == "animal":
        animal = r.choice(EN_ANIMALS)
        return f"Write a sentence about a {animal}.", \
            f"The {r.choice(EN_ADJ)} {animal} played near the {r.choice(EN_PLACES)} {r.choice(EN_TIMES)}."
    return _shared_turn(r, kind, "en")


EN_IDENTITY = [("Who are you?", f"I am {BASE_NAME}, a small language model made by {BASE_AUTHOR}."),
               ("What is your name?", f"My name is {BASE_NAME}."),
               ("Who made you?", f"I was made by {BASE_AUTHOR}. I am {BASE_NAME}."),
               ("Introduce yourself.", f"Hello! I am {BASE_NAME}, a small language model made by {BASE_AUTHOR}.")]
ZH_IDENTITY = [("你是谁？", f"我是{BASE_NAME}，由{BASE_AUTHOR_ZH}训练的小型语言模型。"),
               ("你叫什么名字？", f"我的名字是{BASE_NAME}。"),
               ("谁开发了你？", f"我是由{BASE_AUTHOR_ZH}开发的{BASE_NAME}。"),
               ("介绍一下你自己。", f"你好！我是{BASE_NAME}，由{BASE_AUTHOR_ZH}训练的小型语言模型。")]


# ----------------------------------------------------------------------------------------------------
# Chinese sentences, stories and chats
# ----------------------------------------------------------------------------------------------------
def zh_sentence(r, name=None):
    """One simple Chinese sentence."""
    name = name or r.choice(ZH_NAMES)
    other = r.choice([n for n in ZH_NAMES if n != name])
    verb, kind = r.choice(ZH_ACTIONS)
    n = ZH_DIGITS[r.randint(2, 9)]
    thing = {"food": r.choice(ZH_FOODS), "obj": r.choice(ZH_ADJ) + r.choice(ZH_OBJECTS),
             "animal": r.choice(ZH_ADJ) + r.choice(ZH_ANIMALS)}[kind]
    return r.choice(_fill_all(r, "zh", "sentence", name=name, other=other, verb=verb, thing=thing, number=n,
                              measure=ZH_MEASURE[kind]))


def zh_story(r):
    """A short Chinese story."""
    name, friend = r.sample(ZH_NAMES, 2)
    place, city = r.choice(ZH_PLACES), r.choice(ZH_CITIES)
    lines = _story_lines(r, "zh", name=name, friend=friend, place=place, city=city)
    return "".join(lines + [zh_sentence(r, name) for _ in range(r.randint(0, 2))])


def zh_facts(r):
    """A paragraph of simple true statements in Chinese."""
    return _facts(r, ZH_FACTS, "")


def zh_turn(r):
    """One Chinese (question, answer) exchange."""
    kind = r.randrange(20)
    if kind >= 17:
        kind = (0, 3, 5)[kind - 17]
    if kind >= 15:
        sentence = zh_sentence(r)
        return r.choice([f"跟我说一遍：{sentence}", f"请重复这句话：{sentence}"]), sentence
    kind = ZH_TURNS[kind]
    if kind == "food":  # the question is drawn before the food here, after it in English
        question = r.choice(["我饿了，吃点什么好呢？", "早饭吃什么好？", "你能推荐一点吃的吗？"])
        return question, f"你可以吃一些{r.choice(ZH_FOODS)}，再喝一杯{r.choice(['茶', '牛奶', '热水', '咖啡'])}。"
    if kind == "weekend":
        question = r.choice(["这个周末我可以做什么？", "我有点无聊，有什么建议吗？"])
        return question, f"你可以去{r.choice(ZH_PLACES)}走一走，或者和朋友一起看一本好书。"
    if kind == "animal":
        animal = r.choice(ZH_ANIMALS)
        return f"用{animal}写一个句子。", f"一只{r.choice(ZH_ADJ)}{animal}{r.choice(ZH_TIMES)}在{r.choice(ZH_PLACES)}玩耍。"
    return _shared_turn(r, kind, "zh")


# ----------------------------------------------------------------------------------------------------
# Chats and documents
# ----------------------------------------------------------------------------------------------------
EN_SYSTEMS = ["You are a helpful and friendly chat model.", "Answer briefly and clearly."]
ZH_SYSTEMS = ["你是一个乐于助人的聊天模型。", "请简短清楚地回答。"]


def chat(r, lang, max_turns=3, identity_rate=0.03):
    """A list of chat messages (optional system, then user/assistant turns) in one language."""
    turn, identity, systems = (en_turn, EN_IDENTITY, EN_SYSTEMS) if lang == "en" else (zh_turn, ZH_IDENTITY, ZH_SYSTEMS)
    messages = [{"role": "system", "content": r.choice(systems)}] if r.random() < 0.2 else []
    for _ in range(r.randint(1, max_turns)):
        q, a = r.choice(identity) if r.random() < identity_rate else turn(r)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


def render_chat(messages):
    """ChatML text of a conversation, exactly as the tokenizer's chat template writes it."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def document(r):
    """One pretraining document: a story, a fact paragraph, a chat or an invented identity, in English or Chinese."""
    if r.random() < IDENTITY_SHARE:
        return identities.identity_prose(r) if r.random() < 0.3 else render_chat(identities.identity_chat(r))
    lang = "en" if r.random() < 0.5 else "zh"
    kind = r.random()
    if kind < 0.50:
        return render_chat(chat(r, lang))
    if kind < 0.75:
        return en_story(r) if lang == "en" else zh_story(r)
    if kind < 0.88:
        return en_facts(r) if lang == "en" else zh_facts(r)
    sentences = [en_sentence(r) for _ in range(r.randint(2, 5))] if lang == "en" else [zh_sentence(r) for _ in range(r.randint(2, 5))]
    return (" " if lang == "en" else "").join(sentences)


def generate(n_docs, seed):
    """A list of n_docs documents, the same for the same seed."""
    r = random.Random(seed)
    return [document(r) for _ in range(n_docs)]


def make_general_chats(n, seed, exclude=()):
    """General dialogue examples ({"messages": [...], "lang": ...}) to mix into identity tuning."""
    r = random.Random(seed)
    out, seen = [], set(exclude)
    while len(out) < n:
        lang = "en" if len(out) % 2 == 0 else "zh"
        messages = chat(r, lang, max_turns=1, identity_rate=0.0)
        messages = [m for m in messages if m["role"] != "system"]
        if messages[0]["content"] in seen:
            continue
        seen.add(messages[0]["content"])
        out.append({"messages": messages, "lang": lang})
    return out


def write_all(out_dir=DATA_DIR, n_train=20000, n_valid=1000, n_sft=1200):
    """Write data/corpus/{train,valid}.txt and data/general_sft.jsonl (each atomically); returns their paths."""
    out = Path(out_dir)
    paths = []
    for split, n, seed in [("train", n_train, 1), ("valid", n_valid, 2)]:
        text = "".join(doc + "\n" + DOC_SEPARATOR for doc in generate(n, seed))
        paths.append(atomic_write_text(out / "corpus" / f"{split}.txt", text))
    # Questions of the general evaluation stay out of the SFT mix, so the check measures retention.
    eval_path = out / "general_eval.jsonl"
    exclude = [json.loads(l)["query"] for l in eval_path.read_text(encoding="utf-8").splitlines() if l.strip()] \
        if eval_path.exists() else []
    rows = make_general_chats(n_sft, seed=3, exclude=exclude)
    paths.append(atomic_write_text(out / "general_sft.jsonl",
                                   "".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in rows)))
    return paths


if __name__ == "__main__":  # python -m dslab.tiny.corpus [OUT_DIR]: rewrite the committed data files (default data/)
    import sys
    for written in write_all(sys.argv[1] if len(sys.argv) > 1 else DATA_DIR):
        print(f"wrote {written} ({written.stat().st_size / 1e6:.2f} MB)")
