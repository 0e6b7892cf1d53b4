"""`linnet grpo` end to end on a tiny model directory; built-in rewards."""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from linnet import cli
from linnet.commands import quickstart
from linnet.commands.grpo import run
from linnet.config import GRPOConfig, load
from linnet.rl import rewards
from tests.conftest import quickstart_model, same_metrics

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    quickstart_model(root / "model")
    rng = np.random.default_rng(0)
    lines = [json.dumps({"prompt": p, "answer": a}) for p, a in quickstart.problems(rng, 60, 1)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _overrides(workspace, out, *extra):
    return [f"model.card={workspace / 'model'}", f"data.path={workspace / 'prompts.jsonl'}", "data.chat=false",
            "training.context_length=64", "data.eval_share=0.1", "grpo.group=4", "grpo.prompts_per_step=4",
            "grpo.max_new_tokens=3", "grpo.rewards=[exact, numeric]", "grpo.pass_k=2", "grpo.pass_samples=3",
            "training.steps=3", "evaluation.every=2", "lr_schedule.warmup_steps=1", f"runtime.output_dir={out}", *extra]


def test_grpo_run_writes_metrics(workspace, tmp_path, capsys):
    summary = run(load(GRPOConfig, None, _overrides(workspace, tmp_path / "run")))
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and {"reward", "reward_exact", "reward_numeric", "uniform", "clip_fraction"} <= set(metrics[0])
    assert "held_out_reward" in summary and (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    held_out = ["held_out_reward", "held_out_pass@1", "held_out_pass@2"]
    assert [[key in m for key in held_out] for m in metrics] == [[False] * 3, [True] * 3, [True] * 3]
    assert all(0 <= metrics[-1][key] <= 1 for key in held_out[1:]) and set(held_out) <= set(summary)


def test_grpo_engine_samples_in_its_own_dtype(workspace, tmp_path):
    """grpo.engine_dtype=bfloat16 under a float32 policy: the engine's log-probabilities
    part from the policy's (the mismatch metric), which correction_cap weighs; float32
    engines agree with the policy."""
    mismatch = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        run(load(GRPOConfig, None, _overrides(workspace, out, "model.dtype=float32", f"grpo.engine_dtype={dtype}",
                                              "grpo.correction_cap=2", "grpo.pass_k=0", "grpo.pass_samples=null",
                                              "evaluation.every=3")))
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 3 and all(np.isfinite(m["loss"]) for m in metrics)
        mismatch[dtype] = max(m["mismatch"] for m in metrics)
    assert mismatch["float32"] < 1e-5 and mismatch["bfloat16"] > 3e-4


def test_grpo_run_with_a_qlora_policy_engine_and_reference(workspace, tmp_path):
    pytest.importorskip("bitsandbytes", reason="model.quantize=nf4 needs bitsandbytes (the qlora extra)")
    summary = run(load(GRPOConfig, None, _overrides(workspace, tmp_path / "run", "model.quantize=nf4",
                                                    "grpo.beta=0.05", "training.activation_checkpointing=true")))
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(np.isfinite(m["loss"]) for m in metrics) and "held_out_reward" in summary
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()



def _grpo_process(rank, overrides):
    return run(load(GRPOConfig, None, overrides)).get("last_loss")


def test_grpo_run_with_a_fully_sharded_qlora_policy(workspace, tmp_path):
    """Two processes split an NF4 policy (training.shard=fsdp): the engine cannot share a
    split base, takes the gathered, dequantized and merged weights, and samples what the
    policy computes (float32: log-probabilities within 1e-4)."""
    pytest.importorskip("bitsandbytes", reason="model.quantize=nf4 needs bitsandbytes (the qlora extra)")
    from tests.conftest import in_processes

    overrides = _overrides(workspace, tmp_path / "run", "model.quantize=nf4", "model.dtype=float32",
                           "training.shard=fsdp", "grpo.beta=0.05")
    assert in_processes(_grpo_process, overrides)[0] is not None
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(np.isfinite(m["loss"]) and m["mismatch"] < 1e-4 for m in metrics)
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()


@pytest.mark.parametrize("mode", ["split", "pipeline", "context", "pipeline context"])
def test_two_processes_splitting_or_staging_the_policy_take_one_process_steps(workspace, tmp_path, mode):
    """`linnet grpo` with training.split=2 (both processes split one policy),
    training.pipeline=2 (two stages, every stage's engine taking the whole policy from
    both) or training.context=2 (each computing half of every row's positions), or in four
    processes both (two stages, each splitting every row over a pair): all train on the
    first one's samples, with the steps, rewards and held-out metrics of one process."""
    from tests.conftest import in_processes

    common = ["model.dtype=float32", "training.steps=2", "evaluation.every=2", "grpo.pass_k=0",
              "grpo.pass_samples=null"]
    modes = mode.split()
    two = _overrides(workspace, tmp_path / "two", *common, *(f"training.{m}=2" for m in modes))
    assert in_processes(_grpo_process, two, processes=2 * len(modes))[0] is not None
    run(load(GRPOConfig, None, _overrides(workspace, tmp_path / "one", *common)))
    same_metrics(tmp_path / "two", tmp_path / "one", ("loss", "grad_norm", "reward", "held_out_reward"), steps=2,
                 rel=1e-4, abs=1e-6)


def test_two_copies_of_sharded_stages_take_the_steps_of_two_sharded_processes(workspace, tmp_path):
    """`linnet grpo` with training.pipeline=2 and training.shard=fsdp in four processes:
    two copies of a two-stage pipeline, each stage's blocks sharded over its copies, each
    copy sampling its own share of the prompts on its first stage; the steps, rewards and
    held-out metrics equal those of two processes sharding the whole policy
    (training.shard=fsdp), whose processes take the same shares."""
    from tests.conftest import in_processes

    common = ["model.dtype=float32", "training.steps=2", "evaluation.every=2", "grpo.pass_k=0",
              "grpo.pass_samples=null", "training.shard=fsdp"]
    four = _overrides(workspace, tmp_path / "four", *common, "training.pipeline=2")
    assert in_processes(_grpo_process, four, processes=4)[0] is not None
    assert in_processes(_grpo_process, _overrides(workspace, tmp_path / "two", *common))[0] is not None
    same_metrics(tmp_path / "four", tmp_path / "two", ("loss", "grad_norm", "reward", "held_out_reward"), steps=2,
                 rel=1e-4, abs=1e-6)

def test_builtin_rewards():
    tok = SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)), eos_ids=(0,))
    prompt = SimpleNamespace(answer="Natalia sold 72 clips.\n#### 72")
    enc = lambda s: [ord(c) for s_ in [s] for c in s_]  # noqa: E731
    assert rewards.exact(tok)(prompt, enc("so #### 72")) == 1.0
    assert rewards.exact(tok)(prompt, enc("#### 71")) == 0.0
    assert rewards.exact(tok)(prompt, enc("#### 72") + [0]) == 1.0  # the stop token is not part of the text
    assert rewards.numeric(tok)(prompt, enc("The answer is 72.0")) == 1.0
    assert rewards.numeric(tok)(prompt, enc("no number")) == 0.0
    assert rewards.resolve("format", tok, r"####\s*\d+")(prompt, enc("x #### 3")) == 1.0
    assert rewards.resolve("linnet.rl.rewards:last_number", tok) is rewards.last_number
    with pytest.raises(ValueError, match="module:function"):
        rewards.resolve("fuzzy", tok)
    with pytest.raises(ValueError, match="format_pattern"):
        rewards.resolve("format", tok)


def trl_style(prompts, completions, answer, completion_ids, level, **kwargs):
    """A reward written for TRL's GRPOTrainer: a batch of texts in, a list out (each value
    spells what it was given: the prompt text, the record's level, the answer, the ids)."""
    return [None if c == "skip" else 1000 * (p == "1+1=") + 100 * lvl + 10 * (c == a) + len(ids)
            for p, c, a, lvl, ids in zip(prompts, completions, answer, level, completion_ids)]


def trl_chat(prompts, completions):
    return [float(len(c[0]["content"])) for c in completions]


def trl_fussy(prompts, completions, **kwargs):
    if "boom" in completions:
        raise KeyError("boom")
    return [0.0] * (len(completions) - ("short" in completions))


def test_rewards_with_trls_contract_get_texts_and_the_records_columns():
    """module:function rewards written for TRL score a batch of decoded completions, the
    records' other fields as keyword lists; None is TRL's no-opinion (0); a failing call
    names the completion; a list of the wrong length is one clear message."""
    from linnet.rl.rollouts import Prompt, score

    tok = SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)), eos_ids=(0,))
    enc = lambda s: [ord(c) for c in s]  # noqa: E731
    reward = rewards.resolve("tests.test_reinforce:trl_style", tok)
    assert isinstance(reward, rewards.trl_reward) and reward.__name__ == "trl_style"
    records = [{"prompt": "1+1=", "answer": "2", "level": 1}, {"prompt": "2+2=", "answer": "4", "level": 3}]
    items = [(Prompt(enc(r["prompt"]), r["answer"], r["prompt"], r), enc(c) + [0])
             for r, c in zip(records, ["2", "skip"])]
    assert reward.batch(items) == [1112, 0.0]  # the text "1+1=", level 1, "2" == "2", ids [50, 0]; None: 0
    chat = rewards.resolve("tests.test_reinforce:trl_chat", tok)  # takes no columns: none are passed
    messages = [{"role": "user", "content": "hi"}]
    assert chat.batch([(Prompt(enc("hi"), None, messages, {"prompt": messages}), enc("abc"))]) == [3.0]
    fussy = {"fussy": rewards.resolve("tests.test_reinforce:trl_fussy", tok)}
    batch = [(Prompt(enc("x"), None), enc(c), f"prompt 4, completion {i}") for i, c in enumerate(["ok", "boom"])]
    with pytest.raises(ValueError, match=r"reward 'fussy' raised KeyError: 'boom' on prompt 4, completion 1"):
        score(fussy, batch)
    with pytest.raises(ValueError, match=r"returned list of 1 values for 2 completions; return a list of one"):
        score(fussy, [(Prompt(enc("x"), None), enc(c), "p") for c in ["ok", "short"]])


def test_concurrent_rewards_score_completions_at_once():
    """Concurrent(reward, 2) runs two completions at the same time (each call waits at a
    barrier for a second one: one at a time, the barrier would break), gives the values in
    the items' order, and names the completion whose reward fails."""
    met = threading.Barrier(2, timeout=30)

    def paired(prompt, completion):
        met.wait()
        return float(sum(completion))

    items = [(None, [i]) for i in range(6)]
    assert rewards.Concurrent(paired, 2).batch(items) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert rewards.Concurrent(lambda p, c: 1.0 / c[0], 3)(None, [4]) == 0.25
    with pytest.raises(ValueError, match="completion 2 of the batch: ZeroDivisionError"):
        rewards.Concurrent(lambda p, c: 1.0 / (c[0] - 2), 3).batch(items)
    with pytest.raises(ValueError, match="workers=0"):
        rewards.Concurrent(paired, 0)


def thread_named_reward(prompt, completion):
    """A module:function reward for the next test (imported by name, so a module of its own
    to the run): notes in a file which thread scored it."""
    with open(os.environ["LINNET_TEST_CALLERS"], "a") as f:
        f.write(threading.current_thread().name + "\n")
    return float(len(completion) % 2)


def test_grpo_reward_workers_score_module_rewards_in_threads(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_TEST_CALLERS", str(tmp_path / "callers.txt"))
    run(load(GRPOConfig, None, _overrides(workspace, tmp_path / "run", "grpo.reward_workers=2", "grpo.pass_k=0",
                                          "grpo.pass_samples=null", "training.steps=1",
                                          "grpo.rewards=[tests.test_reinforce:thread_named_reward, exact]")))
    callers = (tmp_path / "callers.txt").read_text().split()
    assert len(callers) >= 16 and all(name.startswith("ThreadPoolExecutor") for name in callers)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "reward_thread_named_reward" in metrics[0]
    with pytest.raises(ValueError, match="grpo.reward_workers=0"):
        load(GRPOConfig, None, ["data.path=x.jsonl", "grpo.reward_workers=0"])


def test_grpo_config_errors(capsys):
    with pytest.raises(ValueError, match="grpo.group"):
        load(GRPOConfig, None, ["data.path=x.jsonl", "grpo.group=1"])
    with pytest.raises(ValueError, match="grpo.pass_k"):
        load(GRPOConfig, None, ["data.path=x.jsonl", "grpo.pass_k=1"])
    with pytest.raises(ValueError, match="grpo.pass_samples"):
        load(GRPOConfig, None, ["data.path=x.jsonl", "grpo.pass_k=4", "grpo.pass_samples=3"])
    assert cli.main(["grpo", "--template"]) == 0
    assert "correction_cap" in capsys.readouterr().out


def _grpo_process(rank, overrides):
    from linnet.commands.grpo import main as grpo_cli

    return grpo_cli([a for o in overrides for a in ("--set", o)])


@pytest.mark.parametrize("settings", [["training.shard=none"], ["training.shard=fsdp"],
                                      ["training.shard=none", "grpo.max_staleness=1"]])
def test_two_processes_share_the_prompts(workspace, tmp_path, settings):
    """Under torchrun each process samples and trains on half of every step's prompts
    (with its own sampling seed; sampling ahead, with its own sampler thread) and evaluates
    half the held-out ones; the first writes one metrics line a step with held-out means
    over both halves."""
    from tests.conftest import in_processes

    out = tmp_path / "two"
    assert in_processes(_grpo_process, _overrides(workspace, out, *settings)) == [0, 0]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["learned"] > 0 and np.isfinite(m["loss"]) for m in metrics)
    assert all(0 <= metrics[-1][k] <= 1 for k in ("held_out_pass@1", "held_out_pass@2"))
    assert (out / "final" / "adapter_model.safetensors").is_file()


def trl_answers(prompts, completions, answer, prompt, **kwargs):
    """TRL's contract from a config: the prompts' text, and the records' columns (prompt, answer)."""
    if not (prompts == prompt and all(isinstance(p, str) for p in prompts) and len(answer) == len(completions)):
        raise AssertionError("not TRL's arguments")
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_linnet_grpo_scores_with_a_reward_written_for_trl(workspace, tmp_path):
    """grpo.rewards names a TRL-style function: it gets the records' prompt texts and
    columns, and the run trains on its scores."""
    overrides = _overrides(workspace, tmp_path / "run", "grpo.pass_k=0", "grpo.pass_samples=null",
                           "grpo.rewards=[tests.test_reinforce:trl_answers]")
    assert cli.main(["grpo", *[a for o in overrides for a in ("--set", o)]]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(0 <= r["reward"] <= 1 for r in rows)
