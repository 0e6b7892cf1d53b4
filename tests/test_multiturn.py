"""Multi-turn rollouts: tool calls in Qwen's and Llama 3's formats, the built-in tools, the
turns inserted between the model's (rendered by the chat template, extending the cache,
never learned), max_turns and done, and GRPO training on conversations."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.data import character_tokenizer
from linnet.packing import Example, PartlyLearned, pack
from linnet.rl.conversations import Conversations, inserted_text, last_turn
from linnet.rl.environments import ToolEnvironment, Turn, calculator, environment_factory, parse_tool_calls
from linnet.rl.rollouts import Prompt
from linnet.serve import Engine
from linnet.train.grpo import grpo

torch.set_num_threads(1)

QWEN = (  # Qwen 2.5's layout: tool results come back as a user turn of <tool_response> blocks
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (  # Llama 3.1's: a tool result is an ipython turn
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|python_tag|>"]


def char_tokenizer(template: str):
    if template == QWEN:
        return character_tokenizer(SPECIALS, chat_template=QWEN, eos="<|im_end|>")
    return character_tokenizer(SPECIALS, chat_template=LLAMA3, eos="<|eot_id|>", bos="<|begin_of_text|>")


TOKENIZER = char_tokenizer(QWEN)
CARD = nest.resolve("debug").replace(vocab=TOKENIZER.vocab_size, hidden=32, intermediate=64, heads=4, kv_heads=2,
                                     head_dim=8, eos_token_ids=tuple(TOKENIZER.eos_ids))
EVERY_TOKEN = range(CARD.vocab)  # as stop ids: each model turn is one sampled token


def _prompts(n=3):
    text = TOKENIZER.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True)
    ids = TOKENIZER.encode(text)
    return [Prompt(ids[: len(ids) - i], answer=5) for i in range(n)]


class Scripted:
    """Answers each turn with a tool result; done after 1, 2 or 3 turns (one environment to the next)."""

    turns_of = itertools.cycle([1, 2, 3])

    def reset(self, prompt):
        self.limit, self.seen = next(self.turns_of), []

    def step(self, text):
        self.seen.append(text)
        return Turn([{"role": "tool", "content": f"r{len(self.seen)}"}], reward=0.25, done=len(self.seen) >= self.limit)


def test_tool_calls_in_both_formats_and_the_calculator():
    qwen = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*(3+4)"}}\n</tool_call>'
    assert parse_tool_calls("Let me compute. " + qwen) == [("calculator", {"expression": "2*(3+4)"})]
    llama = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "7/2"}}'
    assert parse_tool_calls(llama) == [("calculator", {"expression": "7/2"})]
    assert parse_tool_calls('{"name": "f", "arguments": "{\\"x\\": 1}"}') == [("f", {"x": 1})]  # OpenAI's string
    assert parse_tool_calls("The answer is 5.") == []
    assert parse_tool_calls("<tool_call>{oops</tool_call>")[0][0] is None
    assert calculator("2*(3+4)") == "14" and calculator("7/2") == "3.5" and calculator("-2**3") == "-8"
    for bad in ("__import__('os')", "2**10**10", "x + 1"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_environment_runs_calls_and_ends_on_an_answer():
    env = ToolEnvironment(["calculator"])
    env.reset(Prompt([1], record={"tools": [{"type": "function", "function": {"name": "calculator"}}]}))
    turn = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert not turn.done and turn.messages == [{"role": "tool", "name": "calculator", "content": "42"}]
    assert "error: ZeroDivisionError" in env.step('{"name": "calculator", "parameters": {"expression": "1/0"}}'
                                                  ).messages[0]["content"]
    assert "no tool 'python'" in env.step('{"name": "python", "arguments": {"code": "1"}}').messages[0]["content"]
    assert env.step("It is 42.").done
    env.reset(Prompt([1], record={"tools": []}))  # the record offers no tool: none may run
    assert "no tool 'calculator'" in env.step('{"name": "calculator", "arguments": {"expression": "1"}}'
                                               ).messages[0]["content"]
    with pytest.raises(ValueError, match="unknown"):
        environment_factory(None, ["shell"])
    with pytest.raises(ValueError, match="module:Class"):
        environment_factory("no_colon", ())
    with pytest.raises(ValueError, match="importable"):
        environment_factory("no.such.module:Env", ())
    assert environment_factory(None, ()) is None
    assert type(environment_factory("tests.test_multiturn:Scripted", ())()).__name__ == "Scripted"


@pytest.mark.parametrize("template, expected", [
    (QWEN, "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    (LLAMA3, "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n"),
])
def test_inserted_turns_follow_the_chat_template(template, expected):
    tok = char_tokenizer(template)
    assert inserted_text(tok, [{"role": "tool", "content": "42"}]) == expected
    assert inserted_text(tok, "raw text") == "raw text"


def _recomputed(model, prompt, completion):
    """The model's log-probabilities of a conversation's learned tokens, in one pass over all of it."""
    ex = Example.prompted(prompt, PartlyLearned(completion.tokens, completion.learned))
    (row,) = pack([ex], tokens=len(ex))
    with torch.no_grad():
        logp = model.log_probs_packed(row)
    return logp[torch.from_numpy(np.flatnonzero(row.weights > 0))]


def test_conversations_extend_the_cache_mask_the_inserted_turns_and_end():
    reference = nest.load(CARD, weights="random", seed=1)
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    prompts = _prompts()
    turns = Conversations(prompts, 2, Scripted, TOKENIZER, max_turns=5)
    done = engine.sample([p.ids for p in prompts], 2, max_new_tokens=160, stop=EVERY_TOKEN, seed=0, turns=turns)
    for i, c in enumerate(done):
        env = turns.environments[i]
        assert len(c.turn_rewards) == env.limit == len(env.seen) and c.turn_rewards == [0.25] * env.limit
        inserted = [TOKENIZER.encode(inserted_text(TOKENIZER, [{"role": "tool", "content": f"r{k + 1}"}]))
                    for k in range(env.limit - 1)]
        assert int((~c.learned).sum()) == sum(map(len, inserted)) and c.learned.sum() == env.limit
        assert np.array(c.tokens)[~c.learned].tolist() == sum(inserted, [])
        assert torch.all(c.logprobs[torch.from_numpy(~c.learned)] == 0)
        assert last_turn(c.tokens, c.learned) == c.tokens[-1:]  # one token a turn
        # the engine's log-probabilities, from a cache extended turn by turn, are a full recomputation's
        ours = c.logprobs[torch.from_numpy(c.learned)]
        assert torch.allclose(ours, _recomputed(reference, prompts[c.prompt].ids, c), atol=1e-5)
    assert sorted({len(c.turn_rewards) for c in done}) == [1, 2, 3]  # conversations ended at different steps


def test_max_turns_and_room_end_a_conversation():
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    prompts = _prompts(1)

    class Endless(Scripted):
        def reset(self, prompt):
            self.limit, self.seen = 99, []

    turns = Conversations(prompts, 2, Endless, TOKENIZER, max_turns=2)
    done = engine.sample([p.ids for p in prompts], 2, max_new_tokens=160, stop=EVERY_TOKEN, seed=0, turns=turns)
    assert all(len(c.turn_rewards) == 2 and c.learned.sum() == 2 for c in done)
    turns = Conversations(prompts, 4, Endless, TOKENIZER, max_turns=3)  # turns of several tokens
    done = engine.sample([p.ids for p in prompts], 4, max_new_tokens=160, stop=range(0, CARD.vocab, 4), seed=0,
                         turns=turns)
    for c in done:  # the environment saw each model turn once, and only those
        runs = np.flatnonzero(np.diff(np.concatenate([[0], c.learned.astype(int)])) == 1)
        assert len(c.turn_rewards) == len(runs) <= 3 and (len(runs) == 3 or not c.stopped)
    turns = Conversations(prompts, 1, Endless, TOKENIZER, max_turns=9)  # the answer does not fit: it ends there
    (c,) = engine.sample([prompts[0].ids], max_new_tokens=10, stop=EVERY_TOKEN, seed=0, turns=turns)
    assert c.tokens == c.tokens[:1] and c.learned.all() and len(c.turn_rewards) == 1


def test_grpo_trains_on_conversations_learning_only_the_model_turns():
    torch.manual_seed(0)
    policy = nest.load(CARD, weights="random", seed=1, trainable=True)
    policy.add_lora("model.layers.*.self_attn.*_proj", rank=4, alpha=8)
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    seen = []

    def graded(prompt, completion):  # GRPO's rewards read the last turn alone
        seen.append(completion)
        return float(completion[-1] % 2)

    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    history = grpo(policy, engine, _prompts(), graded, optimizer=opt, steps=2, group=4, prompts_per_step=2,
                   max_new_tokens=160, tokens=1024, stop=EVERY_TOKEN, environment=Scripted, max_turns=3,
                   tokenizer=TOKENIZER, verbose=False)
    assert all(len(c) == 1 for c in seen)
    for step in history.steps:
        m = step.metrics
        assert 1 <= m["turns"] <= 3 and m["reward_environment"] == pytest.approx(0.25 * m["turns"])
        assert m["mismatch"] < 1e-4  # the policy's log-probabilities at the model's tokens are the engine's
    with pytest.raises(ValueError, match="tokenizer="):
        grpo(policy, engine, _prompts(), graded, optimizer=opt, steps=1, tools=["calculator"], verbose=False)


def test_the_python_tool_returns_what_sandboxed_code_prints(monkeypatch):
    monkeypatch.setenv("TRAINER_SECRET", "hunter2")
    env = ToolEnvironment(["python"])
    env.reset(Prompt([1]))
    call = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>'
    assert env.step(call % '"print(sum(range(10)))"').messages[0]["content"] == "45\n"
    failed = env.step(call % '"print(1); 1/0"').messages[0]["content"]
    assert failed.startswith("1\nfailed") and "ZeroDivisionError" in failed
    assert "hunter2" not in env.step(call % '"import os; print(os.environ)"').messages[0]["content"]
    refused = env.step(call % '"import socket; socket.create_connection((\\"1.1.1.1\\", 80))"').messages[0]
    assert refused["content"].startswith("refused: sandbox: refused socket")


def test_linnet_grpo_reads_the_tool_settings_and_checks_them_before_writing(tmp_path):
    import json

    from linnet.commands.grpo import run
    from linnet.config import GRPOConfig, load
    from linnet.config.sampling import GRPOSettings
    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    records = [{"prompt": f"{a}+{b}=", "answer": f"{a + b}"} for a in range(4) for b in range(5)]
    (tmp_path / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fields = [f"model.card={tmp_path / 'model'}", f"data.path={tmp_path / 'add.jsonl'}", "data.chat=false",
              "data.eval_share=0.1", "training.context_length=64", "grpo.group=4", "grpo.prompts_per_step=4",
              "grpo.max_new_tokens=6", "grpo.rewards=[numeric]", "training.steps=1", "lr_schedule.warmup_steps=0"]
    with pytest.raises(ValueError, match="grpo.environment='no.such:Env'"):
        run(load(GRPOConfig, None, [*fields, "grpo.environment=no.such:Env", f"runtime.output_dir={tmp_path / 'x'}"]))
    assert not (tmp_path / "x").exists()
    run(load(GRPOConfig, None, [*fields, "grpo.tools=[calculator]", "grpo.max_turns=2",
                                f"runtime.output_dir={tmp_path / 'run'}"]))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= metrics[0]["turns"] <= 2 and metrics[0]["reward_environment"] == 0.0  # no call: one turn, no reward
    for bad, message in [(dict(max_turns=0), "max_turns"), (dict(engine="vllm", tools=["calculator"]), "builtin")]:
        with pytest.raises(ValueError, match=message):
            GRPOSettings(**bad)
