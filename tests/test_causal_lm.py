"""CausalLM against transformers' own model: the loss of one call, a few steps of
transformers.Trainer / trl.SFTTrainer / trl.DPOTrainer, save_pretrained, generate.

Tolerances (float32 on CPU): a single call agrees with transformers to 1e-5 (measured
~5e-7); trainer losses over 3 AdamW steps to 1e-5 relative (measured ~1e-7).
"""

from __future__ import annotations

import random
import shutil
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from linnet import nest
from linnet.torch import CausalLM
from linnet.torch.causal_lm import pack_batch
from linnet.torch.weights import bind_weights
from tests.conftest import make_hf_model

torch.set_num_threads(1)

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789=+"
STEPS = {"max_steps": 3, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
         "learning_rate": 1e-2, "logging_steps": 1, "report_to": [], "use_cpu": True, "save_strategy": "no",
         "dataloader_num_workers": 0, "bf16": False, "seed": 0, "disable_tqdm": True}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama saved as a model directory: (directory, fresh transformers copy)."""
    directory = tmp_path_factory.mktemp("causal_lm") / "llama"
    make_hf_model("llama").save_pretrained(directory)

    def fresh():
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)

    return directory, fresh


def _batch(side: str, seed: int = 0):
    """Three rows of 20, 13 and 7 real tokens padded on `side`; labels -100 on padding,
    on each row's first token and on a prompt-like span."""
    g = torch.Generator().manual_seed(seed)
    B, T, lengths = 3, 20, (20, 13, 7)
    ids = torch.randint(3, 97, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, T - n:] = 1
    labels = ids.masked_fill(mask == 0, -100)
    for b in range(B):
        first = int(mask[b].nonzero()[0])
        labels[b, first: first + 1 + b] = -100  # the first token never counts; more prompt in later rows
    return ids, mask, labels


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("side", ["right", "left"])
def test_loss_equals_transformers_on_padded_batches(base, side):
    directory, fresh = base
    hf = fresh()
    lm = CausalLM(nest.load(directory, trainable=True))
    ids, mask, labels = _batch(side)
    learned = int((labels[:, 1:] != -100).sum())
    for items in (None, learned, torch.tensor(learned + 17)):  # the mean, a whole step's count
        kw = {} if items is None else {"num_items_in_batch": items}
        ours = lm(input_ids=ids, attention_mask=mask, labels=labels, **kw)
        theirs = hf(input_ids=ids, attention_mask=mask, labels=labels, **kw)
        assert abs(ours.loss.item() - theirs.loss.item()) <= 1e-5, (side, items)
        assert ours["loss"] is ours.loss
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # pre-shifted, as some collators send
    ours = lm(input_ids=ids, attention_mask=mask, shift_labels=shifted).loss
    assert abs(ours.item() - hf(input_ids=ids, attention_mask=mask, labels=labels).loss.item()) <= 1e-5
    # the mean and the sum over a count differ, so a swapped branch cannot pass
    plain = lm(input_ids=ids, attention_mask=mask, labels=labels).loss
    summed = lm(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=learned + 17).loss
    assert torch.allclose(summed * (learned + 17), plain * learned, rtol=1e-5)


def test_padding_free_position_ids_equal_transformers_and_the_padded_batch(base):
    """One row of three sequences, positions restarting at 0 (TRL's padding-free
    collator, which puts -100 on each sequence's first label)."""
    directory, fresh = base
    hf = fresh()
    lm = CausalLM(nest.load(directory, trainable=True))
    ids, mask, labels = _batch("right", seed=1)
    real = mask.bool()
    row_ids, row_labels = ids[real][None], labels[real][None]
    row_positions = torch.cat([torch.arange(int(n)) for n in mask.sum(1)])[None]
    ours = lm(input_ids=row_ids, position_ids=row_positions, labels=row_labels).loss
    theirs = hf(input_ids=row_ids, position_ids=row_positions, labels=row_labels, use_cache=False).loss
    padded = lm(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert abs(ours.item() - theirs.item()) <= 1e-5
    assert abs(ours.item() - padded.item()) <= 1e-5
    # without the restarts the sequences would attend to each other: a different loss
    joined = lm(input_ids=row_ids, labels=row_labels).loss
    assert abs(joined.item() - ours.item()) > 1e-3


def test_packing_drops_padding_and_rounds_to_the_bucket(base):
    directory, _ = base
    ids, mask, labels = _batch("left")
    unrounded = pack_batch(ids, mask, labels=labels, bucket=None)
    rounded = pack_batch(ids, mask, labels=labels, bucket=256)
    # the real tokens less each row's last (it predicts nothing), padding gone
    assert unrounded.row.real == len(unrounded.row.tokens) == int(mask.sum()) - 3
    assert len(rounded.row.tokens) == 256 and rounded.row.real == int(mask.sum()) - 3
    assert rounded.row.bounds.tolist() == [0, 19, 31, 37, 256]
    assert int(rounded.row.weights.sum()) == int((labels[:, 1:] != -100).sum())
    # tokens after a sequence's last learned label cannot change the loss: they are cut
    cut = labels.clone()
    cut[0, 15:] = -100
    trimmed = pack_batch(ids, mask, labels=cut, bucket=None)
    assert trimmed.row.real == int(mask.sum()) - 3 - 5  # row 0 keeps positions 0..13
    lm = CausalLM(nest.load(directory), bucket=None)
    with torch.no_grad():
        a = lm(input_ids=ids, attention_mask=mask, labels=cut).loss
        b = CausalLM(lm.decoder, bucket=16)(input_ids=ids, attention_mask=mask, labels=cut).loss
        full = lm(input_ids=ids, attention_mask=mask, labels=cut, logits=True).loss  # untrimmed path
    assert abs(a.item() - b.item()) <= 1e-6 and abs(a.item() - full.item()) <= 1e-6


def test_logits_in_the_input_layout_without_gradients(base):
    directory, fresh = base
    hf = fresh()
    lm = CausalLM(nest.load(directory, trainable=True))
    ids, mask, labels = _batch("left")
    real = mask.bool()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
        out = lm(input_ids=ids, attention_mask=mask, logits=True)
    assert out.loss is None and out.logits.shape == theirs.shape
    assert (out.logits[real] - theirs[real]).abs().max().item() <= 1e-4
    assert out.logits[~real].abs().max().item() == 0.0
    both = CausalLM(lm.decoder, logits=True)(input_ids=ids, attention_mask=mask, labels=labels)
    assert not both.logits.requires_grad and both.loss.requires_grad
    assert abs(both.loss.item() - hf(input_ids=ids, attention_mask=mask, labels=labels).loss.item()) <= 1e-5
    with pytest.raises(ValueError, match="without gradients"):
        lm.train()(input_ids=ids, attention_mask=mask, logits=True)  # e.g. label smoothing
    with pytest.raises(ValueError, match="no labels"):
        lm(input_ids=ids, attention_mask=mask)
    with pytest.raises(TypeError, match="inputs_embeds"):
        lm(input_ids=ids, labels=labels, inputs_embeds=torch.zeros(3, 20, 64))


def test_parameters_are_the_decoders_under_transformers_names(base):
    directory, fresh = base
    decoder = nest.load(directory, trainable=True)
    lm = CausalLM(decoder)
    assert set(lm.state_dict()) == set(fresh().state_dict())
    assert {id(p) for p in lm.parameters()} == {id(p) for p in decoder.parameters()}
    lm.eval()
    assert not decoder.training and not decoder.model.layers[0].training


# ---------------------------------------------------------------------------------------
# the trainers


def _completions(n=8, seed=0):
    r = random.Random(seed)
    word = lambda alphabet, lo, hi: "".join(r.choice(alphabet) for _ in range(r.randint(lo, hi)))
    return [(word(CHARS[:26], 2, 9) + "=", word(CHARS[26:36], 1, 6), word(CHARS[26:36], 1, 6)) for _ in range(n)]


def _tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def _losses(trainer):
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_transformers_trainer_matches_the_transformers_model(base, tmp_path):
    """Padded on the left, accumulation over two micro-batches of uneven token counts."""
    datasets = pytest.importorskip("datasets")
    directory, fresh = base
    tok = _tokenizer()
    rows = []
    for prompt, completion, _ in _completions():
        p, c = tok(prompt)["input_ids"], tok(completion + "</s>")["input_ids"]
        rows.append({"input_ids": p + c, "labels": [-100] * len(p) + c})
    data = datasets.Dataset.from_list(rows)

    def collate(features):
        T = max(len(f["input_ids"]) for f in features)
        pad = lambda x, v: [v] * (T - len(x)) + x
        return {"input_ids": torch.tensor([pad(f["input_ids"], 0) for f in features]),
                "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in features]),
                "labels": torch.tensor([pad(f["labels"], -100) for f in features])}

    def run(model, name):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), **STEPS)
        return _losses(transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate))

    ours = run(CausalLM(nest.load(directory, trainable=True)), "ours")
    theirs = run(fresh(), "theirs")
    assert len(ours) == 3 and ours[0] > ours[-1]
    assert all(_rel(a, b) <= 1e-5 for a, b in zip(ours, theirs)), (ours, theirs)


@pytest.mark.parametrize("config", [{}, {"loss_type": "nll", "packing": True}], ids=["default", "nll-packed"])
def test_sft_trainer_matches_the_transformers_model(base, tmp_path, config):
    """TRL's fused chunked loss over CausalLM.base_model's hidden states: padded batches by
    default; with packing (best-fit, padding-free rows, position_ids restarting at 0)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    directory, fresh = base
    data = datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c, _ in _completions()])

    def run(model, name, **extra):
        args = trl.SFTConfig(output_dir=str(tmp_path / name), max_length=64, **STEPS, **config, **extra)
        return _losses(trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer()))

    lm = CausalLM(nest.load(directory, trainable=True))
    restarts = []  # sequences per row TRL's fused head asked hidden states for
    hidden_states = lm.hidden_states
    lm.hidden_states = lambda ids, mask=None, positions=None, **kw: (
        restarts.append(len(ids) if positions is None else int((positions == 0).sum())),
        hidden_states(ids, mask, positions, **kw))[1]
    # TRL turns gradient checkpointing on by default: the decoder then checkpoints its blocks
    ours = run(lm, "ours")
    assert lm.is_gradient_checkpointing and lm.decoder.checkpointing == "full"
    theirs = run(fresh(), "theirs", activation_checkpointing=False)
    assert len(ours) == 3 and ours[0] > ours[-1]
    assert len(restarts) >= 3 and (max(restarts) > 2) == bool(config.get("packing"))
    assert all(_rel(a, b) <= 1e-5 for a, b in zip(ours, theirs)), (ours, theirs)


def test_dpo_trainer_matches_the_transformers_model(base, tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    directory, fresh = base
    data = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in _completions()])

    def run(model, reference, name):
        args = trl.DPOConfig(output_dir=str(tmp_path / name), activation_checkpointing=False, **STEPS)
        trainer = trl.DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data,
                                 processing_class=_tokenizer())
        return _losses(trainer)

    ours = run(CausalLM(nest.load(directory, trainable=True)), CausalLM(nest.load(directory)), "ours")
    theirs = run(fresh(), fresh(), "theirs")
    assert ours[0] == pytest.approx(np.log(2), abs=1e-6) and ours[1] != ours[0]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(ours, theirs)), (ours, theirs)


# ---------------------------------------------------------------------------------------
# saving and generating


def test_save_pretrained_loads_in_transformers(base, tmp_path):
    directory, _ = base
    lm = CausalLM(nest.load(directory, trainable=True))
    with torch.no_grad():  # not the weights on disk already
        lm.decoder.model.norm.weight.mul_(1.5)
    lm.config.pad_token_id = 0  # as a trainer aligning special tokens would
    lm.save_pretrained(tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (back(ids).logits - lm.decoder(ids)).abs().max().item() <= 1e-4
    assert back.config.pad_token_id == 0


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_lora_sft_run_saves_an_adapter_peft_loads(base, tmp_path, quantize):
    """LoRA, and QLoRA over an NF4 base with TRL's default activation checkpointing."""
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    if quantize:
        pytest.importorskip("bitsandbytes", reason="quantize='nf4' needs bitsandbytes")
    directory, fresh = base
    decoder = nest.load(directory, quantize=quantize)
    decoder.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, alpha=8)
    lm = CausalLM(decoder)
    data = datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c, _ in _completions()])
    args = trl.SFTConfig(output_dir=str(tmp_path / "run"), max_length=64, activation_checkpointing=bool(quantize),
                         **{**STEPS, "max_steps": 2})
    losses = _losses(trl.SFTTrainer(model=lm, args=args, train_dataset=data, processing_class=_tokenizer()))
    assert len(losses) == 2 and decoder.checkpointing == ("full" if quantize else None)
    assert all(p.abs().max() > 0 for n, p in decoder.named_parameters() if n.endswith("lora_b"))  # it trained
    lm.save_pretrained(tmp_path / "adapter")
    tuned = peft.PeftModel.from_pretrained(fresh(), tmp_path / "adapter").eval()
    if quantize:  # PEFT's model is over the original weights: compare with those, adapters included
        plain = nest.load(directory)
        plain.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, alpha=8)
        bind_weights(plain, tmp_path / "adapter", strict=False)
        decoder = plain
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (tuned(ids).logits - decoder.eval()(ids)).abs().max().item() <= 1e-4


def test_generate_greedy_equals_transformers(base):
    """Left-padded prompts of 12 and 5 tokens; eos is a token row 0 emits at its third step,
    so row 0 stops early and is padded while row 1 runs on."""
    directory, fresh = base
    hf = fresh().eval()
    lm = CausalLM(nest.load(directory)).eval()
    ids, mask, _ = _batch("left", seed=4)
    ids, mask = ids[:2, :12], mask[:2, :12]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        eos = int(free[0, 14])
        theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    ours = lm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert (theirs[0, 15:] == 0).all() and eos not in theirs[1, 12:].tolist()  # the case is what it claims
    assert torch.equal(ours, theirs)
    assert lm.generate(ids[:1, 7:], eos_token_id=[]).shape == (1, 20)  # transformers' default max_length
    with pytest.raises(ValueError, match="on the left"):
        lm.generate(ids.flip(1), attention_mask=mask.flip(1), max_new_tokens=1)
    with pytest.raises(ValueError, match="row 1 is all padding"):
        lm.generate(ids, attention_mask=torch.stack([mask[0], torch.zeros_like(mask[1])]), max_new_tokens=1)
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate(ids, attention_mask=mask, generation_config=transformers.GenerationConfig(num_beams=2))


def test_generate_refusals_say_what_generate_takes(base):
    directory, _ = base
    lm = CausalLM(nest.load(directory)).eval()
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    for setting in (dict(num_beams=2), dict(repetition_penalty=1.2), dict(min_p=0.1)):
        with pytest.raises(ValueError, match=rf"generate: {next(iter(setting))}=.* not supported \(greedy or sampled"):
            lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, **setting)
    with pytest.raises(TypeError, match=r"generate: beams=2 is not supported \(generate takes input_ids, .*generator"):
        lm.generate(ids, max_new_tokens=2, beams=2)
    assert lm.generate(ids, max_new_tokens=2, num_beams=1, min_p=0.0, use_cache=True).shape == (2, 8)  # off: fine


def _greedy_without_cache(lm, ids, steps):
    """Greedy continuation from the full logits of the whole sequence each step (no engine)."""
    for _ in range(steps):
        logits = lm(input_ids=ids, logits=True).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("lora", [False, True])
def test_generate_follows_the_weights_as_they_train(base, lora):
    directory, _ = base
    decoder = nest.load(directory, trainable=not lora)
    if lora:
        decoder.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, alpha=8)
    lm = CausalLM(decoder)
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    greedy = dict(max_new_tokens=5, do_sample=False, eos_token_id=[])
    before = lm.generate(ids, **greedy)
    engine = lm._sampler
    optimizer = torch.optim.Adam([p for p in lm.parameters() if p.requires_grad], lr=0.05)
    for _ in range(3):  # teach it to answer 42 to anything
        lm(input_ids=ids, labels=torch.full_like(ids, 42)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = lm.generate(ids, **greedy)
    assert lm._sampler is engine  # built once, refreshed
    assert not torch.equal(after, before) and (after[:, 6:] == 42).any()
    with torch.no_grad():
        assert torch.equal(after, _greedy_without_cache(lm.eval(), ids, 5))
    sampled = dict(max_new_tokens=5, do_sample=True, temperature=0.8, eos_token_id=[])
    assert torch.equal(lm.generate(ids, top_k=1, **sampled), after)  # top-k 1 is greedy
    runs = [lm.generate(ids, top_p=0.9, generator=torch.Generator().manual_seed(0), **sampled) for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0][:, :6], ids)
    three = lm.generate(ids, top_k=1, num_return_sequences=3, **sampled)  # each prompt's 3 in consecutive rows
    assert torch.equal(three, after.repeat_interleave(3, dim=0))
    with pytest.raises(ValueError, match="do_sample"):
        lm.generate(ids, num_return_sequences=2, **greedy)


@pytest.mark.parametrize("adapters", [False, True])
def test_the_trainers_saves_load_and_its_checkpoints_resume(base, tmp_path, adapters):
    """trl.SFTTrainer's save_model writes what transformers (whole weights) or PEFT
    (adapters) loads, as CausalLM.save_pretrained does, and resume_from_checkpoint from its
    step-1 checkpoint gives the uninterrupted run's step-2 loss."""
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    directory, fresh = base
    data = datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c, _ in _completions()])

    def trainer(out, **more):
        torch.manual_seed(0)
        decoder = nest.load(directory, trainable=not adapters)
        if adapters:
            decoder.add_lora(["model.layers.*.self_attn.*_proj"], rank=4, alpha=8)
        args = trl.SFTConfig(output_dir=str(out), max_length=64, **{**STEPS, "max_steps": 2, "save_strategy": "steps",
                                                                     "save_steps": 1, **more})
        return trl.SFTTrainer(model=CausalLM(decoder), args=args, train_dataset=data,
                              processing_class=_tokenizer()), decoder

    whole, decoder = trainer(tmp_path / "whole")
    losses = _losses(whole)
    whole.save_model(str(tmp_path / "saved"))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    loaded = (peft.PeftModel.from_pretrained(fresh(), tmp_path / "saved") if adapters else
              transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)).eval()
    with torch.no_grad():
        assert (loaded(ids).logits - decoder.eval()(ids)).abs().max().item() <= 1e-4
    resumed, _ = trainer(tmp_path / "resumed")
    shutil.copytree(tmp_path / "whole" / "checkpoint-1", tmp_path / "resumed" / "checkpoint-1")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-1"))
    again = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    assert again[-1] == pytest.approx(losses[1], rel=1e-5)
