"""The DDP guide's linear-regression example as a user has it — a plain torchrun script — plus ddpdash's
three lines (marked ddpdash). Run it either way:

    torchrun --standalone --nproc-per-node 2 examples/seed_script.py --epochs 3     # by hand: ddpdash records it
    ddpdash launch --script examples/seed_script.py --num-procs 2 -- --epochs 3      # launched, supervised, stoppable
"""

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpdash  # ddpdash (1 of 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same data and the same initial weights on every rank
    x = torch.randn(2048, 10)
    y = x @ torch.randn(10, 1) + 0.5 + 0.1 * torch.randn(2048, 1)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = DDP(nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world)  # the linear scaling rule

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            ddpdash.log({"loss": loss.item()}, step=step, samples=len(xb))  # ddpdash (2 of 3)
            if ddpdash.should_stop():  # ddpdash (3 of 3): the Stop button asked; finish here
                break
        else:
            continue
        break
    del model, optimizer, loss
    gc.collect()  # release DDP's buffers before tearing the group down: gloo can abort at exit otherwise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
