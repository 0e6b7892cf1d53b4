"""Checkpoints and resuming: a run stopped part-way continues with identical losses.

    python examples/03_resume.py

It trains 10 steps in one go, then the same 10 steps as 5, a stop, and a resume from the
checkpoint directory, and compares the two loss curves. A checkpoint holds the trained
parameters, the optimizer, the step, the schedule and the RNG; `train` skips the batches
the finished steps consumed. Reload the model as the run loaded it, then pass the same
`checkpoint=`.
"""

import itertools
import tempfile

import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.train import cosine_schedule, pack, train


def run(steps, checkpoint=None):
    torch.manual_seed(0)
    model = nest.load(quickstart.CARD, weights="random", trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    schedule = cosine_schedule(optimizer, 2, 10)  # the schedule of the whole run, both times
    rows = pack(itertools.islice(quickstart.training_examples(0, 2, set()), 3000), tokens=256)
    return train(model, rows, optimizer=optimizer, steps=steps, schedule=schedule,
                 checkpoint=checkpoint, checkpoint_every=5).losses


with tempfile.TemporaryDirectory() as directory:
    whole = run(10)
    first = run(5, checkpoint=directory)  # "stops" after step 5, writing its checkpoint
    rest = run(10, checkpoint=directory)  # a new process would do exactly this
for step, (a, b) in enumerate(zip(whole, first + rest), start=1):
    print(f"step {step:2d}: uninterrupted {a:.6f}   resumed {b:.6f}")
print("identical" if whole == first + rest else "DIFFERENT")
