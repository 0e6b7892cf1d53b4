"""`linnet eval`: models or runs on a data file: held-out loss and perplexity, and the
greedy (and sampled) completions of the Engine scored by a reward: exact match, reward,
pass@1, pass@k; each with a 95% bootstrap interval over the records; a table of sample
generations; lm-evaluation-harness tasks on request. Several models (and the first with a
system prompt or few-shot examples, `--system` / `--few-shot`) are compared on the same
records: each against the first, by a paired test.

    linnet eval runs/sft --data held_out.jsonl                    # loss, perplexity
    linnet eval base/ runs/sft --data test.jsonl --few-shot shots.jsonl --per-example who.jsonl
    linnet eval runs/quickstart/model --data runs/quickstart/held_out.jsonl --no-chat --max-new-tokens 4
    linnet eval runs/grpo --data test.jsonl --rewards numeric --pass-k 8 --pass-samples 16
    linnet eval runs/sft --lm-eval hellaswag,arc_easy             # needs lm_eval and the tasks' data

Records with a completion (prompt/completion, Alpaca, OpenAI messages, ShareGPT) give the
loss; records with an answer field (`--answer-field`) are completed and scored, and so are
prompt/completion and Alpaca records (instruction and input as the prompt, the completion
or output as the answer). lm-eval
runs on the model merged into a temporary Hugging Face directory; offline it needs the
tasks' datasets in the Hugging Face cache (HF_DATASETS_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import tempfile
from pathlib import Path

import numpy as np

from linnet.commands.spellings import former_flags

# the former flags, refused with the flag that replaced them (the YAML's names: grpo.rewards, ...)
FORMER_FLAGS = {"--reward": "--rewards", "--k": "--pass-k", "--samples": "--pass-samples",
                "--tokens": "--context-length"}
# the data readers' keywords as this command's flags, for their errors (names=)
RECORD_FLAGS = {"tokens": "--context-length", "prompt": "--prompt-field", "answer": "--answer-field",
                "chat_template": "--no-chat (the model has no chat template)"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linnet eval", description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", metavar="source",
                   help="a run directory, a model directory, a PEFT adapter directory or a registered card's name; "
                        "several are compared, each against the first")
    p.add_argument("--data", help="records: .jsonl, .json, .parquet")
    p.add_argument("--system", help="a system prompt before each prompt: one more column, the first model with it")
    p.add_argument("--few-shot", metavar="FILE", help="records (the --prompt-field and --answer-field) shown as worked "
                                                      "examples before each prompt: one more column, as --system")
    p.add_argument("--shots", type=int, default=3, help="how many of --few-shot's records (default 3)")
    p.add_argument("--shot-separator", default="\n\n",
                   help="between the system prompt and the examples without a chat template (default a blank line)")
    p.add_argument("--judge", metavar="SOURCE",
                   help="a reward model or a language model that compares each model's completions with the first's "
                        "(both orders; a tie when they disagree); on chosen/rejected records, its agreement with them")
    p.add_argument("--per-example", metavar="PATH",
                   help="write each record's completion and scores under every model here (JSON lines; a new file, "
                        "or one an earlier `linnet eval` wrote)")
    p.add_argument("--answer-field", default="answer", help="the reference answer's field, as data.answer (default "
                                                             "answer)")
    p.add_argument("--prompt-field", default="prompt", help="the prompt's field for completions, as data.prompt "
                                                             "(default prompt)")
    p.add_argument("--rewards", nargs="+", default=["exact"], metavar="REWARD",
                   help="as grpo.rewards: exact, numeric, format, model:DIR or module:function; several are summed "
                        "(default exact)")
    p.add_argument("--format-pattern", help="the regular expression of the 'format' reward, as grpo.format_pattern")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to sample a prompt (default 256, or what the model's positions leave after the "
                        "longest prompt; a larger number given here is refused)")
    p.add_argument("--pass-k", type=int, default=0,
                   help="as grpo.pass_k: also pass@k from sampled completions (k >= 2; default 0, pass@1 alone)")
    p.add_argument("--pass-samples", type=int,
                   help="as grpo.pass_samples: completions sampled a prompt for pass@k (default --pass-k)")
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled completions")
    p.add_argument("--show", type=int, default=5, help="sample generations printed (default 5)")
    p.add_argument("--batch", type=int, default=64,
                   help="prompts sampled at once (default 64; the engine's KV cache holds one batch)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="tokenize prompts as raw text")
    p.add_argument("--context-length", type=int, default=4096,
                   help="positions of a packed row for the loss, as training.context_length (default 4096)")
    p.add_argument("--lm-eval", metavar="TASKS", help="comma-separated lm-evaluation-harness tasks, or task YAML "
                                                     "files of your own (local data files: runs offline)")
    p.add_argument("--json", metavar="PATH", help="also write the results here (a new file, or one an earlier "
                                                  "`linnet eval --json` wrote; never an input)")
    former_flags(p, FORMER_FLAGS)
    return p


def added_bos(model, tokenizer) -> int | None:
    """The card's BOS, where the tokenizer adds none of its own (a bare tokenizer.json):
    what eval puts before the prompts of its loss and preference records, which the data
    readers start with the tokenizer's own (linnet.data.prompts.start_id: both together)."""
    return model.card.bos_token_id if tokenizer.bos_id is None else None


def evaluate_file(model, tokenizer, args, framing=None) -> tuple[dict, dict, list[dict]]:
    """(the metrics, {metric: a value for each record} for the comparison, each record's
    completion and scores): loss/perplexity of the records that have completions (not
    under a `framing`, which changes the prompts), and the greedy completions of those
    with answers scored."""
    from linnet.data import load_examples, prompts_from_records, read_records
    from linnet.packing import Example, pack
    from linnet.rl.rewards import resolve, text_of
    from linnet.serve import Engine
    from linnet.train.evaluation import example_losses
    from linnet.train.grpo import evaluate_each

    records = list(read_records(args.data, field="--data"))
    if not records:
        raise ValueError(f"{args.data}: no records")
    results: dict = {"records": len(records)}
    if "chosen" in records[0].data and "rejected" in records[0].data:
        return preference_accuracy(model, tokenizer, records, args, results)
    if getattr(model, "score", None) is not None:
        raise ValueError(f"{args.data}: a reward model scores pairs; give records with 'chosen' and 'rejected'")
    each: dict = {}
    per: list[dict] = [{} for _ in records]
    bos = added_bos(model, tokenizer)
    if args.answer_field not in records[0].data:  # completions: their loss, then the completions as answers
        if framing is None:
            examples = load_examples(args.data, tokenizer=tokenizer, tokens=args.context_length, chat=args.chat,
                                     names=RECORD_FLAGS)
            if bos is not None:
                examples = [Example([bos, *e.tokens], [False, *e.learned]) if e.tokens[0] != bos else e
                            for e in examples]
            losses, counts = example_losses(model, pack(examples, args.context_length, pad_id=tokenizer.pad_id))
            loss = float((losses * counts).sum() / counts.sum())
            results.update(loss=loss, perplexity=math.exp(loss))
            each["loss"] = losses * counts * (len(counts) / counts.sum())  # shares whose mean is the loss
            if len(losses) == len(records):
                for row, value in zip(per, losses):
                    row["loss"] = float(value)
    scored, prompt_field, answer_field = scored_records(records, args)
    if scored is not None:  # every record with one answer: complete its prompt and score the completion
        prompts = prompts_from_records(scored, tokenizer, prompt=prompt_field, answer=answer_field,
                                       chat=args.chat, framing=framing, names=RECORD_FLAGS, card=model.card)
        new = room(model.card, max(len(p.ids) for p in prompts), args.max_new_tokens)
        reward = {spec: resolve(spec, tokenizer, args.format_pattern, named="--rewards") for spec in args.rewards}
        found, done = evaluate_each(model, Engine(model), prompts, reward, max_new_tokens=new,
                                    k=args.pass_k, samples=args.pass_samples, temperature=args.temperature,
                                    stop=list(tokenizer.eos_ids), batch=args.batch, label="eval")
        results.update({name: float(values.mean()) for name, values in found.items()})
        each.update(found)
        for i, completion in enumerate(done):
            per[i]["completion"] = text_of(tokenizer, completion.tokens)
            per[i].update({name: float(values[i]) for name, values in found.items()})
        results["samples"] = [{"prompt": r.data[prompt_field], "completion": row["completion"],
                               "answer": r.data[answer_field]} for r, row in zip(scored[:args.show], per)]
    return results, each, per


def room(card, prompt: int, new: int | None, default: int = 256) -> int:
    """The tokens to sample after a prompt of `prompt` tokens: --max-new-tokens `new`,
    refused where it passes the card's positions (past them RoPE extrapolates and the text
    is noise); when not given, `default` capped to what the positions leave."""
    left = card.max_positions - prompt
    if new is None and left >= 1:
        return min(default, left)
    if new is None or new > left:
        raise ValueError(f"--max-new-tokens {new if new is not None else default} after a prompt of {prompt} tokens "
                         f"passes {card.name}'s {card.max_positions} positions; "
                         + (f"lower --max-new-tokens to at most {left}" if left >= 1 else "shorten the prompt"))
    return new


def check_framing(tokenizer, framing, chat: bool) -> None:
    """Refuse a --system prompt, --few-shot example or --shot-separator that the tokenizer
    cannot spell (it would become the unknown token), naming the flag rather than the data."""
    unk = tokenizer.unk_id
    if unk is None:
        return
    texts = [("--system", framing.system or "")] + [("--few-shot", p + a) for p, a in framing.shots]
    if not (chat and tokenizer.chat_template):  # raw text: the separator joins them
        texts.append(("--shot-separator", framing.separator))
    for flag, text in texts:
        if unk in tokenizer.encode(text):
            raise ValueError(f"{flag} {text!r}: {tokenizer.source} cannot encode it (it becomes the unknown token "
                             f"{tokenizer.raw.id_to_token(unk)!r}); give {flag} text the model's vocabulary spells")


def scored_records(records, args) -> tuple[list | None, str, str]:
    """(the records whose prompts are completed and scored, their prompt field, their
    answer field): the records themselves when they have an answer field, else as
    prompt/answer records made from their completions (None for chats)."""
    from linnet.data.examples import prompt_answer_records

    if args.answer_field in records[0].data:
        return records, args.prompt_field, args.answer_field
    return prompt_answer_records(records), "prompt", "answer"


def judged(judge, args, per: dict[str, list[dict]], each: dict[str, dict]) -> None:
    """Each model's greedy completions judged against the first model's, record by record:
    1 better, 0.5 a tie, 0 worse (the first model: 0.5 throughout), as the metric
    `judge` of `each` and of the per-record rows."""
    from linnet.data import read_records

    scored, prompt_field, _ = scored_records(list(read_records(args.data, field="--data")), args)
    if scored is None or any("completion" not in row for rows in per.values() for row in rows):
        raise ValueError("--judge compares completions: give --data records with prompts and answers")
    names = list(per)
    prompts = [r.data[prompt_field] for r in scored]
    first = [row["completion"] for row in per[names[0]]]
    for name in names:
        mine = [row["completion"] for row in per[name]]
        wins = (judge.compare(prompts, mine, first) + 1) / 2 if name != names[0] else np.full(len(first), 0.5)
        each[name]["judge"] = wins
        for row, value in zip(per[name], wins):
            row["judge"] = float(value)


def judge_agreement(judge, records, args) -> dict:
    """How often the judge prefers each pair's chosen answer (the human label), ties
    counting half, with its interval."""
    from linnet.data.pairs import implicit_prompt
    from linnet.report.stats import interval
    from linnet.train.judge import agreement

    texts = []
    for r in records:
        chosen, rejected = r.data["chosen"], r.data["rejected"]
        if not all(isinstance(x, str) for x in (chosen, rejected)):
            raise ValueError(f"{r.where}: --judge reads text pairs; 'chosen' and 'rejected' here are not text")
        prompt = r.data.get("prompt")
        if not isinstance(prompt, str):
            prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        texts.append((prompt, chosen, rejected))
    verdicts = judge.compare(*zip(*texts))
    agreed = np.where(verdicts == 0, 0.5, (verdicts > 0).astype(np.float64))
    return {"agreement": agreement(verdicts, np.ones(len(verdicts))), "interval": list(interval(agreed)),
            "pairs": len(verdicts)}


def preference_accuracy(model, tokenizer, records, args, results: dict) -> tuple[dict, dict, list[dict]]:
    """`evaluate_file` on preference pairs: how often the chosen answer wins, by a reward
    model's score or by a language model's summed log-probability (a DPO run's
    preference with no reference subtracted), and the mean margin."""
    from linnet.data.pairs import pairs_from_records
    from linnet.train.dpo import reference_log_probs
    from linnet.train.reward import score_answers

    pairs = pairs_from_records(records, tokenizer, chat=args.chat, tokens=args.context_length, names=RECORD_FLAGS)
    bos = added_bos(model, tokenizer)
    if bos is not None:
        pairs = [dataclasses.replace(p, prompt=[bos, *p.prompt]) if list(p.prompt[:1]) != [bos] else p for p in pairs]
    if getattr(model, "score", None) is not None:
        values = score_answers(model, [(p.prompt, a) for p in pairs for a in (p.chosen, p.rejected)],
                               tokens=args.context_length).reshape(-1, 2)
    else:
        values = reference_log_probs(model, pairs, tokens=args.context_length)
    margin = (values[:, 0] - values[:, 1]).astype(np.float64)
    each = {"preference_accuracy": (margin > 0).astype(np.float64), "margin": margin}
    results.update({name: float(v.mean()) for name, v in each.items()})
    per = [{name: float(v[i]) for name, v in each.items()} for i in range(len(margin))]
    return results, each, per


def reward_directory(source: str) -> Path | None:
    """The *ForSequenceClassification directory (a reward model) that `source` names,
    itself or a run's final/, or None."""
    for d in (Path(source) / "final", Path(source)):
        config = d / "config.json"
        if config.is_file():
            names = json.loads(config.read_text()).get("architectures") or []
            return d if any(str(a).endswith("ForSequenceClassification") for a in names) else None
    return None


def load_model(source: str):
    """(model, tokenizer) for a column: a reward model with its head, a registered card by
    name (its own weights, from the hub cache), else `load_trained`."""
    from linnet import nest
    from linnet.cards import REGISTRY
    from linnet.data import load_tokenizer
    from linnet.export import load_trained
    from linnet.train.reward import load_reward_model

    directory = reward_directory(source)
    if directory:
        model = load_reward_model(directory, dtype="float32")
    elif source in REGISTRY and not Path(source).exists():
        model = nest.load(source, dtype="float32")
    else:
        model = load_trained(source)[0]
    model.eval()
    return model, load_tokenizer(model.card)


def lm_eval(model, tasks: str) -> dict:
    """lm-evaluation-harness on the merged model, through its transformers backend. A task
    may be a YAML file of one's own (its folder joins the harness's task paths, its name is
    its `task:`), whose data files are local, so it runs offline."""
    try:
        import lm_eval as harness
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ValueError("--lm-eval needs lm-evaluation-harness: pip install lm-eval") from None
    import yaml

    from linnet.export import export_directory

    names, folders = [], []
    for task in tasks.split(","):
        if task.endswith((".yaml", ".yml")):
            path = Path(task)
            if not path.is_file():
                raise ValueError(f"--lm-eval {task}: no such task file")
            spec = yaml.safe_load(path.read_text()) or {}
            if not isinstance(spec, dict) or not isinstance(spec.get("task"), str):
                raise ValueError(f"--lm-eval {task}: a task file names its task (task: NAME)")
            names.append(spec["task"])
            folders.append(str(path.parent.resolve()))
        else:
            names.append(task)
    bos = ",add_bos_token=True" if model.card.bos_token_id is not None else ""  # the harness adds none unasked
    with tempfile.TemporaryDirectory(prefix="linnet-eval-") as tmp:
        export_directory(model, tmp, about={"source": tmp, "base": tmp})
        out = harness.simple_evaluate(model="hf", model_args=f"pretrained={tmp},dtype=float32{bos}", tasks=names,
                                      device=str(model.device),
                                      task_manager=TaskManager(include_path=sorted(set(folders)) or None))
    return {task: {k: v for k, v in values.items() if isinstance(v, (int, float))}
            for task, values in out["results"].items()}


# The first field of every results file `--json` writes: how a later eval knows the file is
# one it may replace (it writes over nothing else).
MARK = {"written_by": "linnet eval"}


def is_result(path: Path) -> bool:
    """Whether `path` is a results file an earlier `linnet eval --json` wrote (its first
    field is MARK)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256).decode("utf-8", errors="replace")
    except OSError:
        return False
    return head.lstrip().startswith("{") and json.dumps(MARK)[1:-1] in head


def check_output(args, path: str, flag: str) -> None:
    """Refuse an output PATH that is one of the command's inputs (the data file, a file of
    a model, adapter or run directory) or an existing file it did not write. Reads only."""
    from linnet.files.atomic import RUN_ENTRIES, check_writable, is_model_file

    target = Path(path)
    where = target.resolve()
    if target.is_dir():
        raise ValueError(f"{flag} {target}: a directory; give a file path, such as {target / 'eval.json'}")
    for given, name in ((args.data, "--data"), (args.few_shot, "--few-shot")):
        if given and where == Path(given).resolve():
            raise ValueError(f"{flag} {target} is the {name} file: eval never writes over its input; give another "
                             "path")
    for source in args.sources:
        root = Path(source).resolve()
        if root.is_dir() and (where == root or root in where.parents):
            top = where.relative_to(root).parts[0]
            run = (root / "run.json").is_file()
            if is_model_file(where) or (run and any(fnmatch.fnmatch(top, e) for e in RUN_ENTRIES)):
                raise ValueError(f"{flag} {target}: a file of the model or run {source}, which eval reads; give a "
                                 "path outside its files")
    if target.exists() and not is_result(target):
        raise ValueError(f"{flag} {target}: exists and is not a `linnet eval` result; eval writes over no other "
                         "file: give a new path")
    check_writable(target.parent, f"the {flag} file's folder")


def read_framing(args):
    """The --system prompt and --few-shot examples as a Framing, or None; every shot checked."""
    from linnet.data import read_records
    from linnet.data.examples import prompt_answer_records
    from linnet.data.prompts import Framing

    if args.system is None and args.few_shot is None:
        return None
    shots: list[tuple[str, str]] = []
    if args.few_shot:
        if args.shots < 1:
            raise ValueError(f"--shots {args.shots}: show at least one of --few-shot's records")
        records = list(read_records(args.few_shot, field="--few-shot"))[:args.shots]
        if not records:
            raise ValueError(f"--few-shot {args.few_shot}: no records")
        prompt, answer = args.prompt_field, args.answer_field
        if answer not in records[0].data:  # prompt/completion, Alpaca: as the eval data reads them
            records, prompt, answer = prompt_answer_records(records) or [], "prompt", "answer"
        for r in records:
            if not isinstance(r.data.get(prompt), str) or r.data.get(answer) in (None, ""):
                raise ValueError(f"{r.where}: a few-shot example needs a text {prompt!r} and an {answer!r} "
                                 "(--prompt-field / --answer-field)")
            shots.append((r.data[prompt], str(r.data[answer])))
    return Framing(system=args.system, shots=tuple(shots), separator=args.shot_separator)


def columns(args, framing) -> list[tuple[str, str, object]]:
    """(name, source, framing) of each model compared: the sources in order, the first
    again with the framing right after it."""
    out, seen = [], set()
    for source in args.sources:
        name = source if source not in seen else f"{source} ({len(out) + 1})"
        seen.add(source)
        out.append((name, source, None))
    if framing is not None:
        out.insert(1, (f"{out[0][0]} + prompt", args.sources[0], framing))
    return out


METRIC_ORDER = ("loss", "reward", "pass@1", "preference_accuracy", "margin")


def print_comparison(found: dict) -> None:
    """One block a metric: each model's mean and interval, then its difference from the
    first model, the difference's interval and the paired test's p-value."""
    names = list(found)
    metrics = sorted({m for values in found.values() for m in values},
                     key=lambda m: (METRIC_ORDER.index(m) if m in METRIC_ORDER else len(METRIC_ORDER), m))
    width = max(len(n) for n in names)
    for metric in metrics:
        print(f"{metric:<{width}}  {'mean':>8}  {'95% interval':<18}  {'vs first':>10}  {'95% interval':<18}  p")
        for name in names:
            e = found[name].get(metric)
            if e is None:
                print(f"{name:<{width}}  {'-':>8}")
                continue
            line = f"{name:<{width}}  {e['mean']:8.4f}  [{e['low']:.4f}, {e['high']:.4f}]"
            if "difference" in e:
                line += (f"  {e['difference']:+10.4f}  [{e['difference_low']:+.4f}, {e['difference_high']:+.4f}]"
                         f"  {e['p']:.3g}")
            print(line)
        print()


def main(argv: list[str] | None = None) -> int:
    from linnet.files.atomic import write_text
    from linnet.report.stats import compare, interval
    from linnet.report.tables import print_table

    args = parser().parse_args(argv)
    if args.data is None and args.lm_eval is None:
        raise ValueError("give --data FILE and/or --lm-eval TASKS")
    if args.pass_k < 0 or args.pass_k == 1:
        raise ValueError(f"--pass-k {args.pass_k}: pass@k needs k >= 2 (pass@1 is always reported)")
    if args.pass_samples is not None and not 2 <= args.pass_k <= args.pass_samples:
        raise ValueError(f"--pass-samples {args.pass_samples}: needs --pass-k >= 2, and at least --pass-k")
    if args.batch < 1:
        raise ValueError(f"--batch {args.batch}: sample at least one prompt at once")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--context-length", args.context_length)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: give a positive number")
    framing = read_framing(args)
    if framing is not None and args.data is None:
        raise ValueError("--system / --few-shot frame the prompts of --data: give --data FILE")
    outputs = [(path, flag) for path, flag in ((args.json, "--json"), (args.per_example, "--per-example")) if path]
    if len(outputs) == 2 and Path(args.json).resolve() == Path(args.per_example).resolve():
        raise ValueError("--json and --per-example name one file; give each its own")
    for path, flag in outputs:
        check_output(args, path, flag)  # before anything is loaded
    if args.per_example and args.data is None:
        raise ValueError("--per-example writes the records of --data: give --data FILE")
    judge = judged_pairs = None
    if args.judge:
        from linnet.data import read_records
        from linnet.train.judge import Judge

        if args.data is None:
            raise ValueError("--judge compares answers to the prompts of --data: give --data FILE")
        first = read_records(args.data, field="--data")[:1]
        judged_pairs = bool(first) and "chosen" in first[0].data and "rejected" in first[0].data
        if not judged_pairs and len(columns(args, framing)) < 2:
            raise ValueError("--judge compares the models' completions with the first model's: give two models or "
                             "more (or --system / --few-shot), or chosen/rejected records for its agreement")
        judge = Judge(*load_model(args.judge), chat=args.chat, tokens=args.context_length)
    results: dict[str, dict] = {}
    each: dict[str, dict] = {}
    per: dict[str, list[dict]] = {}
    loaded = None
    if framing is not None:  # the first model's tokenizer spells the framing, before anything is measured
        loaded = args.sources[0], *load_model(args.sources[0])
        check_framing(loaded[2], framing, args.chat)
    for name, source, frame in columns(args, framing):
        if loaded is None or loaded[0] != source:
            loaded = source, *load_model(source)
        _, model, tokenizer = loaded
        results[name] = {}
        if args.data:
            results[name], each[name], per[name] = evaluate_file(model, tokenizer, args, frame)
        if args.lm_eval and frame is None:
            results[name]["lm_eval"] = lm_eval(model, args.lm_eval)
    extra: dict = {}
    if judged_pairs:
        extra["judge"] = {"source": args.judge, **judge_agreement(judge, list(read_records(args.data, field="--data")), args)}
        print(f"judge {args.judge}: agrees with {extra['judge']['agreement']:.1%} of the chosen answers "
              f"(95% interval {extra['judge']['interval'][0]:.1%} to {extra['judge']['interval'][1]:.1%})")
    elif judge is not None:
        judged(judge, args, per, each)
    if len(results) == 1:
        (name, found), = results.items()
        found["interval"] = {metric: list(interval(values)) for metric, values in each.get(name, {}).items()}
        print_table({k: v for k, v in found.items() if not isinstance(v, (list, dict))})
        for metric, (low, high) in found["interval"].items():
            print(f"  {metric} 95% interval over the records: [{low:.4g}, {high:.4g}]")
        for sample in found.get("samples", []):
            print(f"  {sample['prompt']!r} -> {sample['completion']!r} (answer {sample['answer']!r})")
        out = found
    else:
        comparison = compare(each) if each else {}
        print_comparison(comparison)
        out = {"models": results, "comparison": comparison}
    out = {**out, **extra}
    for name, found in results.items():
        for task, values in found.get("lm_eval", {}).items():
            print(f"  {name} {task}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
    if args.json:
        write_text(args.json, json.dumps({**MARK, **out}, indent=1) + "\n")
    if args.per_example:
        write_text(args.per_example, per_example_lines(args, per))
    return 0


def per_example_lines(args, per: dict[str, list[dict]]) -> str:
    """JSON lines, one a record: its index, prompt and answer, and each model's completion
    and scores."""
    from linnet.data import read_records

    records = list(read_records(args.data, field="--data"))
    lines = []
    for i, record in enumerate(records):
        row = {**MARK, "record": i, "data": record.data, "models": {name: rows[i] for name, rows in per.items()}}
        lines.append(json.dumps(row) + "\n")
    return "".join(lines)
