"""dslab.compat against the installed libraries: each private thing it reaches into is still there and does what
dslab relies on. Each test's docstring names the version it was checked against (pyproject.toml's pins);
`make test-latest` runs this file with the newest DeepSpeed. The last tests check that no other file of the
package or the tests names a private DeepSpeed or nbval name.

Light: nothing is launched, no C++ op is built."""
import ast
import importlib.util
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dslab import compat

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- DeepSpeed: the launcher

def test_hostfile_lines_are_read_by_deepspeeds_parser():
    """deepspeed 0.19.8: _parse_hostfile(lines) gives {host: slots} in file order, skips comments and blank lines,
    and raises ValueError on a bad line and on a host named twice (dslab.launch.multinode.parse_hostfile)."""
    lines = ["# one line per machine", "", "worker-1 slots=2", "worker-0 slots=4"]
    assert list(compat.parse_hostfile(lines).items()) == [("worker-1", 2), ("worker-0", 4)]
    for bad in (["worker-0 gpus=4"], ["worker-0 slots=1", "worker-0 slots=2"]):
        with pytest.raises(ValueError):
            compat.parse_hostfile(bad)


# --------------------------------------------------------------------------- DeepSpeed: the config readers

def test_the_config_readers_run_alone_and_each_section_model_is_seen():
    """deepspeed 0.19.8: DeepSpeedConfig._initialize_params reads every section on an instance that has only
    _param_dict, world_size and global_rank; each pydantic section is built through DeepSpeedConfigModel.__init__
    (self, strict=False, **data), so a key taken out of data is not seen by the model (dslab.config.keys)."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    original, built = DeepSpeedConfigModel.__init__, []

    def seen(model, data):
        built.append((model.__name__, dict(data)))
        data.pop("stage", None)

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    assert compat.read_config_sections(cfg).zero_optimization_stage == 2
    with compat.watching_config_models(seen):
        read = compat.read_config_sections(cfg)
    assert DeepSpeedConfigModel.__init__ is original
    assert ("DeepSpeedZeroConfig", {"stage": 2}) in built
    assert read.train_micro_batch_size_per_gpu == 2 and read.zero_optimization_stage == 0   # "stage" taken out


def test_removed_keys_are_the_ones_deepspeed_refuses():
    """deepspeed 0.19.8: runtime/config.py lists the removed top-level and zero_optimization keys, each with the
    message DeepSpeedConfig raises when a config has one (dslab.config.keys names them as removed)."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    removed = compat.removed_config_keys()
    assert removed["top"] and removed["zero_optimization"]
    for section, keys in removed.items():
        key, message = next(iter(keys.items()))
        cfg = {"train_micro_batch_size_per_gpu": 1, key: {}}
        if section == "zero_optimization":
            cfg = {"train_micro_batch_size_per_gpu": 1, section: {"stage": 1, key: 1}}
        with pytest.raises(DeepSpeedConfigError) as refused:
            DeepSpeedConfig(cfg)
        assert message in str(refused.value)


def test_a_config_is_read_for_the_world_size_given():
    """deepspeed 0.19.8: DeepSpeedConfig derives and checks the batch sizes from the world_size set before
    _initialize_params, divided by "sequence_parallel_size" (dslab.exercises.resolved_config)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    assert compat.config_on_ranks(dict(cfg), 4).train_batch_size == 24
    assert compat.config_on_ranks({**cfg, "sequence_parallel_size": 2}, 4).train_batch_size == 12
    with pytest.raises(AssertionError):   # 2 x 3 x 4 is not 10
        compat.config_on_ranks({**cfg, "train_batch_size": 10}, 4)


@pytest.mark.parametrize("params, built", [({"lr": 3e-4}, torch.optim.AdamW),
                                           ({"lr": 3e-4, "adam_w_mode": False}, torch.optim.Adam)])
def test_the_engine_builds_its_optimizer_from_the_config_alone(params, built):
    """deepspeed 0.19.8: DeepSpeedEngine._configure_basic_optimizer(params) needs of the engine only _config,
    client_optimizer and zenflow; "Adam" with torch_adam is torch's AdamW unless adam_w_mode is false."""
    section = {"type": "Adam", "params": {**params, "torch_adam": True}}
    read = compat.config_on_ranks({"train_micro_batch_size_per_gpu": 1, "optimizer": section}, 1)
    optimizer = compat.engine_basic_optimizer(read, torch.nn.Linear(4, 2).parameters())
    assert type(optimizer) is built and optimizer.param_groups[0]["lr"] == 3e-4


# --------------------------------------------------------------------------- DeepSpeed: engines and their state

def test_an_inference_engine_keeps_its_config_and_its_group(monkeypatch):
    """deepspeed 0.19.8: InferenceEngine.__init__ keeps its DeepSpeedInferenceConfig as _config (chapter 07 reads
    replace_with_kernel_inject there); _create_model_parallel_group makes the group of ranks 0 .. tp_size - 1 and
    keeps the first one in InferenceEngine.inference_mp_group for every later engine, until it is cleared."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.inference.engine import InferenceEngine

    assert "self._config = config" in inspect.getsource(InferenceEngine.__init__)
    config = DeepSpeedInferenceConfig(replace_with_kernel_inject=True)
    assert compat.inference_config(SimpleNamespace(_config=config)).replace_with_kernel_inject
    group = inspect.getsource(InferenceEngine._create_model_parallel_group)
    assert "ranks = [i for i in range(config.tensor_parallel.tp_size)]" in group
    assert "InferenceEngine.inference_mp_group = self.mp_group" in group
    monkeypatch.setattr(InferenceEngine, "inference_mp_group", object())
    compat.forget_inference_group()
    assert InferenceEngine.inference_mp_group is None


def test_the_checkers_quote_deepspeeds_own_words():
    """deepspeed 0.19.8: DeepSpeedEngine._configure_zero_optimizer asserts "zero stage N requires an optimizer" for
    ZeRO 1 and 2 without one, which 12.zero3_generate recognizes and names."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from dslab.exercises import ch12

    assert '"zero stage {} requires an optimizer".format(zero_stage)' in \
        inspect.getsource(DeepSpeedEngine._configure_zero_optimizer)
    assert ch12.ZERO_WITHOUT_OPTIMIZER.search("zero stage {} requires an optimizer".format(2)).group(1) == "2"


def test_the_parallel_groups_of_earlier_engines_are_forgotten(monkeypatch):
    """deepspeed 0.19.8: deepspeed/utils/groups.py keeps an engine's grid in the module-level names
    compat.PARALLEL_GROUP_NAMES; with them None, _get_model_parallel_world_size() is 1 again."""
    from deepspeed.utils import groups

    assert all(hasattr(groups, name) for name in compat.PARALLEL_GROUP_NAMES)   # a renamed one would not be cleared
    for name in compat.PARALLEL_GROUP_NAMES:
        monkeypatch.setattr(groups, name, object())   # what a pipeline's or AutoTP's engine leaves behind
    groups.mpu = SimpleNamespace(get_model_parallel_world_size=lambda: 2)
    assert groups._get_model_parallel_world_size() == 2
    compat.forget_parallel_groups()
    assert all(getattr(groups, name) is None for name in compat.PARALLEL_GROUP_NAMES)
    assert groups._get_model_parallel_world_size() == 1


def test_a_pipeline_module_keeps_its_layer_specs_and_its_first_layer():
    """deepspeed 0.19.8: PipelineModule keeps every layer it was given, on every stage, in _layer_specs; its stage's
    layers are _layer_specs[_local_start:_local_stop], built in order (chapter 11's pipeline checker). Read from the
    source and a bare instance: a real one needs a process group, and DeepSpeed's comm backend builds a C++ op."""
    from deepspeed.pipe import PipelineModule

    assert "self._layer_specs = list(layers)" in inspect.getsource(PipelineModule.__init__)
    assert "self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])" in \
        inspect.getsource(PipelineModule._partition_layers)
    build = inspect.getsource(PipelineModule._build)
    assert "enumerate(specs[self._local_start:self._local_stop])" in build
    assert "layer_idx = local_idx + self._local_start" in build
    net = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(net)
    net._layer_specs = specs = [torch.nn.Linear(2, 2) for _ in range(3)]
    net._set_bounds(start=1, stop=3)
    assert compat.pipeline_local_start(net) == 1 and compat.pipeline_layer_specs(net) is specs


def test_autotp_layers_keep_the_unsplit_shape_and_the_split():
    """deepspeed 0.19.8 (module_inject/layers.py): an AutoTP layer keeps its weight's unsplit shape in
    _orig_weight_shape and one size per rank along the split dimension in _partition_sizes: output features for
    LinearLayer (column), input features for LinearAllreduce (row)."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    column = LinearLayer(torch.nn.Linear(8, 6), mp_group=None)   # no group: nothing split, the metadata kept
    row = LinearAllreduce(torch.nn.Linear(8, 6), mp_group=None)
    assert compat.autotp_full_weight_shape(column) == compat.autotp_full_weight_shape(row) == (6, 8)
    assert compat.autotp_partition_sizes(column) == (6,) and compat.autotp_partition_sizes(row) == (8,)
    plain = torch.nn.Linear(8, 6)
    assert compat.autotp_full_weight_shape(plain) is None and compat.autotp_partition_sizes(plain) is None


def test_kernel_policies_name_the_blocks_they_replace():
    """deepspeed 0.19.8: instantiating a policy of module_inject.replace_policy.replace_policies fills its
    _orig_layer_class: a class, a list of them, or None (with transformers installed, Llama's block among them)."""
    from deepspeed.module_inject.replace_policy import replace_policies

    classes = [cls for policy in replace_policies for cls in compat.kernel_policy_layer_classes(policy)]
    assert all(isinstance(cls, type) for cls in classes)
    assert "LlamaDecoderLayer" in {cls.__name__ for cls in classes}


def test_zero_1_2_keeps_muons_staged_momentum():
    """deepspeed 0.19.8: DeepSpeedZeroOptimizer (runtime/zero/stage_1_and_2.py) starts _muon_pending_momentum
    empty and keeps (staged, flat copy) pairs in it between steps."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    source = inspect.getsource(DeepSpeedZeroOptimizer)
    assert "self._muon_pending_momentum = {}" in source
    assert "self._muon_pending_momentum[param_group_idx] = (staged, flatten_copy)" in source
    staged = torch.zeros(2)
    assert [s is staged for s in compat.muon_staged_momentum(SimpleNamespace(_muon_pending_momentum={0: (
        staged, None)}))] == [True]
    assert compat.muon_staged_momentum(torch.nn.Linear(1, 1)) == []


# --------------------------------------------------------------------------- torch

def test_hooks_of_one_backward_share_a_graph_task_id():
    """torch 2.13.0: _current_graph_task_id() is the same for every hook of one backward() call, another for the
    next call, and -1 outside a backward pass (chapter 03's checker counts backward passes by it)."""
    x = torch.ones(2, requires_grad=True)
    ids = []
    first, second = (x * 2).sum(), x * 3
    for y in (first, second):
        y.register_hook(lambda grad: ids.append(compat.autograd_graph_task_id()))
    (first + second.sum()).backward()
    again = (x * 4).sum()
    again.register_hook(lambda grad: ids.append(compat.autograd_graph_task_id()))
    again.backward()
    assert ids[0] == ids[1] != ids[2] and compat.autograd_graph_task_id() == -1


def test_the_flight_recorder_dump_lists_the_collectives():
    """torch 2.13.0: _distributed_c10d._dump_fr_trace_json() is JSON whose "entries" hold each collective's
    collective_seq_id and profiling_name (dslab.hangs.diagnoses.flight_recorder_kept)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1), group=dist.new_group(backend="gloo"))
        last = compat.flight_recorder_dump()["entries"][-1]
    finally:
        if started:
            dist.destroy_process_group()
    assert last["profiling_name"] == "gloo:all_reduce" and isinstance(last["collective_seq_id"], int)


def test_torch_builds_an_extension_in_its_own_folder(monkeypatch, tmp_path):
    """torch 2.13.0: cpp_extension._get_build_directory(name, verbose) is $TORCH_EXTENSIONS_DIR/name, created."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = Path(compat.torch_extension_dir("some_op"))
    assert path == tmp_path / "some_op" and path.is_dir()


# --------------------------------------------------------------------------- nbval

def test_nbval_compares_each_cell_by_the_rule(monkeypatch):
    """nbval 0.11.0: IPyNbCell.compare_outputs(self, test, ref, skip_compare=None) judges a cell's outputs; the
    cell holds parent.nb.metadata, cell.metadata, sanitize (the --nbval-sanitize-with rules) and
    comparison_traceback, the lines its failure report shows (tests/nbval_numbers.py)."""
    import nbformat
    from nbval.plugin import IPyNbCell, nocolors

    assert list(inspect.signature(IPyNbCell.compare_outputs).parameters) == ["self", "test", "ref", "skip_compare"]
    monkeypatch.setattr(IPyNbCell, "compare_outputs", IPyNbCell.compare_outputs)   # nbval's own again afterwards
    monkeypatch.setattr(IPyNbCell, "_dslab_rule", False, raising=False)
    seen = []

    def rule(cell, test, ref, exact):
        seen.append((cell.notebook_metadata, cell.metadata, cell.sanitize("took 12 s")))
        if cell.metadata.get("accept"):
            return True
        same = exact(test, ref)
        cell.explain("a line of ours")
        return same

    compat.compare_nbval_outputs_by(rule)
    compat.compare_nbval_outputs_by(rule)   # once per process: a second call changes nothing
    item = IPyNbCell.__new__(IPyNbCell)
    item.parent = SimpleNamespace(nb=SimpleNamespace(metadata={"notebook": 1}), skip_compare=("metadata",),
                                  sanitize_patterns={r"\d+ s": "N s"})
    item.colors, item.cell = nocolors, SimpleNamespace(metadata={})
    stream = [nbformat.from_dict({"output_type": "stream", "name": "stdout", "text": "ok\n"})]
    result = [nbformat.from_dict({"output_type": "execute_result", "data": {"text/plain": "1"}, "execution_count": 1})]
    assert item.compare_outputs(stream, stream) and item.comparison_traceback == ["a line of ours"]
    assert not item.compare_outputs(result, stream)
    assert "Missing output fields" in item.comparison_traceback[0] and item.comparison_traceback[-1] == "a line of ours"
    item.cell = SimpleNamespace(metadata={"accept": True})
    assert item.compare_outputs(result, stream) and item.comparison_traceback == []
    assert seen[0] == ({"notebook": 1}, {}, "took N s") and len(seen) == 3


# --------------------------------------------------------------------------- nothing else names them

LIBRARIES = ("deepspeed", "nbval")
ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")   # monkeypatch.setattr too
THE_DOOR = {"dslab/compat.py", "tests/test_compat.py"}
# `def _x`, `class _X`, and `_x = ...` / `obj._x = ...` / `_x: T = ...` (a keyword argument too: more is harmless)
_DEFINED = re.compile(r"\b(?:def|class)\s+(_[A-Za-z]\w*)|(?<!\w)(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=(?!=)")


def private_names(package):
    """The names with one leading underscore that a library's own source defines or assigns."""
    root = Path(importlib.util.find_spec(package).origin).parent
    return {a or b for path in root.rglob("*.py") for a, b in _DEFINED.findall(path.read_text(errors="replace"))}


def own_attributes(trees):
    """Attribute names our own classes define: their methods, and what they assign to self or cls."""
    names = set()
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.ClassDef):
            names.update(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return names


def imported_from_elsewhere(tree):
    """Names a file imports from anything but the libraries: `name._x` on one of them is not the libraries'."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] not in LIBRARIES:
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] not in LIBRARIES)
    return names


def private_uses(tree, private):
    """(line, name) for each use of a name of `private`: `x._name` (x neither self, cls nor imported from elsewhere)
    or the name as a string (getattr(x, "_name"), a list of names to set), but where getattr, setattr, hasattr,
    delattr or monkeypatch.setattr is given one of our own modules; and `from library import _name`, any private
    name."""
    ours = imported_from_elsewhere(tree) | {"self", "cls"}
    exempt = {id(node.args[1]) for node in ast.walk(tree) if isinstance(node, ast.Call) and len(node.args) > 1
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in ATTRIBUTE_CALLS
              and isinstance(node.args[0], ast.Name) and node.args[0].id in ours}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private \
                and not (isinstance(node.value, ast.Name) and node.value.id in ours):
            found.add((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in private and id(node) not in exempt:
            found.add((node.lineno, node.value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            found.update((node.lineno, a.name) for a in node.names if a.name.startswith("_"))
    return sorted(found)


def test_the_finder_finds_each_kind_of_use():
    private = {"_parse_hostfile", "_local_start", "_config"}
    tree = ast.parse("from deepspeed.launcher.runner import _parse_hostfile\nnet._local_start\n"
                     "getattr(engine, '_config')\nself._config\nmonkeypatch.setattr(groups, '_local_start', 0)\n"
                     "from dslab.exercises import _private, ch11\nch11._config\n"
                     "from deepspeed.utils import groups\ngroups._config\nmonkeypatch.setattr(ch11, '_config', 1)\n"
                     "for name in ('_local_start', 'mpu'):\n    setattr(groups, name, None)\n")
    assert private_uses(tree, private) == [(1, "_parse_hostfile"), (2, "_local_start"), (3, "_config"),
                                           (5, "_local_start"), (9, "_config"), (11, "_local_start")]
    assert private_uses(tree, private - {"_local_start"}) == [(1, "_parse_hostfile"), (3, "_config"), (9, "_config")]
    assert own_attributes([ast.parse("class A:\n    def _f(self):\n        self._g = 1\ndef _h():\n    pass\n")]) \
        == {"_f", "_g"}


def test_no_private_deepspeed_or_nbval_name_outside_the_compat_module():
    """Every private DeepSpeed or nbval name the package and the tests use goes through dslab.compat."""
    private = set().union(*map(private_names, LIBRARIES))
    assert {"_parse_hostfile", "_initialize_params", "_local_start", "_trim_base64"} <= private
    paths = [p for folder in ("dslab", "tests") for p in sorted((ROOT / folder).rglob("*.py"))
             if p.relative_to(ROOT).as_posix() not in THE_DOOR]
    trees = {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(encoding="utf-8")) for p in paths}
    private -= own_attributes(trees.values())   # an attribute of our own that a library happens to use too
    found = {(rel, name, line) for rel, tree in trees.items() for line, name in private_uses(tree, private)}
    outside = sorted(f"{rel}:{line}: {name}" for rel, name, line in found)
    assert not outside, "use these through dslab.compat (a function there, and its test here):\n" + "\n".join(outside)
