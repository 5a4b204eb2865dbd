"""The kit's byte-level BPE tokenizer, with every common Chinese character as one token.

Why: a byte-level BPE trained on a small corpus learns merges for the frequent Latin words and for a few
hundred Chinese characters; every other character (3 bytes in UTF-8) is then 2-3 byte tokens, and a
small model that must produce them in the right order after fine-tuning emits half-characters (U+FFFD).
So Chinese is handled apart from the merges the trainer learns:
  - the pre-tokenizer isolates each CJK character (and CJK punctuation), so a character never merges
    with its neighbours and a Latin name inside a Chinese sentence stays a word of its own;
  - every character of GB2312 (levels 1 and 2: the 6,763 characters of everyday and most name text)
    and every CJK character of the kit's corpus and data gets two merges of its own, placed first:
    (byte 1, byte 2) and (bytes 1-2, byte 3), so it always encodes to exactly one token;
  - the BPE trainer spends the rest of the vocabulary on everything else (English, digits, markup).
Characters outside that set still encode, as 2-3 tokens; `coverage` reports how much of a text is covered.
"""
import json

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
# CJK radicals, symbols and punctuation, kana, bopomofo, unified ideographs (+ extension A), compatibility
# ideographs, vertical and full-width forms, and the supplementary ideograph planes.
_CJK_RANGES = [(0x2E80, 0x2FDF), (0x3000, 0x303F), (0x3040, 0x30FF), (0x3100, 0x312F), (0x31A0, 0x31FF),
               (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFE30, 0xFE4F), (0xFF00, 0xFFEF),
               (0x20000, 0x3134F)]
# Written with the characters themselves: Python's re and the tokenizers library's regex engine read them
# alike (they disagree on escapes such as \U00020000).
CJK_CHAR = "[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _CJK_RANGES) + "]"
HANZI_CHAR = "[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _CJK_RANGES[5:]) + "]"  # ideographs only
# ChatML, as Qwen2 writes it, without a default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def gb2312_hanzi(level):
    """The Chinese characters of GB2312 level 1 (3,755 most common, by pinyin) or level 2 (3,008 more)."""
    rows = range(16, 56) if level == 1 else range(56, 88)
    chars = []
    for row in rows:
        for cell in range(1, 95):
            try:
                chars.append(bytes([0xA0 + row, 0xA0 + cell]).decode("gb2312"))
            except UnicodeDecodeError:  # the few unassigned cells at the end of a row
                pass
    return chars


def is_cjk(char):
    """True for a character the pre-tokenizer isolates (a CJK character or CJK punctuation)."""
    import re
    return re.fullmatch(CJK_CHAR, char) is not None


def byte_symbols():
    """The byte -> printable character table of byte-level BPE (GPT-2's): printable Latin-1 bytes stand for
    themselves, the other 68 bytes are shifted to U+0100 and up, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def char_merges(chars):
    """New vocabulary entries and merges that make each character of `chars` (3- or 4-byte UTF-8) one token."""
    sym = byte_symbols()
    tokens, merges, seen = [], [], set()
    for ch in chars:
        pieces = [sym[b] for b in ch.encode("utf-8")]
        left = pieces[0]
        for piece in pieces[1:]:
            merged = left + piece
            if merged not in seen:
                seen.add(merged)
                tokens.append(merged)
                merges.append((left, piece))
            left = merged
    return tokens, merges


def required_chars(texts, gb2312=True):
    """GB2312's characters (unless gb2312=False) plus every isolated (CJK) character of `texts`, in a stable order."""
    import re
    chars = dict.fromkeys(gb2312_hanzi(1) + gb2312_hanzi(2) if gb2312 else [])
    for text in texts:
        chars.update(dict.fromkeys(re.findall(CJK_CHAR, text)))
    return [c for c in chars if len(c.encode("utf-8")) >= 3]


def train_tokenizer(texts, vocab_size=10240, gb2312=True):
    """A byte-level BPE tokenizer (HF fast tokenizer) with ChatML special tokens; see the module docstring.

    texts: a list of strings (the pretraining corpus). vocab_size: the total, Chinese characters included.
    gb2312=False gives only the characters of `texts` a token of their own (small tokenizers for tests).
    """
    import re

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chars = required_chars(texts, gb2312)
    cjk_tokens, cjk_merges = char_merges(chars)
    floor = len(cjk_tokens) + 256 + len(SPECIAL_TOKENS) + 32   # the bytes, the characters and a few merges
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges: the {len(chars)} Chinese characters "
                         f"need {len(cjk_tokens)} entries besides the 256 bytes; use at least {floor + 2000}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CJK_CHAR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(cjk_tokens), special_tokens=SPECIAL_TOKENS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    # The trainer learns from everything but the isolated characters (they get their merges below) and the
    # special-token strings (markup, not text).
    def latin_only():
        for t in texts:
            for s in SPECIAL_TOKENS:
                t = t.replace(s, " ")
            yield re.sub(CJK_CHAR, " ", t)

    tok.train_from_iterator(latin_only(), trainer)
    learned = json.loads(tok.to_str())["model"]
    vocab = dict(learned["vocab"])
    for token in cjk_tokens:
        vocab.setdefault(token, len(vocab))
    # The character merges come first: inside an isolated character they win over any learned merge of
    # continuation bytes, so each listed character always ends as exactly one token.
    merges = cjk_merges + [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok.model = models.BPE(vocab=vocab, merges=merges)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=1024, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def coverage(tokenizer, text):
    """How a tokenizer handles the Chinese characters of `text`: distinct characters, how many are one token,
    and the characters that are not (a dict)."""
    import re
    chars = sorted(set(re.findall(HANZI_CHAR, text)))
    split = [c for c in chars if len(tokenizer(c, add_special_tokens=False)["input_ids"]) != 1]
    return {"chars": len(chars), "single_token": len(chars) - len(split), "split": "".join(split)}
