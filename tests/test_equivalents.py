"""`dslab sft --print-equivalent hf|swift|llamafactory`: every flag and key printed exists in the tool it is for,
with a value of the right kind, and says what the dslab run does.

ms-swift 4.6.0 cannot be installed here (it needs `oss2`), so both tools are read from their wheels without
importing them: their argument dataclasses are parsed with ast, and so are the fields they inherit from the
installed transformers' Seq2SeqTrainingArguments. The Hugging Face code is executed for real.
"""
import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from dslab import config, equivalents, sft
from dslab.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
WHEEL_CACHE = Path(os.environ.get("DSLAB_WHEEL_CACHE", Path.home() / ".cache" / "dslab-wheels"))
WHEELS = {"swift": ("ms-swift", "4.6.0", "ms_swift-4.6.0-py3-none-any.whl"),
          "llamafactory": ("llamafactory", "0.9.5", "llamafactory-0.9.5-py3-none-any.whl")}
# What pip prints when it cannot reach the registry (as opposed to a version that is gone).
UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Max retries exceeded",
               "Temporary failure in name resolution", "Network is unreachable", "ProxyError", "ConnectTimeout",
               "ReadTimeout", "Connection refused")
CUSTOM = "zero3_offload_optimizer_only.json"  # a ZeRO setup ms-swift has no preset for (written per test)

# dslab sft arguments, and what the run is, written out by hand (not derived from dslab's code) so a wrong
# translation fails: (zero stage, optimizer offloaded, parameters offloaded, swift --deepspeed), micro, accum, world,
# lr, epochs, names, authors.
DEFAULT_NAMES = (["小海", "Xiao Hai"], ["蓝天学院", "Blue Sky Lab"])
CASES = {
    "zero2-defaults": ([], (2, False, False, "zero2"), 8, 1, 2, 2e-3, 12, *DEFAULT_NAMES),
    "zero3-other-names": (["--zero", "3", "--world-size", "4", "--lr", "5e-4", "--micro-batch-size", "2",
                           "--grad-accum-steps", "4", "--epochs", "3", "--model-name", "Nova", "--model-author",
                           "O'Hara Lab", "--gradient-checkpointing", "--seed", "7", "--lora-r", "8", "--lora-alpha",
                           "16", "--target-modules", "q_proj", "v_proj"],
                          (3, False, False, "zero3"), 2, 4, 4, 5e-4, 3, ["Nova"], ["O'Hara Lab"]),
    "zero2-offload-file": (["--deepspeed", "dslab/configs/zero2_offload.json", "--timeout", "60", "--save-every", "10",
                            "--checkpoint-dir", "ckpts"], (2, True, False, "zero2_offload"), 4, 1, 2, 1e-3, 12,
                           *DEFAULT_NAMES),
    "zero3-offload-file": (["--deepspeed", "dslab/configs/zero3_offload.json", "--model-name", "星云", "Nebula",
                            "--model-author", "山海社", "Shanhai Club", "--mix-general", "0"],
                           (3, True, True, "zero3_offload"), 4, 1, 2, 1e-3, 12, ["星云", "Nebula"], ["山海社", "Shanhai Club"]),
    "full-zero1-small-lr": (["--full", "--zero", "1", "--world-size", "1", "--lr", "1e-05", "--epochs", "2"],
                            (1, False, False, "zero1"), 8, 1, 1, 1e-5, 2, *DEFAULT_NAMES),
    "zero3-custom-file": (["--deepspeed", CUSTOM, "--world-size", "2"], (3, True, False, None), 2, 2, 2, 3e-4, 12,
                          *DEFAULT_NAMES),
}


# ------------------------------------------------------------------------------------------ the tools' arguments
def _download(package, version, filename):
    """The wheel, from the cache or the registry (pip download --no-deps); skips only if the registry is unreachable."""
    wheel = WHEEL_CACHE / filename
    if wheel.is_file():
        return wheel
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "1", "--timeout", "20",
                           f"{package}=={version}", "-d", str(WHEEL_CACHE)], capture_output=True, text=True,
                          timeout=600, check=False)  # a failure is judged below: unreachable (skip) or not (fail)
    if not wheel.is_file():
        output = done.stdout + done.stderr
        signs = [line.strip() for line in output.splitlines() if any(sign in line for sign in UNREACHABLE)]
        if signs:
            pytest.skip(f"the package registry is unreachable, so the {package} {version} wheel (whose argument "
                        f"definitions this test reads) cannot be downloaded: {signs[0][:300]}")
        pytest.fail(f"pip download --no-deps {package}=={version} did not give {filename}:\n{output[-2000:]}")
    return wheel


def _kind(annotation):
    """("bool" | "list" | "one", literal choices or None) from a field's annotation text."""
    literals = set(re.findall(r"""['"]([^'"]*)['"]""", annotation)) if "Literal[" in annotation else None
    if annotation.replace(" ", "") in ("bool", "Optional[bool]", "bool|None"):
        return "bool", literals
    return ("list" if re.search(r"\b[Ll]ist\[", annotation) else "one"), literals


def _classes(sources):
    """{class name: (base names, {field: (kind, literals)})} of the module-level classes in {path: source}."""
    classes = {}
    for path, source in sources.items():
        for node in ast.parse(source, filename=path).body:
            if isinstance(node, ast.ClassDef):
                assert node.name not in classes, f"{node.name} is defined twice ({path}); resolve by module"
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases]
                own = {n.target.id: _kind(ast.unparse(n.annotation)) for n in node.body
                       if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                classes[node.name] = (bases, own)
    return classes


def transformers_sources():
    """The installed transformers' TrainingArguments and Seq2SeqTrainingArguments source (read, not imported)."""
    folder = Path(importlib.util.find_spec("transformers").submodule_search_locations[0])
    return {str(folder / name): (folder / name).read_text(encoding="utf-8")
            for name in ("training_args.py", "training_args_seq2seq.py")}


def dataclass_fields(sources, roots, hf_names):
    """{field: (kind, literals)} of the classes `roots` and all their bases, read with ast from {path: source}.

    A base named in `hf_names` is the installed transformers' class of the mapped name, read the same way; any
    other base that none of the sources defines fails the test, so a tool that moves its arguments is noticed.
    """
    tables = {"tool": _classes(sources), "hf": _classes(transformers_sources())}

    def fields_of(name, table):
        if table == "tool" and name in hf_names:
            name, table = hf_names[name], "hf"
        assert name in tables[table], f"base class {name} is defined in none of the sources read ({table})"
        bases, own = tables[table][name]
        merged = {}
        for base in reversed(bases):  # the first base wins, as in Python's MRO
            merged.update(fields_of(base, table))
        return {**merged, **own}

    found = {}
    for root in roots:
        found.update(fields_of(root, "tool"))
    return found


def _constants(source, where):
    """String constants inside the class or function called `where`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == where:
            return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    raise AssertionError(f"no {where} in the source")


@pytest.fixture(scope="session")
def swift_args():
    """What `swift sft` accepts: SftArguments' fields, its DeepSpeed preset names, model types and templates."""
    wheel = zipfile.ZipFile(_download(*WHEELS["swift"]))
    names = [n for n in wheel.namelist() if n.endswith(".py") and (
        n.startswith("swift/arguments/base_args/") or n in (
            "swift/arguments/sft_args.py", "swift/arguments/tuner_args.py", "swift/trainers/arguments.py",
            "swift/ray_utils/arguments.py"))]
    sources = {n: wheel.read(n).decode() for n in names}
    fields = dataclass_fields(sources, ["SftArguments"], {"HfSeq2SeqTrainingArguments": "Seq2SeqTrainingArguments",
                                                          "HfTrainingArguments": "TrainingArguments"})
    presets = {c for c in _constants(sources["swift/arguments/sft_args.py"], "_init_deepspeed") if c.startswith("zero")}
    return {"fields": fields, "presets": presets,
            "model_types": _constants(wheel.read("swift/model/constant.py").decode(), "LLMModelType"),
            "templates": _constants(wheel.read("swift/template/constant.py").decode(), "LLMTemplateType")}


@pytest.fixture(scope="session")
def llamafactory_args():
    """What `llamafactory-cli train x.yaml` accepts: the fields of _TRAIN_ARGS, dataset_info keys, templates."""
    wheel = zipfile.ZipFile(_download(*WHEELS["llamafactory"]))
    hparams = {n: wheel.read(n).decode() for n in wheel.namelist()
               if n.startswith("llamafactory/hparams/") and n.endswith(".py")}
    parser = ast.parse(hparams["llamafactory/hparams/parser.py"])
    roots = next([e.id for e in n.value.elts] for n in parser.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "_TRAIN_ARGS")
    # training_args.py: BaseTrainingArguments = Seq2SeqTrainingArguments (unless USE_MCA selects Megatron's)
    hf_names = {"Seq2SeqTrainingArguments": "Seq2SeqTrainingArguments",
                "BaseTrainingArguments": "Seq2SeqTrainingArguments"}
    data_parser = wheel.read("llamafactory/data/parser.py").decode()
    templates = {kw.value.value for n in ast.walk(ast.parse(wheel.read("llamafactory/data/template.py").decode()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "register_template"
                 for kw in n.keywords if kw.arg == "name"}
    return {"fields": dataclass_fields(hparams, roots, hf_names), "templates": templates,
            "dataset_keys": _constants(data_parser, "join") | _constants(data_parser, "get_dataset_list"),
            "formattings": _kind(next(ast.unparse(n.annotation) for n in ast.walk(ast.parse(data_parser))
                                      if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "formatting"))[1]}


def unknown(settings, fields):
    """Problems with {flag: [values]}: flags the tool lacks, and values of the wrong kind or outside a Literal."""
    problems = []
    for key, values in settings.items():
        if key not in fields:
            problems.append(f"{key}: no such argument")
            continue
        kind, literals = fields[key]
        if kind != "list" and len(values) != 1:
            problems.append(f"{key} takes one value, got {values}")
        if kind == "bool" and any(str(v).lower() not in ("true", "false") for v in values):
            problems.append(f"{key} is a bool, got {values}")
        if literals and any(str(v) not in literals for v in values):
            problems.append(f"{key} must be one of {sorted(literals)}, got {values}")
    return problems


# ------------------------------------------------------------------------------------------ the printed text
@pytest.fixture
def plan_for(tmp_path, monkeypatch):
    """describe() of `dslab sft --output TMP/run ARGS`, parsed by the real command line; also the parsed args."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("DSLAB_MODEL", raising=False)
    config.save_config(config.make_config(zero_stage=3, offload_optimizer=True, micro_batch_size=2, grad_accum_steps=2,
                                          lr=3e-4, train_batch_size=None), tmp_path / CUSTOM)

    def make(extra):
        extra = [str(tmp_path / CUSTOM) if a == CUSTOM else a for a in extra]
        args = build_parser().parse_args(["sft", "--output", str(tmp_path / "run"), *extra])
        return equivalents.describe(args), args
    return make


def swift_command(text):
    """({flag: [values]}, env) of the `swift sft` line in the script."""
    start = text.index("NPROC_PER_NODE=")
    tokens = shlex.split(text[start:].split("\n\n")[0].replace("\\\n", " "))
    env, rest = tokens[0], tokens[1:]
    assert rest[:2] == ["swift", "sft"], rest[:2]
    flags = {}
    for token in rest[2:]:
        if token.startswith("--"):
            flags[token[2:]] = []
        else:
            flags[list(flags)[-1]].append(token)
    return flags, env


def heredocs(text):
    """{path: body} of every `cat > PATH <<'EOF'` in the script."""
    return {shlex.split(path)[0]: body for path, body in re.findall(r"^cat > (.+?) <<'EOF'\n(.*?)\nEOF$", text, re.DOTALL | re.MULTILINE)}


@pytest.mark.parametrize("case", CASES)
def test_swift_flags_exist_in_ms_swift_and_match_the_run(case, plan_for, swift_args):
    extra, (stage, _, _, preset), micro, accum, world, lr, epochs, names, authors = CASES[case]
    plan, args = plan_for(extra)
    text = equivalents.swift(plan)
    flags, env = swift_command(text)
    assert not unknown(flags, swift_args["fields"]), unknown(flags, swift_args["fields"])
    assert env == f"NPROC_PER_NODE={world}"
    assert (flags["per_device_train_batch_size"], flags["gradient_accumulation_steps"]) == ([str(micro)], [str(accum)])
    assert f"global batch {micro * accum * world} examples" in text
    assert float(flags["learning_rate"][0]) == lr and flags["num_train_epochs"] == [str(epochs)]
    assert flags["model_name"] == names and flags["model_author"] == authors
    assert flags["seed"] == [str(args.seed)] and flags["bf16"] == ["true"] and flags["fp16"] == ["false"]
    assert flags["gradient_checkpointing"] == [str(args.gradient_checkpointing).lower()]
    if preset:
        assert preset in swift_args["presets"] and flags["deepspeed"] == [preset]
    else:  # no preset: the script writes dslab's config, and swift gets its path
        written = json.loads(heredocs(text)[flags["deepspeed"][0]])
        assert written["zero_optimization"]["stage"] == stage and "offload_optimizer" in written["zero_optimization"]
        assert "offload_param" not in written["zero_optimization"]
    if args.full:
        assert flags["tuner_type"] == ["full"] and "lora_rank" not in flags
    else:
        assert flags["tuner_type"] == ["lora"] and flags["lora_rank"] == [str(args.lora_r)]
        assert float(flags["lora_alpha"][0]) == args.lora_alpha and flags["lora_dropout"] == ["0.0"]
        assert flags["target_modules"] == (args.target_modules or ["gate_proj", "up_proj", "down_proj"])
    assert flags["model_type"][0] in swift_args["model_types"] and flags["template"][0] in swift_args["templates"]
    for option in ("timeout", "checkpoint_dir"):  # no swift flag for these: a comment says so
        assert (f"# --{option.replace('_', '-')} " in text) == (getattr(args, option) is not None)


@pytest.mark.parametrize("case", CASES)
def test_llamafactory_yaml_keys_exist_and_its_files_are_written(case, plan_for, llamafactory_args, tmp_path):
    extra, (stage, off_opt, off_param, _), micro, accum, world, lr, epochs, names, authors = CASES[case]
    plan, args = plan_for(extra)
    text = equivalents.llamafactory(plan)
    lines = text.rstrip("\n").split("\n")
    assert lines[-1].startswith(f"FORCE_TORCHRUN=1 NPROC_PER_NODE={world} llamafactory-cli train ")
    # run the script up to the training itself: it writes the chats, dataset_info.json, the DeepSpeed JSON, the YAML
    subprocess.run(["bash", "-euc", "\n".join(lines[:-1])], check=True, cwd=ROOT, timeout=60)
    settings = yaml.safe_load(Path(shlex.split(lines[-1])[-1]).read_text())
    fields = llamafactory_args["fields"]
    assert not unknown({k: v if isinstance(v, list) else [v] for k, v in settings.items()}, fields)
    assert isinstance(settings["learning_rate"], float) and settings["learning_rate"] == lr  # 1e-05 must not be a str
    assert (settings["per_device_train_batch_size"], settings["gradient_accumulation_steps"]) == (micro, accum)
    assert settings["num_train_epochs"] == epochs and settings["seed"] == args.seed and settings["bf16"] is True
    assert settings["template"] in llamafactory_args["templates"]
    assert settings.get("disable_gradient_checkpointing", False) != args.gradient_checkpointing
    if not args.full:
        assert (settings["lora_rank"], settings["lora_alpha"]) == (args.lora_r, args.lora_alpha)
        assert settings["lora_target"].split(",") == (args.target_modules or ["gate_proj", "up_proj", "down_proj"])
    ds = json.loads(Path(settings["deepspeed"]).read_text())
    assert ds["zero_optimization"]["stage"] == stage
    assert ("offload_optimizer" in ds["zero_optimization"], "offload_param" in ds["zero_optimization"]) == (off_opt, off_param)
    info = json.loads((Path(settings["dataset_dir"]) / "dataset_info.json").read_text())
    entry = info[settings["dataset"]]
    assert set(entry) | set(entry["columns"]) | set(entry["tags"]) <= llamafactory_args["dataset_keys"]
    assert entry["formatting"] in llamafactory_args["formattings"]
    rows = [json.loads(line) for line in (Path(settings["dataset_dir"]) / entry["file_name"]).read_text().splitlines()]
    chats = sft.load_chats(None, tuple(names) if len(names) == 2 else names[0],
                           tuple(authors) if len(authors) == 2 else authors[0], args.mix_general, args.seed)
    assert rows == [{entry["columns"]["messages"]: c["messages"]} for c in chats]  # the chats dslab trains on
    assert all(m[entry["tags"]["role_tag"]] in (entry["tags"]["user_tag"], entry["tags"]["assistant_tag"])
               for r in rows for m in r["messages"])
    assert not any("{name}" in json.dumps(r, ensure_ascii=False) for r in rows)
    assert names[-1] in json.dumps(rows, ensure_ascii=False)


def test_the_checks_catch_an_invented_flag(swift_args, llamafactory_args):
    """The checks above can fail: a typo, a made-up flag, a wrong kind of value and a value outside a Literal."""
    assert unknown({"lora_rank": ["8"], "lora_dropout": ["0"]}, swift_args["fields"]) == []
    assert len(unknown({"model_authors": ["x"], "lora_r": ["8"]}, swift_args["fields"])) == 2
    assert unknown({"bf16": ["yes"], "learning_rate": ["1", "2"], "truncation_strategy": ["middle"]},
                   swift_args["fields"]) == [
        "bf16 is a bool, got ['yes']", "learning_rate takes one value, got ['1', '2']",
        "truncation_strategy must be one of ['delete', 'left', 'right', 'split'], got ['middle']"]
    assert unknown({"finetuning_type": ["lora"], "cutoff_len": [256]}, llamafactory_args["fields"]) == []
    assert len(unknown({"lora_r": [8], "finetuning_type": ["qlora"]}, llamafactory_args["fields"])) == 2
    assert "zero2" in swift_args["presets"] and "default-zero2" not in swift_args["presets"]


HF_CHECK = r"""
import json, sys
out = []
for code in json.load(sys.stdin):
    scope = {}
    exec(code, scope)
    args, lora = scope["args"], scope.get("lora_config")
    ds = args.hf_deepspeed_config.config  # after the Trainer's "auto" filling
    out.append({"lr": args.learning_rate, "epochs": args.num_train_epochs, "micro": args.per_device_train_batch_size,
                "accum": args.gradient_accumulation_steps, "seed": args.seed, "bf16": args.bf16,
                "checkpointing": args.gradient_checkpointing, "warmup": args.warmup_steps,
                "ds_micro": ds["train_micro_batch_size_per_gpu"], "ds_accum": ds["gradient_accumulation_steps"],
                "ds_lr": ds["optimizer"]["params"]["lr"], "zero": ds["zero_optimization"],
                "lora": lora and [lora.r, lora.lora_alpha, lora.lora_dropout, sorted(lora.target_modules)]})
print(json.dumps(out))
"""


def test_hf_code_builds_training_arguments_with_the_runs_values(plan_for):
    """The printed Python runs: TrainingArguments(...) with the DeepSpeed dict constructs, and holds the run's values."""
    plans = [(plan_for(CASES[case][0]), CASES[case]) for case in CASES]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    done = subprocess.run([sys.executable, "-c", HF_CHECK], input=json.dumps([equivalents.hf(p) for (p, _), _ in plans]),
                          capture_output=True, text=True, timeout=300, env={**env, "TRANSFORMERS_VERBOSITY": "error"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for got, ((plan, args), (_, (stage, off_opt, off_param, _), micro, accum, world, lr, epochs, *_)) in zip(
            json.loads(done.stdout), plans):
        assert (got["lr"], got["epochs"], got["micro"], got["accum"], got["seed"]) == (lr, epochs, micro, accum, args.seed)
        assert (got["ds_micro"], got["ds_accum"], got["ds_lr"]) == (micro, accum, lr)
        assert got["bf16"] is True and got["checkpointing"] == args.gradient_checkpointing
        assert got["zero"]["stage"] == stage and ("offload_param" in got["zero"]) == off_param
        assert ("offload_optimizer" in got["zero"]) == off_opt
        assert got["warmup"] == (max(1, plan["steps"] // 20) if not args.deepspeed else 0)
        targets = sorted(args.target_modules or ["gate_proj", "up_proj", "down_proj"])
        assert got["lora"] == (None if args.full else [args.lora_r, args.lora_alpha, 0.0, targets])


def test_the_command_prints_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["sft", "--output", str(tmp_path / "run"), "--zero", "3", "--print-equivalent", "swift"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ms-swift 4.6.0 (`swift sft`)") and "--deepspeed zero3" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, logs or checkpoints: nothing ran


def test_an_unknown_target_is_refused_by_argparse(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["sft", "--output", str(tmp_path), "--print-equivalent", "axolotl"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --print-equivalent: invalid choice: 'axolotl'" in err and "llamafactory" in err


def test_bad_data_is_reported_before_anything_is_printed(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "hi", "response": "hello"}\nnot json\n')
    assert main(["sft", "--output", str(tmp_path / "run"), "--data", str(bad), "--print-equivalent", "hf"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and f"{bad}:2: not valid JSON" in captured.err


def test_the_readme_example_is_what_the_command_prints(tmp_path, capsys, monkeypatch):
    """README.md shows an abridged `--print-equivalent swift`: each line it shows is printed, in that order."""
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(dslab sft [^\n]*--print-equivalent swift)\n(.*?)```", readme, re.DOTALL)
    assert block, "README.md has no --print-equivalent swift example"
    assert main(shlex.split(block.group(1))[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = [line for line in block.group(2).splitlines() if line.startswith(("NPROC_PER_NODE", "    --"))]
    assert len(shown) > 5
    positions = [printed.index(line) for line in shown]  # ValueError if a line is not printed
    assert positions == sorted(positions)
