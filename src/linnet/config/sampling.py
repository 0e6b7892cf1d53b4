"""The groups of the trainers that sample their own data: `grpo`, `ppo`, and `dpo` when it
trains online. What they share keeps one name in each (`Sampling`, `Rewards`,
`SamplingOptions`, `RolloutSettings`); each trainer's options class is what its Python
function takes (`settings=` or keywords), its settings class what its command reads (the
options and the rewards, engine and held-out pass@k)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from linnet.config.fields import check_finite, check_one_of, check_ranges, option


@dataclass
class Sampling:
    """How completions are sampled, under the same names in every group that samples
    (grpo, ppo, dpo's online training)."""

    YAML: ClassVar[str] = "grpo"  # the group's name in a config

    max_new_tokens: int = option(256, "longest completion")
    temperature: float = option(1.0, "sampling temperature")
    top_k: int | None = option(None, "sample from the k most likely tokens")
    top_p: float | None = option(None, "sample from the smallest set reaching this probability")

    def __post_init__(self):
        g = self.YAML
        check_finite(self, g)
        if self.max_new_tokens < 1:
            raise ValueError(f"config: {g}.max_new_tokens={self.max_new_tokens}; it must be >= 1")
        if self.temperature < 0 or (self.top_k is not None and self.top_k < 1) \
                or (self.top_p is not None and not 0 < self.top_p <= 1):
            raise ValueError(f"config: {g}.temperature must be >= 0, {g}.top_k >= 1 and {g}.top_p in (0, 1]")


@dataclass
class Rewards:
    """The rewards that score sampled completions, under the same names in every group
    that samples; mixed in before the sampling options, so its fields come after theirs."""

    rewards: list[str] = option(["exact"], "exact, numeric, format, code (the share of the record's tests a "
                                           "sandboxed run passes), model:DIR (a reward model from `linnet "
                                           "reward`), or module:function; summed")
    format_pattern: str | None = option(None, "regular expression for the 'format' reward")
    reward_workers: int = option(1, "score each code or module:function reward this many completions at a time, in "
                                    "threads: for rewards that wait on a subprocess or a service (reward models "
                                    "batch already)")
    sandbox_timeout: float = option(10.0, "the code reward: wall-clock seconds a program and its tests may run in "
                                          "the sandbox (its CPU seconds: half of it, at least 1)")
    sandbox_memory_mb: int = option(1024, "the code reward: the program's address space in the sandbox, MiB")

    def __post_init__(self):
        super().__post_init__()
        g = self.YAML
        if not self.rewards:
            raise ValueError(f"config: {g}.rewards lists no reward")
        if not (self.sandbox_timeout > 0 and self.sandbox_memory_mb > 0):
            raise ValueError(f"config: {g}.sandbox_timeout={self.sandbox_timeout} and {g}.sandbox_memory_mb="
                             f"{self.sandbox_memory_mb} must be > 0")
        if self.reward_workers < 1:
            raise ValueError(f"config: {g}.reward_workers={self.reward_workers}; use 1 (one completion at a time) "
                             "or more")


@dataclass
class SamplingOptions(Sampling):
    """What GRPO and PPO share, under the same names in their groups: the prompts a step,
    how completions are sampled, and the optimizer steps that reuse them, the ratio clipped."""

    prompts_per_step: int = option(8, "prompts per sampling step")
    iterations: int = option(1, "optimizer steps per sampling step (reusing the samples)")
    clip: list[float] = option([0.2, 0.2], "the ratio's clip [low, high]: the ratio is kept in [1 - low, 1 + high] "
                                           "(DAPO's clip-higher raises high, e.g. [0.2, 0.28])")

    def __post_init__(self):
        g = self.YAML
        super().__post_init__()
        check_ranges(g, prompts_per_step=(self.prompts_per_step, self.prompts_per_step >= 1, ">= 1"),
                     iterations=(self.iterations, self.iterations >= 1, ">= 1"))
        if len(self.clip) != 2 or not 0 <= self.clip[0] < 1 or self.clip[1] < 0:
            raise ValueError(f"config: {g}.clip={list(self.clip)}; give [low, high] with low in [0, 1) (the ratio is "
                             "clipped below at 1 - low) and high >= 0")


@dataclass
class GRPOOptions(SamplingOptions):
    """GRPO's own options: the `grpo` group's fields that `linnet.train.grpo.grpo` takes
    (its keywords, or `settings=`), the same definition in YAML and Python."""

    YAML: ClassVar[str] = "grpo"

    group: int = option(8, "completions sampled per prompt")
    drop_uniform: bool = option(False, "leave groups whose rewards are all equal out of the loss's average "
                                        "(with beta 0 they skip training anyway)")
    beta: float = option(0.0, "k3 KL weight against a frozen copy of the starting model")
    correction_cap: float | None = option(None, "truncated importance weights p_policy/p_engine, capped (needs "
                                                "temperature 1, no top_k or top_p)")
    correction: Literal["token", "sequence"] = option("token", "correction_cap's weights: token, each token's "
                                                               "own; sequence, one a completion (the product of "
                                                               "its tokens' ratios)")
    dr_grpo: bool = option(False, "Dr. GRPO: no std division, constant normaliser")
    sequence_level: bool = option(False, "GSPO: one ratio per completion")
    advantage: Literal["group", "rloo"] = option("group", "group: reward - group mean, over the group's std; rloo: "
                                                          "reward - the mean of the group's other rewards")
    sequence_mean: bool = option(False, "average each completion's token losses over its own length, then over "
                                        "completions (the GRPO paper's 1/|o_i|)")
    dynamic_sampling: int = option(0, "DAPO's dynamic sampling: up to this many extra sampling rounds a step, "
                                      "until it holds prompts_per_step groups whose rewards differ; 0: off")
    max_staleness: int = option(0, "sample up to this many steps ahead on a second thread, each from the weights "
                                   "that many updates old (correction_cap weighs them); 0: each step samples the "
                                   "current weights")
    stall_timeout: float = option(1800.0, "with max_staleness: seconds the trainer waits for a step's samples, or "
                                          "the sampler for the next weights, before the run ends naming the side "
                                          "that stalled")
    environment: str | None = option(None, "module:Class: an environment answering the model's turns, so each "
                                           "completion is a conversation (linnet.rl.environments); its rewards are "
                                           "summed in as the reward 'environment'")
    tools: list[str] = option([], "tools of the built-in tool environment: calculator, python (run in the "
                                  "sandbox); tool calls in the chat template's format, results inserted as tool "
                                  "turns, never learned")
    max_turns: int = option(4, "with environment or tools: the model turns a conversation may take")

    def __post_init__(self):
        check_one_of(self, "advantage")
        check_one_of(self, "correction")
        if self.group < 2:
            raise ValueError(f"config: grpo.group={self.group}; grpo.group >= 2 (a group's rewards are compared "
                             "with each other)")
        super().__post_init__()
        if self.dynamic_sampling < 0:
            raise ValueError(f"config: grpo.dynamic_sampling={self.dynamic_sampling}; it is a number of extra "
                             "sampling rounds, >= 0")
        if self.max_turns < 1:
            raise ValueError(f"config: grpo.max_turns={self.max_turns}; a conversation takes at least one turn")
        check_ranges("grpo", max_staleness=(self.max_staleness, self.max_staleness >= 0, "a number of steps, >= 0"),
                     stall_timeout=(self.stall_timeout, self.stall_timeout > 0, "a number of seconds, > 0"))
        if self.dr_grpo and self.sequence_mean:
            raise ValueError("config: grpo.dr_grpo divides token sums by a constant and grpo.sequence_mean by each "
                             "completion's length; choose one")
        if self.temperature == 0:
            raise ValueError("config: grpo.temperature=0 samples greedily: every completion of a group is the same, "
                             "so every group's rewards are equal, its advantages 0, and nothing is learned; use a "
                             "temperature > 0 (1.0 samples the policy as it is)")
        check_ranges("grpo", beta=(self.beta, self.beta >= 0, ">= 0"),
                     correction_cap=(self.correction_cap, self.correction_cap is None or self.correction_cap > 0,
                                     "> 0, or null for no correction"))
        if self.correction_cap is not None and (self.temperature != 1.0 or self.top_k or
                                                self.top_p not in (None, 1.0)):
            raise ValueError("config: grpo.correction_cap reads the engine's log-probabilities: use grpo.temperature "
                             "1, no grpo.top_k or grpo.top_p")


@dataclass
class PPOOptions(SamplingOptions):
    """PPO's own options: the `ppo` group's fields that `linnet.train.ppo.ppo` takes (its
    keywords, or `settings=`); what it shares with GRPO keeps GRPO's names."""

    YAML: ClassVar[str] = "ppo"

    iterations: int = option(4, "optimizer steps per sampling step (PPO's epochs over the batch)")
    samples: int = option(1, "completions sampled per prompt")
    kl_coef: float = option(0.05, "the reward's per-token KL penalty against a frozen copy of the starting model")
    gamma: float = option(1.0, "discount of later tokens' rewards")
    lam: float = option(0.95, "GAE's lambda: 0 the one-step TD advantage, 1 the whole return")
    vf_coef: float = option(0.1, "weight of the value loss beside the policy loss")
    value_clip: float = option(0.2, "the new value is kept within this of the old in the value loss")
    whiten: bool = option(True, "advantages normalised to mean 0 and std 1 over each step")

    def __post_init__(self):
        super().__post_init__()
        check_ranges("ppo", samples=(self.samples, self.samples >= 1, ">= 1"),
                     kl_coef=(self.kl_coef, self.kl_coef >= 0, ">= 0"),
                     vf_coef=(self.vf_coef, self.vf_coef >= 0, ">= 0"),
                     value_clip=(self.value_clip, self.value_clip > 0, "> 0"),
                     gamma=(self.gamma, 0 <= self.gamma <= 1, "in [0, 1]"),
                     lam=(self.lam, 0 <= self.lam <= 1, "in [0, 1]"))


@dataclass
class RolloutSettings(Rewards):
    """What `linnet grpo` and `linnet ppo` build around their objective's options, under
    the same names in either group: the rewards (`Rewards`), the engine, the held-out pass@k. Mixed
    in before the options (`GRPOSettings`, `PPOSettings`), so its fields come after theirs."""

    pass_k: int = option(0, "held-out pass@k at each evaluation, from completions sampled with temperature, "
                            "top_k and top_p; 0: only the greedy reward and pass@1")
    pass_samples: int | None = option(None, "completions sampled per held-out prompt for pass@k (>= pass_k; "
                                            "more lowers the estimate's variance); null: pass_k")
    pass_reward: float | None = option(None, "a held-out completion passes when its summed reward reaches this; "
                                             "null: one per reward (full marks from each built-in)")
    engine: Literal["builtin", "vllm"] = option(
        "builtin", "what samples the rollouts: builtin (linnet.serve.Engine, any device) or vllm (vLLM on the "
                   "run's CUDA GPU beside the policy: the vllm extra)")
    engine_dtype: Literal["float32", "bfloat16"] | None = option(
        None, "engine builtin: the dtype it samples in; null: the model's. bfloat16 samples a float32 policy up to 2x "
              "faster where bf16 is native (CUDA, amx_bf16/avx512_bf16 CPUs); pair it with correction_cap (e.g. 2)")
    vllm_gpu_memory_utilization: float | None = option(
        None, "engine vllm: the share of the GPU's memory vLLM takes for its copy of the weights and its KV cache, "
              "the rest left to training; null: 0.3")

    def __post_init__(self):
        super().__post_init__()
        g = self.YAML
        if self.pass_k < 0 or self.pass_k == 1:
            raise ValueError(f"config: {g}.pass_k is 0 (off) or >= 2; pass@1 (greedy) is always reported")
        if self.pass_samples is not None and not 2 <= self.pass_k <= self.pass_samples:
            raise ValueError(f"config: {g}.pass_samples needs {g}.pass_k >= 2, and must be at least pass_k")
        if self.engine_dtype is not None and self.engine != "builtin":
            raise ValueError(f"config: {g}.engine_dtype={self.engine_dtype} is read with {g}.engine=builtin only "
                             "(vLLM samples in the policy's dtype); remove it")
        memory = self.vllm_gpu_memory_utilization
        if memory is not None and self.engine != "vllm":
            raise ValueError(f"config: {g}.vllm_gpu_memory_utilization={memory} is read with {g}.engine=vllm only; "
                             f"remove it, or set {g}.engine=vllm")
        if memory is not None and not 0 < memory < 1:
            raise ValueError(f"config: {g}.vllm_gpu_memory_utilization={memory}; use a share in (0, 1), e.g. 0.3")


@dataclass
class GRPOSettings(RolloutSettings, GRPOOptions):
    """The `grpo` group: GRPO's options and what `linnet grpo` builds around them."""

    def __post_init__(self):
        super().__post_init__()
        if self.engine == "vllm" and (self.environment or self.tools):
            raise ValueError("config: grpo.environment and grpo.tools sample conversations with the builtin engine, "
                             "which inserts each turn's answer into its cache; use grpo.engine=builtin")


@dataclass
class PPOSettings(RolloutSettings, PPOOptions):
    """The `ppo` group: PPO's options and what `linnet ppo` builds around them."""

    critic: str | None = option(None, "null: the critic is a value head on the policy's hidden states; a card, "
                                      "model directory or run: a separate model, loaded and trained as the policy "
                                      "is (the lora group applies to it too), with its value head")
