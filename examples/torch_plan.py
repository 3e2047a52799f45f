"""A model in TorchTitan's Llama's shape, parallelized by TorchTitan's plan (torch's style objects,
sequence parallelism and loss parallelism included) with tp_kernels' layers where torch's DTensors
would be, on whatever this machine has: one process per GPU with NCCL, else processes on the CPU
with gloo.

    torchrun --nproc-per-node 2 examples/torch_plan.py     # CPU, gloo
    torchrun --nproc-per-node 8 examples/torch_plan.py     # 8 GPUs, NCCL

Each rank trains the parallel model three SGD steps beside the dense model (the same seed gives
both the same weights) and checks that their losses agree.
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel)

import tp_kernels

HEAD_DIM = 32


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(dim, heads * HEAD_DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(heads * HEAD_DIM, dim, bias=False)

    def forward(self, x):
        bs, seqlen, _ = x.shape  # (the whole sequence: the plan gathers this module's input)
        q, k, v = (w(x).view(bs, seqlen, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab=512, dim=256, heads=8, hidden=512, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


# TorchTitan's plan for its Llama (parallelize_llama's apply_tp), the patterns over the whole model;
# the logits stay split, a DTensor, for torch's loss_parallel (TorchTitan's default)
PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    "layers.*.attention_norm": SequenceParallel(),
    "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "layers.*.attention.w[qkv]": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "layers.*.ffn_norm": SequenceParallel(),
    "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "layers.*.feed_forward.w[13]": ColwiseParallel(),
    "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
}

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
device = "cuda" if cuda else "cpu"
p, r = dist.get_world_size(), dist.get_rank()
mesh = init_device_mesh(device, (p,), mesh_dim_names=("tp",))

torch.manual_seed(0)  # every rank alike: the same dense weights to shard
dense = Transformer().to(device)
model = tp_kernels.parallelize(copy.deepcopy(dense), PLAN, group=mesh["tp"])

torch.manual_seed(1)
tokens = torch.randint(0, 512, (4, 16 * p), device=device)  # [b, s], the same on every rank; s divisible by p
losses = {"dense": [], "tp_kernels": []}
for name, m in (("dense", dense), ("tp_kernels", model)):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        # the cross-entropy over each rank's columns of the logits, backward included (the dense model's: plain)
        with loss_parallel() if m is model else contextlib.nullcontext():
            loss = F.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())  # the next token
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses[name].append(loss.item())
error = max(abs(a - b) / abs(b) for a, b in zip(losses["tp_kernels"], losses["dense"]))
print(f"rank {r}/{p} ({device}): losses {[round(x, 4) for x in losses['tp_kernels']]} over 3 steps, relative "
      f"error {error:.1e} against the dense model's; {type(model.layers['0'].attention.wq).__name__} in place of "
      "the DTensor layer", flush=True)
assert error < (1e-3 if cuda else 1e-5), losses
# every rank past the collectives loss_parallel's DTensors leave in flight before the group is torn down:
# without it, gloo aborted a rank whose peer tore the group down first (2 runs of 12, torch's own
# parallelize_module alike)
dist.barrier()
dist.destroy_process_group()
