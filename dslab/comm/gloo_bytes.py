"""What torch's gloo backend writes to its sockets for one collective, rank by rank, headers included.

Read from torch 2.13's ProcessGroupGloo and gloo's algorithms (gloo/allreduce.cc, gloo/allgather.cc,
gloo/transport/tcp/pair.cc), and checked against the bytes each process wrote (/proc/self/io `wchar`) for
all_reduce, reduce_scatter_tensor and all_gather_into_tensor of 1 to 4M elements, bf16 and fp32, on 2, 3 and
4 ranks: equal to the byte.

  all_reduce              a ring: the buffer is cut into S = N x (segments per rank) segments; each rank sends
                          S - S/N of them while reducing (reduce-scatter) and as many again while sharing the
                          sums (all-gather): about 2(N-1)/N x the buffer, rounded to whole segments and elements
  reduce_scatter_tensor   gloo has no reduce-scatter of its own: torch clones the input, all-reduces the clone
                          and keeps its chunk, so it costs an all-reduce of the whole input, 2(N-1)/N, not (N-1)/N
  all_gather_into_tensor  a ring: each rank sends its shard on N-1 times, as two halves: (N-1) x the shard
  reduce                  (gloo/reduce.cc) the all-reduce's reduce-scatter ring, S - 2 segment sends of S (so
                          (N-1)/N x the buffer at the minimum S = 2N, more past gloo's 1 MiB segments), then every
                          rank but the root sends the root its reduced chunk: root (N-1)/N, the others 1 x the buffer
  broadcast               (gloo/broadcast.cc) a binomial tree from the root: each rank sends the buffer to at most
                          log2(N) others, N - 1 sends in all; a 0-byte broadcast still sends its preambles
  every message           the sender writes two 48-byte preambles (notify "send ready", then the data's own),
                          the receiver one ("receive ready"): tiny collectives are mostly headers
"""
from dslab.comm.wire import RING_FACTORS

# gloo/transport/tcp/pair.h: each operation starts with a preamble of six size_t fields.
HEADER_BYTES = 48
# gloo/allreduce.h: AllreduceOptions::kMaxSegmentSize, the largest piece the ring passes on at once.
MAX_SEGMENT_BYTES = 1 << 20

# The element size of each dtype name the kit uses (DeepSpeed's norms are fp64, its overflow flag uint8, the
# lists ZeRO-3 checks across ranks int64).
ELEMENT_BYTES = {"fp64": 8, "int64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "uint8": 1}

OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "reduce", "broadcast")


def _round_up(x, multiple):
    return (x + multiple - 1) // multiple * multiple


def _messages_bytes(payload, sent, received):
    """Wire bytes for `payload` bytes in `sent` messages, `received` messages coming in."""
    return payload + 2 * HEADER_BYTES * sent + HEADER_BYTES * received


def all_reduce(nbytes, element_size, world_size):
    """Bytes each rank writes for one gloo all-reduce of an `nbytes` buffer: a list, one number per rank."""
    n = world_size
    if n == 1:
        return [0]
    max_segment = element_size * max(1, MAX_SEGMENT_BYTES // element_size)
    segments = _round_up(max(-(-nbytes // max_segment), 2 * n), n)  # at least two per rank, a multiple of N
    per_rank = segments // n
    segment = _round_up(-(-nbytes // segments), element_size)
    span = segments * segment

    def length(chunk, i):  # segment i of chunk `chunk`; the last ones may be short or empty
        return min(segment, nbytes - ((chunk * per_rank + i) * segment) % span)

    out = []
    for rank in range(n):
        payload = sent = received = 0
        # reduce-scatter: send chunk rank+1's segments, receive rank+2's; all-gather: send rank's, receive rank+1's
        for send_chunk, recv_chunk in ((rank + 1, rank + 2), (rank, rank + 1)):
            for i in range(segments - per_rank):
                if (size := length(send_chunk, i)) > 0:
                    payload, sent = payload + size, sent + 1
                if length(recv_chunk, i) > 0:
                    received += 1
        out.append(_messages_bytes(payload, sent, received))
    return out


def all_gather(shard_bytes, world_size):
    """Bytes each rank writes for one gloo all-gather of `shard_bytes` per rank: a list, one number per rank."""
    n = world_size
    if n == 1:
        return [0]
    messages = 2 * (n - 1)  # each shard goes round as two halves
    return [_messages_bytes((n - 1) * shard_bytes, messages, messages)] * n


def reduce(nbytes, element_size, world_size, root=0):
    """Bytes each rank writes for one gloo reduce of an `nbytes` buffer to `root`: a list, one number per rank."""
    n = world_size
    if n == 1 or nbytes == 0:
        return [0] * n
    max_segment = element_size * max(1, MAX_SEGMENT_BYTES // element_size)
    segment = _round_up(min(-(-nbytes // (2 * n)), max_segment), element_size)
    segments = _round_up(max(-(-nbytes // segment), 2 * n), n)
    per_rank, span = segments // n, segments * segment
    chunk = per_rank * segment
    out = []
    for rank in range(n):
        payload = sent = received = 0
        for i in range(segments - 2):  # the ring: send to rank - 1 from chunk rank+1, receive chunk rank+2
            if (size := min(segment, nbytes - ((rank + 1) * per_rank + i) * segment % span)) > 0:
                payload, sent = payload + size, sent + 1
            if min(segment, nbytes - ((rank + 2) * per_rank + i) * segment % span) > 0:
                received += 1
        if rank == root:  # then every other rank's reduced chunk comes to the root
            received += sum(1 for r in range(n) if r != root and nbytes > r * chunk)
        elif (size := min(chunk, nbytes - rank * chunk)) > 0:
            payload, sent = payload + size, sent + 1
        out.append(_messages_bytes(payload, sent, received))
    return out


def broadcast(nbytes, world_size, root=0):
    """Bytes each rank writes for one gloo broadcast of `nbytes` from `root`: a list, one number per rank."""
    n = world_size
    dim = (n - 1).bit_length()  # log2(N), rounded up: the tree's depth
    out = []
    for rank in range(n):
        vrank, mask, sent, received = (rank - root) % n, (1 << dim) - 1, 0, 0
        for i in range(dim):  # in round i, ranks whose low i+1 bits are 0 pair with the rank 2^i away
            mask ^= 1 << i
            if vrank & mask or (vrank ^ (1 << i)) >= n:
                continue
            if vrank & (1 << i):
                received += 1
            else:
                sent += 1
        out.append(_messages_bytes(sent * nbytes, sent, received))
    return out


def collective(op, numel, dtype, world_size, root=0):
    """Bytes each rank writes for `op` on `numel` elements of `dtype`, counted as DeepSpeed's comms logger counts.

    numel is the message the logger records: the tensor for all_reduce, reduce and broadcast, the whole input
    for reduce_scatter_tensor, one rank's shard for all_gather_into_tensor. root: of a reduce or broadcast.
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")
    size = ELEMENT_BYTES[dtype]
    if op == "all_gather_into_tensor":
        return all_gather(numel * size, world_size)
    if op == "reduce":
        return reduce(numel * size, size, world_size, root)
    if op == "broadcast":
        return broadcast(numel * size, world_size, root)
    return all_reduce(numel * size, size, world_size)  # reduce_scatter_tensor runs as an all-reduce on gloo


def payload(op, message_bytes, world_size):
    """Data bytes (no headers) one rank sends for a message of `message_bytes`, gloo's algorithm, ring rounding aside.

    For reading DeepSpeed's comms log, which records message sizes but not dtypes: all_reduce and
    reduce_scatter_tensor move 2(N-1)/N x the message, all_gather_into_tensor (N-1) x the shard it logs; for the
    rooted ones, the mean over the ranks: reduce (N-1)/N + (N-1)/N^2, broadcast (N-1)/N.
    """
    n = world_size
    if op == "all_gather_into_tensor":
        return (n - 1) * message_bytes
    if op == "reduce":
        return ((n - 1) / n + (n - 1) / n ** 2) * message_bytes
    if op == "broadcast":
        return (n - 1) / n * message_bytes
    return RING_FACTORS["all_reduce"](n) * message_bytes
