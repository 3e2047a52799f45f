"""Training a tensor-parallel language model: shard a dense one, drop out its MLP's hidden units
(each rank's own mask) and its output (the same mask on every rank) under activation
checkpointing, clip its gradient by the whole model's norm, and checkpoint the model and its
optimizer with torch.distributed.checkpoint.

    torchrun --nproc-per-node 2 examples/train.py [checkpoint folder]     # CPU, gloo
    torchrun --nproc-per-node 8 examples/train.py [checkpoint folder]     # 8 GPUs, NCCL

(without a folder, a temporary one of rank 0's, which every rank of one machine reaches).

Every rank trains 4 steps, saves, trains 4 more; then a fresh model and optimizer load the
checkpoint and train the same 4 steps again, from the same random streams. Each rank prints both
runs' losses, which must agree: the checkpoint held every rank's blocks of the weights and of Adam's
moments.
"""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import tp_kernels

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
p, r = dist.get_world_size(), dist.get_rank()
tp_kernels.initialize_model_parallel(tensor_model_parallel_size=p)
vocab, hidden = 64 * p, 128


def dense_model(seed):
    tp_kernels.model_parallel_manual_seed(seed)  # the same full weights on every rank; the dropout streams
    model = nn.ModuleDict({"emb": nn.Embedding(vocab, hidden), "up": nn.Linear(hidden, 4 * hidden),
                           "down": nn.Linear(4 * hidden, hidden), "head": nn.Linear(hidden, vocab, bias=False)})
    nn.init.normal_(model["emb"].weight, std=0.02)
    model["head"].weight = model["emb"].weight  # tied: parallelize keeps them one parameter
    return model.to(device)


PLAN = {"emb": "vocab", "up": "colwise", "down": "rowwise", "head": "colwise"}


def make(seed):
    model = tp_kernels.parallelize(dense_model(seed), PLAN)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def mlp(model, h):
    with tp_kernels.get_rng_tracker().fork():  # this rank's hidden units: its own mask
        hidden = F.dropout(torch.relu(model["up"](h)), 0.1)
    return F.dropout(model["down"](hidden), 0.1)  # replicated: the same mask on every rank


def step(model, opt, ids):
    h = model["emb"](ids)  # [s, b, hidden], the same on every rank
    h = h + tp_kernels.rng.checkpoint(mlp, model, h)  # recomputed in backward, with the same masks
    logits = model["head"](h)  # [s, b, vocab/p]: this rank's block of the vocabulary
    loss = tp_kernels.vocab_parallel_cross_entropy(logits[:-1], ids[1:]).mean()
    loss.backward()
    tp_kernels.clip_grad_norm_(model, max_norm=1.0)  # the whole model's norm, alike on every rank
    opt.step()
    opt.zero_grad()
    return loss.item()


g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, vocab, (16, 4), generator=g).to(device) for _ in range(8)]
folder = sys.argv[1] if len(sys.argv) > 1 else None
with tempfile.TemporaryDirectory() as scratch:
    path = folder or scratch
    if folder is None and p > 1:  # one folder for every rank: rank 0's
        shared = [path]
        dist.broadcast_object_list(shared, src=0, device=device if cuda else None)
        path = shared[0]
    model, opt = make(seed=0)
    for ids in batches[:4]:
        step(model, opt, ids)
    dcp.save({"model": tp_kernels.sharded_state_dict(model),
              "optim": tp_kernels.sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    tp_kernels.model_parallel_manual_seed(2)  # the dropout streams from here, in both runs
    first = [step(model, opt, ids) for ids in batches[4:]]

    model, opt = make(seed=7)  # other weights and an empty optimizer: the checkpoint replaces both
    state = {"model": tp_kernels.sharded_state_dict(model),
             "optim": tp_kernels.sharded_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    tp_kernels.load_sharded_optimizer_state_dict(model, opt, state["optim"])
    tp_kernels.model_parallel_manual_seed(2)
    again = [step(model, opt, ids) for ids in batches[4:]]
    dist.barrier()

print(f"rank {r}/{p} ({device.type}): losses after the checkpoint {[round(x, 4) for x in first]}, "
      f"resumed {[round(x, 4) for x in again]}", flush=True)
assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(first, again)), (first, again)
tp_kernels.destroy_model_parallel()
dist.destroy_process_group()
