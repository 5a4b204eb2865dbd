"""The one door to the private API of DeepSpeed, torch and nbval: what dslab uses of theirs that they do not promise.

Each function reaches into one private thing, and its docstring says what, the pinned version it was checked
against (pyproject.toml: deepspeed 0.19.8, torch 2.13.0, nbval 0.11.0) and what breaks if a release changes it.
tests/test_compat.py checks each one against the installed libraries, and `make test-latest` runs those checks with
the newest DeepSpeed, so a release that breaks one is seen the day it ships. tests/test_compat.py also fails on a
private DeepSpeed or nbval name used anywhere else in dslab or the tests.

Imports are lazy, as elsewhere in dslab: `import dslab.compat` loads none of these libraries.
"""
from contextlib import contextmanager

# --------------------------------------------------------------------------- DeepSpeed: the launcher


def parse_hostfile(lines):
    """{host: slots} from hostfile lines, in file order, read by DeepSpeed's own parser.

    deepspeed.launcher.runner._parse_hostfile(lines), checked against deepspeed 0.19.8: an OrderedDict, comments and
    blank lines skipped, ValueError on a bad line or a host named twice. If it changes, dslab.launch.multinode (chapter
    08's hostfiles) stops reading hostfiles as the `deepspeed` command does.
    """
    from deepspeed.launcher.runner import _parse_hostfile

    return _parse_hostfile(lines)


# --------------------------------------------------------------------------- DeepSpeed: the config readers

@contextmanager
def watching_config_models(seen):
    """While open, seen(model_class, data) is called before each DeepSpeed config section's pydantic model is built,
    with the keyword data it is built from (seen may take keys out of it).

    Wraps DeepSpeedConfigModel.__init__(self, strict=False, **data) (deepspeed/runtime/config_utils.py), checked
    against deepspeed 0.19.8: every section model is built through it. If its signature or that path changes,
    dslab.config.keys no longer learns which model validates which section, and the config checker misses the
    keys DeepSpeed refuses there.
    """
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    original = DeepSpeedConfigModel.__init__

    def watched(self, strict=False, **data):
        seen(type(self), data)
        original(self, strict=strict, **data)

    DeepSpeedConfigModel.__init__ = watched
    try:
        yield
    finally:
        DeepSpeedConfigModel.__init__ = original


def read_config_sections(param_dict):
    """Run DeepSpeed's config readers over param_dict as one rank's DeepSpeedConfig would, without the rest of its
    __init__ (no process group, no batch checks); whatever a reader raises is raised.

    DeepSpeedConfig._initialize_params(param_dict) on an instance made with __new__ and given the _param_dict,
    world_size and global_rank that __init__ sets before calling it; checked against deepspeed 0.19.8. If the
    readers move out of _initialize_params or read other attributes, dslab.config.keys finds fewer keys (or none).
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = DeepSpeedConfig.__new__(DeepSpeedConfig)
    probe._param_dict, probe.world_size, probe.global_rank = param_dict, 1, 0
    probe._initialize_params(param_dict)
    return probe


def removed_config_keys():
    """{"top": {key: message}, "zero_optimization": {key: message}}: the keys DeepSpeed refuses as removed features.

    deepspeed.runtime.config's _REMOVED_TOP_LEVEL_CONFIG_KEYS and _REMOVED_ZERO_CONFIG_KEYS, checked against
    deepspeed 0.19.8; empty where a release lacks them. If they are renamed, the config checker stops naming a
    removed key (DeepSpeed still refuses it, in its own words).
    """
    from deepspeed.runtime import config

    return {"top": dict(getattr(config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})),
            "zero_optimization": dict(getattr(config, "_REMOVED_ZERO_CONFIG_KEYS", {}))}


def config_on_ranks(param_dict, world_size):
    """DeepSpeedConfig(param_dict) as deepspeed.initialize reads it on world_size ranks with no mpu, in this process
    (which has no process group): the batch sizes derived and checked against that world size.

    A subclass sets world_size at the start of DeepSpeedConfig._initialize_params, as __init__ does before calling it
    (world size / "sequence_parallel_size" where the config has one); checked against deepspeed 0.19.8. If the batch
    arithmetic moves out of _initialize_params, the exercise checkers judge batch sizes for the wrong world size.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    class OnRanks(DeepSpeedConfig):
        def _initialize_params(self, param_dict):
            sequence_parallel = param_dict.get("sequence_parallel_size", 1)
            self.world_size = world_size / sequence_parallel if sequence_parallel != 1 else world_size
            super()._initialize_params(param_dict)

    return OnRanks(param_dict)


def engine_basic_optimizer(ds_config, params):
    """The optimizer DeepSpeedEngine builds for `params` from a DeepSpeedConfig's "optimizer" section, built by the
    engine's own code without a model, a process group or an engine.

    DeepSpeedEngine._configure_basic_optimizer run on a stand-in that holds what it reads (_config, client_optimizer,
    zenflow) and lends every other attribute from the class; checked against deepspeed 0.19.8. If it reads more of
    the engine, the tests that hold dslab.exercises.resolved_optimizer against it fail with an AttributeError.
    """
    import types

    from deepspeed.runtime.engine import DeepSpeedEngine

    class EngineParts:
        def __init__(self):
            self._config, self.client_optimizer, self.zenflow = ds_config, None, False

        def __getattr__(self, name):
            attr = getattr(DeepSpeedEngine, name)
            return types.MethodType(attr, self) if callable(attr) else attr

    return EngineParts()._configure_basic_optimizer(params)


# --------------------------------------------------------------------------- DeepSpeed: engines and their state

def inference_config(engine):
    """The DeepSpeedInferenceConfig an InferenceEngine was made with (replace_with_kernel_inject, tensor_parallel...).

    InferenceEngine._config, checked against deepspeed 0.19.8 (no public accessor). If it is renamed, chapter 07's
    checker cannot tell a learner that kernel injection was asked for.
    """
    return engine._config


def forget_inference_group():
    """Let the next init_inference in this process make its own tensor-parallel group.

    DeepSpeed keeps the first InferenceEngine's group in the class attribute InferenceEngine.inference_mp_group and
    hands it to every later engine (set in InferenceEngine._create_model_parallel_group); checked against deepspeed
    0.19.8. If that changes, chapter 07's checker, which runs several answers in one process, may give an answer an
    earlier answer's group.
    """
    from deepspeed.inference.engine import InferenceEngine

    InferenceEngine.inference_mp_group = None


# deepspeed/utils/groups.py's module-level pointers to the groups an engine with a grid set up.
PARALLEL_GROUP_NAMES = ("_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK",
                        "mpu", "mesh_device")


def forget_parallel_groups():
    """Clear DeepSpeed's pointers to the parallel groups of earlier engines in this process (the groups stay).

    Sets PARALLEL_GROUP_NAMES in deepspeed.utils.groups to None, checked against deepspeed 0.19.8: with them None,
    groups._get_model_parallel_world_size() is 1 and AutoTP builds a new mesh. If a release keeps this state
    elsewhere, an engine made after a pipeline or AutoTP engine in the same process takes their grid
    (dslab.parallel.tensor_parallel.forget_groups).
    """
    from deepspeed.utils import groups

    for name in PARALLEL_GROUP_NAMES:
        setattr(groups, name, None)


def pipeline_local_start(module):
    """The index, in the whole PipelineModule, of the first layer this rank's stage holds.

    PipelineModule._local_start, checked against deepspeed 0.19.8. If it is renamed, chapter 11's pipeline checker
    cannot line a stage's layers up with the one-process twin's.
    """
    return module._local_start


def pipeline_layer_specs(module):
    """Every layer (LayerSpec or module) the PipelineModule was given, on every stage, as a list.

    PipelineModule._layer_specs, checked against deepspeed 0.19.8. If it is renamed, chapter 11's pipeline checker
    cannot count the model's layers or tell whether they were given as LayerSpecs.
    """
    return module._layer_specs


def autotp_partition_sizes(layer):
    """The sizes an AutoTP layer split its weight into along the split dimension, one per rank (None: not split).

    The _partition_sizes AutoTP's layers set (deepspeed/module_inject/layers.py), checked against deepspeed 0.19.8.
    If it is renamed, chapter 11's tensor-data checker finds no counterpart for a split weight and says so.
    """
    return getattr(layer, "_partition_sizes", None)


def autotp_full_weight_shape(layer):
    """The shape of an AutoTP layer's weight before it was split over the ranks (None: not recorded).

    The _orig_weight_shape AutoTP's layers set (deepspeed/module_inject/layers.py), checked against deepspeed 0.19.8.
    If it is renamed, dslab.parallel.tensor_parallel counts a split layer at its local size.
    """
    shape = getattr(layer, "_orig_weight_shape", None)
    return None if shape is None else tuple(shape)


def kernel_policy_layer_classes(policy):
    """The transformer block classes a DeepSpeed kernel-injection policy class replaces (None left out).

    Instantiating policy(None) fills the class attribute _orig_layer_class (a class, a list of them, or None when the
    model library is missing), checked against deepspeed 0.19.8 (module_inject/containers). If it is renamed,
    dslab.parallel.tp_infer lists no model family as having fused kernels.
    """
    policy(None)
    classes = policy._orig_layer_class
    return [cls for cls in (classes if isinstance(classes, list) else [classes]) if cls is not None]


# Readable names for the buffers DeepSpeed's ZeRO optimizers keep, by attribute name (stage_1_and_2.py and stage3.py,
# checked against deepspeed 0.19.8; one is private). dslab.zero.engine_memory walks the optimizer's tensors and labels
# each by the attribute it hangs from: a renamed attribute is still counted, under "buffer: NAME".
ZERO_BUFFER_LABELS = {
    "ipg_buckets": "reduce bucket (reduce_bucket_size)",
    "accumulated_grads_in_cpu": "16-bit gradient accumulation",
    "param_buffer_of_bit16_for_cpu_offload_groups": "16-bit parameter staging",
    "temp_grad_buffer_for_cpu_offload": "gradient staging",
    "temp_grad_buffer_for_gpu_offload": "gradient staging",
    "_global_grad_norm": "gradient norm",
    "inf_or_nan_tracker": "overflow flag",
}


def muon_staged_momentum(optimizer):
    """The staged copies of Muon's momentum a ZeRO 1-2 optimizer keeps between steps (an empty list elsewhere).

    The values (staged, flat copy) of DeepSpeedZeroOptimizer._muon_pending_momentum (runtime/zero/stage_1_and_2.py),
    checked against deepspeed 0.19.8. If it is renamed, the memory ledgers of dslab.zero leave the staged momentum
    out of the optimizer's bytes.
    """
    return [staged for staged, _ in (getattr(optimizer, "_muon_pending_momentum", None) or {}).values()]


# --------------------------------------------------------------------------- torch

def autograd_graph_task_id():
    """An id of the backward pass running now (the same for every hook one backward() call runs); -1 outside one.

    torch._C._current_graph_task_id(), checked against torch 2.13.0. If it goes, chapter 03's checker cannot count
    how many backward passes a learner's loop ran.
    """
    import torch

    return torch._C._current_graph_task_id()


def flight_recorder_dump():
    """What torch's flight recorder holds in this process, as the dict a dump file has ("entries", ...).

    json.loads(torch._C._distributed_c10d._dump_fr_trace_json()), checked against torch 2.13.0. If it goes,
    dslab.hangs.diagnoses.flight_recorder_kept (chapter 12) cannot show which collectives the recorder kept.
    """
    import json

    import torch

    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json())


def torch_extension_dir(name):
    """The folder torch builds and loads C++ extension `name` in (it creates it).

    torch.utils.cpp_extension._get_build_directory(name, verbose=False), checked against torch 2.13.0. If it changes,
    the test that holds dslab.machine.extensions_dir against torch's own choice cannot run.
    """
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, False)


# --------------------------------------------------------------------------- nbval

def compare_nbval_outputs_by(rule):
    """Make nbval compare each cell's outputs by rule(cell, test, ref, exact) -> bool (done once per process).

    `cell` has notebook_metadata, metadata (the cell's), sanitize (nbval's --nbval-sanitize-with rules for one
    string) and explain(text) (a line for the failure report); exact(test, ref) is nbval's own comparison.
    Replaces nbval.plugin.IPyNbCell.compare_outputs(self, test, ref, skip_compare=None), reading the cell's
    parent.nb.metadata, cell.metadata, sanitize and comparison_traceback; checked against nbval 0.11.0. If these
    change, tests/nbval_numbers.py's rule (numbers within a tolerance) stops working and the notebooks fail or
    compare exactly.
    """
    from types import SimpleNamespace

    from nbval.plugin import IPyNbCell

    if getattr(IPyNbCell, "_dslab_rule", False):
        return
    exact = IPyNbCell.compare_outputs

    def compare_outputs(self, test, ref, skip_compare=None):
        self.comparison_traceback = []   # what nbval's own comparison starts with; an accepted cell reports nothing
        cell = SimpleNamespace(notebook_metadata=self.parent.nb.metadata, metadata=self.cell.metadata,
                               sanitize=self.sanitize, explain=lambda text: self.comparison_traceback.append(text))
        return rule(cell, test, ref, lambda test, ref: exact(self, test, ref, skip_compare))

    IPyNbCell.compare_outputs = compare_outputs
    IPyNbCell._dslab_rule = True
