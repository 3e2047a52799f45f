"""A Hugging Face transformers model run tensor-parallel by its own `tp_plan`: a mixture of
experts (Mixtral's architecture) generating text, its greedy tokens the dense model's.

    pip install transformers
    torchrun --nproc-per-node 2 examples/hugging_face.py                  # CPU, gloo
    torchrun --nproc-per-node 2 examples/hugging_face.py --experts whole  # E/p whole experts a rank
    torchrun --nproc-per-node 2 examples/hugging_face.py --sequence-parallel  # a training step's loss, [b, s/p, h]
    torchrun --nproc-per-node 8 examples/hugging_face.py --model PATH     # 8 GPUs, a checkpoint of yours

Without `--model`, a small Mixtral is made from a config here, with random weights (nothing is
downloaded); with it, `from_pretrained(PATH)` (any model whose config has a `base_model_tp_plan`).
Every rank builds the dense model, `tp_kernels.parallelize` keeps this rank's shard of each layer
named by the plan (the attention's heads, each expert's hidden units), and the ranks generate
together. With `--experts whole`, the model's `ep_plan` over its `tp_plan` gives each rank whole
experts of its own instead (expert parallelism over the same ranks). Each rank compares the tokens
with the dense model's own. With `--sequence-parallel`, `tp_kernels.sequence_parallel_plan` makes
of that plan one under sequence parallelism (the decoder layers on each rank's block of the
sequence), and the ranks compute a training step's loss and gradients instead of generating (one
token at a time is no sequence to split); each rank compares the loss with the dense model's.
"""

import argparse
import copy

import torch
import torch.distributed as dist

import tp_kernels

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a path (or hub name) for from_pretrained; default: a small random Mixtral")
parser.add_argument("--new-tokens", type=int, default=8)
parser.add_argument("--experts", choices=["split", "whole"], default="split",
                    help="split: every rank a block of every expert (tp_plan); whole: E/p whole experts a rank "
                         "(ep_plan over tp_plan)")
parser.add_argument("--sequence-parallel", action="store_true",
                    help="the plan under sequence parallelism (tp_kernels.sequence_parallel_plan); a training step's "
                         "loss instead of generation")
args = parser.parse_args()

import transformers  # noqa: E402  (after the arguments: --help without it)

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
p, r = dist.get_world_size(), dist.get_rank()
tp_kernels.initialize_model_parallel(tensor_model_parallel_size=p)
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)

torch.manual_seed(0)  # every rank makes the same weights
if args.model:
    dense = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
else:
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=128)
    dense = transformers.MixtralForCausalLM(config).to(dtype)
dense = dense.to(device).eval()
plan = dict(dense.tp_plan)  # transformers' own: "colwise", "rowwise", "moe_tp_experts", "packed_colwise", ...
if args.experts == "whole":
    # the experts' entries: "ep_dispatch_experts", "grouped_gemm" (transformers 5.17 has no ep_plan
    # property: its _ep_plan names the router "ep_router" and leaves the experts "moe_tp_experts",
    # which parallelize reads as the same plan)
    plan.update(dense.ep_plan if hasattr(type(dense), "ep_plan") else dense._ep_plan)
if args.sequence_parallel:  # the same plan under sequence parallelism (torch's styles beside its entries)
    plan = tp_kernels.sequence_parallel_plan(dense, plan)
model = tp_kernels.parallelize(copy.deepcopy(dense), plan, strict=False)  # (a plan may name what a model lacks)
plans = "tp_plan" if args.experts == "split" else "tp_plan and ep_plan"

if args.sequence_parallel:  # a training step: its sequence one the ranks divide, each rank's block of it
    ids = torch.randint(1, dense.config.vocab_size, (2, 4 * p), generator=torch.Generator().manual_seed(1)).to(device)
    loss, want = (m(ids, labels=ids).loss for m in (model, dense))
    loss.backward()  # (the gradients each rank holds of its shards; tests/ check them against the dense model's)
    close = torch.allclose(loss, want, rtol=1e-2 if cuda else 1e-5)
    print(f"rank {r}/{p} ({device}, {dtype}): {type(dense).__name__} by its {plans} under sequence parallelism: "
          f"loss {loss.item():.6f}, {'the' if close else 'NOT the'} dense model's ({want.item():.6f})", flush=True)
    assert close, (loss, want)
    dist.barrier()  # (no rank tears the group down under a peer still finishing the backward's last collective)
    tp_kernels.destroy_model_parallel()
    dist.destroy_process_group()
    raise SystemExit(0)

ids = torch.randint(1, dense.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
with torch.no_grad():
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
    want = dense.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
same = torch.equal(tokens, want)
verdict = "the dense model's" if same else "NOT the dense model's"
print(f"rank {r}/{p} ({device}, {dtype}): {type(dense).__name__} by its {plans} generated {tokens.shape[1] - 5} "
      f"tokens per sequence, {verdict}", flush=True)
# (in bfloat16 on GPUs, a near-tie between two tokens may round the other way: reported, not asserted)
assert same or cuda, (tokens, want)
tp_kernels.destroy_model_parallel()
dist.destroy_process_group()
