"""dslab sft: data with placeholders, prompt masking, checks before launch, and a real 2-rank ZeRO-3 run
whose adapter loads in plain PEFT, merges, and resumes from a checkpoint to the same weights; the step's loss
is the mean over every label token; logs and checkpoints go beside the output, where --resume finds them."""
import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dslab import data
from dslab.config import check
from dslab.models import checkpoints, loading, lora
from dslab.training import sft, sft_settings
from dslab.tiny.tokenizer import train_tokenizer

NAME, AUTHOR = ("小海", "Xiao Hai"), ("蓝天学院", "Blue Sky Lab")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A small random-init model of the dslab-tiny architecture with a tokenizer, in HF format."""
    out = tmp_path_factory.mktemp("base")
    texts = [line for line in (data.DATA_DIR / "general_sft.jsonl").read_text(encoding="utf-8").splitlines()]
    tok = train_tokenizer(texts, vocab_size=1536, gb2312=False)  # the data's Chinese characters (~1,170) + merges
    cfg = loading.tiny_config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    loading.save_pretrained(loading.build_model(cfg, seed=0), tok, out)
    return out


@pytest.fixture(scope="module")
def identity_file(tmp_path_factory):
    rows = data.load_jsonl(data.DATA_DIR / "self_cognition.jsonl")[:8]
    path = tmp_path_factory.mktemp("data") / "identity.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_chats_fills_names_per_language_and_mixes_general_dialogue(identity_file):
    chats = sft.load_chats(identity_file, NAME, AUTHOR, seed=0)
    assert len(chats) == 16  # 8 identity chats + as many general ones
    identity = [c for c in chats if any(n in json.dumps(c, ensure_ascii=False) for n in NAME)]
    assert len(identity) == 8
    for c in identity:
        text = c["messages"][1]["content"]
        assert "{name}" not in text and (NAME[0] in text if c["lang"] == "zh" else NAME[1] in text)
    assert len(sft.load_chats(identity_file, NAME, AUTHOR, mix_general=0)) == 8
    with pytest.raises(data.DataError, match="--model-name"):
        sft.load_chats(identity_file, None, None)


def test_only_the_answer_is_supervised(base_dir):
    tok = loading.load_tokenizer(base_dir)
    chat = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Whale."}]
    (example,) = sft.tokenize(tok, [{"messages": chat}])
    supervised = [t for t, label in zip(example["input_ids"], example["labels"]) if label != data.IGNORE_INDEX]
    assert tok.decode(supervised) == "I am Whale.<|im_end|>"
    assert example["labels"][0] == data.IGNORE_INDEX


def _refused_quickly(tmp_path, monkeypatch, exc, match, **kwargs):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    with pytest.raises(exc, match=match):
        sft.run(**{"output": str(tmp_path / "out"), **kwargs})
    assert time.perf_counter() - start < 10  # refused before any rank was started
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("*-logs"))


def test_unwritable_output_is_refused_before_launch(tmp_path, monkeypatch):
    _refused_quickly(tmp_path, monkeypatch, PermissionError, "--output", output="/proc/dslab-nope/adapter")


def test_missing_data_is_refused_before_launch(tmp_path, monkeypatch):
    _refused_quickly(tmp_path, monkeypatch, sft.SFTError, "no such file", data=str(tmp_path / "missing.jsonl"))


def test_bad_deepspeed_file_is_refused_before_launch(tmp_path, monkeypatch):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimisation": {"stage": 2}}))
    _refused_quickly(tmp_path, monkeypatch, check.ConfigError, "zero_optimization", deepspeed=str(bad))


def test_resume_on_another_world_size_needs_the_same_global_batch_and_zero(tmp_path, monkeypatch):
    _refused_quickly(tmp_path, monkeypatch, checkpoints.CheckpointError, "no complete checkpoint", resume=str(tmp_path))
    (tmp_path / "step4").mkdir()
    state = {"step": 4, "world_size": 4, "zero_stage": 2, "global_batch": 32}
    (tmp_path / "step4" / checkpoints.STATE_FILE).write_text(json.dumps(state))
    (tmp_path / "latest").write_text("step4")
    # 2 ranks x 8 x 1 = 16 examples per step, not 32: the fix names the product to choose
    _refused_quickly(tmp_path, monkeypatch, checkpoints.CheckpointError, r"global batch is 32.*--grad-accum-steps = 16",
                     resume=str(tmp_path), world_size=2)
    _refused_quickly(tmp_path, monkeypatch, checkpoints.CheckpointError, "resume with --zero 2", resume=str(tmp_path),
                     zero_stage=3)
    (tmp_path / "step4" / checkpoints.STATE_FILE).write_text(json.dumps({**state, "zero_stage": 0}))
    _refused_quickly(tmp_path, monkeypatch, checkpoints.CheckpointError, "resume with --world-size 4",
                     resume=str(tmp_path), zero_stage=0, world_size=2, grad_accum_steps=2)
    assert not (tmp_path / "step4_universal").exists()


def test_resume_given_the_runs_output_finds_its_checkpoints_or_says_where_it_looked(tmp_path, monkeypatch):
    output = tmp_path / "adapter"
    where = re.escape(str(tmp_path / "adapter-checkpoints"))
    _refused_quickly(tmp_path, monkeypatch, checkpoints.CheckpointError, f"no complete checkpoint.*{where}",
                     resume=str(output))
    tag_dir = checkpoints.default_dir(output) / "step6"
    tag_dir.mkdir(parents=True)
    (tag_dir / checkpoints.STATE_FILE).write_text(json.dumps({"step": 6, "world_size": 2, "zero_stage": 2,
                                                              "global_batch": 16}))
    (tag_dir.parent / "latest").write_text("step6")
    assert checkpoints.find_checkpoints(output) == tag_dir.parent
    assert checkpoints.latest_checkpoint(output) == checkpoints.latest_checkpoint(tag_dir.parent)
    assert checkpoints.latest_checkpoint(output)[1]["step"] == 6
    # found, and then checked like any checkpoint: this one was written with ZeRO-2
    _refused_quickly(tmp_path, monkeypatch, checkpoints.CheckpointError, "resume with --zero 2", resume=str(output),
                     zero_stage=3)


def test_zero3_lora_run_saves_a_real_adapter_that_merges_and_resumes_exactly(base_dir, identity_file, tmp_path,
                                                                             monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    common = dict(model=str(base_dir), data=str(identity_file), zero_stage=3, world_size=2, epochs=2,
                  micro_batch_size=4, lora_r=4, lora_alpha=8, gradient_checkpointing=True, stream=False, timeout=300)
    # 16 chats / 2 ranks / 4 per micro-batch = 2 steps per epoch; a checkpoint after each epoch
    first = sft.run(output=tmp_path / "adapter", save_every=2, **common)
    assert first["zero_stage"] == 3 and first["steps"] == 4
    # the ranks' logs sit beside the output, as its checkpoints do, not in the directory the run started from
    logs = tmp_path / "adapter-logs"
    assert any("loss" in p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file())
    assert not (tmp_path / "runs").exists()
    assert first["ungathered_adapter_numel"] == 0  # what a plain save would have written under ZeRO-3
    state = load_file(str(tmp_path / "adapter" / loading.ADAPTER_WEIGHTS))
    assert sum(v.numel() for v in state.values()) == first["trainable"] > 0
    assert all("lora_" in k for k in state)

    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    assert sum(p.numel() for n, p in plain.named_parameters() if "lora_" in n) == first["trainable"]
    report = lora.merge(base_dir, tmp_path / "adapter", tmp_path / "merged", verbose=False)
    assert report["max_abs_diff"] <= 1e-4
    AutoModelForCausalLM.from_pretrained(tmp_path / "merged")

    # Pretend the job died after step 2: `latest` still names the step-2 checkpoint. Resuming must
    # reproduce the uninterrupted run exactly (same data order, optimizer and scheduler state).
    ckpt = tmp_path / "adapter-checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step")) == ["step2", "step4"]
    (ckpt / "latest").write_text("step2")
    second = sft.run(output=tmp_path / "resumed", resume=str(tmp_path / "adapter"), **common)  # finds ckpt
    assert second["start_step"] == 2 and [e["step"] for e in second["loss_log"]] == [3, 4]
    assert [e["loss"] for e in second["loss_log"]] == [e["loss"] for e in first["loss_log"][2:]]
    resumed = load_file(str(tmp_path / "resumed" / loading.ADAPTER_WEIGHTS))
    assert all(torch.equal(resumed[k], state[k]) for k in state)

    # The same checkpoint on ONE rank (global batch kept: 1 x 4 x 2 = 2 x 4 x 1): DeepSpeed's universal
    # checkpoint re-cuts the ZeRO-3 shards. Asked for 2 steps in all, it has none left to train, so the adapter it
    # saves is exactly what it loaded: the fp32 master weights of step 2, rounded to the model's bf16.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    one = sft.run(output=tmp_path / "one-rank", resume=str(ckpt), **{**common, "world_size": 1, "grad_accum_steps": 2,
                                                                      "epochs": 1})
    assert one["start_step"] == 2 and one["loss_log"] == [] and (ckpt / "step2_universal" / checkpoints.STATE_FILE).exists()
    master = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="step2", exclude_frozen_parameters=True)
    loaded = load_file(str(tmp_path / "one-rank" / loading.ADAPTER_WEIGHTS))
    assert loaded.keys() == {k.replace(".default", "") for k in master}
    assert all(torch.equal(loaded[k.replace(".default", "")], v.to(loaded[k.replace(".default", "")].dtype))
               for k, v in master.items())
    assert not any(torch.equal(loaded[k], state[k]) for k in state if "lora_B" in k)  # step 2, not step 4


# ---- the training script chapters 05 and 08 write (the one a learner takes to a cluster) -----------------------
ROOT = Path(__file__).resolve().parent.parent


def _written_script(notebook):
    """The text the notebook's `%%writefile .../train_sft.py` cell writes."""
    cells = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))["cells"]
    found = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and "".join(c["source"]).startswith("%%writefile")]
    assert len(found) == 1, f"{notebook}: expected one %%writefile cell"
    return found[0].split("\n", 1)[1]


def test_chapters_05_and_08_write_the_same_training_script():
    assert _written_script("05_lora_sft.ipynb") == _written_script("08_cli_and_multinode.ipynb")


def test_the_take_away_scripts_defaults_are_dslab_sfts(monkeypatch):
    """The script runs without dslab, so it declares its options itself: run as far as its parser, it starts from the
    settings `dslab sft` has (dslab.training.sft_settings), and so do the LoRA numbers written into it."""
    import ast

    monkeypatch.delenv("DSLAB_MODEL", raising=False)
    script = _written_script("05_lora_sft.ipynb")
    names = {}
    exec(script[:script.index("args = parser.parse_args()")], names)  # the imports and the parser, nothing else
    args = names["parser"].parse_args(["--output", "adapter"])
    d = sft_settings.DEFAULTS
    assert (tuple(args.name), tuple(args.author)) == (d["model_name"], d["model_author"])
    assert (args.epochs, args.max_length, args.full, args.save_every, args.checkpoint_dir) == \
        (d["epochs"], d["max_length"], d["full"], d["save_every"], d["checkpoint_dir"])
    assert Path(args.data).name == sft.DEFAULT_DATA.name and Path(args.model).name == loading.DEFAULT_MODEL_DIR.name
    (lora_config,) = [node for node in ast.walk(ast.parse(script))
                      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LoraConfig"]
    given = {k.arg: ast.literal_eval(k.value) for k in lora_config.keywords}
    assert (given["r"], given["lora_alpha"], tuple(given["target_modules"])) == \
        (d["lora_r"], d["lora_alpha"], lora.DEFAULT_TARGETS)


def test_chapter_09s_trainer_recipe_starts_from_the_same_lora_and_length():
    """dslab/recipes/hf_sft.py is printed whole in chapter 09 (its stored output), so its dataclass keeps the numbers
    written out rather than read from dslab.training.sft_settings: they must be the same."""
    import ast

    from dslab import launch

    tree = ast.parse((launch.RECIPES_DIR / "hf_sft.py").read_text(encoding="utf-8"))
    (fields,) = [node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ScriptArguments"]
    numbers = {f.target.id: f.value.value for f in fields
               if isinstance(f, ast.AnnAssign) and isinstance(f.value, ast.Constant)}
    assert numbers == {name: sft_settings.DEFAULTS[name] for name in ("lora_r", "lora_alpha", "max_length")}
    (lora_config,) = [node for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LoraConfig"]
    targets = next(k.value for k in lora_config.keywords if k.arg == "target_modules")
    assert tuple(ast.literal_eval(targets)) == lora.DEFAULT_TARGETS


def test_training_script_step_is_the_mean_over_every_label_token_of_all_micro_batches_and_ranks(
        base_dir, identity_file, tmp_path):
    """One SGD step (lr 1, fp32, no clipping) of the script on 2 ranks x 2 micro-batches: LoRA's B starts at zero,
    so the saved B is minus the gradient, which must be that of (sum of all token losses) / (all label tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from dslab import launch

    script = tmp_path / "train_sft.py"
    script.write_text(_written_script("05_lora_sft.ipynb"), encoding="utf-8")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    result = launch.run_commands(
        f"deepspeed --num_gpus 2 {script} --model {base_dir} --data {identity_file} "
        f"--general {data.DATA_DIR / 'general_sft.jsonl'} --deepspeed_config {tmp_path / 'ds.json'} "
        f"--output {tmp_path / 'adapter'} --max_steps 1", run_dir=tmp_path, stream=False)
    assert result.rank0["env"]["LOCAL_SIZE"] == "2" and [r["rank"] for r in result.results] == [0, 1]

    tokenizer = loading.load_tokenizer(base_dir)
    examples = sft.tokenize(tokenizer, sft.load_chats(str(identity_file), NAME, AUTHOR))
    micro = [b for r in (0, 1) for b in _take(sft.rank_batches(examples, r, 2, 2, tokenizer.pad_token_id), 2)]
    torch.manual_seed(0)  # as the script does before building the model
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["gate_proj", "up_proj", "down_proj"]))  # the script's targets (the MLP)
    n_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
    total = 0.0
    for b in micro:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                                 ignore_index=-100, reduction="sum")
        (loss / n_tokens).backward()
        total += loss.item()
    assert abs(result.rank0["loss_log"][0]["loss"] - total / n_tokens) < 1e-5
    saved = load_file(str(tmp_path / "adapter" / loading.ADAPTER_WEIGHTS))
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_B" in n}
    assert grads and saved.keys() >= grads.keys()
    worst = max((saved[k] + g).abs().max().item() for k, g in grads.items())  # B after one step = 0 - 1.0 x grad
    assert worst < 1e-6, worst
    # averaging the micro-batches' own means (model(**batch).loss) would have given another step
    grads = {k: g.clone() for k, g in grads.items()}
    model.zero_grad()
    for b in micro:
        (model(**b).loss / len(micro)).backward()
    other = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_B" in n}
    assert max((other[k] - g).abs().max().item() for k, g in grads.items()) > 1e-4


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


# ---- the settings of a run, defined once (dslab.training.sft_settings) and read everywhere --------------------------
def test_dslab_sft_and_the_recipe_start_from_the_settings_defaults():
    from dslab.cli import build_parser
    from dslab.recipes import sft as recipe

    as_parsed = {name: list(v) if isinstance(v, tuple) else v for name, v in sft_settings.DEFAULTS.items()}
    cli = build_parser().parse_args(["sft", "--output", "out"])
    assert {name: getattr(cli, name) for name in sft_settings.DEFAULTS} == {**as_parsed, "output": "out"}
    ranks = vars(recipe.parse_args(["--output", "out"]))
    assert {s.name: ranks[s.recipe_name] for s in sft_settings.SETTINGS if s.on_ranks} == \
        {s.name: as_parsed[s.name] for s in sft_settings.SETTINGS if s.on_ranks} | {"output": "out"}


def test_each_flag_is_the_settings_name_with_dashes_unless_the_setting_says_otherwise():
    flags = {s.name: s.flag for s in sft_settings.SETTINGS if s.flag != "--" + s.name.replace("_", "-")}
    assert flags == {"zero_stage": "--zero"}
    assert sft_settings.replaced_by_deepspeed_file() == ["--zero", "--lr", "--micro-batch-size", "--grad-accum-steps"]


@pytest.mark.parametrize("typed, meant", [("zero", "zero_stage"), ("deepspeed_config", "deepspeed"),
                                          ("lora_rank", "lora_r"), ("micro_batch", "micro_batch_size"),
                                          ("--grad-accum", "grad_accum_steps"), ("epoch", "epochs")])
def test_an_unknown_setting_is_a_type_error_naming_the_closest(typed, meant, tmp_path, monkeypatch):
    monkeypatch.setenv("DSLAB_LANG", "en")
    with pytest.raises(TypeError, match=f"'{typed}' is not a setting of a fine-tuning run: did you mean '{meant}'"):
        sft.run(output=tmp_path / "out", **{typed: 3})
    monkeypatch.setenv("DSLAB_LANG", "zh")
    with pytest.raises(TypeError, match=f"是不是想写 '{meant}'"):
        sft.run(output=tmp_path / "out", **{typed: 3})
    assert not list(tmp_path.iterdir())  # refused before anything was checked or written


def test_the_check_holds_every_limit_the_settings_give():
    limited = [s for s in sft_settings.SETTINGS if s.least is not None or s.above_zero]
    assert {s.name for s in limited} >= {"epochs", "micro_batch_size", "grad_accum_steps", "lora_r", "lora_alpha",
                                         "lr", "save_every", "log_every", "mix_general", "max_length", "world_size",
                                         "timeout"}
    sft.check_settings(sft_settings.DEFAULTS)
    for s in limited:
        too_small = s.least - 1 if s.least is not None else 0
        with pytest.raises(sft.SFTError, match=re.escape(s.flag)):
            sft.check_settings({**sft_settings.DEFAULTS, s.name: too_small})


def test_the_built_config_is_the_settings_default_run():
    """The config the recipe builds when no --deepspeed file is given (dslab.training.sft.deepspeed_config, its only
    builder) starts from the same sizes, stage and learning rate as `dslab sft`."""
    d = sft_settings.DEFAULTS
    config = sft.deepspeed_config(steps=50)
    assert config["zero_optimization"]["stage"] == d["zero_stage"]
    assert config["train_micro_batch_size_per_gpu"] == d["micro_batch_size"]
    assert config["gradient_accumulation_steps"] == d["grad_accum_steps"]
    assert config["train_batch_size"] == d["micro_batch_size"] * d["grad_accum_steps"] * d["world_size"]
    assert config["optimizer"]["params"]["lr"] == sft.default_lr(full=False) == sft_settings.LORA_LR
    assert sft.default_lr(full=True) == sft_settings.FULL_LR < sft_settings.LORA_LR


# ---- the recipe `dslab sft` runs: the same per-token step as the chapter's script --------------------------------
def test_recipe_step_is_the_mean_over_every_label_token_of_all_micro_batches_and_ranks(
        base_dir, identity_file, tmp_path, monkeypatch):
    """One SGD step (lr 1, fp32, no clipping) of a full fine-tune on 2 ranks x 2 micro-batches: every saved weight
    must be W minus the gradient of (sum of all token losses) / (all label tokens), as in chapter 05's script."""
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    # 8 chats / 2 ranks / 2 per micro-batch / 2 micro-batches per step: one step
    result = sft.run(output=tmp_path / "full", model=str(base_dir), data=str(identity_file), mix_general=0, full=True,
                     epochs=1, world_size=2, deepspeed=str(tmp_path / "ds.json"), stream=False, timeout=300)
    assert result["steps"] == 1

    tokenizer = loading.load_tokenizer(base_dir)
    examples = sft.tokenize(tokenizer, sft.load_chats(str(identity_file), NAME, AUTHOR, mix_general=0))
    micro = [b for r in (0, 1) for b in _take(sft.rank_batches(examples, r, 2, 2, tokenizer.pad_token_id), 2)]
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    n_tokens = sum(int((b["labels"][:, 1:] != data.IGNORE_INDEX).sum()) for b in micro)
    total = 0.0
    for b in micro:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                                 ignore_index=data.IGNORE_INDEX, reduction="sum")
        (loss / n_tokens).backward()
        total += loss.item()
    assert abs(result["loss_log"][0]["loss"] - total / n_tokens) < 1e-5
    saved = load_file(str(tmp_path / "full" / "model.safetensors"))
    expected = {n: (p - p.grad).detach() for n, p in model.named_parameters() if n in saved}
    assert expected and max((saved[n] - w).abs().max().item() for n, w in expected.items()) < 1e-5
    # the mean of the micro-batches' own means (model(**batch).loss) is another number: the test tells them apart
    with torch.no_grad():
        per_batch = sum(model(**b).loss.item() for b in micro) / len(micro)
    assert abs(per_batch - total / n_tokens) > 1e-4

