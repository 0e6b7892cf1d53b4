"""Rollouts, for both backends: prompts, rewards, sampled completions scored into
group-relative advantages, and the metrics of a sampling step (GRPO's and evaluation's).

Group relative policy optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300)
samples a group of completions per prompt and uses each completion's reward standing in
its group as the advantage of all its tokens, so no value model is needed. What is here
does not depend on a backend: the engines (`linnet.serve.Engine`, `linnet.jax.engine.Engine`)
sample, and each backend's trainer turns the advantages into a loss.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from linnet.packing import PartlyLearned
from linnet.rl.conversations import conversations_for, last_turn

if TYPE_CHECKING:
    from linnet.config.sampling import GRPOOptions


@dataclass
class Completion:
    """One sampled completion.

    prompt     index of its prompt in the list given to `sample`
    tokens     the sampled ids, a stop token included as the last when `stopped`
    logprobs   [len(tokens)] float32 on the host (a torch tensor from the PyTorch engine, a
               numpy array from the JAX one): the model's log-probability of each token
               (temperature 1, before top-k/top-p; see `linnet.torch.engine`)
    stopped    True when it ended on a stop token, False when it hit max_new_tokens
    version    the policy's weights it came from, in updates applied: GRPO's (both backends)
               step s samples those after s - 1 updates, or older ones when sampling ahead
               (`grpo.max_staleness`); 0 where nothing sets it
    learned    a multi-turn conversation's [len(tokens)] flags, False at the tokens its
               environment inserted (never learned; their logprobs are 0); None: all sampled
    turn_rewards  a conversation's environment reward of each model turn (None: single-turn)
    """

    prompt: int
    tokens: list[int]
    logprobs: Any
    stopped: bool
    version: int = 0
    learned: Any = None
    turn_rewards: list[float] | None = None


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids and whatever its reward needs: the reference answer, and, from
    a data file, the prompt as the record gives it (text, or chat messages) and the record's
    fields (a reward with TRL's contract reads them: linnet.rl.rewards.trl_reward)."""

    ids: Sequence[int]
    answer: Any = None
    text: Any = None
    record: Mapping[str, Any] | None = None


Reward = Callable[[Prompt, list[int]], float]


def reward_functions(reward: Reward | Mapping[str, Reward], who: str = "grpo") -> dict[str, Reward]:
    """The rewards by name; `who`: the trainer an error names."""
    if callable(reward):
        return {getattr(reward, "__name__", "reward"): reward}
    if isinstance(reward, Mapping) and reward and all(callable(f) for f in reward.values()):
        return dict(reward)
    raise TypeError(f"{who}: reward must be a callable (prompt, completion) -> number, or a dict of them")


def score(functions: dict[str, Reward], items: Sequence[tuple[Prompt, list[int], str]],
          who: str = "grpo") -> list[dict[str, float]]:
    """Each reward function's value for each (prompt, completion, where) item; a function
    with a `batch(items)` method (a reward model, linnet.train.reward.RewardScorer) scores
    them all at once. A failure or a value that is not a finite number names the item (and
    `who`, the trainer)."""
    out: list[dict[str, float]] = [{} for _ in items]
    for name, f in functions.items():
        batch = getattr(f, "batch", None)
        try:
            values = batch([(p, c) for p, c, _ in items]) if batch is not None else None
        except Exception as e:
            for p, c, where in items:  # which completion: each alone, the first failing as the batch did
                try:
                    batch([(p, c)])
                except Exception as one:
                    if type(one) is type(e) and str(one) == str(e):
                        raise ValueError(f"{who}: reward {name!r} raised {type(e).__name__}: {e} on {where}") from e
            raise ValueError(f"{who}: reward {name!r} raised {type(e).__name__}: {e} on a batch of "
                             f"{len(items)} completions") from e
        for i, (prompt, completion, where) in enumerate(items):
            try:
                value = values[i] if values is not None else f(prompt, completion)
            except Exception as e:
                raise ValueError(f"{who}: reward {name!r} raised {type(e).__name__}: {e} on {where}") from e
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                raise ValueError(f"{who}: reward {name!r} returned {value!r} on {where}; it must return a finite number")
            out[i][name] = float(value)
    return out


def check_prompts(prompts: Iterable[tuple[int, Prompt]], room: int, max_new_tokens: int,
                  names: Mapping[str, str] | None = None, who: str = "grpo") -> None:
    """Each (index, prompt) is a non-empty Prompt leaving room for its completion in a row
    of `room` positions. `names`: how the error names the row's length and max_new_tokens
    where the caller's user spells them otherwise (`linnet grpo`: training.context_length,
    grpo.max_new_tokens); default the keywords (`tokens=`, `max_new_tokens=`). `who`: the
    trainer the error names."""
    names = {"tokens": "tokens=", "max_new_tokens": "max_new_tokens=", **(names or {})}
    for i, p in prompts:
        if not isinstance(p, Prompt):
            raise TypeError(f"{who}: item {i} is a {type(p).__name__}, not a linnet.train.grpo.Prompt")
        if len(p.ids) == 0:
            raise ValueError(f"{who}: prompt {i} is empty; every prompt needs at least one token")
        if len(p.ids) + max_new_tokens > room:
            raise ValueError(f"{who}: prompt {i} has {len(p.ids)} tokens; with {max_new_tokens} new ones "
                             f"({names['max_new_tokens']}) it does not fit a row of {room} positions; raise the "
                             f"row length ({names['tokens']}) or lower {names['max_new_tokens']}")


ADVANTAGES = ("group", "rloo")


def group_advantages(rewards_PG: np.ndarray, *, scale: bool = True, kind: str = "group",
                     eps: float = 1e-4) -> np.ndarray:
    """[prompts, group] advantages. group: reward - group mean, over the group's std
    unless scale=False (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, leaves the std out).
    rloo: reward - the mean of the group's other rewards (Ahmadian et al. 2024,
    arXiv:2402.14740), G/(G-1) times the centred reward, never divided by a std; each
    group's advantages sum to zero."""
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage={kind!r}; use one of {', '.join(ADVANTAGES)}")
    rewards_PG = np.asarray(rewards_PG, np.float64)
    centered = rewards_PG - rewards_PG.mean(axis=1, keepdims=True)
    if kind == "rloo":
        G = rewards_PG.shape[1]
        return centered * G / (G - 1)
    if not scale:
        return centered
    return centered / (rewards_PG.std(axis=1, keepdims=True) + eps)


@dataclass
class Scored:
    """A step's samples and what the rewards made of them."""

    samples: list
    per_function: dict[str, np.ndarray]  # each reward function's value of each sample
    rewards: np.ndarray  # [prompts, group] summed rewards
    uniform: np.ndarray  # [prompts] groups whose rewards are all equal
    advantages: np.ndarray  # [samples]
    keep: np.ndarray  # [samples] the samples that train
    seconds: float  # sampling time
    score_seconds: float = 0.0  # the rewards' time


def sample_in_batches(engine, prompts: Sequence[Sequence[int] | Prompt], n: int = 1, *, batch: int = 64,
                      seed: int | None = None, label: str | None = None, conversations: Callable | None = None,
                      **options) -> list[Completion]:
    """`engine.sample(prompts, n, ...)` over `batch` prompts a call: an engine's KV cache
    holds one call's prompts and completions, so a whole data set in one call could take
    all the memory. Completions come prompt-major as from one call (completion j of
    prompt i at i * n + j); a batch draws with `seed` plus its first prompt's index. A
    progress bar named `label` on a terminal (none without a label). `conversations`
    (`Sampler.conversations`; the prompts then Prompts): multi-turn, an environment each."""
    from linnet.report.progress import Progress

    if batch < 1:
        raise ValueError(f"sample_in_batches: batch={batch}; sample at least one prompt a call")
    bar = Progress(len(prompts), label, unit="prompt") if label else None
    done: list[Completion] = []
    for start in range(0, len(prompts), batch):
        mine = prompts[start : start + batch]
        turns = {} if conversations is None else {"turns": conversations(mine, n)}
        part = engine.sample([list(getattr(p, "ids", p)) for p in mine], n, seed=None if seed is None
                             else seed + start, **options, **turns)
        done += [dataclasses.replace(c, prompt=start + c.prompt) for c in part]
        if bar is not None:
            bar.update(min(start + batch, len(prompts)))
    if bar is not None:
        bar.close()
    return done


def sample_and_score(engine, chunk, functions: dict[str, Reward], *, group: int, max_new_tokens: int,
                     temperature: float, top_k, top_p, stop, seed: int, dr_grpo: bool, drop_uniform: bool,
                     advantage: str = "group", conversations: Callable | None = None) -> Scored:
    """Sample `group` completions of each (index, prompt) of `chunk` with `engine` (the
    PyTorch or the JAX one), score them and give each its group advantage. With
    `conversations(prompts, group)` (a linnet.rl.conversations.Conversations) each
    completion is a multi-turn conversation: the rewards grade its last turn, and its
    environment's rewards are summed in as the reward "environment"."""
    prompts = [p for _, p in chunk]
    t0 = time.perf_counter()
    turns = {} if conversations is None else {"turns": conversations(prompts, group)}
    samples = engine.sample([list(p.ids) for p in prompts], n=group, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, stop=stop, seed=seed, **turns)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    scores = score(functions, [(prompts[s.prompt], last_turn(s.tokens, s.learned),
                                f"prompt {chunk[s.prompt][0]}, completion {i % group}") for i, s in enumerate(samples)])
    if turns:
        for values, s in zip(scores, samples):
            values["environment"] = float(sum(s.turn_rewards))
        functions = {**functions, "environment": None}
    scoring = time.perf_counter() - t1
    per_function = {name: np.array([sc[name] for sc in scores]) for name in functions}
    rewards = np.sum(list(per_function.values()), axis=0).reshape(len(prompts), group)
    uniform = rewards.std(axis=1) == 0
    advantages = group_advantages(rewards, scale=not dr_grpo, kind=advantage).reshape(-1)
    keep = np.repeat(~uniform, group) if drop_uniform else np.ones(len(samples), bool)
    return Scored(samples, per_function, rewards, uniform, advantages, keep, seconds, scoring)


def fill_groups(parts: list[tuple[list, Scored]], want: int) -> tuple[list, Scored]:
    """DAPO's dynamic sampling: from the scored chunks in order, the first `want` groups
    whose rewards are not all equal (chunk, Scored), their samples renumbered; fewer when
    the parts hold fewer."""
    chunk, samples, rows, per_function, advantages = [], [], [], {name: [] for name in parts[0][1].per_function}, []
    group = parts[0][1].rewards.shape[1]
    for part, scored in parts:
        for p in np.flatnonzero(~scored.uniform):
            if len(chunk) == want:
                break
            taken = slice(p * group, (p + 1) * group)
            samples += [dataclasses.replace(s, prompt=len(chunk)) for s in scored.samples[taken]]
            for name, values in scored.per_function.items():
                per_function[name].append(values[taken])
            rows.append(scored.rewards[p])
            advantages.append(scored.advantages[taken])
            chunk.append(part[p])
    n = len(chunk)
    rewards = np.array(rows).reshape(n, group)
    return chunk, Scored(samples, {k: np.concatenate(v) if v else np.zeros(0) for k, v in per_function.items()},
                         rewards, np.zeros(n, bool), np.concatenate(advantages) if advantages else np.zeros(0),
                         np.ones(n * group, bool), sum(s.seconds for _, s in parts),
                         sum(s.score_seconds for _, s in parts))


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The engine's seed for a step's sampling round: a resumed run draws what an
    uninterrupted one does (GRPO's Sampler, online DPO)."""
    return seed * 1_000_003 + step + 100_000_019 * round_


@dataclass
class Sampler:
    """Samples and scores a step's groups: `group` completions of each prompt through the
    engine, scored by the reward functions into group advantages; with DAPO's dynamic
    sampling, more rounds of prompts drawn from `prompts` until the step holds
    prompts_per_step groups whose rewards differ. Seeded by (seed, step, round), so a
    resumed run samples what an uninterrupted one does; `rank` (the process's, in
    PyTorch's process group) draws its own extra prompts. Both backends' grpo use it."""

    engine: Any
    functions: dict[str, Reward]
    settings: GRPOOptions
    stop: Iterable[int] | None = None
    seed: int = 0
    prompts: Sequence[Prompt] = ()
    rank: int = 0
    tokenizer: Any = None  # multi-turn: the environments read and answer text

    def __post_init__(self):
        s = self.settings
        self.conversations = conversations_for(s.environment, s.tools, self.tokenizer, s.max_turns)

    def round(self, chunk: list, step: int, round_: int) -> Scored:
        s = self.settings
        return sample_and_score(self.engine, chunk, self.functions, group=s.group, max_new_tokens=s.max_new_tokens,
                                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, stop=self.stop,
                                seed=step_seed(self.seed, step, round_), dr_grpo=s.dr_grpo,
                                drop_uniform=s.drop_uniform, advantage=s.advantage,
                                conversations=self.conversations)

    def __call__(self, chunk: list, step: int) -> tuple[list, Scored, int]:
        """(the step's (index, prompt) pairs, their Scored samples, sampling rounds), each
        sample's version step - 1: the weights a step samples when it samples them itself."""
        chunk, scored, rounds = self._sample(chunk, step)
        for sample in scored.samples:
            sample.version = step - 1
        return chunk, scored, rounds

    def _sample(self, chunk: list, step: int) -> tuple[list, Scored, int]:
        scored, rounds = self.round(chunk, step, 0), 1
        if not self.settings.dynamic_sampling:
            return chunk, scored, rounds
        parts = [(chunk, scored)]
        draw = np.random.default_rng([self.seed, step, self.rank])
        while sum(int((~sc.uniform).sum()) for _, sc in parts) < len(chunk) \
                and rounds <= self.settings.dynamic_sampling:
            extra = [(int(i), self.prompts[int(i)]) for i in draw.integers(0, len(self.prompts), len(chunk))]
            parts.append((extra, self.round(extra, step, rounds)))
            rounds += 1
        chunk, scored = fill_groups(parts, len(chunk))
        return chunk, scored, rounds


def to_train(scored: Scored, beta: float) -> np.ndarray:
    """[samples] the completions a training step passes through the model: the kept ones,
    less those whose advantage is exactly 0 when there is no KL term (beta = 0). Their
    clipped surrogate and its gradient are 0 whatever the ratio, so leaving them out
    changes the time, not the update; they still count in the step's normaliser. Groups
    whose rewards are all equal are the common case (all right or all wrong). When no
    completion would pass, the first kept one does: the step then updates as a
    zero-gradient step does (the optimizer's moments still move), as without skipping."""
    mask = scored.keep.copy()
    if beta == 0:
        mask &= scored.advantages != 0
        if not mask.any() and scored.keep.any():
            mask[np.flatnonzero(scored.keep)[0]] = True
    return mask


def counted(scored: Scored) -> tuple[int, int]:
    """(completions, tokens) a step's loss averages over: the kept ones, skipped or not, and
    their learned tokens (a conversation's inserted ones are not)."""
    kept = [s for s, k in zip(scored.samples, scored.keep) if k]
    return len(kept), sum(learned_count(s) for s in kept)


def learned_count(sample: Completion) -> int:
    return len(sample.tokens) if sample.learned is None else int(sample.learned.sum())


def reward_metrics(rewards: np.ndarray, per_function: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The summed reward's mean and spread over a step's completions, and each reward's
    mean where there are several."""
    return {"reward": float(rewards.mean()), "reward_std": float(rewards.std()),
            **{f"reward_{name}": float(v.mean()) for name, v in per_function.items() if len(per_function) > 1}}


def step_metrics(scored: Scored, trained: np.ndarray, *, tokens: float, checked: float, clipped: float, kl: float,
                 mismatch: float) -> dict[str, float]:
    """What a GRPO step reports: rewards, uniform groups, lengths, stops, the share of
    completions that skipped training (`to_train`), and the clip and KL per trained
    token and the engine mismatch per `checked` token (those that passed the model)."""
    lengths = np.array([len(s.tokens) for s in scored.samples])
    per_token = max(tokens, 1.0)
    return {
        **reward_metrics(scored.rewards, scored.per_function),
        "uniform": float(scored.uniform.mean()), "completion_length": float(lengths.mean()),
        "stopped": float(np.mean([s.stopped for s in scored.samples])),
        "skipped": float((scored.keep & ~trained).mean()),
        "clip_fraction": clipped / per_token, "kl": kl / per_token, "mismatch": mismatch / max(checked, 1.0),
        "sample_seconds": scored.seconds, "score_seconds": scored.score_seconds,
        "sampled_tokens_per_second": float(lengths.sum()) / max(scored.seconds, 1e-9),
        **({"turns": float(np.mean([len(s.turn_rewards or ()) for s in scored.samples]))}
           if any(s.turn_rewards is not None for s in scored.samples) else {}),
    }


def prompt_groups(samples, prompts, tokens: int, share: bool):
    """(prompt, completions) of consecutive samples of one prompt, split where one row of
    `tokens` positions could not hold them together (`pack_prompted`'s layout)."""
    for prompt, run in itertools.groupby(samples, key=lambda s: s.prompt):
        ids = list(prompts[prompt].ids)
        base, each = (len(ids), 1) if share else (0, len(ids))
        chunk, size = [], base
        for s in run:
            if chunk and size + each + len(s.tokens) > tokens:
                yield ids, chunk
                chunk, size = [], base
            chunk.append(s.tokens if s.learned is None else PartlyLearned(s.tokens, s.learned))
            size += each + len(s.tokens)
        yield ids, chunk


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct (Chen et al. 2021,
    arXiv:2107.03374): 1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without
    replacement hold a correct one. Drawing more than k samples lowers its variance."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
