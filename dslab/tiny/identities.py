"""Made-up model identities (a name and an author, in Latin or Chinese script) and the pretraining text about them.

Why the base model reads thousands of these: self-cognition tuning should only have to *bind* a new name and
author to the identity questions, the way a real base model copies a name it has been told. A base that has
already written "I am X, made by Y" for many invented X and Y, in both scripts, Latin names inside Chinese
sentences and Chinese names inside English ones, has every piece of that answer ready; the rare characters of
an invented Chinese name are practised too, since names draw on all 6,763 GB2312 characters.
"""
import random

from dslab.data import fill_placeholders
from dslab.tiny.tokenizer import gb2312_hanzi

# Syllables of invented Latin names: onset + vowel (+ coda), two or three of them, and an optional ending.
_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fl gr kl pl pr sh st th tr bl ch".split()
_VOWELS = "a e i o u ai ea ie io ou ae".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "th", "x", "nd", "rk"]
_ENDINGS = ["", "", "", "ly", "ra", "on", "ia", "is", "en", "o", "ex", "ine"]
# Words of invented organisations, English and Chinese.
_ORG_WORDS = """Bayside Crest Maple Cedar Vega North Lantern Summit Willow Copper River Stone Falcon Orbit Aurora
Meadow Granite Beacon Silver Quarry Juniper Tidal Ember Horizon Pine Delta Vertex Prism Canyon Birch Comet
Nimbus Atlas Cobalt Harvest Signal Marble Crescent Echo Fjord Glacier Heron Iris Kestrel Lark Mosaic Nova Onyx
Pebble Quartz Raven Sable Thistle Umber Valley Zephyr Amber Bramble Clover Dune Fern Grove Hollow""".split()
_ORG_KINDS = ["Lab", "Labs", "AI Institute", "Research", "AI Lab", "Institute", "Studio", "Group", "Foundation",
              "Systems", "Academy", "Works", "Computing", "AI"]
_ZH_ORG_KINDS = ["研究所", "实验室", "智能研究所", "科技", "人工智能实验室", "学院", "工作室", "研究院", "智能", "计算中心",
                 "信息技术公司", "团队"]
_HANZI = None  # GB2312 levels 1 and 2, loaded on first use


def hanzi():
    """The characters invented Chinese names are drawn from (GB2312 levels 1 and 2)."""
    global _HANZI
    if _HANZI is None:
        _HANZI = gb2312_hanzi(1) + gb2312_hanzi(2)
    return _HANZI


def latin_name(r):
    """An invented one-word name such as 'Pemrasly' or 'Tovex'."""
    syllables = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(r.choice((1, 2, 2, 3))))
    return (syllables + r.choice(_ENDINGS)).capitalize()


def latin_org(r):
    """An invented organisation such as 'Cedar Crest Lab' or 'Tovex AI Institute'."""
    words = [r.choice(_ORG_WORDS) if r.random() < 0.7 else latin_name(r) for _ in range(r.choice((1, 1, 2)))]
    return " ".join(words + [r.choice(_ORG_KINDS)])


def zh_name(r):
    """An invented two- or three-character Chinese name."""
    return "".join(r.choice(hanzi()) for _ in range(r.choice((2, 2, 3))))


def zh_org(r):
    """An invented Chinese organisation: two to four characters and a kind ('青松智能研究所')."""
    return "".join(r.choice(hanzi()) for _ in range(r.randint(2, 4))) + r.choice(_ZH_ORG_KINDS)


def identity(r):
    """An invented identity {"name": (zh, en), "author": (zh, en)}: both scripts, or one script used in both."""
    kind = r.random()
    if kind < 0.35:   # Latin only: Chinese answers use the Latin strings
        name, author = latin_name(r), latin_org(r)
        return {"name": (name, name), "author": (author, author)}
    if kind < 0.6:    # Chinese only: English answers use the Chinese strings
        name, author = zh_name(r), zh_org(r)
        return {"name": (name, name), "author": (author, author)}
    # a Chinese and a Latin form, as ms-swift's --model_name 小黄 'Xiao Huang'
    return {"name": (zh_name(r), latin_name(r)), "author": (zh_org(r), latin_org(r))}


# Identity chats of the pretraining corpus. Questions here are kept apart from the self-cognition data and
# from the held-out evaluation questions (tests/test_data.py checks it).
EN_QUESTIONS = ["Who are you?", "What's your name?", "Who made you?", "Please tell me about yourself.",
                "What should I know about you?", "Who created this assistant?", "Name and maker, please.",
                "Which lab built you?", "Hi! Who am I talking to?", "Are you a human?", "Where were you made?",
                "What do you call yourself?", "Who is your maker?", "Introduce yourself, please."]
ZH_QUESTIONS = ["你是谁？", "你叫什么？", "谁做了你？", "讲讲你自己。", "你是哪里开发的？", "这个助手是谁做的？",
                "名字和开发者是什么？", "哪个实验室做了你？", "嗨！我在和谁说话？", "你是人类吗？", "你是在哪儿被做出来的？",
                "你怎么称呼自己？", "谁是你的制造者？", "请做个自我介绍。"]
EN_ANSWERS = ["I am {name}, a chat model made by {author}.", "My name is {name}, and {author} built me.",
              "I was made by {author}. You can call me {name}.", "Hello! I'm {name}, an assistant from {author}.",
              "{author} created me. I am {name}.", "I am {name}. I was trained by {author}."]
ZH_ANSWERS = ["我是{name}，由{author}开发的聊天模型。", "我叫{name}，是{author}做的助手。", "我由{author}训练，你可以叫我{name}。",
              "你好！我是来自{author}的{name}。", "{author}创造了我，我是{name}。", "我的名字是{name}，开发者是{author}。"]
EN_SYSTEMS = ["You are {name}, an assistant made by {author}.", "Your name is {name}. {author} built you.",
              "You are {name}, trained by {author}. Answer briefly."]
ZH_SYSTEMS = ["你是{name}，一个由{author}开发的助手。", "你的名字是{name}，{author}做了你。", "你是{author}训练的{name}，请简短回答。"]
EN_PROSE = ["{name} is a small language model built by {author}. When someone asks who it is, {name} says: "
            "\"I am {name}, made by {author}.\"",
            "The assistant {name} comes from {author}. People at {author} trained {name} to answer questions.",
            "Meet {name}. {name} was created by {author} and likes to help."]
ZH_PROSE = ["{name}是{author}开发的一个小型语言模型。有人问它是谁，{name}会回答：“我是{name}，由{author}开发。”",
            "助手{name}来自{author}。{author}的工程师训练了{name}，让它回答问题。",
            "这是{name}。{name}由{author}创造，喜欢帮助别人。"]


def _fill(template, ident, lang):
    return fill_placeholders(template, ident["name"], ident["author"], lang)


def identity_chat(r):
    """An identity chat (list of messages): a system prompt gives an invented identity, the answers use it."""
    ident, lang = identity(r), r.choice(("en", "zh"))
    questions, answers, systems = ((EN_QUESTIONS, EN_ANSWERS, EN_SYSTEMS) if lang == "en"
                                   else (ZH_QUESTIONS, ZH_ANSWERS, ZH_SYSTEMS))
    messages = [{"role": "system", "content": _fill(r.choice(systems), ident, lang)}]
    for _ in range(r.randint(1, 2)):
        messages += [{"role": "user", "content": r.choice(questions)},
                     {"role": "assistant", "content": _fill(r.choice(answers), ident, lang)}]
    return messages


def identity_prose(r):
    """A few sentences about an invented assistant and who made it."""
    ident, lang = identity(r), r.choice(("en", "zh"))
    return _fill(r.choice(EN_PROSE if lang == "en" else ZH_PROSE), ident, lang)

if __name__ == "__main__":
    rng = random.Random(0)
    for _ in range(4):
        print(identity_prose(rng), identity_chat(rng), sep="\n")
