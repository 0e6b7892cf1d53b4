"""grpo.engine=vllm without vLLM: the refusals, and VLLMEngine's translation between
linnet's engine contract and vLLM's API, against a fake `vllm` module that records what it
is given and answers in the shapes of vLLM's RequestOutput / CompletionOutput / Logprob.
The last two tests run the real vLLM and are skipped without it and a CUDA GPU:

    pip install 'linnet[vllm]' && python -m pytest -q tests/test_vllm.py -k real -rs
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from linnet import cli, nest
from linnet.packing import Example, pack
from linnet.rl.rollouts import Prompt
from linnet.serve.vllm import VLLMEngine, check_usable
from linnet.train.grpo import grpo
from tests.conftest import quickstart_model

torch.set_num_threads(1)

TOKENS = (2, 5, 7, 11, 13)  # what the fake samples from; 2 is the debug card's eos
DECOY = 3  # a token the fake lists first in every step's logprobs, never sampled


def fake_logprob(token: int, step: int) -> float:
    return -(token + step) / 64


class SamplingParams:
    """vLLM's names: an option vLLM does not have is a TypeError here too."""

    def __init__(self, *, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=None,
                 ignore_eos=False, logprobs=None, detokenize=True, seed=None):
        self.__dict__.update(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs,
                             detokenize=detokenize, seed=seed)


class FakeModel:
    """vLLM's model for the card's config.json: q/k/v and gate/up fused, as vLLM's Llama."""

    FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}

    def __init__(self, config: dict, calls: list):
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        for i in range(config["num_hidden_layers"]):
            names += [f"model.layers.{i}.{part}.weight" for part in (
                "input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj",
                "mlp.gate_up_proj", "mlp.down_proj")]
        if not config["tie_word_embeddings"]:
            names.append("lm_head.weight")
        self.names, self.calls = names, calls

    def named_parameters(self):
        return [(name, None) for name in self.names]

    def load_weights(self, weights):
        received = [(name, t) for name, t in weights]  # vLLM iterates what it is given
        self.calls.append(("load_weights", received))
        loaded = set()
        for name, _ in received:
            for part, fused in self.FUSED.items():
                name = name.replace(f".{part}.", f".{fused}.")
            loaded.add(name)
        return loaded


class LLM:
    made: list[LLM] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.config = json.loads(Path(kwargs["model"], "config.json").read_text())
        self.calls: list = []
        self.model = FakeModel(self.config, self.calls)
        runner = SimpleNamespace(model=self.model)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            model_runner=runner)))
        LLM.made.append(self)

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling_params, *, use_tqdm=True):
        self.calls.append(("generate", prompts, sampling_params, use_tqdm))
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                outputs=[self._child(sp, j) for j in range(sp.n)])
                for p, sp in zip(prompts, sampling_params, strict=True)]

    def _child(self, sp, j):
        """Completion j of a request: vLLM seeds it sp.seed + j."""
        g = None if sp.seed is None else torch.Generator().manual_seed(sp.seed + j)
        eos = set() if sp.ignore_eos else set(self.config["eos_token_id"])
        tokens, logprobs = [], []
        for step in range(sp.max_tokens):
            t = TOKENS[int(torch.randint(len(TOKENS), (1,), generator=g))]
            tokens.append(t)
            logprobs.append({DECOY: SimpleNamespace(logprob=-0.01, rank=1),
                             t: SimpleNamespace(logprob=fake_logprob(t, step), rank=2)})
            if t in eos or t in sp.stop_token_ids:
                return SimpleNamespace(index=j, token_ids=tokens, logprobs=logprobs, finish_reason="stop")
        return SimpleNamespace(index=j, token_ids=tokens, logprobs=logprobs, finish_reason="length")


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29555")):  # set (and restored) here, not by the engine
        monkeypatch.setenv(name, value)
    LLM.made.clear()
    return module


@pytest.fixture
def policy():
    model = nest.load("debug", weights="random", seed=0)
    model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.normal_(0, 0.1)  # adapters that change the weights
    return model


def _engine(policy, **options):
    engine = VLLMEngine("debug", device="cuda", dtype=torch.float32, tokens=96, **options)
    engine.load_weights(policy)
    return engine


PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61]]


def test_vllm_is_built_from_the_cards_config_with_raw_logprobs(fake_vllm):
    VLLMEngine("debug", device="cuda:0", dtype=torch.bfloat16, tokens=96, seed=4)
    (llm,) = LLM.made
    assert llm.config == nest.resolve("debug").hf_config()
    assert llm.kwargs == dict(model=llm.kwargs["model"], skip_tokenizer_init=True, load_format="dummy",
                              dtype="bfloat16", max_model_len=96, gpu_memory_utilization=0.3, seed=4,
                              logprobs_mode="raw_logprobs", distributed_executor_backend="external_launcher")


def test_load_weights_passes_merged_weights_by_hf_name_then_resets_the_prefix_cache(fake_vllm, policy):
    expected = copy.deepcopy(policy)
    expected.merge_lora()
    engine = _engine(policy)
    (llm,) = LLM.made
    (kind, received), reset = llm.calls
    assert kind == "load_weights" and reset == ("reset_prefix_cache",)
    want = dict(expected.named_parameters())
    assert [name for name, _ in received] == list(want)  # HF names, no adapter tensors
    for name, tensor in received:
        assert not tensor.requires_grad
        torch.testing.assert_close(tensor.float(), want[name].float(), rtol=0, atol=1e-6, msg=name)
    assert policy.lora and any(n.endswith(".lora_b") for n, _ in policy.named_parameters())  # policy unchanged
    assert engine.sample([[1, 2]], max_new_tokens=2, seed=0)[0].prompt == 0  # sampling is allowed now


def test_a_vllm_weight_the_policy_lacks_is_named(fake_vllm, policy):
    engine = VLLMEngine("debug", device="cuda", dtype=torch.float32, tokens=96)
    engine.llm.model.names.append("model.layers.0.mlp.extra.weight")
    with pytest.raises(ValueError, match=r"no weight for vLLM's 'model.layers.0.mlp.extra.weight'"):
        engine.load_weights(policy)


def test_sample_before_load_weights_is_refused(fake_vllm):
    engine = VLLMEngine("debug", device="cuda", dtype=torch.float32, tokens=96)
    with pytest.raises(ValueError, match=r"random weights until load_weights"):
        engine.sample(PROMPTS)
    with pytest.raises(ValueError, match=r"VLLMEngine.sample: prompt 1 is empty"):
        engine.sample([[1], []])


def test_sample_is_prompt_major_with_the_sampled_tokens_logprobs_and_stops(fake_vllm, policy):
    engine = _engine(policy)
    done = engine.sample(PROMPTS, n=4, max_new_tokens=6, temperature=0.7, top_p=0.9, seed=3)
    (llm,) = LLM.made
    _, prompts, params, tqdm = llm.calls[-1]
    assert prompts == [{"prompt_token_ids": p} for p in PROMPTS] and tqdm is False
    for sp in params:
        assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (4, 6, 0.7, 0.9, 0)
        assert (sp.logprobs, sp.ignore_eos, sp.stop_token_ids, sp.detokenize) == (0, True, [2], False)
    assert [c.prompt for c in done] == [0] * 4 + [1] * 4 + [2] * 4
    for i, c in enumerate(done):
        child = llm._child(params[c.prompt], i % 4)  # what vLLM returned for it
        assert c.tokens == child.token_ids
        assert c.logprobs.dtype == torch.float32
        assert c.logprobs.tolist() == pytest.approx([fake_logprob(t, s) for s, t in enumerate(c.tokens)])
        assert c.stopped == (c.tokens[-1] == 2)
        assert c.stopped or len(c.tokens) == 6
    assert any(c.stopped for c in done) and not all(c.stopped for c in done)


def test_stop_ids_replace_eos(fake_vllm, policy):
    engine = _engine(policy)
    never = engine.sample(PROMPTS, n=4, max_new_tokens=8, stop=(), seed=0)
    assert LLM.made[0].calls[-1][2][0].stop_token_ids == []
    assert all(not c.stopped and len(c.tokens) == 8 for c in never) and any(2 in c.tokens for c in never)
    on_five = engine.sample(PROMPTS, n=4, max_new_tokens=8, stop=[5], top_k=2, seed=0)
    assert LLM.made[0].calls[-1][2][0].top_k == 2
    for c in on_five:
        assert 5 not in c.tokens[:-1] and c.stopped == (c.tokens[-1] == 5)


def test_seeds_repeat_and_keep_prompts_and_steps_apart(fake_vllm, policy):
    engine = _engine(policy)
    first = engine.sample(PROMPTS, n=4, max_new_tokens=6, seed=7)
    again = engine.sample(PROMPTS, n=4, max_new_tokens=6, seed=7)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    engine.sample(PROMPTS, n=4, max_new_tokens=6, seed=8)
    calls = [c for c in LLM.made[0].calls if c[0] == "generate"]
    seeds = {step: [sp.seed for sp in call[2]] for step, call in zip((7, 7, 8), calls)}
    drawn = [{s + j for s in seeds[step] for j in range(4)} for step in (7, 8)]  # vLLM's seed + j
    assert len(drawn[0]) == len(drawn[1]) == 12 and not drawn[0] & drawn[1]
    engine.sample(PROMPTS, n=2, max_new_tokens=2)
    assert [sp.seed for sp in LLM.made[0].calls[-1][2]] == [None] * 3


def test_grpo_trains_through_it(fake_vllm, policy):
    engine = VLLMEngine("debug", device="cuda", dtype=torch.float32, tokens=64)
    prompts = [Prompt(p, answer=i) for i, p in enumerate(PROMPTS * 2)]
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    history = grpo(policy, engine, prompts, lambda prompt, c: float(5 in c), optimizer=opt, steps=2, group=4,
                   prompts_per_step=3, max_new_tokens=6, tokens=64, verbose=False)
    assert len(history) == 2 and all(math.isfinite(loss) for loss in history.losses)
    kinds = [c[0] for c in LLM.made[0].calls]
    assert kinds == ["load_weights", "reset_prefix_cache", "generate"] * 2  # fresh weights before each step


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable, whatever is installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'linnet\[vllm\]'"):
        VLLMEngine("debug")
    with pytest.raises(ValueError, match=r"grpo.engine=vllm needs vLLM.*linnet\[vllm\].*grpo.engine=builtin"):
        check_usable(torch.device("cuda"))
    with pytest.raises(ValueError, match=r"CUDA GPU, and this run computes on cpu.*grpo.engine=builtin"):
        check_usable(torch.device("cpu"))


def test_linnet_grpo_refuses_vllm_without_the_package_before_writing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine without vLLM
    config = {"model": {"card": "debug"}, "data": {"path": str(tmp_path / "prompts.jsonl")},
              "grpo": {"engine": "vllm", "vllm_gpu_memory_utilization": 0.4},
              "runtime": {"output_dir": str(tmp_path / "run"), "progress": False}}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["grpo", "--config", str(tmp_path / "grpo.yaml")]) == 2
    err = capsys.readouterr().err
    assert "linnet grpo: grpo.engine=vllm needs vLLM" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grpo.yaml"]


# On a CUDA GPU with vLLM installed (skipped elsewhere, this machine included): the real thing.
needs_vllm = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM on a CUDA GPU")
GPU_CARD = nest.resolve("debug").replace(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64)


def _model_log_probs(model, prompt, tokens):
    """The model's log-probability of each completion token, through log_probs_packed."""
    ex = Example.prompted(prompt, tokens)
    (row,) = pack([ex], tokens=len(ex))
    with torch.no_grad():
        return model.log_probs_packed(row)[len(prompt) - 1 : len(ex) - 1].float().cpu()


@needs_vllm
def test_real_vllm_samples_the_loaded_policy_and_reports_its_log_probs():
    """The merged LoRA policy reaches vLLM and its raw log-probabilities are the policy's
    own (to bf16 rounding), far from the base's; after the adapters are zeroed and loaded
    again, they are the base's (new weights, prefix cache emptied)."""
    policy = nest.load(GPU_CARD, device="cuda", dtype="bfloat16", weights="random", seed=0)
    base = nest.load(GPU_CARD, device="cuda", dtype="bfloat16", weights="random", seed=0)
    with torch.no_grad():
        for m in (policy, base):  # peaked distributions, so that wrong weights show
            m.model.embed_tokens.weight.mul_(10)
    policy.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=8, alpha=16)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith(".lora_b"):
                p.normal_(0, 0.5)
    engine = VLLMEngine(GPU_CARD, device="cuda", dtype=policy.dtype, tokens=128, gpu_memory_utilization=0.3)
    prompts = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60]]

    def errors(reference_model):
        done = engine.sample(prompts, n=4, max_new_tokens=16, temperature=1.0, stop=(), seed=0)
        assert [c.prompt for c in done] == [0] * 4 + [1] * 4 + [2] * 4
        assert all(len(c.tokens) == 16 and not c.stopped and c.logprobs.dtype == torch.float32 for c in done)
        return [float((c.logprobs - _model_log_probs(m, prompts[c.prompt], c.tokens)).abs().mean())
                for c in done for m in reference_model]

    engine.load_weights(policy)
    to_policy, to_base = np.array(errors([policy, base])).reshape(-1, 2).mean(axis=0)
    assert to_policy < 0.1 and to_policy < to_base / 4, (to_policy, to_base)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith(".lora_b"):
                p.zero_()
    engine.load_weights(policy)
    (now,) = np.array(errors([base])).mean(keepdims=True)
    assert now < 0.1, now


@needs_vllm
def test_real_linnet_grpo_with_the_vllm_engine(tmp_path):
    """`linnet grpo` with grpo.engine=vllm: two steps, the engine's log-probabilities
    within bf16 rounding of the policy's (the logged mismatch)."""
    from linnet.commands import quickstart

    quickstart_model(tmp_path / "model")
    problems = quickstart.problems(np.random.default_rng(0), 40, 2)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                                    for p, a in problems))
    config = {"model": {"card": str(tmp_path / "model"), "dtype": "bfloat16"}, "lora": {"rank": 4},
              "data": {"path": str(tmp_path / "prompts.jsonl"), "chat": False},
              "training": {"steps": 2, "context_length": 64}, "lr_schedule": {"warmup_steps": 1},
              "grpo": {"engine": "vllm", "group": 4, "prompts_per_step": 4, "max_new_tokens": 4},
              "runtime": {"output_dir": str(tmp_path / "run"), "progress": False}}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["grpo", "--config", str(tmp_path / "grpo.yaml")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mismatch" in r]
    assert len(steps) == 2 and all(r["mismatch"] < 0.05 for r in steps), steps
