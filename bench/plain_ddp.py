"""A plain DDP training script, written as a user would without ddpdash: the baseline for the
trainer-throughput and launch-latency benchmarks.

    torchrun --standalone --nproc-per-node 2 bench/plain_ddp.py --steps 1000 --out result.json
"""

import argparse
import gzip
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def digits() -> TensorDataset:
    spec = importlib.util.find_spec("sklearn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path) as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    order = np.random.default_rng(1234).permutation(len(table))[: int(len(table) * 0.8)]
    x = torch.from_numpy(table[order, :-1]) / 16.0
    y = torch.from_numpy(table[order, -1]).long()
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, nccl")
    args = p.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    data = digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * world, momentum=0.9)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    step, epoch, stamps = 0, 0, {}
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step == 1:
                stamps["first_step"] = time.time()
            if step == args.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                stamps["warm"] = time.time()
            if step >= args.steps:
                break
        epoch += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stamps["end"] = time.time()
    if rank == 0:
        samples = (args.steps - args.warmup) * args.batch_size * world
        stamps["samples_per_s"] = samples / (stamps["end"] - stamps["warm"])
        Path(args.out).write_text(json.dumps(stamps))
    del ddp, model, opt, loss
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
