"""Instructor solutions for notebooks/07_inference.ipynb (checked by tests/test_exercises.py)."""
from dslab.models import loading

config = loading.tiny_config()

# 07.allreduces_per_token: AutoTP closes attention (o_proj) and the MLP (down_proj) with one all-reduce each.
allreduces_per_token = 2 * config.num_hidden_layers

# 07.v_proj_shard: v_proj maps hidden -> kv_heads x head_dim; split by output features over 2 ranks.
head_dim = config.hidden_size // config.num_attention_heads
v_proj_shard = [config.num_key_value_heads * head_dim // 2, config.hidden_size]



# 07.init_inference: called on every rank of the job (the checker runs 2, then 3): AutoTP over all of them (no kernel
# injection), in float32 (init_inference defaults to float16, refused on CPU); the engine's greedy answer equals plain
# Hugging Face generation.
def make_engine(model):
    import deepspeed
    import torch
    import torch.distributed as dist

    return deepspeed.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": dist.get_world_size()},
                                    replace_with_kernel_inject=False)


SOLUTIONS = {
    "07.allreduces_per_token": allreduces_per_token,
    "07.v_proj_shard": v_proj_shard,
    "07.init_inference": make_engine,
}
