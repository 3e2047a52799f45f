"""Tensor-parallel decode steps as a serving engine runs them: its own weights, a
`tp_kernels.Communicator` for the collectives, CUDA graphs on GPUs.

    torchrun --nproc-per-node 2 examples/decode.py     # CPU, gloo: eager steps
    torchrun --nproc-per-node 8 examples/decode.py     # 8 GPUs, NCCL, bfloat16: captured steps

Each step is an MLP block: the up projection column-parallel (no communication), the down
projection row-parallel, its partial sums all-reduced by the communicator. On GPUs every batch
size is run once eagerly (the communicator measures its paths there), then captured in a CUDA
graph under `comm.capture()` and replayed. Each rank checks the result against the dense MLP.
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
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
hidden, ffn = 1024, 4096

torch.manual_seed(0)  # every rank draws the same full weights, then keeps its shard
w_up = torch.randn(ffn, hidden, device=device, dtype=dtype) / hidden**0.5
w_down = torch.randn(hidden, ffn, device=device, dtype=dtype) / ffn**0.5
up, down = w_up.chunk(p, dim=0)[r], w_down.chunk(p, dim=1)[r]  # column- and row-parallel shards

comm = tp_kernels.Communicator()  # the tensor-parallel group, on this rank's device


def step(x):
    partial = torch.nn.functional.gelu(x @ up.t()) @ down.t()  # [batch, hidden], this rank's part
    return comm.all_reduce(partial)


batches = (1, 8, 32)
inputs = {b: torch.randn(b, hidden, device=device, dtype=dtype) for b in batches}  # the same on every rank
outputs = {b: step(inputs[b]) for b in batches}  # eager: on GPUs, each size's paths measured here
if cuda:
    graphs = {}
    with comm.capture():
        for b in batches:
            graphs[b] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[b]):
                outputs[b] = step(inputs[b])
    for b in batches:
        inputs[b].normal_(generator=torch.Generator(device).manual_seed(b))  # a new token
        graphs[b].replay()
for b in batches:
    dense = torch.nn.functional.gelu(inputs[b].double() @ w_up.double().t()) @ w_down.double().t()
    err = (outputs[b].double() - dense).abs().max().item() / dense.abs().max().item()
    print(f"rank {r}/{p} ({device}, {dtype}, {'replayed' if cuda else 'eager'}): batch {b}, relative error "
          f"{err:.1e} against the dense MLP", flush=True)
    assert err < (3e-2 if cuda else 1e-5), err
tp_kernels.destroy_model_parallel()
dist.destroy_process_group()
