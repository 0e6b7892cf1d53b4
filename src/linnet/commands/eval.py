"""`linnet eval`: a model or run on a data file: held-out loss and perplexity, and the
greedy (and sampled) completions of the Engine scored by a reward: exact match, reward,
pass@1, pass@k; a table of sample generations; lm-evaluation-harness tasks on request.

    linnet eval runs/sft --data held_out.jsonl                    # loss, perplexity
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
import sys
import tempfile
from pathlib import Path

from linnet.commands.spellings import former_flags

# the former flags, refused with the flag that replaced them (the YAML's names: grpo.rewards, ...)
FORMER_FLAGS = {"--reward": "--rewards", "--k": "--pass-k", "--samples": "--pass-samples",
                "--tokens": "--context-length"}
# the data readers' keywords as this command's flags, for their errors (names=)
RECORD_FLAGS = {"tokens": "--context-length", "prompt": "--prompt-field", "answer": "--answer-field",
                "chat_template": "--no-chat (the model has no chat template)"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linnet eval", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a run directory, a model directory or a PEFT adapter directory")
    p.add_argument("--data", help="records: .jsonl, .json, .parquet")
    p.add_argument("--answer-field", default="answer", help="the reference answer's field, as data.answer (default "
                                                             "answer)")
    p.add_argument("--prompt-field", default="prompt", help="the prompt's field for completions, as data.prompt "
                                                             "(default prompt)")
    p.add_argument("--rewards", nargs="+", default=["exact"], metavar="REWARD",
                   help="as grpo.rewards: exact, numeric, format, model:DIR or module:function; several are summed "
                        "(default exact)")
    p.add_argument("--format-pattern", help="the regular expression of the 'format' reward, as grpo.format_pattern")
    p.add_argument("--max-new-tokens", type=int, default=256)
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
    p.add_argument("--lm-eval", metavar="TASKS", help="comma-separated lm-evaluation-harness tasks")
    p.add_argument("--json", metavar="PATH", help="also write the results here (a new file, or one an earlier "
                                                  "`linnet eval --json` wrote; never an input)")
    former_flags(p, FORMER_FLAGS)
    return p


def evaluate_file(model, tokenizer, args) -> dict:
    """Loss/perplexity of the records that have completions; scores of those with answers."""
    from linnet.data import load_examples, prompts_from_records, read_records
    from linnet.data.examples import prompt_answer_records
    from linnet.packing import pack
    from linnet.rl.rewards import resolve, text_of
    from linnet.serve import Engine
    from linnet.train.evaluation import held_out_loss
    from linnet.train.grpo import evaluate

    records = list(read_records(args.data))
    if not records:
        raise ValueError(f"{args.data}: no records")
    results: dict = {"records": len(records)}
    scored, prompt_field, answer_field = records, args.prompt_field, args.answer_field
    if args.answer_field not in records[0].data:  # completions: their loss, then the completions as answers
        examples = load_examples(args.data, tokenizer=tokenizer, tokens=args.context_length, chat=args.chat,
                                 names=RECORD_FLAGS)
        loss = held_out_loss(model, pack(examples, args.context_length, pad_id=tokenizer.pad_id))
        results.update(loss=loss, perplexity=math.exp(loss))
        scored, prompt_field, answer_field = prompt_answer_records(records), "prompt", "answer"
    if scored is not None:  # every record with one answer: complete its prompt and score the completion
        prompts = prompts_from_records(scored, tokenizer, prompt=prompt_field, answer=answer_field,
                                       chat=args.chat, names=RECORD_FLAGS)
        bos = model.card.bos_token_id
        if tokenizer.bos_id is None and bos is not None:  # the card's BOS, where the tokenizer adds none
            prompts = [dataclasses.replace(p, ids=[bos, *p.ids]) if list(p.ids[:1]) != [bos] else p for p in prompts]
        engine = Engine(model)
        reward = {spec: resolve(spec, tokenizer, args.format_pattern) for spec in args.rewards}
        stop = list(tokenizer.eos_ids)
        found = evaluate(model, engine, prompts, reward, max_new_tokens=args.max_new_tokens, k=args.pass_k,
                         samples=args.pass_samples, temperature=args.temperature, stop=stop, batch=args.batch,
                         label="eval")
        results.update(found)
        shown = engine.sample([list(p.ids) for p in prompts[:args.show]], max_new_tokens=args.max_new_tokens,
                              temperature=0.0, stop=stop)
        results["samples"] = [{"prompt": r.data[prompt_field], "completion": text_of(tokenizer, c.tokens),
                               "answer": r.data[answer_field]} for r, c in zip(scored, shown)]
    return results


def lm_eval(model, tasks: str) -> dict:
    """lm-evaluation-harness on the merged model, through its transformers backend."""
    try:
        import lm_eval as harness
    except ImportError:
        raise ValueError("--lm-eval needs lm-evaluation-harness: pip install lm-eval") from None
    from linnet.export import export_directory

    with tempfile.TemporaryDirectory(prefix="linnet-eval-") as tmp:
        export_directory(model, tmp, about={"source": tmp, "base": tmp})
        out = harness.simple_evaluate(model="hf", model_args=f"pretrained={tmp},dtype=float32",
                                      tasks=tasks.split(","), device="cpu")
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


def check_json(args) -> None:
    """Refuse a --json PATH that is one of the command's inputs (the data file, a file of
    the model, adapter or run directory) or an existing file it did not write. Reads only."""
    from linnet.files.atomic import RUN_ENTRIES, check_writable, is_model_file

    target = Path(args.json)
    where = target.resolve()
    if target.is_dir():
        raise ValueError(f"--json {target}: a directory; give a file path, such as {target / 'eval.json'}")
    if args.data and where == Path(args.data).resolve():
        raise ValueError(f"--json {target} is the --data file: eval never writes over its input; give another path")
    source = Path(args.source).resolve()
    if source.is_dir() and (where == source or source in where.parents):
        top = where.relative_to(source).parts[0]
        run = (source / "run.json").is_file()
        if is_model_file(where) or (run and any(fnmatch.fnmatch(top, e) for e in RUN_ENTRIES)):
            raise ValueError(f"--json {target}: a file of the model or run {args.source}, which eval reads; give a "
                             "path outside its files")
    if target.exists() and not is_result(target):
        raise ValueError(f"--json {target}: exists and is not a `linnet eval` result; eval writes over no other file: "
                         "give a new path")
    check_writable(target.parent, "the --json file's folder")


def main(argv: list[str] | None = None) -> int:
    from linnet.data import load_tokenizer
    from linnet.export import load_trained
    from linnet.files.atomic import write_text
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
    if args.json:
        check_json(args)  # before anything is loaded
    model, _ = load_trained(args.source)
    model.eval()
    tokenizer = load_tokenizer(model.card)
    results: dict = {}
    if args.data:
        results = evaluate_file(model, tokenizer, args)
    if args.lm_eval:
        results["lm_eval"] = lm_eval(model, args.lm_eval)
    print_table({k: v for k, v in results.items() if not isinstance(v, (list, dict))})
    for sample in results.get("samples", []):
        print(f"  {sample['prompt']!r} -> {sample['completion']!r} (answer {sample['answer']!r})", file=sys.stdout)
    for task, values in results.get("lm_eval", {}).items():
        print(f"  {task}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
    if args.json:
        write_text(args.json, json.dumps({**MARK, **results}, indent=1) + "\n")
    return 0
