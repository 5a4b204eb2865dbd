"""The dslab source loads no pickles, runs no shell and no remote code unless the user asks: an ast scan.

Each rule is a function from a parsed module to a list of findings; the negative tests feed every rule a
snippet that breaks it, so a rule that stopped finding anything would fail here too.
"""
import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dslab"


def _dotted(node):
    """'torch.load' for the expression torch.load, 'load' for a bare name, None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _imported_names(tree):
    """{local name: 'module.name'} for every `from module import name [as local]` in the module."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
    return names


def _calls(tree):
    """(call node, full dotted name of what is called, with import aliases resolved) for every call."""
    aliases = _imported_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name:
                head, _, rest = name.partition(".")
                name = aliases.get(head, head) + (f".{rest}" if rest else "")
            yield node, name


def _keyword(call, name):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node, value):
    return isinstance(node, ast.Constant) and node.value is value


def _where(node, message):
    return f"line {node.lineno}: {message}"


# --------------------------------------------------------------------------- the rules

def torch_load_without_weights_only(tree):
    """torch.load unpickles arbitrary objects unless weights_only=True is passed explicitly."""
    found = []
    for call, name in _calls(tree):
        if name in ("torch.load", "torch.serialization.load") and not _is_const(_keyword(call, "weights_only"), True):
            found.append(_where(call, f"{name}(...) without weights_only=True"))
    return found


PICKLE_LOADERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
                  "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "joblib.load",
                  "pandas.read_pickle", "torch.jit.load"}


def pickle_loads(tree):
    """Any pickle-based loader (pickle, dill, joblib, numpy with allow_pickle=True)."""
    found = [_where(call, f"{name}(...) unpickles arbitrary objects") for call, name in _calls(tree)
             if name in PICKLE_LOADERS]
    for call, name in _calls(tree):
        if name in ("numpy.load", "np.load") and not _is_const(_keyword(call, "allow_pickle"), False) \
                and _keyword(call, "allow_pickle") is not None:
            found.append(_where(call, f"{name}(..., allow_pickle=...) may unpickle"))
    return found


def shell_commands(tree):
    """subprocess with shell=True (anything but a literal False), os.system and os.popen run a shell."""
    found = []
    for call, name in _calls(tree):
        shell = _keyword(call, "shell")
        if shell is not None and not _is_const(shell, False):
            found.append(_where(call, f"{name}(..., shell={ast.unparse(shell)}) runs a shell"))
        if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
            found.append(_where(call, f"{name}(...) runs a shell"))
    return found


def remote_code_defaults(tree):
    """trust_remote_code is never a literal True: functions default it to False, CLI flags are store_true
    without default=True, and calls pass it through from a variable (the user's explicit choice) or False."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            pairs += [(a, None) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
            for arg, default in pairs:
                if arg.arg == "trust_remote_code" and not _is_const(default, False):
                    found.append(_where(node, "parameter trust_remote_code must default to False"))
    for call, name in _calls(tree):
        value = _keyword(call, "trust_remote_code")
        if value is not None and not (_is_const(value, False) or isinstance(value, (ast.Name, ast.Attribute))):
            found.append(_where(call, f"{name}(trust_remote_code={ast.unparse(value)}): pass the user's flag through"))
        for kw in call.keywords:  # **{"trust_remote_code": True}
            if kw.arg is None and isinstance(kw.value, ast.Dict):
                for k, v in zip(kw.value.keys, kw.value.values):
                    if isinstance(k, ast.Constant) and k.value == "trust_remote_code" and not _is_const(v, False):
                        found.append(_where(call, "trust_remote_code passed as a literal in **kwargs"))
        flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if name and name.endswith("add_argument") and any("trust-remote-code" in f or "trust_remote_code" in f
                                                          for f in flags):
            action, default = _keyword(call, "action"), _keyword(call, "default")
            if not (isinstance(action, ast.Constant) and action.value == "store_true") or \
                    (default is not None and not _is_const(default, False)):
                found.append(_where(call, "--trust-remote-code must be a store_true flag that defaults to False"))
    return found


def weights_not_from_safetensors(tree):
    """Model weights come from safetensors (or from_pretrained, which prefers them): never use_safetensors=False,
    never the pickle-based .bin loaders of transformers/peft."""
    found = []
    for call, name in _calls(tree):
        if _is_const(_keyword(call, "use_safetensors"), False) or _is_const(_keyword(call, "safe_serialization"), False):
            found.append(_where(call, f"{name}(...) opts out of safetensors"))
        if name and name.rpartition(".")[2] in ("load_state_dict_from_url", "load_sharded_checkpoint",
                                                "torch_load", "load_pt_weights"):
            found.append(_where(call, f"{name}(...) reads pickled weights"))
    return found


# from_pretrained of these holds no weights: a tokenizer, a config, a processor. use_safetensors would not apply
# (a tokenizer would even store it in its tokenizer_config.json).
NO_WEIGHTS = ("Tokenizer", "Config", "Processor", "FeatureExtractor")


def model_loads_without_safetensors_only(tree):
    """A transformers model's from_pretrained falls back to pickled pytorch_model.bin when a folder has no
    safetensors file; use_safetensors=True makes it fail instead. Every weights-loading from_pretrained passes it.
    PeftModel.from_pretrained is the exception: peft reads adapter_model.safetensors first and its only fallback
    is torch.load(weights_only=True), which unpickles no code (and dslab checks adapters with read_adapter)."""
    found = []
    for call, name in _calls(tree):
        if not name or not name.endswith(".from_pretrained"):
            continue
        owner = name.split(".")[-2]
        if owner == "PeftModel" or any(word in owner for word in NO_WEIGHTS):
            continue
        if not _is_const(_keyword(call, "use_safetensors"), True):
            found.append(_where(call, f"{name}(...) without use_safetensors=True may unpickle a .bin"))
    return found


def _innermost_functions(tree):
    """{id(call): the innermost def around it} for every call inside a function (ast.walk goes outer to inner)."""
    owner = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    owner[id(sub)] = node
    return owner


def remote_code_not_from_a_false_default(tree):
    """trust_remote_code=<name> in a from_pretrained call must be a parameter of the calling function that
    defaults to False (the caller's explicit opt-in), whatever the parameter is called."""
    found, owner = [], _innermost_functions(tree)
    for call, name in _calls(tree):
        value = _keyword(call, "trust_remote_code")
        if not (name and name.endswith(".from_pretrained") and isinstance(value, ast.Name)):
            continue
        func = owner.get(id(call))
        args = func.args if func else None
        params = {}
        if args:
            positional = args.posonlyargs + args.args
            params.update({a.arg: d for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)})
            params.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults)})
        if not _is_const(params.get(value.id), False):
            found.append(_where(call, f"trust_remote_code={value.id}: not a parameter of the caller that defaults to "
                                      "False"))
    return found


RULES = [torch_load_without_weights_only, pickle_loads, shell_commands, remote_code_defaults,
         weights_not_from_safetensors, model_loads_without_safetensors_only,
         remote_code_not_from_a_false_default]


def scan_source(source, rules=RULES):
    tree = ast.parse(textwrap.dedent(source))
    return [f"{rule.__name__}: {finding}" for rule in rules for finding in rule(tree)]


def _package_files():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10 and (PACKAGE / "__init__.py") in files  # the scan really sees the package
    return files


# --------------------------------------------------------------------------- the package passes every rule

@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_package_source_passes(rule):
    problems = []
    for path in _package_files():
        for finding in rule(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            problems.append(f"{path.relative_to(PACKAGE.parent)} {finding}")
    assert not problems, f"{rule.__doc__}\n" + "\n".join(problems)


def test_the_package_offers_remote_code_only_as_an_opt_in():
    """The pass-through rules above are not vacuous: dslab's model and tokenizer loads do take the caller's
    trust_remote_code (a parameter defaulting to False, checked by remote_code_not_from_a_false_default)."""
    opt_ins = []
    for path in _package_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        opt_ins += [f"{path.name}:{call.lineno}" for call, name in _calls(tree) if name
                    and name.endswith(".from_pretrained") and isinstance(_keyword(call, "trust_remote_code"), ast.Name)]
    assert len(opt_ins) >= 2, f"expected the model and the tokenizer load to take the opt-in, found {opt_ins}"


def test_the_opt_in_check_catches_a_true_default_under_another_name():
    bad = ast.parse("def load(p, trust=True):\n    return AutoModel.from_pretrained(p, trust_remote_code=trust)\n"
                    "def outer(p, allow=False):\n    def inner():\n"
                    "        return M.from_pretrained(p, trust_remote_code=x)\n")
    assert [f.split(":")[0] for f in remote_code_not_from_a_false_default(bad)] == ["line 2", "line 5"]
    good = ast.parse("def load(p, *, allow=False):\n"
                     "    return AutoTokenizer.from_pretrained(p, trust_remote_code=allow)")
    assert remote_code_not_from_a_false_default(good) == []


def test_the_base_model_folder_holds_no_pickled_weights():
    from dslab.models import loading

    assert sorted(p.name for p in Path(loading.DEFAULT_MODEL_DIR).glob("*.bin")) == []
    assert list(Path(loading.DEFAULT_MODEL_DIR).glob("*.safetensors"))


# --------------------------------------------------------------------------- each rule catches what it should

BAD = {
    torch_load_without_weights_only: [
        "import torch\nstate = torch.load('x.pt')",
        "import torch\nstate = torch.load('x.pt', weights_only=False)",
        "from torch import load\nstate = load('x.pt')",
        "import torch as t\nstate = t.load('x.pt', map_location='cpu')",
    ],
    pickle_loads: [
        "import pickle\nobj = pickle.load(open('f', 'rb'))",
        "from pickle import loads\nobj = loads(b'')",
        "import numpy as np\na = np.load('a.npy', allow_pickle=True)",
        "import joblib\nm = joblib.load('m.joblib')",
    ],
    shell_commands: [
        "import subprocess\nsubprocess.run('ls | wc', shell=True)",
        "import subprocess\nflag = True\nsubprocess.Popen(cmd, shell=flag)",
        "import os\nos.system('rm -rf x')",
        "from subprocess import check_output\ncheck_output('ls', shell=True)",
    ],
    remote_code_defaults: [
        "def load(path, trust_remote_code=True):\n    pass",
        "def load(path, *, trust_remote_code=None):\n    pass",
        "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
        "AutoTokenizer.from_pretrained(p, **{'trust_remote_code': True})",
        "p.add_argument('--trust-remote-code', action='store_true', default=True)",
        "p.add_argument('--trust-remote-code', type=bool, default=False)",
    ],
    weights_not_from_safetensors: [
        "AutoModelForCausalLM.from_pretrained(p, use_safetensors=False)",
        "model.save_pretrained(out, safe_serialization=False)",
    ],
    model_loads_without_safetensors_only: [
        "from transformers import AutoModelForCausalLM\nm = AutoModelForCausalLM.from_pretrained(path)",
        "import transformers\nm = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=dt)",
        "m = model_class.from_pretrained(path, use_safetensors=None)",
    ],
    remote_code_not_from_a_false_default: [
        "def load(p, trust=True):\n    return AutoModel.from_pretrained(p, trust_remote_code=trust)",
        "def load(p):\n    trust = True\n    return AutoTokenizer.from_pretrained(p, trust_remote_code=trust)",
        "allow = True\nAutoTokenizer.from_pretrained(p, trust_remote_code=allow)",
    ],
}

GOOD = {
    torch_load_without_weights_only: ["import torch\nstate = torch.load('x.pt', weights_only=True)"],
    pickle_loads: ["import json\nobj = json.load(open('f'))", "import numpy as np\na = np.load('a.npy')"],
    shell_commands: ["import subprocess\nsubprocess.run(['ls', '-l'])",
                     "import subprocess\nsubprocess.run(['ls'], shell=False)"],
    remote_code_defaults: [
        "def load(path, trust_remote_code=False):\n    return M.from_pretrained(path, trust_remote_code=trust_remote_code)",
        "load(args.model, trust_remote_code=args.trust_remote_code)",
        "p.add_argument('--trust-remote-code', action='store_true', help='off by default')",
    ],
    weights_not_from_safetensors: ["AutoModelForCausalLM.from_pretrained(p, use_safetensors=True)"],
    model_loads_without_safetensors_only: [
        "AutoModelForCausalLM.from_pretrained(p, dtype=dt, use_safetensors=True)",
        "AutoTokenizer.from_pretrained(p)", "AutoConfig.from_pretrained(p)",
        "PeftModel.from_pretrained(base, adapter_dir)",
    ],
    remote_code_not_from_a_false_default: [
        "def load(p, *, opt_in=False):\n    return AutoModel.from_pretrained(p, trust_remote_code=opt_in)",
        "def load(p, trust_remote_code=False):\n"
        "    return AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)",
    ],
}


@pytest.mark.parametrize("rule, source", [(r, s) for r, sources in BAD.items() for s in sources],
                         ids=lambda v: v.__name__ if callable(v) else "")
def test_rule_catches_a_violation(rule, source):
    assert rule(ast.parse(source)), f"{rule.__name__} missed:\n{source}"


@pytest.mark.parametrize("rule, source", [(r, s) for r, sources in GOOD.items() for s in sources],
                         ids=lambda v: v.__name__ if callable(v) else "")
def test_rule_accepts_the_safe_form(rule, source):
    assert rule(ast.parse(source)) == []


def test_every_rule_has_negative_examples():
    assert set(BAD) == set(RULES) == set(GOOD)


def test_scan_source_names_rule_and_line():
    found = scan_source("""
        import subprocess, torch
        x = 1
        torch.load('a.pt')
        subprocess.call('make', shell=True)
    """)
    assert found == ["torch_load_without_weights_only: line 4: torch.load(...) without weights_only=True",
                     "shell_commands: line 5: subprocess.call(..., shell=True) runs a shell"]
