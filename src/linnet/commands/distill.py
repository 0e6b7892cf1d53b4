"""`linnet distill`: a student learns from a frozen teacher, from a YAML config, with the
run directory every training command shares (linnet.train.distill has the objectives).

    linnet distill --config configs/distill.yaml --set distill.teacher=path/to/teacher
    linnet distill --template > distill.yaml

distill.mode: logit (the teacher's distributions on the records' completions, blockwise
over positions), sequence (SFT on the teacher's greedy completions of the records'
prompts) or on_policy (the student completes the prompts each step; it learns the
teacher's distributions on its own completions, or with distill.on_policy_share below 1 on
the records' answers in the other steps, as GKD mixes them). The data are read as
`linnet sft` reads them. Logit and on-policy distillation compare distributions token by
token, so their teacher must share the student's tokenizer; sequence distillation takes a
teacher with another tokenizer or chat template through text (`answers_through_text`).
"""

from __future__ import annotations

import math

import numpy as np

from linnet.commands import runs, sft, spellings
from linnet.config import DistillConfig
from linnet.torch.distributed import data_share


def load_teacher(config: DistillConfig, student, tokenizer):
    """(the frozen teacher on the student's device, its tokenizer where sequence
    distillation must pass through text, else None). Text is the way when the teacher's
    vocabulary or chat template is not the student's; logit and on-policy distillation
    compare distributions over one vocabulary, so another one is refused by name for them."""
    import warnings

    from linnet import nest
    from linnet.cards import resolve
    from linnet.data import load_tokenizer

    d = config.distill
    card = resolve(d.teacher)
    theirs = load_tokenizer(card)
    vocab = theirs.raw.get_vocab(with_added_tokens=True) != tokenizer.raw.get_vocab(with_added_tokens=True)
    template = config.data.chat and theirs.chat_template != tokenizer.chat_template  # unused with data.chat off
    if vocab and d.mode != "sequence":
        raise ValueError(f"distill.teacher={d.teacher}: its tokenizer is not the student's ({theirs.vocab_size} and "
                         f"{tokenizer.vocab_size} tokens, other ids); distill.mode={d.mode} compares distributions "
                         "token by token, so the teacher must use the student's tokenizer, or set "
                         "distill.mode=sequence (the teacher's answers pass as text)")
    if template and d.mode != "sequence":
        warnings.warn(f"distill.teacher={d.teacher}: its chat template is not the student's; distill.mode={d.mode} "
                      "shows the teacher the records as the student's template renders them (distill.mode=sequence "
                      "would prompt it in its own)", stacklevel=2)
    teacher = nest.load(card, device=student.device, dtype=config.model.dtype)
    teacher.eval()
    return teacher, theirs if d.mode == "sequence" and (vocab or template) else None


def answers_through_text(config: DistillConfig, tokenizer, engine, theirs) -> list:
    """Sequence distillation with a teacher of another tokenizer or chat template: each
    training record's prompt rendered by the teacher's tokenizer and template, the
    teacher's greedy answer decoded to text, and that text learned after the prompt as the
    student's tokenizer and template render it, with the student's stop token for the turn
    where the teacher stopped (none where it ran out of distill.max_new_tokens)."""
    import sys

    from linnet.data import examples_from_records
    from linnet.packing import Example
    from linnet.rl.rollouts import sample_in_batches

    sources = sft.source_records(config)[0]  # each read as its own records' shape
    whole = dict(tokens=sys.maxsize, **sft.record_fields(config), names=spellings.RECORDS)  # one example a record, none cut
    ours = [e for records in sources for e in examples_from_records(records, tokenizer, **whole)]
    done = sample_in_batches(engine, [_prompt(e) for records in sources
                                      for e in examples_from_records(records, theirs, **whole)],
                             **_answering(config), stop=engine.card.eos_token_ids)
    out = []
    for c in done:
        mine = ours[c.prompt]
        answer = tokenizer.encode(theirs.decode(c.tokens[:-1] if c.stopped else c.tokens))
        out.append(Example.prompted(_prompt(mine), answer + ([_answer(mine)[-1]] if c.stopped else [])))
    return out


def _answering(config: DistillConfig) -> dict:
    """How the teacher answers sequence distillation's prompts: greedy, distill.teacher_batch
    prompts an engine call, behind a progress bar unless runtime.progress is off."""
    d = config.distill
    return dict(max_new_tokens=d.max_new_tokens, temperature=0.0, seed=config.runtime.seed, batch=d.teacher_batch,
                label="teacher" if config.runtime.progress else None)


def _warn_unfinished(examples, stops: set[int], limit: int) -> None:
    """Say how many of the teacher's answers ran out of new tokens before a stop token:
    the student learns those cut, and never to stop where they end."""
    import warnings

    cut = sum(int(e.tokens[-1]) not in stops for e in examples)
    if cut:
        warnings.warn(f"distill: {cut} of {len(examples)} teacher answers reached distill.max_new_tokens={limit} "
                      "without a stop token, and are learned cut there; raise distill.max_new_tokens if the "
                      "answers are longer", stacklevel=2)


def _prompt(example) -> list[int]:
    """The context before an example's first learned token."""
    return example.tokens[:_first_answer(example).start].tolist()


def _answer(example) -> list[int]:
    """An example's first learned span: its first answer, through the stop token that ends
    it (as `examples_from_records` learns it)."""
    return example.tokens[_first_answer(example)].tolist()


def _first_answer(example) -> slice:
    """Where an example's first run of learned positions lies."""
    learned = np.asarray(example.learned, bool)
    first = int(np.argmax(learned))
    after = np.flatnonzero(~learned[first:])  # the first unlearned position past it ends the run
    return slice(first, first + (int(after[0]) if len(after) else len(learned) - first))


def run(config: DistillConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None) -> dict:
    from linnet import nest
    from linnet.packing import pack
    from linnet.serve import Engine
    from linnet.train import train
    from linnet.train.distill import distill, held_out_divergence, on_policy_distill, teacher_completions
    from linnet.train.evaluation import held_out_loss

    inputs = sft.read_inputs(config)  # data errors before anything is written
    t, d = config.training, config.distill
    job = runs.start(config, inputs.steps, overwrite=overwrite, resume=resume, resume_from=resume_from)
    if job.complete is not None:
        return job.complete
    student = job.load(inputs.card)
    teacher, theirs = load_teacher(config, student, inputs.tokenizer)
    options = dict(divergence=d.divergence, beta=d.beta, temperature=d.temperature)
    stop = list(inputs.card.eos_token_ids)
    steps = inputs.steps
    if d.mode == "sequence":  # the teacher's completions become the training examples
        from linnet.packing import count_rows
        from linnet.torch.sharding import copy_first

        # a split's or a pipeline's processes train on the same completions: its first process's
        inputs.train_examples = copy_first(student, lambda: teacher_completions(
            Engine(teacher), [_prompt(e) for e in inputs.train_examples], **_answering(config), stop=stop)
            if theirs is None else answers_through_text(config, inputs.tokenizer, Engine(teacher), theirs))
        _warn_unfinished(inputs.train_examples, {*stop, *inputs.tokenizer.eos_ids}, d.max_new_tokens)
        steps = t.steps or max(1, math.ceil(t.epochs * count_rows(inputs.train_examples, t.context_length)
                                            / t.accumulation))
    elif d.mode == "on_policy":
        steps = t.steps or max(1, math.ceil(t.epochs * len(inputs.train_examples)
                                            / (d.prompts_per_step * data_share(t.per_copy)[1])))
    job.steps = steps
    eval_rows = list(pack(inputs.eval_examples, t.context_length, pad_id=inputs.tokenizer.pad_id)) \
        if inputs.eval_examples else []

    def evaluate(student):
        import torch

        with torch.no_grad():
            loss = held_out_loss(student, eval_rows)
        if theirs is not None:  # the teacher reads other tokens (or another template)
            return {"held_out_loss": loss}
        return {"held_out_loss": loss, "held_out_divergence": held_out_divergence(student, teacher, eval_rows,
                                                                                  **options)}

    with job.open(student, evaluate if eval_rows else None) as run:
        if d.mode == "logit":
            history = distill(student, teacher, sft.epochs_of_rows(inputs), run, accumulate=t.accumulation,
                              **options)
        elif d.mode == "sequence":
            history = train(student, sft.epochs_of_rows(inputs), run, accumulate=t.accumulation)
        else:
            m = config.model
            engine = Engine(nest.load(inputs.card, device=student.device, dtype=m.dtype, weights=m.weights,
                                      quantize=runs.engine_quantize(config)))
            share, shares = data_share(t.per_copy)  # each copy its prompts; a split's processes the same ones
            mine = inputs.train_examples[share::shares]
            history = on_policy_distill(student, teacher, engine, [_prompt(e) for e in mine], run,
                                        prompts_per_step=d.prompts_per_step, max_new_tokens=d.max_new_tokens,
                                        sample_temperature=d.sample_temperature, stop=stop, tokens=t.context_length,
                                        answers=[_answer(e) for e in mine], on_policy_share=d.on_policy_share,
                                        seed=config.runtime.seed, **options)
    return job.summarize(history, card=inputs.card.name)


def main(argv: list[str] | None = None) -> int:
    args, config = runs.parse_command(argv, "linnet distill", "Distillation from a frozen teacher, from a YAML "
                                      "config.", DistillConfig, training=True)
    return 0 if config is None else runs.execute(run, args, config)
