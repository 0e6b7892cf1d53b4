"""One measurement of bench/compare.py: one library, method, size and dtype, in a fresh
process (clean peak RSS). The parent passes the spec as JSON and reads the result back
(`_common.run_child`):

    python bench/_compare_run.py '{"library": "linnet", "method": "sft-lora", ...}'

The spec names the workload directory bench/compare.py built (model directory with
tokenizer, LoRA adapter directory, data JSON) and the run's settings; both sides read
the same files. Timing: wall time between consecutive step-end callbacks (so data
loading, collation, generation and the optimizer all count); peak memory: the RSS
high-water mark at the end less VmRSS right after the imports, where the mark is reset
(model, optimizer, data, activations count; the libraries' import footprint does not).
"""

from __future__ import annotations

import inspect
import json
import sys
import time

from _common import peak_rss, reset_peak, rss, send_result


class Clock:
    """Step-end timestamps, per-step losses and metrics."""

    def __init__(self):
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.losses: list[float] = []
        self.metrics: list[dict] = []
        self.real: list[int] = []

    def begin(self):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def tick(self):
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def seconds(self) -> list[float]:
        marks = [self.start] + self.ends
        return [b - a for a, b in zip(marks, marks[1:])]

    def cpu_seconds(self) -> list[float]:
        """Process CPU time of each step: with one thread, the wall time less the time
        other jobs on the shared machine held the core."""
        marks = [self.cpu_start] + self.cpu_ends
        return [b - a for a, b in zip(marks, marks[1:])]


LORA_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------
# linnet


def run_linnet(spec: dict, data: dict, clock: Clock) -> dict:
    import torch

    from linnet import nest
    from linnet.packing import Example, Pair, pack_groups
    from linnet.torch.weights import bind_weights

    method, dtype = spec["method"], spec["dtype"]
    lora = method != "sft-full"
    device = spec.get("device", "cpu")
    model = nest.load(spec["model_dir"], dtype=dtype, trainable=not lora, device=device)
    if lora:
        model.add_lora([f"model.layers.*.{p}.weight" for p in LORA_LAYERS], rank=16, alpha=32)
        bind_weights(model, spec["adapter_dir"], strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.0)
    extra: dict = {}

    first_step: list[float] = []

    def on_step(step):
        first_step.append(step.seconds)
        clock.tick()
        clock.losses.append(step.loss)
        clock.real.append(step.real)
        clock.metrics.append(dict(step.metrics))

    def count_work(steps_done):
        """Real tokens as TRL's run counts them (each sequence's prompt + answer): linnet
        computes a shared prompt once, so its own count (positions computed) is lower for
        the same work."""
        if method == "dpo":
            clock.real = dpo_tokens(data, spec)
        elif method == "grpo":
            completions = spec["group"] * spec["prompts_per_step"]
            clock.real = grpo_tokens(data, spec, [round(m["completion_length"] * completions) for m in steps_done])

    t_setup = time.perf_counter()
    if method.startswith("sft"):
        from linnet.train import train

        examples = [Example.prompted(p, c) for p, c in zip(data["prompt"], data["completion"])]
        rows = []
        for bin_ in data["bins"][: spec["steps"]]:
            (row,) = list(pack_groups([[examples[i] for i in bin_]], spec["tokens"]))
            rows.append(row)
        clock.begin()
        train(model, rows, optimizer=optimizer, steps=spec["steps"], clip=1.0, on_step=on_step)
    elif method == "dpo":
        from linnet.train.dpo import dpo

        n = spec["steps"] * spec["pairs_per_step"]
        pairs = [Pair(p, c, r) for p, c, r in zip(data["prompt"][:n], data["chosen"][:n], data["rejected"][:n])]
        clock.begin()
        dpo(model, pairs, optimizer=optimizer, steps=spec["steps"], pairs_per_step=spec["pairs_per_step"],
            beta=0.1, tokens=spec["tokens"], clip=1.0, on_step=on_step)
        # dpo() computes every pair's reference log-probabilities before step 1 (its own
        # clock starts after them): report them apart, and take them out of step 1
        extra["reference_seconds"] = clock.seconds()[0] - first_step[0]
        clock.start += extra["reference_seconds"]
        count_work(clock.metrics)
    elif method in ("simpo", "orpo", "kto", "reward"):
        n = spec["steps"] * spec["pairs_per_step"]
        pairs = [Pair(p, c, r) for p, c, r in zip(data["prompt"][:n], data["chosen"][:n], data["rejected"][:n])]
        common = dict(optimizer=optimizer, steps=spec["steps"], tokens=spec["tokens"], clip=1.0, on_step=on_step)
        clock.begin()
        if method == "kto":
            from linnet.packing import Unpaired
            from linnet.train.kto import kto

            kto(model, unpaired(pairs, Unpaired), examples_per_step=2 * spec["pairs_per_step"], beta=0.1, **common)
            extra["reference_seconds"] = clock.seconds()[0] - first_step[0]  # before step 1, as for DPO
            clock.start += extra["reference_seconds"]
        elif method == "reward":
            from linnet.train.reward import add_score_head, reward

            add_score_head(model)
            optimizer.add_param_group({"params": [model.score.weight]})
            reward(model, pairs, pairs_per_step=spec["pairs_per_step"], **common)
        else:
            from linnet.train.dpo import dpo

            dpo(model, pairs, pairs_per_step=spec["pairs_per_step"], loss_type=method, **OBJECTIVE[method], **common)
        clock.real = dpo_tokens(data, spec)
    elif method == "grpo":
        from linnet.serve import Engine
        from linnet.train.grpo import Prompt, grpo

        engine_dtype = spec.get("engine_dtype") or dtype
        engine = Engine(nest.load(spec["model_dir"], dtype=engine_dtype, device=device),
                        compile=spec.get("compile_engine"))
        if spec.get("compile_engine"):  # compile the passes before the clock starts, as a run's warmup would
            lengths = [len(p) for p in data["prompt"]]
            engine.warmup([min(lengths), max(lengths)], n=spec["group"], max_new_tokens=spec["max_new_tokens"])
        target = spec["vocab"] // 2

        def lower_half(prompt, completion):
            if spec.get("uniform_groups") and all_right(prompt.ids):
                return 1.0
            return sum(1 for t in completion if 3 <= t < target) / max(len(completion), 1)

        n = spec["steps"] * spec["prompts_per_step"]
        prompts = [Prompt(p) for p in data["prompt"][:n]]
        clock.begin()
        grpo(model, engine, prompts, lower_half, optimizer=optimizer, steps=spec["steps"], group=spec["group"],
             prompts_per_step=spec["prompts_per_step"], max_new_tokens=spec["max_new_tokens"], temperature=1.0,
             stop=(spec["eos"],), tokens=spec["tokens"], seed=spec["seed"], verbose=False,
             correction_cap=2.0 if engine_dtype != dtype else None, on_step=on_step)
        count_work(clock.metrics)
    elif method == "distill":
        from linnet.serve import Engine
        from linnet.train.distill import on_policy_distill

        teacher = nest.load(spec["teacher_dir"], dtype=dtype, device=device)
        engine = Engine(nest.load(spec["model_dir"], dtype=dtype, device=device))
        n = spec["steps"] * spec["prompts_per_step"]
        clock.begin()
        on_policy_distill(model, teacher, engine, data["prompt"][:n], optimizer=optimizer, steps=spec["steps"],
                          prompts_per_step=spec["prompts_per_step"], max_new_tokens=spec["max_new_tokens"],
                          sample_temperature=1.0, stop=(spec["eos"],), divergence="reverse_kl", temperature=1.0,
                          tokens=spec["tokens"], clip=1.0, seed=spec["seed"], on_step=on_step)
        clock.real = distill_tokens(data, spec, [m["completion_length"] * spec["prompts_per_step"]
                                                 for m in clock.metrics])
    else:
        raise ValueError(method)
    extra["setup_seconds"] = clock.start - t_setup
    return extra


# beta (and SimPO's gamma) of each objective, the same on both sides
OBJECTIVE = {"simpo": dict(beta=2.0, simpo_gamma=0.5), "orpo": dict(beta=0.1)}


def no_checkpointing(transformers) -> dict:
    """TrainingArguments' switch for activation checkpointing, off: `activation_checkpointing`
    in recent transformers, `gradient_checkpointing` before (5.17, on the GPU machines)."""
    params = inspect.signature(transformers.TrainingArguments).parameters
    return {next(n for n in ("activation_checkpointing", "gradient_checkpointing") if n in params): False}


def unpaired(pairs, make) -> list:
    """KTO's examples from pairs: each chosen answer desirable, each rejected one not."""
    return [make(p.prompt, answer, good) for p in pairs for answer, good in ((p.chosen, True), (p.rejected, False))]


# ---------------------------------------------------------------------------------------
# TRL (+ PEFT)


def run_trl(spec: dict, data: dict, clock: Clock) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    method, dtype = spec["method"], spec["dtype"]
    lora = method != "sft-full"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    if lora:
        from peft import PeftModel

        # the same adapter tensors linnet starts from (A drawn once, B zero)
        model = PeftModel.from_pretrained(model, spec["adapter_dir"], is_trainable=True)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    extra: dict = {}

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.tick()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs and len(clock.losses) < len(clock.ends):
                clock.losses.append(float(logs["loss"]))
                clock.metrics.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    common = dict(
        output_dir=spec["scratch"], max_steps=spec["steps"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        gradient_accumulation_steps=1, bf16=dtype == "bfloat16", **no_checkpointing(transformers),
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=spec["seed"], use_cpu=spec.get("device", "cpu") == "cpu",
    )
    t_setup = time.perf_counter()
    if method.startswith("sft"):
        from trl import SFTConfig, SFTTrainer

        rows = [p + c for p, c in zip(data["prompt"], data["completion"])]
        masks = [[0] * len(p) + [1] * len(c) for p, c in zip(data["prompt"], data["completion"])]
        args = SFTConfig(**common, per_device_train_batch_size=1, packing=True, packing_strategy="bfd",
                         max_length=spec["tokens"], completion_only_loss=True, padding_free=True,
                         train_sampling_strategy="sequential")
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, callbacks=[Timer()],
                             train_dataset=Dataset.from_dict({"input_ids": rows, "completion_mask": masks}))
        # the rows TRL packed must be the ones linnet trains on, in the same order
        got = trainer.train_dataset[: spec["steps"]]["input_ids"]
        want = [[t for i in b for t in rows[i]] for b in data["bins"][: spec["steps"]]]
        if [list(r) for r in got] != want:
            raise AssertionError("TRL's packed rows differ from the bins given to linnet")
        clock.real = [len(r) for r in want]
    elif method == "dpo":
        from trl import DPOConfig, DPOTrainer

        n = spec["steps"] * spec["pairs_per_step"]
        words = data["words"]

        def text(ids):
            return " ".join(words[t] for t in ids)

        ds = Dataset.from_dict({
            "prompt": [text(p) + " " for p in data["prompt"][:n]],
            "chosen": [text(c) for c in data["chosen"][:n]],  # each ends with the eos word: none is added
            "rejected": [text(r) for r in data["rejected"][:n]],
        })
        micro = spec.get("trl_micro") or spec["pairs_per_step"]  # pairs a forward; the rest accumulates
        common.update(gradient_accumulation_steps=spec["pairs_per_step"] // micro)
        args = DPOConfig(**common, per_device_train_batch_size=micro, beta=0.1,
                         loss_type=["sigmoid"], max_length=None, precompute_ref_log_probs=True,
                         train_sampling_strategy="sequential")
        t_ref = time.perf_counter()
        trainer = DPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=ds,
                             callbacks=[Timer()])
        extra["reference_seconds"] = time.perf_counter() - t_ref
        # the token ids TRL trains on must be linnet's
        got = trainer.train_dataset[:n]
        for key, want in (("prompt_ids", data["prompt"]), ("chosen_ids", data["chosen"]),
                          ("rejected_ids", data["rejected"])):
            if [list(x) for x in got[key]] != want[:n]:
                raise AssertionError(f"TRL's {key} differ from linnet's")
        clock.real = dpo_tokens(data, spec)
    elif method in ("simpo", "orpo", "kto", "reward"):
        n = spec["steps"] * spec["pairs_per_step"]
        words = data["words"]

        def text(ids):
            return " ".join(words[t] for t in ids)

        prompts = [text(p) + " " for p in data["prompt"][:n]]
        chosen, rejected = [text(c) for c in data["chosen"][:n]], [text(r) for r in data["rejected"][:n]]
        micro = spec.get("trl_micro") or spec["pairs_per_step"]
        lengths = dict(max_length=spec["tokens"] * 2)
        if method == "kto":
            from trl import KTOConfig, KTOTrainer

            ds = Dataset.from_dict({"prompt": [p for p in prompts for _ in (0, 1)],
                                    "completion": [a for c, r in zip(chosen, rejected) for a in (c, r)],
                                    "label": [True, False] * n})
            common.update(gradient_accumulation_steps=2 * spec["pairs_per_step"] // micro)
            args = KTOConfig(**common, per_device_train_batch_size=micro, beta=0.1, precompute_ref_log_probs=True,
                             **lengths)
            t_ref = time.perf_counter()
            trainer = KTOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=ds,
                                 callbacks=[Timer()])
            extra["reference_seconds"] = time.perf_counter() - t_ref
        elif method == "reward":
            from trl import RewardConfig, RewardTrainer

            ds = Dataset.from_dict({"chosen": [p + c for p, c in zip(prompts, chosen)],
                                    "rejected": [p + r for p, r in zip(prompts, rejected)]})
            common.update(gradient_accumulation_steps=spec["pairs_per_step"] // micro)
            args = RewardConfig(**common, per_device_train_batch_size=micro, **lengths)
            trainer = RewardTrainer(model=reward_model(spec, torch), args=args, processing_class=tokenizer,
                                    train_dataset=ds, callbacks=[Timer()])
        else:
            ds = Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
            common.update(gradient_accumulation_steps=spec["pairs_per_step"] // micro)
            if method == "simpo":
                from trl.experimental.cpo import CPOConfig as Config
                from trl.experimental.cpo import CPOTrainer as Trainer

                settings = dict(loss_type="simpo", cpo_alpha=0.0, **OBJECTIVE["simpo"])
            else:
                from trl.experimental.orpo import ORPOConfig as Config
                from trl.experimental.orpo import ORPOTrainer as Trainer

                settings = dict(OBJECTIVE["orpo"])
            args = Config(**common, per_device_train_batch_size=micro, **settings, **lengths)
            trainer = Trainer(model=model, args=args, processing_class=tokenizer, train_dataset=ds,
                              callbacks=[Timer()])
        clock.real = dpo_tokens(data, spec)
    elif method == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        n = spec["steps"] * spec["prompts_per_step"]
        words = data["words"]
        target = spec["vocab"] // 2

        lengths: list[int] = []  # completion tokens of each step (for the real-token count)

        ids_of = {w: i for i, w in enumerate(words)}

        def lower_half(completions, completion_ids, prompts, **kw):
            lengths.append(sum(len(ids) for ids in completion_ids))
            return [1.0 if spec.get("uniform_groups") and all_right([ids_of[w] for w in prompt.split()])
                    else sum(1 for t in ids if 3 <= t < target) / max(len(ids), 1)
                    for prompt, ids in zip(prompts, completion_ids)]

        ds = Dataset.from_dict({"prompt": [" ".join(words[t] for t in p) for p in data["prompt"][:n]]})
        group = spec["group"]
        completions = group * spec["prompts_per_step"]
        micro = spec.get("trl_micro") or completions  # completions a forward; one generation a step
        common.update(gradient_accumulation_steps=completions // micro)
        args = GRPOConfig(**common, per_device_train_batch_size=micro, generation_batch_size=completions,
                          num_generations=group, max_completion_length=spec["max_new_tokens"], temperature=1.0,
                          top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", scale_rewards="group",
                          num_iterations=1, shuffle_dataset=False, use_vllm=False)
        trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=ds,
                              reward_funcs=lower_half, callbacks=[Timer()])
        extra["completion_tokens"] = lengths
    elif method == "distill":
        from trl import DistillationConfig, DistillationTrainer

        n = spec["steps"] * spec["prompts_per_step"]
        words = data["words"]
        teacher = AutoModelForCausalLM.from_pretrained(spec["teacher_dir"], dtype=torch.float32,
                                                       attn_implementation="sdpa")
        ds = Dataset.from_dict({"prompt": [" ".join(words[t] for t in p) for p in data["prompt"][:n]]})
        # reverse KL (beta=1) on the student's own completions, sampled at temperature 1, as linnet's run
        args = DistillationConfig(**common, per_device_train_batch_size=spec["prompts_per_step"],
                                  max_completion_length=spec["max_new_tokens"], temperature=1.0, top_k=0, top_p=1.0,
                                  beta=1.0, shuffle_dataset=False, use_vllm=False)
        trainer = DistillationTrainer(model=model, teacher_model=teacher, args=args, processing_class=tokenizer,
                                      train_dataset=ds, callbacks=[Timer()])
    else:
        raise ValueError(method)
    extra["setup_seconds"] = time.perf_counter() - t_setup
    extra["versions"] = {"transformers": transformers.__version__}
    trainer.train()
    if method == "grpo":
        clock.real = grpo_tokens(data, spec, lengths)
    if method == "distill":  # TRL logs each step's mean completion length
        clock.real = distill_tokens(data, spec, [m["completions/mean_length"] * spec["prompts_per_step"]
                                                 for m in clock.metrics])
    return extra


def reward_model(spec: dict, torch):
    """TRL's side of the reward model: the same base and adapter, a sequence classifier
    with one label whose head trains."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=1, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    config = PeftConfig.from_pretrained(spec["adapter_dir"])
    config.task_type = None  # the same adapter on a classifier (a plain PeftModel; its head is set to train below)
    model = PeftModel.from_pretrained(model, spec["adapter_dir"], config=config, is_trainable=True)
    for name, p in model.named_parameters():
        if name.endswith("score.weight"):
            p.requires_grad_(True)
    return model


def all_right(prompt_ids) -> bool:
    """--uniform-groups: the prompts whose ids sum to an even number (about half) score 1 for
    every completion, as a right-or-wrong reward does on a problem the model always solves."""
    return sum(prompt_ids) % 2 == 0


def dpo_tokens(data, spec) -> list[int]:
    """Each step's real tokens: every pair's prompt twice, and both answers."""
    k = spec["pairs_per_step"]
    return [sum(2 * len(data["prompt"][i]) + len(data["chosen"][i]) + len(data["rejected"][i])
                for i in range(s * k, (s + 1) * k)) for s in range(spec["steps"])]


def grpo_tokens(data, spec, completion_tokens: list[int]) -> list[int]:
    """Each step's real tokens: every prompt once a completion, and the completions."""
    k = spec["prompts_per_step"]
    return [spec["group"] * sum(len(p) for p in data["prompt"][s * k:(s + 1) * k]) + c
            for s, c in enumerate(completion_tokens)]


def distill_tokens(data, spec, completion_tokens: list[float]) -> list[int]:
    """Each step's real tokens: its prompts and their completions."""
    k = spec["prompts_per_step"]
    return [sum(len(p) for p in data["prompt"][s * k:(s + 1) * k]) + round(c) for s, c in enumerate(completion_tokens)]


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    if spec["library"] == "trl":
        import datasets
        import peft  # noqa: F401
        import transformers
        import trl  # noqa: F401

        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
        run = run_trl
    else:
        import linnet.serve
        import linnet.train
        import linnet.train.dpo
        import linnet.train.grpo  # noqa: F401

        run = run_linnet
    with open(spec["data"]) as f:
        data = json.load(f)
    baseline = rss()
    reset_peak()
    cuda = spec.get("device", "cpu") == "cuda"
    if cuda:  # on a GPU the peak that matters is the device's
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    clock = Clock()
    extra = run(spec, data, clock)
    send_result(dict(spec=spec, seconds=clock.seconds(), cpu_seconds=clock.cpu_seconds(), losses=clock.losses,
                     metrics=clock.metrics, real=clock.real, peak_bytes=(torch.cuda.max_memory_allocated() if cuda else peak_rss()) - baseline, baseline_bytes=baseline,
                     **extra))


if __name__ == "__main__":
    main()
