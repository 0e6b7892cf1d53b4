"""Multi-turn GRPO with a calculator tool: a tiny model learns to call it and copy its result.

    python examples/13_tool_use.py              # a few minutes on 2 CPU cores, offline
    python examples/13_tool_use.py --code       # then a code task graded in the sandbox

The task is two-digit multiplication ("47*86"), which a model of a million parameters
cannot do by itself. A few SFT steps on demonstrations teach it the conversation's shape:
a tool call in Qwen's format, the calculator's answer inserted as a tool turn (context,
never learned), then the answer. GRPO then samples whole conversations through the tool
environment (`tools=["calculator"]`): each completion is a conversation, the engine feeds
the tool's answer into its cache, and the reward grades the last turn. Held-out accuracy
is measured with the tool and without it (the same model answering in one turn).

With --code, the same model is graded on writing a function: each completion runs against
the record's tests in linnet.rl.sandbox (`rewards.code`), never in this process.
"""

import argparse
import itertools

import numpy as np
import torch

from linnet import nest
from linnet.data import character_tokenizer
from linnet.packing import Example, PartlyLearned
from linnet.rl import rewards
from linnet.rl.conversations import conversations_for, inserted_text, last_turn
from linnet.serve import Engine
from linnet.train import cosine_schedule, pack, train
from linnet.train.grpo import Prompt, evaluate, grpo

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--sft-steps", type=int, default=700)
parser.add_argument("--steps", type=int, default=30, help="GRPO steps")
parser.add_argument("--held-out", type=int, default=200, help="held-out problems")
parser.add_argument("--code", action="store_true", help="also score a code task in the sandbox")
args = parser.parse_args()
torch.manual_seed(0)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
tokenizer = character_tokenizer(["<|im_start|>", "<|im_end|>"], chat_template=CHATML, eos="<|im_end|>")
card = nest.Card("tool-user", "llama", vocab=tokenizer.vocab_size, hidden=128, intermediate=384, layers=4, heads=4,
                 kv_heads=2, head_dim=32, max_positions=256, tied_embeddings=True, eos_token_ids=tokenizer.eos_ids,
                 pad_token_id=0, dtype="float32")
END = tokenizer.eos_ids[0]


def problem(rng) -> tuple[str, int]:
    a, b = rng.integers(10, 100, size=2)
    return f"{a}*{b}", int(a * b)


def prompt_of(question: str, answer) -> Prompt:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return Prompt(tokenizer.encode(text), answer)


def demonstration(question: str, answer: int) -> Example:
    """The whole conversation, its tool turn not learned: the layout the rollouts will have."""
    call = tokenizer.encode(f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{question}"}}}}'
                            "</tool_call>") + [END]
    tool = tokenizer.encode(inserted_text(tokenizer, [{"role": "tool", "content": str(answer)}]))
    reply = tokenizer.encode(str(answer)) + [END]
    learned = [True] * len(call) + [False] * len(tool) + [True] * len(reply)
    return Example.prompted(prompt_of(question, answer).ids, PartlyLearned(call + tool + reply, learned))


def right(prompt, completion) -> float:
    """1 when the last turn is exactly the product, then the end of the turn."""
    return float(completion == tokenizer.encode(str(prompt.answer)) + [END])


rng = np.random.default_rng(0)
held_out = [prompt_of(*problem(rng)) for _ in range(args.held_out)]
seen = {tuple(p.ids) for p in held_out}
train_prompts = [p for p in (prompt_of(*problem(rng)) for _ in range(2000)) if tuple(p.ids) not in seen]
model = nest.load(card, weights="random", trainable=True)
engine = Engine(nest.load(card, weights="random"))
with_tool = conversations_for(None, ["calculator"], tokenizer, max_turns=2)


def accuracy(label: str) -> None:
    options = dict(max_new_tokens=120, passing=1.0)
    tool = evaluate(model, engine, held_out, right, conversations=with_tool, **options)["pass@1"]
    alone = evaluate(model, engine, held_out, right, **options)["pass@1"]
    print(f"{label}: held-out accuracy with the calculator {tool:.1%}, without it {alone:.1%}")


demos = (demonstration(*problem(rng)) for _ in itertools.count())
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
train(model, pack(demos, tokens=1024), optimizer=optimizer, steps=args.sft_steps,
      schedule=cosine_schedule(optimizer, min(20, args.sft_steps), args.sft_steps))
accuracy(f"after {args.sft_steps} SFT steps")

model.set_trainable(False)
model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=16, alpha=32)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
history = grpo(model, engine, train_prompts, right, optimizer=optimizer, steps=args.steps, group=8,
               prompts_per_step=8, max_new_tokens=120, tokens=2048, tools=["calculator"], max_turns=2,
               tokenizer=tokenizer, verbose=False,
               on_step=lambda s: print(f"GRPO step {s.step}: reward {s.metrics['reward']:.3f}, turns "
                                       f"{s.metrics['turns']:.2f}") if s.step % 5 == 0 else None)
accuracy(f"after {args.steps} GRPO steps")

if args.code:  # a code task: the completions are programs, run against each record's tests in the sandbox
    task = Prompt(tokenizer.encode("def double(x):"), ["assert double(2) == 4", {"call": "double(-3)", "expect": -6}])
    grade = rewards.code(tokenizer)
    engine.load_weights(model)
    samples = engine.sample([task.ids], n=4, max_new_tokens=40, seed=0)
    scores = [grade(task, last_turn(c.tokens, c.learned)) for c in samples]
    solution = tokenizer.encode("def double(x):\n    return 2 * x")
    print(f"code task: the share of tests 4 samples pass {scores}; a right answer's {grade(task, solution):.0f}")
