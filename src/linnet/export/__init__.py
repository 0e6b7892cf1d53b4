"""Export a trained model: a merged Hugging Face directory with a model card, a PEFT
adapter, or a GGUF file for llama.cpp.

    model, about = load_trained("runs/sft")            # a run directory, a model or an adapter
    export_directory(model, "out/", about=about, merge=True, dtype="bfloat16")
    write_gguf(model, "out/model.gguf", kind="q8_0")     # llama.cpp's architecture, vocabulary, types

A run directory's `final/` is either whole weights or a PEFT adapter over the base its
config.json names; merging folds the adapters (dequantizing an NF4 base first) into plain
weights. The model card (README.md) names the base model (its hub id when the card has
one) and, for a run trained from another run, the whole chain; the method, data and
hyperparameters of the run's config.json; the final metrics of its summary.json; and the
versions of the libraries that wrote it.

GGUF: see linnet.export.gguf_file (every family linnet loads, llama.cpp's names and
types, its fallback for shapes that do not divide).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from linnet.export.gguf_file import KINDS as GGUF_KINDS
from linnet.export.gguf_file import Plan, plan_gguf, write_gguf
from linnet.torch.weights import attach_adapter  # exported here too: loading a trained model's adapters

__all__ = ["GGUF_KINDS", "Plan", "attach_adapter", "export_directory", "load_trained", "model_card", "plan_gguf",
           "run_card", "write_gguf"]


def load_trained(source: str | os.PathLike, *, dtype: str = "float32") -> tuple[Any, dict[str, Any]]:
    """(model, about): the model a run directory trained (its final/, adapters attached to
    the base its config names), one of its checkpoints, a model directory, or a PEFT
    adapter directory over the base its adapter_config.json names. `about` holds what the model card says. A run's
    model carries the tokenizer it trained with (its data.tokenizer: `with_run_data`)."""
    from linnet import nest
    from linnet.cards import configured, resolve, run_checkpoint, run_config, with_run_data

    path = Path(source)
    about: dict[str, Any] = {"source": str(path), "chain": lineage(path)}
    if run_checkpoint(path):  # a run's checkpoints/step-…: its weights (adapters folded in), as resolve reads them
        about["base"] = str(path)
        return nest.load(run_card(path), dtype=dtype), about
    if (path / "run.json").is_file():
        config = run_config(path)
        about.update(command=json.loads((path / "run.json").read_text()).get("command"), config=config)
        if (path / "summary.json").is_file():
            about["summary"] = json.loads((path / "summary.json").read_text())
        final = path / "final"
        if not final.is_dir():
            raise ValueError(f"{path}: no final/ (the run has not finished); resume it with --resume, or name one "
                             f"of its checkpoints ({path / 'checkpoints'}/step-…)")
        model_config = config.get("model", {})
        base = model_config.get("card")
        if (final / "adapter_config.json").is_file():
            about["base"] = base
            card = _trained_ids(with_run_data(configured(model_config, path), config.get("data", {})), path)
            model = nest.load(card, weights=model_config.get("weights"), dtype=dtype)
            attach_adapter(model, final)
            return model, about
        about["base"] = base
        return nest.load(run_card(path), weights=final, dtype=dtype), about
    if (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{path}/adapter_config.json: base_model_name_or_path is empty; load the base and "
                             "call attach_adapter yourself")
        about["base"] = base
        model = nest.load(resolve(base), dtype=dtype)
        attach_adapter(model, path)
        return model, about
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a linnet run (run.json), a model directory (config.json) or a PEFT adapter "
                         "(adapter_config.json)")
    about["base"] = str(path)
    return nest.load(path, weights=path, dtype=dtype), about


def run_card(source: str | os.PathLike):
    """The card `source` names (linnet.cards.resolve); a linnet run's with the start, stop
    and padding ids of the tokenizer it trained with, which the card's own may not be."""
    from linnet.cards import resolve

    run = _run_of(Path(source))
    return _trained_ids(resolve(source), run) if run else resolve(source)


def _trained_ids(card, run: Path):
    """`card` with the BOS, stop and padding ids of the run's data.tokenizer (loaded as
    training loaded it), so generation stops and an export's config.json says what it
    learned; unchanged where the run names none."""
    from linnet.cards import REGISTRY, run_config
    from linnet.data.tokenizer import load_tokenizer

    data = run_config(run).get("data", {})
    name = data.get("tokenizer")
    if not name:
        return card
    if not Path(name).exists() and name not in REGISTRY:
        raise ValueError(f"{run / 'config.json'}: data.tokenizer {name!r} is not found from here or from where the "
                         "run trained; write the tokenizer's path there")
    tok = load_tokenizer(name, chat_template=data.get("chat_template"))
    return card.replace(bos_token_id=tok.bos_id, eos_token_ids=tok.eos_ids, pad_token_id=tok.pad_id)


def _run_of(path: Path) -> Path | None:
    """The linnet run directory `path` names: the run, its final/ or one of its checkpoints."""
    for run in (path, path.parent, path.parent.parent):
        if (run / "run.json").is_file() and (run == path or path.name == "final" or path.parent.name == "checkpoints"):
            return run
    return None


def lineage(source: str | os.PathLike) -> list[str]:
    """The chain a model was trained through, oldest first: the first base (a card name,
    a hub id or a model directory), then each linnet run or PEFT adapter, `source` last."""
    from linnet.cards import run_config

    chain: list[str] = []
    where: str | None = str(source)
    while where and where not in chain:
        path = Path(where)
        run = _run_of(path)
        if run is not None:
            chain.insert(0, str(run))
            where = run_config(run).get("model", {}).get("card")
        elif (path / "adapter_config.json").is_file():
            chain.insert(0, str(path))
            where = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        else:
            chain.insert(0, where)
            break
    return chain


def hub_id(base: str) -> str | None:
    """The hub repository of a registered card (or a hub id itself), else None."""
    from linnet.cards import REGISTRY

    if base in REGISTRY:
        return REGISTRY[base].weights.repo
    if base.count("/") == 1 and not Path(base).exists() and not base.startswith((".", "/")):
        return base
    return None


def _versions() -> dict[str, str]:
    from importlib import metadata

    import linnet

    found = {"linnet": linnet.__version__}
    for name in ("torch", "transformers", "peft", "gguf"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


# the groups of a run's config.json that say how it trained, in the card's order
_SETTINGS = ("lora", "training", "optimizer", "lr_schedule")
_NOT_SETTINGS = ("model", "data", "evaluation", "runtime")
# how the run was laid out and saved, not how it learned
_PLUMBING = {"lora.enabled", "training.checkpoint_every", "training.keep", "training.activation_checkpointing",
             "training.shard", "training.split", "training.pipeline", "training.pipeline_schedule"}


def _settings(config: dict[str, Any], method: str) -> list[tuple[str, Any]]:
    """(group.field, value) of the hyperparameters: the method's own group first."""
    groups = [g for g in config if g not in _SETTINGS and g not in _NOT_SETTINGS and isinstance(config[g], dict)]
    rows = []
    for group in (*groups, *_SETTINGS):
        values = config.get(group)
        if not isinstance(values, dict) or (group == "lora" and not values.get("enabled", False)):
            continue
        rows += [(f"{group}.{k}", v) for k, v in values.items()
                 if v is not None and v != [] and f"{group}.{k}" not in _PLUMBING]
    for key in ("dtype", "quantize"):
        if config.get("model", {}).get(key) is not None:
            rows.append((f"model.{key}", config["model"][key]))
    if config.get("runtime", {}).get("seed") is not None:
        rows.append(("runtime.seed", config["runtime"]["seed"]))
    return rows


def model_card(about: dict[str, Any], *, merged: bool, gguf: list[str] | None = None) -> str:
    """README.md for an export: what was trained, from what (the chain of runs), how
    (the hyperparameters), on what, how far, and with which library versions."""
    config, summary = about.get("config", {}), about.get("summary", {})
    lora = config.get("lora", {})
    method = about.get("command")
    chain = about.get("chain") or [about.get("base") or about["source"]]
    first = chain[0]
    base_model = hub_id(first) or first
    tags = ["linnet"] + (["gguf"] if gguf else [])
    kind = "full fine-tuning" if not lora.get("enabled", False) else (
        f"LoRA r={lora.get('rank')} alpha={lora.get('alpha')}" + (" (DoRA)" if lora.get("dora") else ""))
    lines = ["---", "library_name: " + ("transformers" if merged else "peft"), f"base_model: {base_model}",
             f"tags: [{', '.join(tags)}]", "---", "", f"# {Path(about['source']).name}", ""]
    if method:
        lines += [f"Trained with linnet's `linnet {method}` ({kind}"
                  + (", adapters merged into the base" if merged and lora.get("enabled") else "") + ").", ""]
    hub = hub_id(first)
    lines.append(f"- Base model: [{hub}](https://huggingface.co/{hub})" + (f" (linnet card `{first}`)" if hub != first
                                                                         else "") if hub else f"- Base model: `{first}`")
    if len(chain) > 1:
        lines.append("- Trained through: " + " → ".join(f"`{step}`" for step in chain))
    data = config.get("data", {}).get("path")
    if data:
        lines.append(f"- Data: `{data}`" + (f" (split {config['data']['split']})" if config["data"].get("split") else ""))
    for key in ("steps", "first_loss", "last_loss", "held_out_loss", "held_out_accuracy", "held_out_margin",
                "seconds"):
        if summary.get(key) is not None:
            value = summary[key]
            lines.append(f"- {key.replace('_', ' ')}: {round(value, 4) if isinstance(value, float) else value}")
    if gguf:
        lines.append("- GGUF for llama.cpp: " + ", ".join(f"`{name}`" for name in gguf))
    settings = _settings(config, method or "")
    if settings:
        lines += ["", "## Hyperparameters", "", "| setting | value |", "| --- | --- |"]
        lines += [f"| `{k}` | `{json.dumps(v) if isinstance(v, (list, dict, bool)) else v}` |" for k, v in settings]
    lines += ["", "## Libraries", "", ", ".join(f"{k} {v}" for k, v in _versions().items())]
    return "\n".join(lines) + "\n"


def export_directory(model, out: str | os.PathLike, *, about: dict[str, Any], merge: bool = True,
                     dtype: str | None = None, gguf: str | None = None, plan: Plan | None = None) -> Path:
    """Write `out` (new, or an empty directory): with merge (or no adapters) a whole
    Hugging Face model (weights in `dtype`, config.json, tokenizer, README.md); else the
    PEFT adapter and README.md; with `gguf` (a kind, which merges) also model-KIND.gguf.
    Everything is checked first (`plan_gguf`); the directory is written under a temporary
    name beside `out` and renamed into place, so a failed or killed export leaves no
    half-written `out` (the temporary directory goes, or a later export removes it)."""
    import shutil

    from linnet.files.atomic import DiskFull, disk_full, ordinary_permissions, remove_stale
    from linnet.torch.lora import save_peft

    out = Path(out)
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty; export into a new directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: is a file; export into a new directory")
    if gguf is not None:
        merge = True
        plan = plan or plan_gguf(model, gguf)
    made = [d for d in (out.parent, *out.parent.parents) if not d.exists()]  # what a failure removes again
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        adapters = bool(getattr(model, "lora", None))
        if adapters and not merge:
            save_peft(model, tmp, base_model=about.get("base"))
        else:
            if adapters:
                model.merge_lora()
            model.save_weights(tmp, dtype=dtype or "float32")
        names = [f"model-{gguf}.gguf"] if gguf else []
        if gguf:
            write_gguf(model, tmp / names[0], kind=gguf, plan=plan)
        (tmp / "README.md").write_text(model_card(about, merged=not adapters or merge, gguf=names))
        ordinary_permissions(tmp)
        if out.exists():
            out.rmdir()  # empty, as checked
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for directory in made:
            try:
                directory.rmdir()
            except OSError:
                break
        full = disk_full(e, out)
        if isinstance(full, DiskFull) and full.filename and Path(full.filename).is_relative_to(tmp):
            full = DiskFull(out / Path(full.filename).relative_to(tmp), full.strerror)  # the name the user gave
        if full is None and isinstance(e, OSError) and e.filename and Path(e.filename).is_relative_to(tmp):
            full = OSError(f"{out}: cannot write the export there ({e.strerror})")  # not the temporary name
        if full is None:
            raise
        raise full from None
    return out
