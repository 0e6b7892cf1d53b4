"""vLLM as GRPO's rollout engine: what GRPO uses of `linnet.serve.Engine` (`sample`,
`load_weights`) over a `vllm.LLM` in this process, on the policy's GPU (TRL's "colocate").

    pip install 'linnet[vllm]'                                   # on a CUDA machine
    linnet grpo --config configs/grpo.yaml --set grpo.engine=vllm

    engine = VLLMEngine(card, device=policy.device, dtype=policy.dtype, tokens=1024)
    engine.load_weights(policy)        # first: vLLM starts from random weights
    done = engine.sample([ids_a, ids_b], n=8, max_new_tokens=256, temperature=1.0, seed=0)

How linnet's engine contract maps onto vLLM:

- Architecture: vLLM builds the model from the card's own config.json (`Card.hf_config`,
  written to a temporary directory) with random weights (`load_format="dummy"`) and no
  tokenizer: the weights come from the policy, and prompts and completions are token ids.
  `sample` before the first `load_weights` is refused.
- Weights: `load_weights(policy)` streams the policy's weights by their Hugging Face names
  through the helpers `Engine.load_weights` uses (adapters merged in float32, an NF4 base
  dequantized, a sharded weight gathered) into the vLLM model's own `load_weights`, which
  fuses q/k/v and gate/up as it copies; then the prefix cache is emptied, since its keys
  and values came from the old weights.
- Log-probabilities: `logprobs=0` returns the sampled token's log-probability, and
  `logprobs_mode="raw_logprobs"` takes it before temperature and top-k/top-p: the model's
  unmodified distribution, as `Engine` gives (vLLM's kernels' numbers in the compute
  dtype, so not bit-equal to the policy's recomputed ones; GRPO logs the gap as
  `mismatch`). Float32 CPU tensors, as `Engine` returns.
- Stops: EOS is ignored and the stop ids are vLLM's `stop_token_ids`, so exactly `stop`
  ends a completion (None: the card's eos_token_ids; (): none), kept as its last token.
- Seeds: vLLM seeds a request's n completions seed + j, so each prompt's request gets its
  own seed drawn from (seed, prompt index); the same seed gives the same completions
  (not the builtin Engine's: the random streams differ).
- Groups: one request per prompt with `n` completions, vLLM's parallel sampling, whose
  prefix cache shares the prompt's keys and values across the group.
- Process: `distributed_executor_backend="external_launcher"` keeps vLLM's engine in this
  process, where its model can take the weights; it reads RANK, LOCAL_RANK, WORLD_SIZE
  and MASTER_ADDR/PORT as torchrun sets them (one process on its GPU when not set).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from linnet.cards import Card, resolve
from linnet.rl.rollouts import Completion
from linnet.torch.engine import sampling_options, token_prompts
from linnet.torch.lora import merged, policy_weights

INSTALL = "pip install 'linnet[vllm]' (on a CUDA machine)"


def check_usable(device: torch.device) -> None:
    """Refuse `grpo.engine=vllm` before a run writes anything: vLLM samples on a CUDA
    GPU, from the vllm package."""
    if device.type != "cuda":
        raise ValueError(f"grpo.engine=vllm samples on a CUDA GPU, and this run computes on {device} "
                         "(runtime.device; null takes CUDA only when present); set grpo.engine=builtin to sample "
                         "with linnet's engine on any device")
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"grpo.engine=vllm needs vLLM, which is not installed: {INSTALL}, or set "
                         "grpo.engine=builtin")


def _vllm():
    """The vllm module, or an error that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ModuleNotFoundError(f"VLLMEngine needs vLLM: {INSTALL}; or sample with linnet.serve.Engine") from e
    return vllm


# The share of the GPU's memory vLLM takes by default: its own 0.9 would leave training little
GPU_SHARE = 0.3


class VLLMEngine:
    """GRPO's rollouts through vLLM on one CUDA GPU, beside the policy.

    card: the policy's card (a Card, a registered name or a model directory).
    device: the policy's CUDA device. dtype: what vLLM computes in (the policy's).
    tokens: the longest prompt + completion (GRPO's packed row, training.context_length).
    gpu_memory_utilization: the share of the GPU's memory vLLM takes for its weights and
        KV cache; the rest stays with training (None: GPU_SHARE).
    seed: vLLM's own seed (each `sample` call's seed decides the draws).
    """

    def __init__(self, card: Card | str, *, device: torch.device | str = "cuda", dtype: torch.dtype | str = "bfloat16",
                 tokens: int = 2048, gpu_memory_utilization: float | None = None, seed: int = 0):
        vllm = _vllm()
        self.card = resolve(card)
        self._sampling_params = vllm.SamplingParams
        self._config = tempfile.TemporaryDirectory(prefix="linnet-vllm-")  # vLLM may read it again later
        Path(self._config.name, "config.json").write_text(json.dumps(self.card.hf_config(), indent=2))
        _launcher_environment(torch.device(device))
        self.llm = vllm.LLM(
            model=self._config.name, skip_tokenizer_init=True, load_format="dummy",
            dtype=str(dtype).removeprefix("torch."), max_model_len=tokens,
            gpu_memory_utilization=GPU_SHARE if gpu_memory_utilization is None else gpu_memory_utilization,
            seed=seed, logprobs_mode="raw_logprobs", distributed_executor_backend="external_launcher",
        )
        self._loaded = False

    @torch.no_grad()
    def load_weights(self, policy: torch.nn.Module) -> None:
        """Copy a policy's weights in by Hugging Face name, LoRA adapters merged (the
        policy is not changed); a sharded policy is gathered one tensor at a time, so every
        process calls this together. Every weight of vLLM's model must come from the
        policy: a missing one is named."""
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        loaded = model.load_weights((name, merged(p, layer)) for name, p, layer in policy_weights(policy))
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            raise ValueError(f"VLLMEngine.load_weights: the policy gave no weight for vLLM's {missing[0]!r} (and "
                             f"{len(missing) - 1} more); load the engine from the policy's card")
        self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        self._loaded = True

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: Iterable[int] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample n completions of each prompt, as `Engine.sample` does (the same options
        but `generator`; see the module docstring for how each maps onto vLLM).

        Returns len(prompts) * n completions, prompt-major: completion j of prompt i is
        at i * n + j.
        """
        who = "VLLMEngine.sample"
        prompts = token_prompts(prompts, self.card.vocab, who)
        top_k, top_p = sampling_options(n, max_new_tokens, temperature, top_k, top_p, self.card.vocab, who)
        if not self._loaded:
            raise ValueError(f"{who}: vLLM holds random weights until load_weights(policy); call it first")
        stop_ids = list(self.card.eos_token_ids if stop is None else (int(t) for t in stop))
        options = dict(n=n, max_tokens=max_new_tokens, temperature=float(temperature), top_p=top_p,
                       stop_token_ids=stop_ids, ignore_eos=True, logprobs=0, detokenize=False)
        if top_k:  # vLLM's default keeps every token
            options["top_k"] = top_k
        params = [self._sampling_params(**options, seed=None if seed is None else _request_seed(seed, i))
                  for i in range(len(prompts))]
        requests = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                     use_tqdm=False)
        done = []
        for i, request in enumerate(requests):  # vLLM returns them in the order given
            assert len(request.outputs) == n, (len(request.outputs), n)
            done += [_completion(i, out) for out in request.outputs]
        return done


def _completion(prompt: int, out) -> Completion:
    """A vLLM CompletionOutput as a Completion: each step's logprobs maps token id ->
    Logprob; the sampled token's entry is the one kept."""
    tokens = list(out.token_ids)
    logprobs = [step[token].logprob for token, step in zip(tokens, out.logprobs, strict=True)]
    return Completion(prompt, tokens, torch.tensor(logprobs, dtype=torch.float32), out.finish_reason == "stop")


def _request_seed(seed: int, prompt: int) -> int:
    """The seed of one prompt's request, drawn from (seed, prompt): vLLM gives completion
    j seed + j, so the prompt index or seed itself would hand neighbouring prompts (and
    the next step, whose seed GRPO makes one larger) the same random streams."""
    return int(np.random.SeedSequence([int(seed) % 2**64, prompt]).generate_state(1)[0])


def _launcher_environment(device: torch.device) -> None:
    """What vLLM's external launcher reads, as torchrun sets it; when torchrun did not,
    this process alone, on `device`."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a free port for the rendezvous of a group of one
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
