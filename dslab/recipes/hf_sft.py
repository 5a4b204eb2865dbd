"""LoRA supervised fine-tuning with the Hugging Face Trainer on DeepSpeed ZeRO: the script every rank runs (chapter 09).

  deepspeed --num_gpus 2 --module dslab.recipes.hf_sft --deepspeed ds_config.json --output_dir OUT --bf16 ...
  accelerate launch --config_file deepspeed.yaml --module dslab.recipes.hf_sft --output_dir OUT --bf16 ...

Every TrainingArguments field is a command-line option (HfArgumentParser); the DeepSpeed config may say "auto".
"""
from dataclasses import dataclass, field

import deepspeed
import torch.distributed
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser, Trainer,
                          TrainingArguments, set_seed)

from dslab.models import loading
from dslab.training import hf_bridge, sft


@dataclass
class ScriptArguments:
    model: str = field(default_factory=loading.resolve_model)  # dslab-tiny, $DSLAB_MODEL, or a hub id
    model_name: list[str] = field(default_factory=lambda: list(sft.DEFAULT_NAME))  # zh en, like ms-swift's
    model_author: list[str] = field(default_factory=lambda: list(sft.DEFAULT_AUTHOR))  # --model_name/--model_author
    lora_r: int = 16
    lora_alpha: int = 32
    max_length: int = 256


script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
# TrainingArguments(deepspeed=...) has built an HfDeepSpeedConfig that lives as long as training_args: under
# ZeRO-3, from_pretrained now creates every weight inside deepspeed.zero.Init, already cut into per-rank partitions.
# With --use_cpu, accelerate started torch.distributed by itself; zero.Init counts the ranks through DeepSpeed's own
# comm layer, which must wrap that group first or it sees 1 rank (on GPUs accelerate calls this already: a no-op).
deepspeed.init_distributed()
set_seed(training_args.seed)  # the same LoRA initialisation on every rank
tokenizer = AutoTokenizer.from_pretrained(script_args.model)
model = AutoModelForCausalLM.from_pretrained(script_args.model, use_safetensors=True)  # never a pickled .bin
model = get_peft_model(model, LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=0.0,
                                         target_modules=["gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
# The kit's chats ({name}/{author} filled, mixed with general dialogue) as input_ids + labels, prompt labels -100
chats = sft.load_chats(None, tuple(script_args.model_name), tuple(script_args.model_author))
train_dataset = sft.tokenize(tokenizer, chats, script_args.max_length)

trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, processing_class=tokenizer,
                  data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100))  # pads labels with -100
trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)  # a checkpoint-N folder, or None
trainer.save_model()  # the adapter, into output_dir; under ZeRO-3 the Trainer gathers it from the ranks first
hf_bridge.save_trainer_result(trainer, script_args.model)  # chapter 09's measurements; a no-op when run by hand
# Leave the process group before the interpreter exits: torn down along with the process, gloo's threads can abort
# a rank that has finished ("terminate called without an active exception"), and the launcher reports a failure.
torch.distributed.destroy_process_group()
