"""ZeRO++ hierarchical partitioning (hpZ): ZeRO-3 with a second copy of the parameters within each group of ranks.

Plain ZeRO-3 splits every parameter over all N ranks and all-gathers it from all of them before each use, in the
forward and again in the backward. With `"zero_hpz_partition_size": g` each rank also keeps a secondary shard of
1/g of every parameter (on top of its primary 1/N), filled without communication when the parameter is released
after its first use (deepspeed/runtime/zero/partition_parameters.py, _partition_param_sec); later gathers in the
step read the secondary shards within the rank's group of g consecutive ranks (deepspeed/utils/groups.py,
_create_zero_param_parallel_group: [0..g-1], [g..2g-1], ...). With g = the ranks of one node, the backward
all-gathers never leave the node.

`gathers_by_pass` runs one configuration on a rank and records, for the forward and the backward of its last step,
the all-gathers DeepSpeed's comms logger saw (their messages: the shard each rank puts in) and the bytes this rank
sent and received, per peer, while ZeRO-3 fetched parameters (`FetchBytes`).
"""
import copy

from dslab.comm import gloo_bytes, wire
from dslab.config.build import BUCKET_SIZE


def zero3_config(zero_hpz_partition_size=1, micro_batch_size=2):
    """A ZeRO-3 ds_config (fp32) that releases every layer after use, so the backward must gather it again.

    The three stage3_* keys at 0 turn off what would keep gathered layers until the backward on a model this
    small (prefetching, reuse distance, live-parameter budget); persistence 0 partitions even the small norms.
    """
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": BUCKET_SIZE}
    if zero_hpz_partition_size > 1:
        zero["zero_hpz_partition_size"] = zero_hpz_partition_size
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": 0.0, "steps_per_print": 10**6,
            "comms_logger": {"enabled": True, "prof_all": True},
            "zero_optimization": zero}


def _all_gathers(raw):
    """[[message bytes, calls], ...] of the all-gathers among the comms logger's records (a JSON-ready list)."""
    out = {}
    for name, by_size in raw.items():
        if name.split(" |")[0].startswith("all_gather"):
            for size, record in by_size.items():
                out[size] = out.get(size, 0) + record[0]
    return [[size, calls] for size, calls in sorted(out.items())]


def peer_ranks():
    """{(host, port): rank} for every rank's end of its TCP connections (a collective: every rank calls it).

    A peer in dslab.comm.wire.tcp_bytes is named by the address of its own end of the connection; this maps it back to
    the rank it belongs to.
    """
    import torch.distributed as tdist

    endpoints = [None] * tdist.get_world_size()
    tdist.all_gather_object(endpoints, wire.local_endpoints())
    return {tuple(end): rank for rank, ends in enumerate(endpoints) for end in ends}


class FetchBytes:
    """Bytes this rank sends and receives while ZeRO-3 fetches parameters, between start() and stop().

    DeepSpeed's module hooks call the parameter coordinator's fetch_sub_module before each module runs, in the
    forward and in the backward (runtime/zero/parameter_offload.py). With prefetching off (zero3_config) it starts
    the module's all-gathers and waits for them, so what the rank sends and receives inside it is exactly those
    gathers; the gradients' reduce-scatters run in the backward hooks, outside it, and are not counted.
    sent: bytes this process wrote (`wchar`, dslab.comm.wire.bytes_written: chapter 10's counter); received: TCP
    payload bytes, per peer rank (dslab.comm.wire.tcp_bytes), since /proc/self/io does not count socket reads.
    """

    def __init__(self, engine, owners, world_size):
        self.owners, self.world_size, self.counting = owners, world_size, False
        self.sent, self.received, self.unknown = 0, [0] * world_size, 0
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        fetch = coordinator.fetch_sub_module

        def counted_fetch(*args, **kwargs):
            if not self.counting:
                return fetch(*args, **kwargs)
            written, connections = wire.bytes_written(), wire.tcp_bytes()
            try:
                return fetch(*args, **kwargs)
            finally:
                self.sent += wire.bytes_written() - written
                for peer, (_, received) in wire.tcp_bytes().items():
                    delta = received - connections.get(peer, [0, 0])[1]
                    if peer in self.owners:
                        self.received[self.owners[peer]] += delta
                    else:
                        self.unknown += delta  # the rendezvous store, or a connection made meanwhile

        coordinator.fetch_sub_module = counted_fetch   # this instance only: the hooks look it up on the instance

    def start(self):
        self.sent, self.received, self.unknown, self.counting = 0, [0] * self.world_size, 0, True

    def stop(self):
        """{"sent": bytes, "received": [bytes from rank 0, 1, ...], "received_unknown": bytes from no rank}."""
        self.counting = False
        return {"sent": self.sent, "received": list(self.received), "received_unknown": self.unknown}


def gathers_by_pass(ds_config, steps, model_path=None):
    """Run on every rank: train dslab-tiny under `ds_config` on `steps` (lists of token batches, one per rank);
    in the last step, record the forward and the backward separately.

    Returns {"losses", "forward", "backward", "primary", "secondary"}. forward / backward: {"gathers": [[message
    bytes (the shard each rank puts in), calls], ...] from the comms logger, "sent", "received",
    "received_unknown"} (FetchBytes). primary / secondary: this rank's shards of the embedding after the forward
    (elements; secondary None without hpZ).
    """
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.comm import comms_logger

    from dslab.models import loading

    engine, *_ = deepspeed.initialize(model=copy.deepcopy(loading.load_model(model_path)).train(), config=ds_config)
    rank, world_size = tdist.get_rank(), tdist.get_world_size()
    fetches = FetchBytes(engine, peer_ranks(), world_size)   # every process group is connected by now
    losses, passes = [], {}
    for index, batches in enumerate(steps):
        tokens = batches[rank % len(batches)].to(engine.device)
        last = index == len(steps) - 1
        comms_logger.reset_data()
        if last:
            fetches.start()
        loss = engine(input_ids=tokens, labels=tokens).loss
        if last:
            passes["forward"] = {"gathers": _all_gathers(comms_logger.get_raw_data()), **fetches.stop()}
            embed = engine.module.model.embed_tokens.weight   # released after the forward: shards only
            passes["primary"] = embed.ds_tensor.numel()
            secondary = getattr(embed, "ds_secondary_tensor", None)
            passes["secondary"] = None if secondary is None else secondary.numel()
            comms_logger.reset_data()
            fetches.start()
        engine.backward(loss)
        if last:
            fetched = fetches.stop()
        engine.step()
        if last:
            passes["backward"] = {"gathers": _all_gathers(comms_logger.get_raw_data()), **fetched}
        losses.append(loss.item())
    comms_logger.reset_data()
    return {"losses": losses, **passes}


def shard_bytes(pairs):
    """The sum of message size x calls over [size, calls] pairs: the bytes of the shards a rank put in (what the
    comms logger records for an all-gather), not what it sent."""
    return sum(size * calls for size, calls in pairs)


def gloo_gather_bytes(pairs, group_size):
    """Bytes a rank writes for these all-gathers ([shard bytes, calls] pairs) in groups of `group_size` ranks on
    gloo: (group_size - 1) x each shard, plus gloo's preambles (dslab.comm.gloo_bytes)."""
    return sum(calls * gloo_bytes.all_gather(size, group_size)[0] for size, calls in pairs)
