"""Synthetic training throughput, the way a Horovod user measures it.

Random images through a small convolutional network with DistributedOptimizer; prints
img/sec per worker and for the job. The only change from a Horovod script is the import.

    mpirun -np 2 python examples/horovod/pytorch_synthetic_benchmark.py
    torchrun --nproc_per_node=2 examples/horovod/pytorch_synthetic_benchmark.py
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import polytrain.horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="images per worker and step")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=3)
parser.add_argument("--num-batches-per-iter", type=int, default=5)
parser.add_argument("--num-iters", type=int, default=5)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--use-adasum", action="store_true")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)


class SmallConvNet(torch.nn.Module):
    def __init__(self, classes=100):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = torch.nn.Conv2d(64, 128, 3, padding=1)
        self.fc1 = torch.nn.Linear(128 * (args.image_size // 8) ** 2, 512)
        self.fc2 = torch.nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


model = SmallConvNet()
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, 100, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


log(f"Model: SmallConvNet, batch size {args.batch_size}, {hvd.size()} workers")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for i in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{i}: {img_sec:.1f} img/sec per worker")
    img_secs.append(img_sec)

mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
