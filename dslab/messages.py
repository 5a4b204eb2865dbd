"""What dslab says to a learner, in English and in Chinese: one catalogue, one lookup (`say`).

The language: `dslab --lang zh|en` (which sets DSLAB_LANG), else $DSLAB_LANG, else the locale the way POSIX
programs read it for messages (LC_ALL, then LC_MESSAGES, then LANG): zh_* means Chinese, anything else English.
Only the words change: keys, values, commands and numbers are the same in both languages.
"""
import os

LANGUAGES = ("en", "zh")
LANG_ENV = "DSLAB_LANG"


def language():
    """"zh" or "en", as the module docstring says."""
    chosen = os.environ.get(LANG_ENV, "").strip().lower()
    if chosen in LANGUAGES:
        return chosen
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(var, "")
        if value:  # the first one set decides, as for any POSIX program
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def set_language(lang):
    """Use `lang` ("en" or "zh") from now on, in this process and in the processes it starts."""
    if lang not in LANGUAGES:
        raise ValueError(f"language {lang!r} is not one of {', '.join(LANGUAGES)}")
    os.environ[LANG_ENV] = lang


def say(key, /, **fields):
    """The catalogue's text for `key` in the current language, with `fields` filled in (a field may be named key)."""
    return CATALOGUE[key][language()].format(**fields)


# Each entry: the English and the Chinese text; {name} fields are filled by say(). Chinese follows
# docs/glossary.md's terms; DeepSpeed's keys and values stay as they are written in a config.
CATALOGUE = {
    # --- how a problem and a list of problems are shown
    "problem.fix": {"en": "fix", "zh": "修改方法"},
    "problems.header": {"en": "{n} problem{s} in {source}:", "zh": "{source}中有 {n} 个问题："},
    "problems.file": {"en": "{file}: {n} problem{s}", "zh": "{file}：{n} 个问题"},
    "problems.source": {"en": "the DeepSpeed config", "zh": "DeepSpeed 配置"},
    "config.ok": {"en": "{file}: OK", "zh": "{file}：没有问题"},
    "config.no_file": {"en": "{file}: no such file (ready-made configs: {bundled})",
                       "zh": "{file}：文件不存在（现成的配置：{bundled}）"},
    # --- the config checker (dslab.config_check)
    "check.not_a_dict": {
        "en": "a DeepSpeed config is a dict (JSON object), got {kind}",
        "zh": "DeepSpeed 配置应当是一个 dict（JSON 对象），这里是 {kind}"},
    "check.not_a_dict.fix": {
        "en": "pass a dict such as dslab.config.make_config(...) or dslab.config.load_config(path)",
        "zh": "传入一个 dict，例如 dslab.config.make_config(...) 或 dslab.config.load_config(path) 的结果"},
    "check.auto": {
        "en": '"auto" is a placeholder that only transformers\' Trainer fills in; deepspeed.initialize does not: '
              'inside sections DeepSpeed quietly uses its default, elsewhere it fails later with a confusing error',
        "zh": '"auto" 是占位符，只有 transformers 的 Trainer 会把它换成实际值，deepspeed.initialize 不会：'
              '在子配置里 DeepSpeed 会悄悄改用默认值，在别处则会在之后报出令人费解的错误'},
    "check.auto.fix": {
        "en": 'replace it with the value itself (a number, true/false, ...), or pass the config to transformers\' '
              'Trainer (TrainingArguments(deepspeed=...)), which fills every "auto" from its arguments; check such '
              'a file with `dslab config check --hf-trainer`',
        "zh": '换成具体的值（数字、true/false 等），或者把配置交给 transformers 的 Trainer'
              '（TrainingArguments(deepspeed=...)），由它根据训练参数填好每个 "auto"；'
              '这样的文件用 `dslab config check --hf-trainer` 检查'},
    "check.number_as_string": {"en": "the number {value} is written as a string ({quoted})",
                               "zh": "数字 {value} 被写成了字符串（{quoted}）"},
    "check.bool_as_string": {"en": "the boolean {value} is written as a string ({quoted})",
                             "zh": "布尔值 {value} 被写成了字符串（{quoted}）"},
    "check.remove_quotes": {"en": "remove the quotes: {value}", "zh": "去掉引号：{value}"},
    "check.removed": {"en": "DeepSpeed removed this option: {why}", "zh": "DeepSpeed 已经删除了这个选项：{why}"},
    "check.delete": {"en": "delete {key!r}", "zh": "删除 {key!r}"},
    "check.level.top": {"en": "at the top level", "zh": "在顶层"},
    "check.level.in": {"en": "in {path!r}", "zh": "在 {path!r} 中"},
    "check.unknown_key": {
        "en": "unknown key {key!r} {level}; DeepSpeed silently ignores keys it does not know",
        "zh": "{level}有未知的键 {key!r}；DeepSpeed 会悄悄忽略它不认识的键"},
    "check.did_you_mean": {"en": "did you mean {hint!r}?", "zh": "是不是想写 {hint!r}？"},
    "check.unknown_key.fix": {
        "en": "delete it, or check the spelling against DeepSpeed's config docs ({level} it reads: {keys})",
        "zh": "删除它，或对照 DeepSpeed 的配置文档检查拼写（{level}它读取的键：{keys}）"},
    "check.deprecated": {"en": "deprecated: DeepSpeed still reads it but warns and may drop it",
                         "zh": "已弃用：DeepSpeed 目前仍会读取，但会发出警告，以后可能删除"},
    "check.use_instead": {"en": "use {new!r} instead", "zh": "改用 {new!r}"},
    "check.not_object": {"en": "must be a JSON object {{...}}, got {value}", "zh": "应当是 JSON 对象 {{...}}，这里是 {value}"},
    "check.not_object.fix": {"en": "write it as an object, e.g. {key!r}: {{...}}",
                             "zh": "写成对象，例如 {key!r}: {{...}}"},
    "check.bool": {"en": "must be true or false, got {value}", "zh": "应当是 true 或 false，这里是 {value}"},
    "check.bool.fix": {"en": "write true or false (no quotes)", "zh": "写 true 或 false（不加引号）"},
    "check.int": {"en": "must be a whole number, got {value}", "zh": "应当是整数，这里是 {value}"},
    "check.int.fix": {"en": "write an integer such as 4 (no quotes)", "zh": "写一个整数，例如 4（不加引号）"},
    "check.posint": {"en": "must be at least 1, got {value}", "zh": "至少应为 1，这里是 {value}"},
    "check.posint.fix": {"en": "use a positive integer", "zh": "使用正整数"},
    "check.float": {"en": "must be a number, got {value}", "zh": "应当是数字，这里是 {value}"},
    "check.float.fix": {"en": "write a number such as 1.0 (no quotes)", "zh": "写一个数字，例如 1.0（不加引号）"},
    "check.str": {"en": "must be a string, got {value}", "zh": "应当是字符串，这里是 {value}"},
    "check.str.fix": {"en": "write it in double quotes", "zh": "用双引号括起来"},
    "check.rejects": {"en": "DeepSpeed rejects this: {msg}", "zh": "DeepSpeed 不接受这个值：{msg}"},
    "check.rejects.fix": {"en": "change the value as the message says (see DeepSpeed's config docs)",
                          "zh": "按提示修改这个值（参见 DeepSpeed 的配置文档）"},
    "check.rejects_section": {"en": "DeepSpeed rejects this section: {msg}", "zh": "DeepSpeed 不接受这一段配置：{msg}"},
    "check.rejects_section.fix": {"en": "change the values the message names", "zh": "修改提示中指出的值"},
    "check.no_batch": {
        "en": "neither train_batch_size nor train_micro_batch_size_per_gpu is set; DeepSpeed needs one of them",
        "zh": "train_batch_size 和 train_micro_batch_size_per_gpu 都没有设置；DeepSpeed 至少需要其中一个"},
    "check.no_batch.fix": {"en": "set train_micro_batch_size_per_gpu (e.g. 4)",
                           "zh": "设置 train_micro_batch_size_per_gpu（例如 4）"},
    "check.batch": {
        "en": "train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
              "{accum} x world_size {world} = {product}; world_size {world} came from {source}{fits}",
        "zh": "train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
              "{accum} x world_size {world} = {product}；world_size {world} 来自{source}{fits}"},
    "check.batch.fits": {"en": "; {total} would fit world_size {world}", "zh": "；{total} 对应的是 world_size {world}"},
    "check.batch.fix": {
        "en": "set train_batch_size to {suggested}, or remove it so DeepSpeed computes micro x accum x world; "
              "if the config is for another number of ranks, pass that world size (--world-size N)",
        "zh": "把 train_batch_size 设为 {suggested}，或者删掉它，让 DeepSpeed 自己算 micro x accum x world；"
              "如果这个配置是给另一个进程数（rank 数）用的，请传入那个 world size（--world-size N）"},
    "world.argument": {"en": "the world_size argument (--world-size)", "zh": "参数 world_size（--world-size）"},
    "world.env": {"en": "the WORLD_SIZE environment variable", "zh": "环境变量 WORLD_SIZE"},
    "world.default": {"en": "the default (no world_size given and WORLD_SIZE unset)",
                      "zh": "默认值（没有给 world_size，也没有设置 WORLD_SIZE）"},
    "check.zero_bool": {"en": "the old boolean form (true/false) is deprecated", "zh": "旧的布尔写法（true/false）已弃用"},
    "check.zero_bool.fix": {"en": 'write an object with the stage, e.g. "zero_optimization": {{"stage": 1}}',
                            "zh": '写成带 stage 的对象，例如 "zero_optimization": {{"stage": 1}}'},
    "check.zero_stage": {"en": "ZeRO stage must be 0, 1, 2 or 3, got {value}",
                         "zh": "ZeRO stage 只能是 0、1、2 或 3，这里是 {value}"},
    "check.zero_stage.fix": {
        "en": "use 0 (plain data parallel), 1 (partition optimizer states), 2 (+ gradients) or 3 (+ parameters)",
        "zh": "使用 0（普通数据并行）、1（切分优化器状态）、2（再切分梯度）或 3（再切分参数）"},
    "check.offload_device": {"en": 'offload device must be "cpu" or "nvme", got {value}',
                             "zh": 'offload 的 device 只能是 "cpu" 或 "nvme"，这里是 {value}'},
    "check.offload_device.fix": {"en": 'use "cpu" (or "nvme" with nvme_path; "none" turns offload off)',
                                 "zh": '使用 "cpu"（或带 nvme_path 的 "nvme"；"none" 表示关闭 offload）'},
    "check.nvme_path": {"en": 'device "nvme" needs nvme_path, the directory on the fast disk',
                        "zh": 'device "nvme" 需要 nvme_path，即高速磁盘上的目录'},
    "check.nvme_path.fix": {"en": 'add "nvme_path": "/local_nvme" to {key}, or use device "cpu"',
                            "zh": '在 {key} 中加入 "nvme_path": "/local_nvme"，或改用 device "cpu"'},
    "check.offload_param": {
        "en": "offload_param needs ZeRO stage 3 (parameters are only partitioned there), stage is {stage}",
        "zh": "offload_param 需要 ZeRO stage 3（只有 stage 3 才切分参数），当前 stage 是 {stage}"},
    "check.offload_param.fix": {
        "en": "set zero_optimization.stage to 3, or remove offload_param (offload_optimizer works with stages 1-3)",
        "zh": "把 zero_optimization.stage 设为 3，或删掉 offload_param（offload_optimizer 在 stage 1-3 都可用）"},
    "check.offload_optimizer": {"en": "offload_optimizer needs ZeRO stage 1, 2 or 3; with stage 0 it does nothing",
                                "zh": "offload_optimizer 需要 ZeRO stage 1、2 或 3；在 stage 0 下它不起作用"},
    "check.offload_optimizer.fix": {"en": "set zero_optimization.stage to 1, 2 or 3, or remove offload_optimizer",
                                    "zh": "把 zero_optimization.stage 设为 1、2 或 3，或删掉 offload_optimizer"},
    "check.bfloat16_name": {"en": '"bfloat16" is the old name of the section', "zh": '"bfloat16" 是这一段的旧名字'},
    "check.bfloat16_name.fix": {"en": 'rename it to "bf16"', "zh": '改名为 "bf16"'},
    "check.fp16_and_bf16": {
        "en": "fp16.enabled and {bf16_key} are both true; DeepSpeed trains in one 16-bit format",
        "zh": "fp16.enabled 和 {bf16_key} 同时为 true；DeepSpeed 只能用一种 16 位格式训练"},
    "check.fp16_and_bf16.fix": {
        "en": "keep one: bf16 on CPUs and Ampere-or-newer GPUs, fp16 on older GPUs (set the other's enabled to false)",
        "zh": "只保留一个：CPU 和 Ampere 及更新的 GPU 用 bf16，较老的 GPU 用 fp16（把另一个的 enabled 设为 false）"},
    "check.fp16_cpu": {"en": "DeepSpeed's CPU accelerator has no fp16 training", "zh": "DeepSpeed 的 CPU 加速器不支持 fp16 训练"},
    "check.fp16_device": {"en": "{detail} has no fp16 support", "zh": "{detail} 不支持 fp16"},
    "check.fp16": {
        "en": "fp16 is enabled but {why}; deepspeed.initialize would stop later with "
              "'Type fp16 is not supported on your device.'",
        "zh": "启用了 fp16，但 {why}；deepspeed.initialize 之后会报错停下："
              "'Type fp16 is not supported on your device.'"},
    "check.fp16.fix": {
        "en": "use bf16 (bf16.enabled true, fp16.enabled false) or fp32 (both false); fp16 needs a GPU",
        "zh": "改用 bf16（bf16.enabled 为 true，fp16.enabled 为 false）或 fp32（两者都为 false）；fp16 需要 GPU"},
    "check.bf16": {"en": "bf16 is enabled but {detail} has no native bf16 (it needs an Ampere or newer GPU)",
                   "zh": "启用了 bf16，但 {detail} 没有原生 bf16（需要 Ampere 或更新的 GPU）"},
    "check.bf16.fix": {"en": "use fp16 instead (fp16.enabled true, bf16.enabled false), or fp32",
                       "zh": "改用 fp16（fp16.enabled 为 true，bf16.enabled 为 false），或者 fp32"},
    "check.unknown_param": {
        "en": "unknown parameter {key!r}; the optimizer/scheduler would fail with an unexpected keyword argument",
        "zh": "未知参数 {key!r}；优化器/学习率调度器会因为意外的关键字参数而失败"},
    "check.use_one_of": {"en": "use one of: {choices}", "zh": "使用以下之一：{choices}"},
    "check.optimizer_no_type": {"en": "the optimizer section has no type, so DeepSpeed ignores it",
                                "zh": "optimizer 段没有 type，DeepSpeed 会忽略它"},
    "check.optimizer_no_type.fix": {
        "en": 'add "type": "AdamW" (or remove the section and pass an optimizer to deepspeed.initialize)',
        "zh": '加上 "type": "AdamW"（或删掉这一段，把优化器直接传给 deepspeed.initialize）'},
    "check.optimizer_unknown": {"en": "DeepSpeed knows no optimizer {name!r} (its own: {own}; or a torch.optim class name)",
                                "zh": "DeepSpeed 不认识优化器 {name!r}（它自带的：{own}；也可以用 torch.optim 的类名）"},
    "check.use_adamw": {"en": 'use "AdamW"', "zh": '使用 "AdamW"'},
    "check.max_grad_norm": {"en": "DeepSpeed refuses max_grad_norm as an optimizer parameter",
                            "zh": "DeepSpeed 不接受把 max_grad_norm 作为优化器参数"},
    "check.max_grad_norm.fix": {"en": 'remove it and set the top-level "gradient_clipping" instead',
                                "zh": '删掉它，改为设置顶层的 "gradient_clipping"'},
    "check.scheduler_no_type": {"en": "the scheduler section has no type, so DeepSpeed ignores it",
                                "zh": "scheduler 段没有 type，DeepSpeed 会忽略它"},
    "check.scheduler_no_type.fix": {"en": 'add "type": "WarmupLR" (or remove the section)',
                                    "zh": '加上 "type": "WarmupLR"（或删掉这一段）'},
    "check.scheduler_unknown": {"en": "DeepSpeed knows no LR scheduler {name!r}", "zh": "DeepSpeed 不认识学习率调度器 {name!r}"},
    "check.scheduler_unknown.fix": {
        "en": "use one of {choices} or a torch.optim.lr_scheduler class",
        "zh": "使用 {choices} 之一，或 torch.optim.lr_scheduler 中的类"},
    # --- reading a config file (dslab.config.load_config)
    "load.duplicate_key": {
        "en": "{path}: key {key!r} appears twice in the same object; JSON keeps only the last one and DeepSpeed "
              "refuses the file. Keep one {key!r}.",
        "zh": "{path}：同一个对象里键 {key!r} 出现了两次；JSON 只保留最后一个，DeepSpeed 会拒绝这个文件。"
              "只保留一个 {key!r}。"},
    "load.malformed": {"en": "{path}, line {line}, column {column}: malformed JSON: {msg}",
                       "zh": "{path}，第 {line} 行第 {column} 列：JSON 格式错误：{msg}"},
    "load.malformed.fix": {
        "en": "JSON has no comments, no trailing commas, and needs double quotes around keys and strings",
        "zh": "JSON 不能有注释，不能有末尾多余的逗号，键和字符串都要用双引号"},
    "load.not_object": {"en": "{path}: a DeepSpeed config is a JSON object {{...}}, this file holds a {kind}",
                        "zh": "{path}：DeepSpeed 配置应当是 JSON 对象 {{...}}，这个文件里是 {kind}"},
    # --- describe(): what a valid config does
    "describe.stage": {"en": "ZeRO stage {stage}", "zh": "ZeRO stage {stage}"},
    "describe.offload": {"en": "offload {what} -> {device}", "zh": "offload {what} -> {device}"},
    "describe.computed": {"en": "{total} (computed by DeepSpeed)", "zh": "{total}（由 DeepSpeed 计算）"},
    "describe.batch": {
        "en": "batch: train_batch_size {total} = micro {micro} x accum {accum} x world {world}; "
              "world_size {world} came from {source}",
        "zh": "批大小：train_batch_size {total} = micro {micro} x accum {accum} x world {world}；"
              "world_size {world} 来自{source}"},
    # --- the learner's data (dslab.data)
    "data.no_file": {"en": "{path}: no such file", "zh": "{path}：文件不存在"},
    "data.not_json": {
        "en": "{where}: not valid JSON ({msg}, column {column}); each line must be one JSON object such as "
              "{{\"query\": \"...\", \"response\": \"...\"}}",
        "zh": "{where}：不是合法的 JSON（{msg}，第 {column} 列）；每一行都必须是一个 JSON 对象，例如 "
              "{{\"query\": \"...\", \"response\": \"...\"}}"},
    "data.not_object": {"en": "{where}: expected a JSON object, got {kind}", "zh": "{where}：应当是 JSON 对象，这里是 {kind}"},
    "data.missing_field": {"en": "{where}: missing field {missing} (required: {required}; found: {found})",
                           "zh": "{where}：缺少字段 {missing}（必需：{required}；实际有：{found}）"},
    "data.none": {"en": "none", "zh": "无"},
    "data.name_pair": {"en": "{option} {values}: give one value (both languages) or two (Chinese, then English)",
                       "zh": "{option} {values}：给一个值（中英文共用）或两个值（先中文，后英文）"},
    "data.eval_question": {
        "en": "{path}: question {query!r} needs \"lang\": \"en\"|\"zh\" and \"asks\": \"name\"|\"author\" "
              "(got {lang!r}, {asks!r})",
        "zh": "{path}：问题 {query!r} 需要 \"lang\": \"en\"|\"zh\" 和 \"asks\": \"name\"|\"author\"（实际是 {lang!r}、{asks!r}）"},
    "data.no_answer": {"en": "a chat without an assistant message has nothing to learn",
                       "zh": "没有 assistant 消息的对话没有可学的内容"},
    # --- where outputs go (dslab.files)
    "files.is_a_file": {"en": "{option} {directory!r} exists and is a file; choose a directory path",
                        "zh": "{option} {directory!r} 已存在且是一个文件；请换一个目录路径"},
    "files.not_writable": {"en": "cannot write under {parent!r} ({why}); choose an {option} directory you can write to",
                           "zh": "无法在 {parent!r} 下写入（{why}）；请为 {option} 选择一个有写权限的目录"},
    "files.no_space": {
        "en": "{option} {directory!r}: only {free:,.1f} MiB free on that disk, about {needed:,.1f} MiB needed; free some "
              "space or choose {option} on another disk",
        "zh": "{option} {directory!r}：所在磁盘只剩 {free:,.1f} MiB，大约需要 {needed:,.1f} MiB；请清理空间，"
              "或把 {option} 放到另一块磁盘上"},
    # --- resuming (dslab.checkpoints)
    "resume.none": {
        "en": "--resume {path}: no complete checkpoint there (no '{latest}' file in {path} nor in {default}, where a "
              "run with --output {path} writes them); write checkpoints with --save-every K, or give --resume the "
              "--checkpoint-dir the run used",
        "zh": "--resume {path}：这里没有完整的检查点（{path} 和 {default} 中都没有 '{latest}' 文件；"
              "用 --output {path} 运行时检查点写在后者）；请用 --save-every K 保存检查点，"
              "或把那次运行的 --checkpoint-dir 传给 --resume"},
    "resume.zero_stage": {"en": "{what}: written with ZeRO-{stage}; resume with --zero {stage}",
                          "zh": "{what}：它是用 ZeRO-{stage} 写的；请用 --zero {stage} 续训"},
    "resume.zero0_world": {
        "en": "--resume {path}: written by {saved} ranks with ZeRO-0, asked for {world_size}; resume with "
              "--world-size {saved} (a different world size needs a ZeRO 1-3 checkpoint)",
        "zh": "--resume {path}：它由 {saved} 个 rank 以 ZeRO-0 写出，现在要求 {world_size} 个；请用 --world-size {saved} "
              "续训（换 world size 需要 ZeRO 1-3 的检查点）"},
    "resume.batch": {
        "en": "--resume {path}: the checkpoint's global batch is {wanted} examples per step, this run's is "
              "{global_batch}; keep it when changing the world size: {fix}",
        "zh": "--resume {path}：检查点的全局批大小是每步 {wanted} 条样本，本次运行是 {global_batch}；"
              "改变 world size 时要保持它不变：{fix}"},
    "resume.batch.fix": {
        "en": "with --world-size {world_size}, choose --micro-batch-size x --grad-accum-steps = {per_rank}",
        "zh": "在 --world-size {world_size} 下，让 --micro-batch-size x --grad-accum-steps = {per_rank}"},
    "resume.batch.divide": {"en": "choose a --world-size that divides {wanted}",
                            "zh": "选一个能整除 {wanted} 的 --world-size"},
    # --- dslab env (dslab.env.format_report)
    "env.versions": {"en": "versions", "zh": "版本"},
    "env.not_installed": {"en": "not installed", "zh": "未安装"},
    "env.accelerator": {"en": "accelerator", "zh": "加速器"},
    "env.device": {"en": "device", "zh": "设备"},
    "env.backend": {"en": "communication backend", "zh": "通信后端"},
    "env.yes": {"en": "yes", "zh": "支持"},
    "env.no": {"en": "no", "zh": "不支持"},
    "env.cpu": {"en": "cpu", "zh": "CPU"},
    "env.model": {"en": "model", "zh": "型号"},
    "env.cores": {"en": "cores usable / total", "zh": "可用核数 / 总核数"},
    "env.flags": {"en": "bf16-related flags", "zh": "与 bf16 相关的指令集"},
    "env.none": {"en": "none", "zh": "无"},
    "env.memory": {"en": "memory", "zh": "内存"},
    "env.memory_value": {"en": "{total} GiB total, {available} GiB available", "zh": "共 {total} GiB，可用 {available} GiB"},
    "env.gpus": {"en": "gpus", "zh": "GPU"},
    "env.topology": {"en": "topology (nvidia-smi topo -m):", "zh": "拓扑（nvidia-smi topo -m）："},
    "env.build_tools": {"en": "build tools", "zh": "构建工具"},
    "env.missing": {"en": "missing: {hint}", "zh": "缺少：{hint}"},
    "env.jit_ops": {"en": "JIT ops", "zh": "JIT 算子"},
    "env.cache": {"en": "cache", "zh": "缓存目录"},
    "env.built": {"en": "built", "zh": "已编译"},
    "env.not_built": {"en": "not built yet", "zh": "尚未编译"},
    "env.not_compatible": {"en": "not compatible", "zh": "不兼容"},
    "env.aio_ok": {"en": "compatible (libaio found)", "zh": "兼容（找到了 libaio）"},
    "env.aio_missing": {"en": "not available: needs libaio ({hint})", "zh": "不可用：需要 libaio（{hint}）"},
    "env.aio_use": {"en": "; the course does not use it, only {purpose} do", "zh": "；本课程不用它，只有{purpose}才用"},
    "env.what_runs": {"en": "what runs here", "zh": "这台机器上能运行的内容"},
}
