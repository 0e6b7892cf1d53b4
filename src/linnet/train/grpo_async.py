"""GRPO's sampling ahead of training (`grpo.max_staleness: k` > 0), on a second thread.

While the policy trains step t, a sampler thread samples steps t+1 .. t+k through the
engine. Step s is sampled from exactly the weights after update max(s - 1 - k, 0): the
trainer publishes a copy of its weights (adapters merged) after each update, and the
sampler waits for the version a step needs. Fixed versions keep a run reproducible: the
same seed gives the same samples, the same losses and the same weights, however the two
threads happen to interleave. Each step's samples record their version; the step's
`staleness` metric is how many updates they are behind, and `correction_cap` weighs their
tokens by p_policy / p_engine (`grpo.correction: sequence` one weight a completion).

Nothing waits silently: the trainer waits at most `stall_timeout` seconds for a step's
samples, the sampler as long for the trainer's next weights or prompts, and either ends
the run with an error naming the side that stalled (a stalled trainer is interrupted
with a signal when grpo runs on the main thread; a trainer stuck inside a C call that
never returns gets the message on stderr).

A checkpoint after step t holds the samples already drawn for steps t+1 .. t+k (the
sampler finishes them first: their weights are all published); a resumed run trains on
those and samples the rest from its restored weights, so it ends where an uninterrupted
run does, bit for bit. (A run's last steps draw nothing beyond its `steps`: a run
extended past them samples its first k steps from the restored weights instead.) The sampler and the trainer each take half of torch's threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from linnet.rl.rollouts import Completion, Sampler, Scored
from linnet.run import Lookahead
from linnet.torch.lora import merged, policy_weights
from linnet.torch.sharding import is_sharded


def sample_ahead(sampler: Sampler, policy, stream, run):
    """(the prompt stream, the Ahead or None, the Run) for grpo: with max_staleness > 0 the
    stream read ahead, the sampler thread's Ahead, and the Run's evaluation made to wait
    for the engine."""
    s = sampler.settings
    if not s.max_staleness:
        return stream, None, run
    check_ahead(policy, sampler.engine)
    stream = Lookahead(stream)
    ahead = Ahead(sampler, policy, stream, staleness=s.max_staleness, per_step=s.prompts_per_step, last=run.steps,
                  timeout=s.stall_timeout)
    return stream, ahead, dataclasses.replace(run, evaluate=ahead.paused(run.evaluate))


def check_ahead(policy, engine) -> None:
    """Refuse what sampling ahead cannot take: weights that every process must gather
    together, or an engine that shares the policy's NF4 base (it would change under it)."""
    if is_sharded(policy) or getattr(policy, "pipe", None) is not None or getattr(policy, "context", None):
        raise ValueError("grpo: max_staleness > 0 samples on a thread of each process, which cannot gather a "
                         "split, sharded or pipelined policy's weights, nor give a context group one sample; set "
                         "grpo.max_staleness: 0 or train whole copies (training.split, training.context: 1, no "
                         "fully_shard or pipeline)")
    from linnet.torch.engine import Engine

    if not isinstance(engine, Engine):
        raise ValueError(f"grpo: max_staleness > 0 samples with linnet's builtin engine, not {type(engine).__name__}; "
                         "set grpo.engine: builtin or grpo.max_staleness: 0")
    if getattr(engine.model, "quantized", False):
        raise ValueError("grpo: max_staleness > 0 keeps the engine's weights apart from the policy's, which an "
                         "NF4 engine sharing the policy's base cannot; load the engine without quantize=")


class Weights:
    """A policy's weights at one version, as the engine reads a policy: adapters merged,
    trained tensors copied (the trainer goes on changing them), frozen ones shared."""

    def __init__(self, policy):
        self.card = policy.card
        self.tensors = {name: merged(p, layer).clone() if layer is not None or p.requires_grad else p.detach()
                        for name, p, layer in policy_weights(policy)}

    def named_parameters(self):
        return iter(self.tensors.items())

    def named_modules(self):
        return iter(())


class Ahead:
    """The sampler thread and what it shares with the trainer (see the module docstring).
    The trainer calls `take(step, chunk)` for each step's samples; `state` and `restore`
    carry the drawn samples through a checkpoint; `paused(f)` runs f with the engine to
    itself (held-out evaluation samples through it too)."""

    def __init__(self, sampler: Sampler, policy, items: Lookahead, *, staleness: int, per_step: int, last: int,
                 timeout: float):
        self.sampler, self.policy, self.items = sampler, policy, items
        self.staleness, self.per_step, self.last, self.timeout = staleness, per_step, last, timeout
        self.lock = threading.Condition()
        self.engine_lock = threading.Lock()
        self.versions: dict[int, Weights] = {}
        self.chunks: dict[int, list] = {}
        self.done: dict[int, tuple] = {}  # step -> (chunk, scored, rounds, version, seconds)
        self.error: BaseException | None = None
        self.closing = False
        self.loaded: int | None = None  # the version in the engine
        self.busy = self.trainer_waited = 0.0
        self.mark = time.perf_counter()
        self.thread: threading.Thread | None = None
        self.floor = 0  # the version this process starts from (`take`'s first step - 1)
        self.trainer = threading.get_ident()
        self.threads = torch.get_num_threads()  # each side's (`running` halves them)

    def version(self, step: int) -> int:
        """The weights version (updates applied) step `step` samples from: never one from
        before this process started (a run extended past the `steps` of the run whose
        checkpoint it resumes finds no samples drawn for its next steps)."""
        return max(step - 1 - self.staleness, self.floor)

    def take(self, step: int, chunk: list) -> tuple[list, Scored, int, int]:
        """Step `step`'s (chunk, scored samples, sampling rounds, weights version): the
        trainer publishes its current weights (version step - 1), hands the sampler this
        step's prompts and the next k steps', and waits for this step's samples."""
        with self.lock:
            if self.thread is None:
                self.floor = step - 1
            if any(self.version(s) == step - 1 for s in range(step, self.last + 1)):
                self.versions[step - 1] = Weights(self.policy)
            self.chunks.setdefault(step, chunk)
            ahead = self.items.peek(self.staleness * self.per_step)
            for i in range(self.staleness):
                later = ahead[i * self.per_step:(i + 1) * self.per_step]
                if step + 1 + i <= self.last and len(later) == self.per_step:
                    self.chunks.setdefault(step + 1 + i, later)
            self._forget(step)
            self.lock.notify_all()
        if self.thread is None:
            self.thread = threading.Thread(target=self._sample, args=(step,), daemon=True, name="linnet grpo sampler")
            self.thread.start()
        with self.lock:
            waiting = time.monotonic()
            if not self.lock.wait_for(lambda: step in self.done or self.error is not None, timeout=self.timeout):
                raise TimeoutError(f"grpo: the sampler delivered no samples for step {step} in {self.timeout:g} s "
                                   f"(grpo.stall_timeout); it {self._doing(step)}")
            if self.error is not None:
                raise RuntimeError(f"grpo: the sampler thread failed at step {step}") from self.error
            found, version, _ = self.done.pop(step)
            self.trainer_waited = time.monotonic() - waiting
        if isinstance(found, dict):  # restored from a checkpoint: its prompts by index
            found = _unplain(found, {**dict(enumerate(self.sampler.prompts)), **dict(chunk)})
        return (*found, version)

    def _forget(self, step: int) -> None:
        """Drop the weights no step from `step` on samples from."""
        needed = {self.version(s) for s in range(step, self.last + 1)}
        for v in [v for v in self.versions if v not in needed]:
            del self.versions[v]

    def _doing(self, step: int) -> str:
        if self.thread is None or not self.thread.is_alive():
            return "is not running"
        return f"was last sampling step {self.sampling} (from weights version {self.version(self.sampling)})"

    def _sample(self, step: int) -> None:
        torch.set_num_threads(self.threads)  # a thread starts with the default count, not the trainer's
        self.sampling = step
        while step <= self.last:
            with self.lock:
                ready = self.lock.wait_for(functools.partial(self._ready, step), timeout=self.timeout)
                if self.closing:
                    return
                if not ready:
                    self.error = TimeoutError(
                        f"grpo: the trainer published no weights or prompts for step {step} in {self.timeout:g} s "
                        f"(grpo.stall_timeout): it stalled before finishing step {step - 1 - self.staleness}")
                    self.lock.notify_all()
                    self._interrupt_trainer()
                    return
                restored = step in self.done
                chunk, weights = self.chunks.get(step), self.versions.get(self.version(step))
            if not restored:
                self.sampling = step
                started = time.perf_counter()
                try:
                    with self.engine_lock:
                        if self.loaded != self.version(step):
                            self.sampler.engine.load_weights(weights)
                            self.loaded = self.version(step)
                        found = self.sampler(chunk, step)
                except BaseException as e:  # the trainer raises it, naming the step
                    with self.lock:
                        self.error = e
                        self.lock.notify_all()
                    return
                seconds = time.perf_counter() - started
                for sample in found[1].samples:
                    sample.version = self.version(step)
                with self.lock:
                    self.busy += seconds
                    self.done[step] = (found, self.version(step), seconds)
                    self.lock.notify_all()
            step += 1

    def _ready(self, step: int) -> bool:
        """Whether the sampler can go on with `step` (or stop)."""
        return self.closing or step in self.done or (step in self.chunks and self.version(step) in self.versions)

    def _interrupt_trainer(self) -> None:
        print(f"linnet: {self.error}", file=sys.stderr, flush=True)
        if self.trainer == threading.main_thread().ident:
            signal.pthread_kill(self.trainer, signal.SIGUSR2)

    @contextlib.contextmanager
    def running(self):
        """While grpo trains: half of torch's threads a side, and a stalled trainer
        interrupted by the sampler's SIGUSR2, which raises its error (on the main thread
        alone, where Python runs signal handlers); the thread told to stop after."""
        threads = torch.get_num_threads()
        self.threads = max(1, threads // 2)
        torch.set_num_threads(self.threads)

        def stalled(signum, frame):
            raise self.error if self.error is not None else TimeoutError("grpo: the sampler interrupted the trainer")

        main = threading.get_ident() == threading.main_thread().ident
        before = signal.signal(signal.SIGUSR2, stalled) if main else None
        try:
            yield
        finally:
            if main:
                signal.signal(signal.SIGUSR2, before)
            self.close()
            torch.set_num_threads(threads)

    def paused(self, evaluate: Callable | None) -> Callable | None:
        """`evaluate` run with the engine to itself (it loads the policy's own weights)."""
        if evaluate is None:
            return None

        def run(model):
            with self.engine_lock:
                self.loaded = None
                return evaluate(model)

        return run

    def state(self, step: int) -> dict:
        """The samples drawn for the steps after `step` (waiting for those already handed
        to the sampler), as plain values for a checkpoint."""
        with self.lock:
            wanted = [s for s in self.chunks if s > step]
            if not self.lock.wait_for(lambda: self.error is not None or all(s in self.done for s in wanted),
                                      timeout=self.timeout):
                raise TimeoutError(f"grpo: the sampler did not finish steps {wanted} for the checkpoint after step "
                                   f"{step} in {self.timeout:g} s (grpo.stall_timeout); it {self._doing(wanted[0])}")
            if self.error is not None:
                raise RuntimeError("grpo: the sampler thread failed") from self.error
            return {"ahead": {str(s): self.done[s][0] if isinstance(self.done[s][0], dict) else _plain(*self.done[s])
                              for s in wanted}}

    def restore(self, extra: dict) -> None:
        """Take a checkpoint's drawn samples back (from `state`)."""
        with self.lock:
            for s, entry in extra.get("ahead", {}).items():
                self.done[int(s)] = (entry, entry["version"], entry["seconds"])
                self.chunks[int(s)] = []

    def close(self) -> None:
        with self.lock:
            self.closing = True
            self.lock.notify_all()

    def metrics(self, step: int, version: int) -> dict[str, float]:
        """The step's staleness (updates its samples are behind) and each side's busy share
        of the time since the previous step's metrics: the sampler's sampling, the
        trainer's time not waiting for samples."""
        now = time.perf_counter()
        wall, self.mark = max(now - self.mark, 1e-9), now
        with self.lock:
            busy, self.busy = self.busy, 0.0
        return {"staleness": float(step - 1 - version), "sampler_busy": min(busy / wall, 1.0),
                "trainer_busy": 1.0 - min(self.trainer_waited / wall, 1.0)}


def _plain(found: tuple, version: int, seconds: float) -> dict:
    """A step's drawn samples as the tensors and plain values a checkpoint holds (its
    prompts by index)."""
    chunk, scored, rounds = found
    arrays = {name: torch.from_numpy(np.ascontiguousarray(getattr(scored, name)))
              for name in ("rewards", "uniform", "advantages", "keep")}
    return {"prompts": [int(i) for i, _ in chunk], "rounds": rounds, "version": version, "seconds": seconds,
            "samples": [{"prompt": c.prompt, "tokens": list(c.tokens), "logprobs": c.logprobs, "stopped": c.stopped,
                         "version": c.version}
                        for c in scored.samples],
            "per_function": {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in scored.per_function.items()},
            "times": [scored.seconds, scored.score_seconds], **arrays}


def _unplain(entry: dict, prompts: dict) -> tuple:
    """(chunk, scored, rounds) back from `_plain`, the prompts found by index in `prompts`."""
    scored = Scored([Completion(**c) for c in entry["samples"]],
                    {k: v.numpy() for k, v in entry["per_function"].items()},
                    *(entry[name].numpy() for name in ("rewards", "uniform", "advantages", "keep")),
                    *entry["times"])
    return [(i, prompts[i]) for i in entry["prompts"]], scored, entry["rounds"]
