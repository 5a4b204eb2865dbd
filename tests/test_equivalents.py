"""`dslab sft --print-equivalent hf|swift|llamafactory`: every flag and key printed exists in the framework it is
for, with a value of the right kind, and says what the dslab run does; the files it writes hold the chats dslab
trains on, as each framework reads them.

The frameworks live in venvs of their own (make swift, make llamafactory), which these tests do not need: both are
read from their wheels without importing them: their argument dataclasses are parsed with ast, and so are the fields
they inherit from the installed transformers' Seq2SeqTrainingArguments. The Hugging Face script is executed up to where
the ranks start. tests/test_frameworks_runs.py runs every printout for real in the frameworks' venvs.
"""
import ast
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from dslab.config import build
from dslab.training import equivalents, sft, sft_plan, sft_settings
from dslab.cli import build_parser, main
from dslab.launch import frameworks

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
    "zero2-offload-file": (["--deepspeed", "dslab/config/presets/zero2_offload.json", "--timeout", "60", "--save-every", "10",
                            "--checkpoint-dir", "ckpts"], (2, True, False, "zero2_offload"), 4, 1, 2, 1e-3, 12,
                           *DEFAULT_NAMES),
    "zero3-offload-file": (["--deepspeed", "dslab/config/presets/zero3_offload.json", "--model-name", "星云", "Nebula",
                            "--model-author", "山海社", "Shanhai Club", "--mix-general", "0"],
                           (3, True, True, "zero3_offload"), 4, 1, 2, 1e-3, 12, ["星云", "Nebula"], ["山海社", "Shanhai Club"]),
    "full-zero1-small-lr": (["--full", "--zero", "1", "--world-size", "1", "--lr", "1e-05", "--epochs", "2"],
                            (1, False, False, "zero1"), 8, 1, 1, 1e-5, 2, *DEFAULT_NAMES),
    "zero3-custom-file": (["--deepspeed", CUSTOM, "--world-size", "2"], (3, True, False, None), 2, 2, 2, 3e-4, 12,
                          *DEFAULT_NAMES),
}


# ------------------------------------------------------------------------------------- the frameworks' arguments
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
    other base that none of the sources defines fails the test, so a framework that moves its arguments is noticed.
    """
    tables = {"framework": _classes(sources), "hf": _classes(transformers_sources())}

    def fields_of(name, table):
        if table == "framework" and name in hf_names:
            name, table = hf_names[name], "hf"
        assert name in tables[table], f"base class {name} is defined in none of the sources read ({table})"
        bases, own = tables[table][name]
        merged = {}
        for base in reversed(bases):  # the first base wins, as in Python's MRO
            merged.update(fields_of(base, table))
        return {**merged, **own}

    found = {}
    for root in roots:
        found.update(fields_of(root, "framework"))
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
    """Problems with {flag: [values]}: flags the framework lacks, and values of the wrong kind or outside a Literal."""
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
    """plan_from_args() of `dslab sft --output TMP/run ARGS`, parsed by the real command line; also the parsed args."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("DSLAB_MODEL", raising=False)
    build.save_config(build.make_config(zero_stage=3, offload_optimizer=True, micro_batch_size=2, grad_accum_steps=2,
                                          lr=3e-4, train_batch_size=None), tmp_path / CUSTOM)

    def make(extra):
        extra = [str(tmp_path / CUSTOM) if a == CUSTOM else a for a in extra]
        args = build_parser().parse_args(["sft", "--output", str(tmp_path / "run"), *extra])
        return sft_plan.plan_from_args(args), args
    return make


def swift_command(text):
    """({flag: [values]}, env) of the `swift sft` command: the script's last line, continued with backslashes."""
    env, argv = frameworks.split_framework_command(equivalents.command_line(text))
    assert argv[:2] == ["swift", "sft"], argv[:2]
    flags = {flag[2:]: words for flag, words in equivalents.command_words(text).items()}
    return flags, " ".join(f"{key}={value}" for key, value in env.items())


def chats_as_set(chats):
    """Chats ({"messages"}) compared as a multiset: each framework draws them in its own order."""
    return sorted(json.dumps(c["messages"], ensure_ascii=False, sort_keys=True) for c in chats)


def dslab_chats(args, names, authors):
    """The chats `dslab sft` trains on for these arguments (names as typed: one, or zh then en)."""
    pair = lambda v: tuple(v) if len(v) == 2 else v[0]  # noqa: E731
    return sft.load_chats(None, pair(names), pair(authors), args.mix_general, args.seed)


def swift_fills(row, names, authors):
    """A row of swift's self-cognition dataset as SelfCognitionPreprocessor fills it (swift/dataset/dataset/llm.py):
    the first name for tag "zh", the second (or the only one) otherwise; then query/response as a chat."""
    name, author = (names * 2)[:2], (authors * 2)[:2]
    pick = 0 if row["tag"] == "zh" else 1
    fill = lambda text: text.replace("{{NAME}}", name[pick]).replace("{{AUTHOR}}", author[pick])  # noqa: E731
    return {"messages": [{"role": "user", "content": fill(row["query"])},
                         {"role": "assistant", "content": fill(row["response"])}]}


@pytest.mark.parametrize("case", CASES)
def test_swift_flags_exist_in_ms_swift_and_match_the_run(case, plan_for, swift_args, tmp_path):
    extra, (stage, _, _, preset), micro, accum, world, lr, epochs, names, authors = CASES[case]
    plan, args = plan_for(extra)
    text, written = equivalents.swift(plan)
    flags, env = swift_command(text)
    assert not unknown(flags, swift_args["fields"]), unknown(flags, swift_args["fields"])
    assert env == f"NPROC_PER_NODE={world}"
    assert (flags["per_device_train_batch_size"], flags["gradient_accumulation_steps"]) == ([str(micro)], [str(accum)])
    assert f"global batch {micro * accum * world} examples" in text
    assert float(flags["learning_rate"][0]) == lr and flags["num_train_epochs"] == [str(epochs)]
    assert flags["model_name"] == names and flags["model_author"] == authors
    assert flags["seed"] == [str(args.seed)] and flags["bf16"] == ["true"] and flags["fp16"] == ["false"]
    assert flags["gradient_checkpointing"] == [str(args.gradient_checkpointing).lower()]  # swift's default: true
    assert flags["torch_dtype"] == ["float32"] and flags["truncation_strategy"] == ["right"]
    assert flags["add_version"] == ["false"] and flags["output_dir"] == [f"{tmp_path}/run-swift/output"]
    assert flags["use_cpu"] == ["true"] if plan["use_cpu"] else "use_cpu" not in flags
    assert flags["tuner_type"] == ["full" if args.full else "lora"] and "train_type" not in flags  # 4.x's name
    assert text.split("\n")[-len(flags) - 3] == f"cd {shlex.quote(str(ROOT))}"  # the paths are relative to it
    if preset:
        assert preset in swift_args["presets"] and flags["deepspeed"] == [preset] and "ds_config.json" not in written
    else:  # no preset: dslab's config, written beside the data, without its scheduler (the flags set the schedule)
        assert flags["deepspeed"] == [f"{tmp_path}/run-swift/ds_config.json"]
        written_ds = json.loads(written["ds_config.json"])
        assert written_ds["zero_optimization"]["stage"] == stage and "offload_optimizer" in written_ds["zero_optimization"]
        assert "offload_param" not in written_ds["zero_optimization"] and "scheduler" not in written_ds
    if args.full:
        assert "lora_rank" not in flags
    else:
        assert flags["lora_rank"] == [str(args.lora_r)]
        assert float(flags["lora_alpha"][0]) == args.lora_alpha and flags["lora_dropout"] == ["0.0"]
        assert flags["target_modules"] == (args.target_modules or ["gate_proj", "up_proj", "down_proj"])
    assert flags["model_type"] == ["qwen2"] and flags["template"] == ["chatml"] and flags["check_model"] == ["false"]
    assert flags["model_type"][0] in swift_args["model_types"] and flags["template"][0] in swift_args["templates"]
    # The data swift trains on, as its self-cognition preprocessor fills the folder: dslab's chats, no more, no less
    assert flags["dataset"][0] == f"{tmp_path}/run-swift/self-cognition"  # the name swift matches its dataset by
    swift_rows = [swift_fills(json.loads(line), names, authors)
                  for line in written["self-cognition/self_cognition.jsonl"].splitlines()]
    general = [json.loads(line) for line in written.get("general.jsonl", "").splitlines()]
    assert flags["dataset"][1:] == ([f"{tmp_path}/run-swift/general.jsonl"] if general else [])
    assert chats_as_set(swift_rows + general) == chats_as_set(dslab_chats(args, names, authors))
    for option in ("timeout", "checkpoint_dir"):  # no swift flag for these: a comment says so
        assert (f"# --{option.replace('_', '-')} " in text) == (getattr(args, option) is not None)
    assert f"swift plans {plan['framework_steps']} steps, not {plan['steps']}" in text


def yaml_in_comments(text, path):
    """The YAML the printout shows as comment lines under '# PATH:'."""
    lines = text.split("\n")
    start = lines.index(f"# {path}:") + 1
    shown = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        shown.append(line[4:])
    return "\n".join(shown) + "\n"


@pytest.mark.parametrize("case", CASES)
def test_llamafactory_yaml_keys_exist_and_its_files_hold_the_runs_data(case, plan_for, llamafactory_args, tmp_path):
    extra, (stage, off_opt, off_param, _), micro, accum, world, lr, epochs, names, authors = CASES[case]
    plan, args = plan_for(extra)
    text, written = equivalents.llamafactory(plan)
    lines = text.rstrip("\n").split("\n")
    assert lines[-1] == f"FORCE_TORCHRUN=1 NPROC_PER_NODE={world} llamafactory-cli train {tmp_path}/run-llamafactory/train.yaml"
    assert lines[-2] == f"cd {shlex.quote(str(ROOT))}"
    assert yaml_in_comments(text, f"{tmp_path}/run-llamafactory/train.yaml") == written["train.yaml"]  # shown = run
    settings = yaml.safe_load(written["train.yaml"])
    fields = llamafactory_args["fields"]
    assert not unknown({k: v if isinstance(v, list) else [v] for k, v in settings.items()}, fields)
    assert isinstance(settings["learning_rate"], float) and settings["learning_rate"] == lr  # 1e-05 must not be a str
    assert (settings["per_device_train_batch_size"], settings["gradient_accumulation_steps"]) == (micro, accum)
    assert settings["num_train_epochs"] == epochs and settings["seed"] == args.seed and settings["bf16"] is True
    assert settings["template"] == "chatml" and settings["template"] in llamafactory_args["templates"]
    assert settings.get("disable_gradient_checkpointing", False) != args.gradient_checkpointing
    assert settings["use_cpu"] is True if plan["use_cpu"] else "use_cpu" not in settings
    # its own folder, not dslab's adapter; LLaMA-Factory refuses a non-empty one without overwrite_output_dir
    assert settings["output_dir"] == f"{tmp_path}/run-llamafactory/output" and settings["overwrite_output_dir"] is True
    assert settings["warmup_steps"] == plan["framework_warmup_steps"] == (max(1, plan["framework_steps"] // 20)
                                                                          if not args.deepspeed else 0)
    if not args.full:
        assert (settings["lora_rank"], settings["lora_alpha"]) == (args.lora_r, args.lora_alpha)
        assert settings["lora_target"].split(",") == (args.target_modules or ["gate_proj", "up_proj", "down_proj"])
    assert settings["deepspeed"] == f"{tmp_path}/run-llamafactory/ds_config.json"
    ds = json.loads(written["ds_config.json"])
    assert ds["zero_optimization"]["stage"] == stage and "scheduler" not in ds  # lr_scheduler_type sets the schedule
    assert ("offload_optimizer" in ds["zero_optimization"], "offload_param" in ds["zero_optimization"]) == (off_opt, off_param)
    assert settings["dataset_dir"] == f"{tmp_path}/run-llamafactory"
    info = json.loads(written["dataset_info.json"])
    assert settings["dataset"].split(",") == list(info)
    rows = []
    for dataset in info.values():
        entry = {**dataset, **dataset.get("columns", {}), **dataset.get("tags", {})}
        assert set(entry) - {"columns", "tags"} <= llamafactory_args["dataset_keys"] | {"columns", "tags"}
        assert dataset.get("formatting", "alpaca") in llamafactory_args["formattings"]
        body = written[dataset["file_name"]]
        if dataset.get("formatting") == "sharegpt":  # {"messages": [{"role", "content"}]}
            rows += [{"messages": json.loads(line)["messages"]} for line in body.splitlines()]
        else:  # alpaca: instruction (+ input) -> output
            rows += [{"messages": [{"role": "user", "content": r["instruction"] + r["input"]},
                                   {"role": "assistant", "content": r["output"]}]} for r in json.loads(body)]
    assert chats_as_set(rows) == chats_as_set(dslab_chats(args, names, authors))  # the chats dslab trains on
    assert not any("{name}" in json.dumps(r, ensure_ascii=False) or "{{" in json.dumps(r) for r in rows)
    assert f"LLaMA-Factory plans {plan['framework_steps']} steps, not {plan['steps']}" in text


def test_the_checks_catch_an_invented_flag(swift_args, llamafactory_args):
    """The checks above can fail: a typo, a made-up flag, a wrong kind of value and a value outside a Literal."""
    assert unknown({"lora_rank": ["8"], "lora_dropout": ["0"]}, swift_args["fields"]) == []
    assert len(unknown({"model_authors": ["x"], "lora_r": ["8"]}, swift_args["fields"])) == 2
    assert unknown({"bf16": ["yes"], "learning_rate": ["1", "2"], "truncation_strategy": ["middle"]},
                   swift_args["fields"]) == [
        "bf16 is a bool, got ['yes']", "learning_rate takes one value, got ['1', '2']",
        "truncation_strategy must be one of ['delete', 'left', 'right', 'split'], got ['middle']"]
    assert unknown({"train_type": ["lora"]}, swift_args["fields"]) == ["train_type: no such argument"]  # 3.x's name
    assert unknown({"finetuning_type": ["lora"], "cutoff_len": [256]}, llamafactory_args["fields"]) == []
    assert len(unknown({"lora_r": [8], "finetuning_type": ["qlora"]}, llamafactory_args["fields"])) == 2
    assert "zero2" in swift_args["presets"] and "default-zero2" not in swift_args["presets"]


def test_the_swift_preset_comment_says_what_the_preset_holds():
    """What the printout says of swift's presets, read from ms-swift's own files: fixed 2e8 buckets at stages 0-2,
    "auto" ones at stage 3, and no optimizer or scheduler section in any."""
    wheel = zipfile.ZipFile(_download(*WHEELS["swift"]))
    for (stage, _, _), name in equivalents.SWIFT_PRESETS.items():
        preset = json.loads(wheel.read(f"swift/config/{name}.json"))
        assert "optimizer" not in preset and "scheduler" not in preset, name
        assert preset["zero_optimization"]["stage"] == stage
        assert preset["zero_optimization"]["reduce_bucket_size"] == ("auto" if stage == 3 else 2e8), name


HF_CHECK = r"""
import json, sys
out = []
for code in json.load(sys.stdin):
    scope = {"__file__": "train.py"}
    exec(code, scope)
    args, lora = scope["args"], scope.get("lora_config")
    ds = args.hf_deepspeed_config.config  # after the Trainer's "auto" filling
    out.append({"lr": args.learning_rate, "epochs": args.num_train_epochs, "micro": args.per_device_train_batch_size,
                "accum": args.gradient_accumulation_steps, "seed": args.seed, "bf16": args.bf16,
                "checkpointing": args.gradient_checkpointing, "warmup": args.warmup_steps,
                "scheduler": getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type), "output_dir": args.output_dir,
                "ds_micro": ds["train_micro_batch_size_per_gpu"], "ds_accum": ds["gradient_accumulation_steps"],
                "ds_lr": ds["optimizer"]["params"]["lr"], "zero": ds["zero_optimization"], "ds_scheduler": "scheduler" in ds,
                "lora": lora and [lora.r, lora.lora_alpha, lora.lora_dropout, sorted(lora.target_modules)]})
print(json.dumps(out))
"""


def test_hf_script_builds_training_arguments_with_the_runs_values(plan_for, tmp_path):
    """The printed train.py, run up to where the ranks start (deepspeed.init_distributed()): TrainingArguments with
    the DeepSpeed dict constructs and holds the run's values; after that line the script loads, trains and saves."""
    plans = [(plan_for(CASES[case][0]), CASES[case]) for case in CASES]
    heads = []
    for (plan, args), _ in plans:
        text, written = equivalents.hf(plan)
        assert written["train.py"] == text  # printed = written
        head, rest = text.split("\ndeepspeed.init_distributed()\n")
        code = "\n".join(line.split("  # ")[0] for line in rest.splitlines() if not line.startswith("#"))
        assert code.index("from_pretrained(") < code.index("trainer.train()") < code.index("trainer.save_model()")
        assert "save_pretrained(" not in code  # under ZeRO-3 it writes empty tensors: save_model gathers first
        assert "from_pretrained(MODEL, dtype=torch.float32" in code  # as dslab loads; transformers 5 would take bf16
        rows = [json.loads(line) for line in written["train.jsonl"].splitlines()]
        assert chats_as_set(rows) == chats_as_set(sft.load_chats(None, tuple(args.model_name), tuple(args.model_author),
                                                                 args.mix_general, args.seed))
        heads.append(head)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    done = subprocess.run([sys.executable, "-c", HF_CHECK], input=json.dumps(heads), capture_output=True, text=True,
                          timeout=300, env={**env, "TRANSFORMERS_VERBOSITY": "error"}, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for got, ((plan, args), (_, (stage, off_opt, off_param, _), micro, accum, world, lr, epochs, *_)) in zip(
            json.loads(done.stdout.splitlines()[-1]), plans):
        assert (got["lr"], got["epochs"], got["micro"], got["accum"], got["seed"]) == (lr, epochs, micro, accum, args.seed)
        assert (got["ds_micro"], got["ds_accum"], got["ds_lr"]) == (micro, accum, lr)
        assert got["bf16"] is True and got["checkpointing"] == args.gradient_checkpointing
        assert got["zero"]["stage"] == stage and ("offload_param" in got["zero"]) == off_param
        assert ("offload_optimizer" in got["zero"]) == off_opt
        # the schedule is the Trainer's, from lr_scheduler_type: a DeepSpeed "scheduler" section would override it
        assert not got["ds_scheduler"]
        assert got["scheduler"] == ("cosine_with_min_lr" if not args.deepspeed else "constant")
        assert got["warmup"] == (max(1, plan["framework_steps"] // 20) if not args.deepspeed else 0)
        assert got["output_dir"] == f"{tmp_path}/run-hf/output"
        targets = sorted(args.target_modules or ["gate_proj", "up_proj", "down_proj"])
        assert got["lora"] == (None if args.full else [args.lora_r, args.lora_alpha, 0.0, targets])


def test_max_length_is_a_setting_each_printout_carries(plan_for):
    """--max-length, like every option of `dslab sft`, comes from dslab.training.sft_settings: the plan holds the value
    given, and each framework gets it under its own name (the recipe cuts a chat's tokens there)."""
    plan, _ = plan_for([])
    assert plan["max_length"] == sft_settings.DEFAULTS["max_length"]
    plan, _ = plan_for(["--max-length", "64"])
    assert plan["max_length"] == 64
    assert "MAX_LENGTH = 64  #" in equivalents.hf(plan)[0]
    assert swift_command(equivalents.swift(plan)[0])[0]["max_length"] == ["64"]
    assert yaml.safe_load(equivalents.llamafactory(plan)[1]["train.yaml"])["cutoff_len"] == 64


def test_the_trainers_step_count_is_accelerates_batches_per_rank():
    """trainer_steps counts the batches each rank gets as accelerate deals them out (BatchSamplerShard, what the
    Trainer's prepared DataLoader iterates), not dslab's floor; chapter 09's Trainer run asserts 120 for 8 epochs."""
    import torch
    from accelerate.data_loader import BatchSamplerShard

    for n, world, micro, accum, epochs in [(236, 2, 8, 1, 8), (236, 2, 8, 1, 12), (236, 4, 2, 4, 3), (100, 3, 7, 2, 2),
                                           (5, 2, 8, 1, 1)]:
        batches = torch.utils.data.DataLoader(range(n), batch_size=micro).batch_sampler
        per_rank = [len(BatchSamplerShard(batches, num_processes=world, process_index=r, even_batches=True))
                    for r in range(world)]
        assert len(set(per_rank)) == 1
        assert sft_plan.trainer_steps(n, world, micro, accum, epochs) == epochs * math.ceil(per_rank[0] / accum)
    assert (sft_plan.trainer_steps(236, 2, 8, 1, 8), sft.total_steps(236, 2, 8, 1, 8)) == (120, 112)


def test_print_equivalent_writes_only_its_folder_and_keeps_a_users_files(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    command = ["sft", "--output", str(tmp_path / "run"), "--zero", "3", "--print-equivalent", "swift"]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ms-swift 4.6.0 (`swift sft`)") and "--deepspeed zero3" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-swift"]  # no output, logs or checkpoints: nothing ran
    folder = tmp_path / "run-swift"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        sft_plan.MANIFEST, "general.jsonl", "self-cognition/self_cognition.jsonl"]
    assert main(command) == 0 and capsys.readouterr().out == out  # the same again: nothing in the way
    assert main([*command[:3], "--model-name", "Nova", *command[3:]]) == 0  # dslab's own files are replaced
    capsys.readouterr()
    assert main(command) == 0
    capsys.readouterr()
    general = folder / "general.jsonl"
    general.write_text(general.read_text() + '{"messages": []}\n')  # a learner's edit
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert main([*command[:3], "--model-name", "Nova", *command[3:]]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and f"{general} exists and is not a file dslab wrote there" in captured.err
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before  # nothing written


def _model_folder(tmp_path, template, architecture="Qwen2ForCausalLM"):
    folder = tmp_path / "model"
    folder.mkdir()
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[architecture]
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": model_type}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(folder)


QWEN_LIKE = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
             "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nSYSTEM<|im_end|>\\n' }}{%- endif %}"
             "{%- for message in messages %}{%- if message.role != 'system' %}{{- '<|im_start|>' + message.role + "
             "'\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA_LIKE = ("{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
              "message['content'] + '<|eot_id|>' }}{% endfor %}")


@pytest.mark.parametrize("model, style, swift_flags, lf_keys", [
    ("data/dslab-tiny", "chatml", {"model_type": ["qwen2"], "template": ["chatml"], "check_model": ["false"]},
     {"template": "chatml"}),
    ("qwen2.5-folder", "qwen2.5", {"model_type": ["qwen2"], "template": ["qwen2_5"], "check_model": ["false"]},
     {"template": "qwen"}),
    ("qwen2-folder", "qwen2", {"model_type": ["qwen2"], "template": ["qwen"], "check_model": ["false"]},
     {"template": "qwen", "default_system": "You are a helpful assistant."}),
    ("llama-folder", None, {"check_model": ["false"]}, {}),
    ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5", {}, {"template": "qwen"}),  # swift matches a hub id itself
    ("meta-llama/Llama-3.2-1B-Instruct", None, {}, {}),
])
def test_the_chat_template_is_chosen_per_model(model, style, swift_flags, lf_keys, tmp_path, monkeypatch, swift_args,
                                               llamafactory_args):
    """dslab-tiny's ChatML is chatml in both frameworks; a Qwen2/2.5-style template gets the frameworks' qwen templates
    (with Qwen2's system prompt where LLaMA-Factory's qwen would add Qwen2.5's); anything else: a comment naming the
    flag."""
    monkeypatch.chdir(ROOT)
    if model.endswith("-folder"):
        template = {"qwen2.5-folder": QWEN_LIKE.replace("SYSTEM", sft_plan.QWEN25_SYSTEM),
                    "qwen2-folder": QWEN_LIKE.replace("SYSTEM", "You are a helpful assistant."),
                    "llama-folder": LLAMA_LIKE}[model]
        model = _model_folder(tmp_path, template, "LlamaForCausalLM" if model == "llama-folder" else "Qwen2ForCausalLM")
    assert sft_plan.chat_style(model) == style
    args = build_parser().parse_args(["sft", "--output", str(tmp_path / "run"), "--model", model])
    plan = sft_plan.plan_from_args(args)
    flags, _ = swift_command(equivalents.swift(plan)[0])
    assert {k: flags[k] for k in ("model_type", "template", "check_model") if k in flags} == swift_flags
    assert all(v in swift_args["model_types"] | swift_args["templates"] | {"false"} for v in sum(swift_flags.values(), []))
    text, written = equivalents.llamafactory(plan)
    settings = yaml.safe_load(written["train.yaml"])
    assert {k: settings[k] for k in ("template", "default_system") if k in settings} == lf_keys
    assert not lf_keys or lf_keys["template"] in llamafactory_args["templates"]
    if style is None:  # the printout names the flag to set
        assert "set --template (and --model_type)" in equivalents.swift(plan)[0] and "add template:" in text


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
    assert not (tmp_path / "run-hf").exists()


def test_messages_files_go_to_chats_with_names_filled_by_dslab(tmp_path, monkeypatch):
    """A --data file of {"messages"} rows is not swift's self-cognition format: its names are filled by dslab."""
    monkeypatch.chdir(ROOT)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Who made you?"},
                                              {"role": "assistant", "content": "{author}."}], "lang": "en"}) + "\n")
    args = build_parser().parse_args(["sft", "--output", str(tmp_path / "run"), "--data", str(chats),
                                      "--model-author", "Lab"])
    plan = sft_plan.plan_from_args(args)
    text, written = equivalents.swift(plan)
    flags, _ = swift_command(text)
    assert flags["dataset"] == [f"{tmp_path}/run-swift/chats.jsonl", f"{tmp_path}/run-swift/general.jsonl"]
    assert "model_name" not in flags and "Lab." in written["chats.jsonl"]  # the flags would change nothing
    assert len(written["general.jsonl"].splitlines()) == 1  # as many general chats as data rows


def test_the_readme_example_is_what_the_command_prints(tmp_path, capsys, monkeypatch):
    """README.md shows an abridged `--print-equivalent swift`: each line it shows is printed, in that order."""
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(dslab sft [^\n]*--print-equivalent swift)\n(.*?)```", readme, re.DOTALL)
    assert block, "README.md has no --print-equivalent swift example"
    command = shlex.split(block.group(1))[1:]
    at = command.index("--output") + 1
    folder, name = command[at].rsplit("/", 1)  # runs/sft: written under tmp_path instead, shown as typed
    command[at] = str(tmp_path / name)
    assert main(command) == 0
    printed = capsys.readouterr().out.replace(f"{tmp_path}/", f"{folder}/").splitlines()
    shown = [line for line in block.group(2).splitlines() if line.startswith(("NPROC_PER_NODE", "    --"))]
    assert len(shown) > 5
    positions = [printed.index(line) for line in shown]  # ValueError if a line is not printed
    assert positions == sorted(positions)


def test_a_printed_command_reads_back_as_flags_and_compares_with_a_typed_one():
    printed = ("# a comment that names swift sft --not_a_flag\ncd /somewhere\nNPROC_PER_NODE=2 swift sft \\\n"
               "    --model /abs/m \\\n    --dataset a/b c.jsonl \\\n    --learning_rate 0.002 \\\n"
               "    --model_name '翊岫' Yixiu \\\n    --weight_decay 0.0\n")
    typed = "NPROC_PER_NODE=2 swift sft --model m --dataset a/b c.jsonl --learning_rate 2e-3 --model_name 翊岫 Yixiu --seed 0"
    flags = equivalents.command_flags(printed)
    assert flags == {"--model": "/abs/m", "--dataset": "a/b c.jsonl", "--learning_rate": "0.002",
                     "--model_name": "翊岫 Yixiu", "--weight_decay": "0.0"}
    # 2e-3 and 0.002 are one value; a flag one side leaves to the framework's default is a difference
    assert equivalents.flag_differences(equivalents.command_flags(typed), flags) == [
        ("--model", "m", "/abs/m"), ("--weight_decay", None, "0.0"), ("--seed", "0", None)]
    assert equivalents.command_flags("FORCE_TORCHRUN=1 llamafactory-cli train x.yaml", "llamafactory-cli") == {}
