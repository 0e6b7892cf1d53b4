"""Full fine-tuning in JAX with every local device as one mesh (FSDP): each device trains
on its own packed row and holds a part of every weight, gradient and optimizer state.
Each layer gathers its weights where it runs, and backward computes each layer again
rather than keeping its values (`--no-remat` keeps them: faster, in more memory).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/07_fully_shard_jax.py
    python examples/07_fully_shard_jax.py --card path/to/hf-model           # every GPU
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python examples/07_fully_shard_jax.py --card path/to/hf-model --no-remat

The first line runs a tiny random model on two CPU host devices; the same script takes
every GPU of the machine. Without remat a large model can need more than the 75% of a
GPU XLA takes by default, hence the memory fraction. One process drives every device:
the PyTorch counterpart, examples/06_fully_shard.py, runs one process a device under
torchrun instead.
"""

import argparse
import itertools
import statistics

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from linnet import nest
from linnet.commands import quickstart
from linnet.jax.train import train
from linnet.packing import pack

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--card", help="registered card or HF model directory (default: a tiny random model)")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 on GPUs, float32 on CPU)")
parser.add_argument("--no-remat", dest="remat", action="store_false", help="keep each layer's values for backward")
parser.add_argument("--out", default="runs/example-sharded-jax")
args = parser.parse_args()
TOKENS = 512  # positions in a packed row

card = args.card or quickstart.CARD
# numerics="fast": TF32 / reduced-precision matmul sums on GPUs; nothing changes on a CPU
model = nest.load(card, backend="jax", weights=None if args.card else "random", dtype=args.dtype, numerics="fast")
mesh = Mesh(np.array(jax.devices()), ("data",))  # a step takes one row a device
examples = itertools.islice(quickstart.training_examples(seed=0, digits=2, held_out=set()), 20000)
schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(5, args.steps // 2), args.steps, 0.0)
params, history = train(
    model, pack(examples, tokens=TOKENS), optimizer=optax.adamw(schedule, weight_decay=0.0), steps=args.steps,
    mesh=mesh, remat=args.remat, save_to=args.out,  # the parts gathered into one safetensors file + config.json
    on_step=lambda s: print(f"step {s.step}: loss {s.loss:.3f}, {s.seconds:.2f} s", flush=True)
    if s.step % 10 == 0 or s.step == args.steps else None,
)
step = statistics.median(s.seconds for s in history.steps[2:] or history.steps)
peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in mesh.devices.flat) / 2**30  # 0 on CPU
print(f"loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}; {step:.2f} s a step "
      f"({mesh.size * TOKENS / step:.0f} positions/s on {mesh.size} {jax.default_backend()} devices), "
      f"peak {peak:.1f} GiB a device; remat {args.remat}; weights in {args.out}")
