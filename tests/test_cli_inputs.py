"""Bad input to every `dslab` verb, tried as a new user would: each is refused with one line that names the problem and
the fix (no traceback), before anything is loaded, trained or launched. The checks live in the library (dslab.models
.loading, dslab.zero.memory, dslab.launch, ...), so a notebook calling it gets the same message.

Most cases run the command in this process (dslab.cli.main, as tests/test_config.py does); the cases issue 40 names
run `python -m dslab.cli` as a subprocess, so that "no traceback, one line on stderr" is checked on the real streams.
A tripwire stops any case that would start ranks or train, so a check that goes missing fails fast instead of running.
"""
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest

from dslab import launch
from dslab.cli import main
from dslab.models import loading

TINY = loading.DEFAULT_MODEL_DIR
# DeepSpeed's own log lines ("[2026-01-01 12:00:00,000] [WARNING] [real_accelerator.py:...] Setting accelerator to
# CPU...") are not dslab's answer; they appear once per process, wherever DeepSpeed is imported first.
DEEPSPEED_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\] ")


@pytest.fixture(autouse=True)
def english_and_untouched_environment(monkeypatch):
    """Messages in English; what a command sets in os.environ (this_rank.quiet: HF_HUB_OFFLINE, ...) is undone."""
    monkeypatch.setenv("DSLAB_LANG", "en")
    monkeypatch.delenv("DSLAB_MODEL", raising=False)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    """Starting ranks (every launch goes through run_job) or pretraining fails the test at once."""
    def started(*args, **kwargs):
        raise AssertionError("the bad input was not refused: ranks were started")

    def trained(*args, **kwargs):
        raise AssertionError("the bad input was not refused: build-base started training")

    from dslab.tiny import pretrain

    monkeypatch.setattr(launch, "run_job", started)
    monkeypatch.setattr(pretrain, "train_tokenizer", trained)


def in_process(capsys, *argv):
    """(exit status, stdout, stderr) of `dslab ARGV` run by dslab.cli.main in this process, as the console script
    would end: SystemExit("message") is status 1 with the message on stderr."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exc:
        status = exc.code
        if isinstance(status, str):
            print(status, file=sys.stderr)
            status = 1
    out, err = capsys.readouterr()
    return status, out, err


def as_subprocess(*argv, cwd, **env):
    """`python -m dslab.cli ARGV` in a fresh process (English messages): (exit status, stdout, stderr)."""
    base = {k: v for k, v in os.environ.items() if k not in ("DSLAB_LANG", "LC_ALL", "LC_MESSAGES", "DSLAB_MODEL")}
    run = subprocess.run([sys.executable, "-m", "dslab.cli", *map(str, argv)], capture_output=True, text=True,
                         cwd=cwd, env={**base, "DSLAB_LANG": "en", **env}, timeout=300)
    return run.returncode, run.stdout, run.stderr


def one_line(text):
    """The one line dslab answered with (DeepSpeed's log lines left out); fails unless there is exactly one."""
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip() and not DEEPSPEED_LOG.match(line)]
    assert len(lines) == 1, text
    return lines[0]


def refused(capsys, argv, words, stream="stderr"):
    """Run `dslab ARGV` in this process: a nonzero status and one line on `stream` holding every one of `words`."""
    status, out, err = in_process(capsys, *argv)
    line = one_line(err if stream == "stderr" else out)
    assert status != 0, (status, out, err)
    assert all(w in line for w in words), line
    return line


@pytest.fixture
def model_folders(tmp_path):
    """Folders that are not loadable models, each in its own way."""
    made = {"file": tmp_path / "model.txt", "empty": tmp_path / "empty", "adapter": tmp_path / "adapter",
            "no-weights": tmp_path / "no-weights", "no-tokenizer": tmp_path / "no-tokenizer"}
    made["file"].write_text("not a model")
    made["empty"].mkdir()
    made["adapter"].mkdir()
    (made["adapter"] / "adapter_config.json").write_text("{}")
    made["no-weights"].mkdir()
    shutil.copy(TINY / "config.json", made["no-weights"])
    made["no-tokenizer"].mkdir()
    shutil.copy(TINY / "config.json", made["no-tokenizer"])
    (made["no-tokenizer"] / "model.safetensors").symlink_to(TINY / "model.safetensors")
    return made


def pickle_that_runs_code(folder, marker):
    """A checkpoint folder (dslab-tiny's config and tokenizer) whose only weights are pytorch_model.bin, a pickle that
    creates `marker` when it is unpickled."""
    class CreatesMarker:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": CreatesMarker()}))
    return folder


# --------------------------------------------------------------------------- the cases issue 40 names (subprocess)

@pytest.mark.parametrize("verb", [["infer", "--prompt", "Hello"], ["eval", "--model-name", "A", "--model-author", "B"]],
                         ids=["infer", "eval"])
def test_a_model_folder_that_does_not_exist(verb, tmp_path):
    missing = tmp_path / "no-such-model"
    status, out, err = as_subprocess(*verb, "--model", missing, cwd=tmp_path)
    line = one_line(err)
    assert status != 0 and not out
    assert f"model folder '{missing}' does not exist" in line
    assert "config.json + model.safetensors" in line and "hub" in line  # the fix, and why a hub id will not do here
    assert "Repo id must be in the form" not in err


def test_a_pickle_only_checkpoint_is_refused_and_never_unpickled(tmp_path):
    marker = tmp_path / "the-pickle-ran"
    folder = pickle_that_runs_code(tmp_path / "pickled", marker)
    with open(folder / "pytorch_model.bin", "rb") as f:  # the tripwire works: unpickling does create the marker
        pickle.load(f)
    assert marker.exists()
    marker.unlink()
    status, out, err = as_subprocess("infer", "--model", folder, "--prompt", "Hello", cwd=tmp_path)
    line = one_line(err)
    assert status != 0 and not out
    assert "pytorch_model.bin" in line and "pickle" in line and "run any code" in line  # the problem and why
    assert "safetensors only" in line and "save_pretrained" in line and "weights_only=True" in line  # the fix
    assert not marker.exists()
    with pytest.raises(loading.ModelError, match="safetensors only"):  # the library, as a notebook calls it
        loading.load_model(folder)
    assert not marker.exists()


def test_the_conversion_the_pickle_message_gives_works(tmp_path):
    import torch

    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder)
    model = loading.load_model()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # a checkpoint in transformers' old format
    with pytest.raises(loading.ModelError) as info:
        loading.load_model(folder)
    command = re.search(r'python -c "([^"]+)"', str(info.value)).group(1)
    subprocess.run([sys.executable, "-c", command], check=True, capture_output=True, timeout=300)
    converted = loading.load_model(folder)
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in model.state_dict().items())


def test_estimate_refuses_a_negative_size(tmp_path):
    status, out, err = as_subprocess("estimate", "--params", "-3", "--zero", "2", cwd=tmp_path)
    assert status != 0 and not out
    assert one_line(err) == "error: params must be at least 1, got -3.0"


def test_a_hub_id_where_the_hub_cannot_be_reached(tmp_path):
    status, out, err = as_subprocess("infer", "--model", "Qwen/Qwen2-0.5B", "--prompt", "Hello", cwd=tmp_path,
                                     HF_HUB_OFFLINE="1")
    line = one_line(err)
    assert status != 0 and not out
    assert "'Qwen/Qwen2-0.5B' is no folder here" in line and "hub" in line and "local checkpoint" in line


# --------------------------------------------------------------------------- models: infer, eval, merge

@pytest.mark.parametrize("kind, words", [
    ("file", ["is a file", "give the model's folder"]),
    ("empty", ["has no config.json", "save_pretrained"]),
    ("adapter", ["is a LoRA adapter", "--adapter", "--model"]),
    ("no-weights", ["no weights", "model.safetensors"]),
    ("no-tokenizer", ["has no tokenizer", "tokenizer.save_pretrained"]),
])
def test_infer_with_a_folder_that_is_not_a_model(kind, words, model_folders, capsys):
    refused(capsys, ["infer", "--model", model_folders[kind], "--prompt", "Hello"], words)


def test_a_missing_folder_under_an_existing_one_is_not_tried_on_the_hub(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # runs/merged has a hub id's form, but runs/ is here: a typo, not a hub id
    refused(capsys, ["infer", "--model", "runs/merged", "--prompt", "Hello"], ["'runs/merged' does not exist"])


@pytest.mark.parametrize("argv, words", [
    (["--prompts-file", "{tmp}/prompts.txt"], ["prompts.txt: no such file"]),
    (["--prompts-file", "{tmp}/prompts.jsonl"], ["prompts.jsonl: no such file"]),
    (["--prompts-file", "{tmp}"], [": no such file"]),
    (["--prompt", "Hi", "--max-new-tokens", "0"], ["max_new_tokens must be at least 1, got 0"]),
    (["--prompt", "Hi", "--temperature", "-1"], ["temperature must be at least 0, got -1.0"]),
    (["--prompt", "Hi", "--tp", "0"], ["--tp must be at least 1"]),
    (["--prompt", "Hi", "--adapter", "{tmp}/no-adapter"], ["adapter directory", "does not exist"]),
], ids=["missing-text-file", "missing-jsonl", "a-folder", "max-new-tokens-0", "negative-temperature", "tp-0",
        "missing-adapter"])
def test_infer_options(argv, words, tmp_path, capsys):
    refused(capsys, ["infer", *(a.format(tmp=tmp_path) for a in argv)], words)


@pytest.mark.parametrize("argv, words", [
    (["--model", "{tmp}/no-model"], ["does not exist", "config.json + model.safetensors"]),
    (["--model", "{tmp}/pickled"], ["pickle", "safetensors only", "save_pretrained"]),
    (["--adapter", "{tmp}/no-adapter"], ["adapter directory", "does not exist"]),
    (["--max-new-tokens", "0"], ["max_new_tokens must be at least 1, got 0"]),
], ids=["missing-model", "pickle-only", "missing-adapter", "max-new-tokens-0"])
def test_tensor_parallel_infer_checks_before_starting_ranks(argv, words, tmp_path, capsys):
    marker = tmp_path / "the-pickle-ran"
    pickle_that_runs_code(tmp_path / "pickled", marker)
    refused(capsys, ["infer", "--tp", "2", "--prompt", "Hello", *(a.format(tmp=tmp_path) for a in argv)], words)
    assert not marker.exists()


@pytest.mark.parametrize("argv, words", [
    (["--questions", "{tmp}/questions.jsonl"], ["--questions", "questions.jsonl: no such file"]),
    (["--questions", "{tmp}/broken.jsonl"], ["broken.jsonl:1: not valid JSON", "each line must be one JSON object"]),
    (["--model", "{tmp}/no-model"], ["does not exist", "config.json + model.safetensors"]),
], ids=["missing-questions", "broken-questions", "missing-model"])
def test_eval_inputs(argv, words, tmp_path, capsys):
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    refused(capsys, ["eval", "--model-name", "A", "--model-author", "B", *(a.format(tmp=tmp_path) for a in argv)],
            words)


def test_eval_with_three_names(capsys):
    refused(capsys, ["eval", "--model-name", "A", "B", "C", "--model-author", "D"],
            ["--model-name A B C", "give one value (both languages) or two (Chinese, then English)"])


def test_merge_onto_a_base_that_does_not_exist(tmp_path, capsys):
    from dslab.models import lora

    lora.save_adapter(lora.attach_lora(loading.load_model(), r=2, alpha=4), tmp_path / "adapter")
    capsys.readouterr()   # what loading the model printed (a progress bar where nothing quieted it) is not the answer
    refused(capsys, ["merge", "--model", tmp_path / "no-base", "--adapter", tmp_path / "adapter", "--output",
                     tmp_path / "merged"], ["does not exist", "config.json + model.safetensors"])
    assert not (tmp_path / "merged").exists()


def test_merge_refuses_a_negative_tolerance(tmp_path, capsys):
    refused(capsys, ["merge", "--adapter", tmp_path / "adapter", "--output", tmp_path / "merged", "--tolerance", "-1"],
            ["tolerance must be at least 0, got -1.0"])
    assert not (tmp_path / "merged").exists()


def test_merge_with_an_adapter_that_does_not_exist(tmp_path, capsys):
    refused(capsys, ["merge", "--adapter", tmp_path / "no-adapter", "--output", tmp_path / "merged"],
            ["adapter directory", "does not exist"])


# --------------------------------------------------------------------------- sft

@pytest.mark.parametrize("argv, words", [
    (["--model", "{tmp}/no-model"], ["does not exist", "config.json + model.safetensors"]),
    (["--model", "{tmp}/no-model", "--print-equivalent", "swift"], ["does not exist"]),
    (["--data", "{tmp}/chats.jsonl"], ["--data", "chats.jsonl: no such file"]),
    (["--deepspeed", "{tmp}/ds.json"], ["--deepspeed", "ds.json: no such file"]),
    (["--resume", "{tmp}/no-run"], ["no complete checkpoint", "--save-every"]),
    (["--epochs", "0"], ["--epochs must be at least 1, got 0"]),
    (["--micro-batch-size", "0", "--print-equivalent", "hf"], ["--micro-batch-size must be at least 1, got 0"]),
    (["--grad-accum-steps", "0"], ["--grad-accum-steps must be at least 1, got 0"]),
    (["--lora-r", "0"], ["--lora-r must be at least 1, got 0"]),
    (["--lora-alpha", "0"], ["--lora-alpha must be a number above 0, got 0.0"]),
    (["--lr", "-1"], ["--lr must be a number above 0, got -1.0"]),
    (["--save-every", "-1"], ["--save-every must be at least 0, got -1"]),
    (["--mix-general", "-1"], ["--mix-general must be at least 0, got -1"]),
    (["--max-length", "1"], ["--max-length must be at least 2, got 1"]),
    (["--world-size", "0"], ["--world-size must be at least 1, got 0"]),
    (["--world-size", "0", "--print-equivalent", "swift"], ["--world-size must be at least 1, got 0"]),
    (["--timeout", "0"], ["--timeout must be a number above 0, got 0.0"]),
    (["--timeout", "-5", "--print-equivalent", "hf"], ["--timeout must be a number above 0, got -5.0"]),
], ids=["missing-model", "missing-model-equivalent", "missing-data", "missing-deepspeed", "nothing-to-resume",
        "epochs-0", "micro-batch-0", "grad-accum-0", "lora-r-0", "lora-alpha-0", "negative-lr", "save-every-negative",
        "mix-general-negative", "max-length-1", "world-size-0", "world-size-0-equivalent", "timeout-0",
        "timeout-negative-equivalent"])
def test_sft_inputs(argv, words, tmp_path, capsys):
    refused(capsys, ["sft", "--output", tmp_path / "run", *(a.format(tmp=tmp_path) for a in argv)], words)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- estimate, measure, comm

@pytest.mark.parametrize("argv, words", [
    (["--params", "0"], ["params must be at least 1, got 0.0"]),
    (["--params", "nan"], ["params must be a finite number, got nan"]),
    (["--params", "inf"], ["params must be a finite number, got inf"]),
    (["--params", "1e9", "--world-size", "0"], ["world_size must be a whole number >= 1, got 0"]),
    (["--params", "1e9", "--optimizer", "muon", "--muon-fraction", "2"], ["muon_fraction", "0 to 1"]),
    (["--params", "1e9", "--trainable", "0"], ["trainable must be at least 1, got 0.0"]),
    (["--params", "1e9", "--trainable", "-5"], ["trainable must be at least 1, got -5.0"]),
    (["--params", "1e9", "--trainable", "nan"], ["trainable must be a finite number, got nan"]),
    (["--params", "1e9", "--trainable", "2e9"], ["trainable must be at most params (1,000,000,000), "
                                                 "got 2,000,000,000", "adapters"]),
], ids=["params-0", "params-nan", "params-inf", "world-size-0", "muon-fraction-2", "trainable-0",
        "trainable-negative", "trainable-nan", "trainable-above-params"])
def test_estimate_numbers(argv, words, capsys):
    refused(capsys, ["estimate", "--zero", "2", *argv], words)


@pytest.mark.parametrize("argv, words", [
    (["--model", "{tmp}/no-model"], ["does not exist", "config.json + model.safetensors"]),
    (["--steps", "1"], ["steps must be at least 2, got 1"]),
    (["--hidden-size", "-5"], ["hidden_size must be at least 1, got -5"]),
    (["--layers", "0"], ["num_hidden_layers must be at least 1, got 0"]),
    (["--params", "-3"], ["params must be at least 1, got -3.0"]),
    (["--timeout", "-1"], ["timeout must be a positive number of seconds", "got -1.0"]),
    (["--world-size", "0"], ["world_size must be a whole number >= 1, got 0"]),
], ids=["missing-model", "steps-1", "hidden-size-negative", "layers-0", "params-negative", "timeout-negative",
        "world-size-0"])
def test_measure_inputs(argv, words, tmp_path, capsys):
    refused(capsys, ["measure", "--zero", "2", *(a.format(tmp=tmp_path) for a in argv)], words)


@pytest.mark.parametrize("argv, words", [
    (["--vocab-size", "0"], ["vocab_size must be at least 1, got 0"]),
    (["--intermediate-size", "-1"], ["intermediate_size must be at least 1, got -1"]),
    (["--params", "-3"], ["params must be at least 1, got -3.0"]),
    (["--grad-accum-steps", "0"], ["grad_accum_steps must be at least 1, got 0"]),
    (["--timeout", "0"], ["timeout must be a positive number of seconds", "got 0.0"]),
], ids=["vocab-size-0", "intermediate-size-negative", "params-negative", "grad-accum-0", "timeout-0"])
def test_comm_inputs(argv, words, capsys):
    refused(capsys, ["comm", "--zero", "2", *argv], words)


# --------------------------------------------------------------------------- launch, build-base

@pytest.mark.parametrize("argv, words", [
    (["{tmp}/no-script.py"], ["is neither a dslab recipe or driver", "nor a script file"]),
    (["--world-size", "0", "{tmp}/script.py"], ["world_size must be at least 1, got 0"]),
    (["--timeout", "-1", "{tmp}/script.py"], ["timeout must be a positive number of seconds", "got -1.0"]),
    (["--master-port", "99999", "{tmp}/script.py"], ["master_port must be a port number from 1 to 65535", "99999"]),
    (["--hang-timeout", "-1", "{tmp}/script.py"], ["hang_timeout must be a positive number of seconds"]),
], ids=["missing-script", "world-size-0", "timeout-negative", "port-out-of-range", "hang-timeout-negative"])
def test_launch_inputs(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where ./runs would go
    (tmp_path / "script.py").write_text("print('hello')\n")
    refused(capsys, ["launch", *(a.format(tmp=tmp_path) for a in argv)], words)


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0", "--output", "{tmp}/model"], ["steps must be at least 1, got 0"]),
    (["--output", "{tmp}/a-file"], ["exists and is a file", "choose a directory path"]),
], ids=["steps-0", "output-is-a-file"])
def test_build_base_inputs(argv, words, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    refused(capsys, ["build-base", "--quiet", *(a.format(tmp=tmp_path) for a in argv)], words)
    assert not (tmp_path / "model").exists()


# --------------------------------------------------------------------------- config check, config new
# `dslab config` prints its report, problems included, on stdout (tests/test_config_check.py): so does a refusal.

@pytest.mark.parametrize("argv, words", [
    (["{tmp}/no-config.json"], ["no-config.json: no such file", "ready-made configs: zero0"]),
    (["{tmp}"], ["a folder, not a file", "give a DeepSpeed JSON file"]),
    (["zero2", "--world-size", "0"], ["world_size must be at least 1, got 0"]),
], ids=["missing-file", "a-folder", "world-size-0"])
def test_config_check_inputs(argv, words, tmp_path, capsys):
    refused(capsys, ["config", "check", *(a.format(tmp=tmp_path) for a in argv)], words, stream="stdout")


@pytest.mark.parametrize("argv, words", [
    (["--world-size", "0"], ["world_size must be at least 1, got 0"]),
    (["--micro-batch-size", "0"], ["train_micro_batch_size_per_gpu: must be at least 1, got 0"]),
    (["--lr", "-1"], ["optimizer.params.lr: the learning rate must be a finite number, 0 or more, got -1.0"]),
], ids=["world-size-0", "micro-batch-0", "negative-lr"])
def test_config_new_numbers(argv, words, capsys):
    status, out, err = in_process(capsys, "config", "new", *argv)
    assert status != 0 and "Traceback" not in out + err
    assert all(w in out for w in words), out  # a config problem is reported as `config check` reports it


@pytest.mark.parametrize("where, words", [
    ("{tmp}", ["is a folder; give the path of a file to write"]),
    ("/proc/no-such-dir/ds.json", ["cannot write under '/proc'", "choose an --output directory you can write to"]),
], ids=["a-folder", "unwritable"])
def test_config_new_output_that_cannot_be_written(where, words, tmp_path, capsys):
    refused(capsys, ["config", "new", "--output", where.format(tmp=tmp_path)], words)
