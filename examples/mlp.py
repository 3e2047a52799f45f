"""A sequence-parallel MLP on whatever this machine has: one process per GPU with NCCL, else
processes on the CPU with gloo.

    torchrun --nproc-per-node 2 examples/mlp.py     # CPU, gloo
    torchrun --nproc-per-node 8 examples/mlp.py     # 8 GPUs, NCCL, bfloat16

Each rank prints what it ran and checks its output against the dense MLP's block (the same seed
gives every rank, and the dense model, the same full weights).
"""

import torch
import torch.distributed as dist

import tp_kernels

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
p, r = dist.get_world_size(), dist.get_rank()
tp_kernels.initialize_model_parallel(tensor_model_parallel_size=p)

torch.manual_seed(0)  # seed every rank alike: same full weights
kw = dict(sequence_parallel=True, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
fc1 = tp_kernels.ColumnParallelLinear(1024, 4096, **kw)
fc2 = tp_kernels.RowParallelLinear(4096, 1024, **kw)

torch.manual_seed(1)
x_full = torch.randn(512, 4, 1024, device=kw["device"], dtype=kw["dtype"])  # [s, b, h], the same on every rank
x = x_full.chunk(p)[r]  # [s/p, b, h]: this rank's block of the sequence
y = fc2(torch.nn.functional.gelu(fc1(x)))  # [s/p, b, h]: all-gather in fc1, reduce-scatter in fc2
y.float().sum().backward()

# the dense MLP, from the same seed: nn.Linear draws the full weights as the parallel layers did
torch.manual_seed(0)
dense1 = torch.nn.Linear(1024, 4096, device=kw["device"], dtype=kw["dtype"])
dense2 = torch.nn.Linear(4096, 1024, device=kw["device"], dtype=kw["dtype"])
with torch.no_grad():
    ref = dense2(torch.nn.functional.gelu(dense1(x_full))).chunk(p)[r]
err = (y.detach().double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
print(f"rank {r}/{p} ({'cuda' if cuda else 'cpu'}, {kw['dtype']}): y {tuple(y.shape)}, relative error "
      f"{err:.1e} against the dense MLP, fc1.weight.grad {tuple(fc1.weight.grad.shape)}", flush=True)
assert err < (2e-2 if cuda else 1e-5), err
tp_kernels.destroy_model_parallel()
dist.destroy_process_group()
