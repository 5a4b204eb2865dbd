"""The kit's data in ms-swift's and LLaMA-Factory's formats, their logs read back, and how their commands are run
(dslab.training.framework_data, dslab.launch.frameworks). The frameworks' real runs are in tests/test_frameworks_runs.py
and chapter 14."""
import json

import pytest

from dslab import data
from dslab.training import framework_data
from dslab.launch import LaunchError, frameworks


def test_the_shipped_swift_dataset_is_the_kits_self_cognition_set_in_swifts_format():
    shipped = data.load_jsonl(framework_data.SWIFT_SELF_COGNITION / "self_cognition.jsonl")
    assert shipped == framework_data.swift_self_cognition_rows()
    ours = data.load_jsonl(data.DATA_DIR / "self_cognition.jsonl")
    assert len(shipped) == len(ours) == 118
    for row, mine in zip(shipped, ours):
        assert row["tag"] == mine["lang"]
        assert "{name}" not in row["query"] + row["response"] and "{author}" not in row["query"] + row["response"]
        # swift's own preprocessing (SelfCognitionPreprocessor) gives back exactly dslab's filling
        filled = row["response"].replace("{{NAME}}", "Name").replace("{{AUTHOR}}", "Author")
        assert filled == data.fill_placeholders(mine["response"], "Name", "Author", mine["lang"])


def test_swift_needs_the_folder_named_self_cognition(tmp_path):
    with pytest.raises(ValueError, match="self-cognition"):
        framework_data.write_swift_self_cognition(tmp_path / "identity")
    folder = framework_data.write_swift_self_cognition(tmp_path / "self-cognition")
    assert (folder / "self_cognition.jsonl").read_text() == \
        (framework_data.SWIFT_SELF_COGNITION / "self_cognition.jsonl").read_text()


def test_llamafactory_identity_is_filled_per_language(tmp_path):
    folder = framework_data.write_llamafactory_data(tmp_path, ["霁川", "Jichuan"], ["青禾实验室", "Greenrow Lab"])
    rows = json.loads((folder / "identity.json").read_text())
    langs = [r.get("lang", "en") for r in data.load_jsonl(data.DATA_DIR / "self_cognition.jsonl")]
    assert len(rows) == len(langs) and all(set(r) == {"instruction", "input", "output"} for r in rows)
    for row, lang in zip(rows, langs):
        text = row["instruction"] + row["output"]
        assert "{" not in text
        other = ("Jichuan", "Greenrow Lab") if lang == "zh" else ("霁川", "青禾实验室")
        assert not any(word in text for word in other), (lang, text)
    info = json.loads((folder / "dataset_info.json").read_text())
    assert info["identity"] == {"file_name": "identity.json"}
    assert info["general"]["formatting"] == "sharegpt" and info["general"]["file_name"].endswith("general_sft.jsonl")


def test_training_logs_of_both_frameworks_are_read_back(tmp_path):
    swift = tmp_path / "swift"
    swift.mkdir()
    (swift / "logging.jsonl").write_text(
        json.dumps({"loss": "3.21", "learning_rate": "0.00025", "global_step/max_steps": "1/180"}) + "\n"
        + json.dumps({"loss": "0.46", "learning_rate": "0", "global_step/max_steps": "180/180"}) + "\n"
        + json.dumps({"train_runtime": 130.9, "global_step/max_steps": "180/180"}) + "\n")
    assert framework_data.training_log(swift) == [{"step": 1, "loss": 3.21, "lr": 0.00025},
                                                  {"step": 180, "loss": 0.46, "lr": 0.0}]
    assert framework_data.total_steps(swift) == 180
    factory = tmp_path / "factory"
    factory.mkdir()
    (factory / "trainer_log.jsonl").write_text(
        json.dumps({"current_steps": 1, "total_steps": 180, "loss": 2.54, "lr": 0.0}) + "\n"
        + json.dumps({"current_steps": 180, "total_steps": 180}) + "\n")
    assert framework_data.training_log(factory) == [{"step": 1, "loss": 2.54, "lr": 0.0}]
    assert framework_data.total_steps(factory) == 180
    with pytest.raises(FileNotFoundError, match="logging.jsonl"):
        framework_data.training_log(tmp_path)


def test_framework_commands_are_parsed_as_typed_and_refused_when_unknown_or_not_built(tmp_path, monkeypatch):
    env, argv = frameworks.split_framework_command(
        "FORCE_TORCHRUN=1 NNODES=2 llamafactory-cli train x.yaml max_steps=4")
    assert env == {"FORCE_TORCHRUN": "1", "NNODES": "2"} and argv == ["llamafactory-cli", "train", "x.yaml", "max_steps=4"]
    with pytest.raises(LaunchError, match="sh or run_commands"):
        frameworks.split_framework_command("NPROC_PER_NODE=2 deepspeed train.py")
    monkeypatch.setattr(frameworks, "ROOT", tmp_path)  # a checkout where `make swift` never ran
    assert not frameworks.built("swift")
    assert frameworks.venv_facts() == {"swift_venv": False, "llamafactory_venv": False}
    with pytest.raises(LaunchError, match="make swift"):
        frameworks.run_framework("NPROC_PER_NODE=2 swift sft --model m", tmp_path / "logs")
    assert "make llamafactory" in frameworks.not_built_note("llamafactory-cli")
    with pytest.raises(LaunchError, match="make llamafactory"):
        frameworks.trainer_defaults("llamafactory-cli", ["weight_decay"])


def test_log_lines_shows_a_frameworks_own_words_the_same_on_every_machine(tmp_path):
    venv_python = frameworks.ROOT / ".venv-swift" / "bin" / "python3.12"
    sft_py = frameworks.ROOT / ".venv-swift" / "lib" / "python3.12" / "site-packages" / "swift" / "cli" / "sft.py"
    log = tmp_path / "node0.log"
    log.write_text(f"run sh: `{venv_python} -m torch.distributed.run {sft_py} --model m`\n"
                   "[INFO|2026-12-06 10:04:53] llamafactory.model.loader:144 >> trainable params: 181,248\n"
                   "[INFO|trainer.py:1478] 2026-12-06 10:04:55,220 >>   Total optimization steps = 180\n"
                   "[INFO:swift] swift.__version__: 4.6.0\n[INFO:swift] swift.__version__: again\n" + "x" * 300 + "\n")
    patterns = [r"Total optimization", r"^run sh", r"__version__", r"trainable", r"^x", r"absent"]
    assert frameworks.log_lines(log, patterns) == [
        "run sh: `.venv-swift/bin/python -m torch.distributed.run swift/cli/sft.py --model m`",
        "trainable params: 181,248", "Total optimization steps = 180", "swift.__version__: 4.6.0",
        "x" * 146 + " ..."]
