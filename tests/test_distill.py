"""Distillation: each divergence against its formula and TRL's GKD loss, the blockwise
divergence against the plain one (values, gradients, peak memory of one block), a teacher
distilled into itself (zero loss, zero gradient), and logit, sequence-level and on-policy
distillation bringing a student closer to its teacher."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Example, pack
from linnet.serve import Engine
from linnet.train.distill import (
    distill,
    linear_divergence,
    on_policy_distill,
    row_divergence,
    teacher_completions,
    token_divergence,
)
from tests.conftest import gathered, quickstart_model, same_metrics

torch.set_num_threads(1)
CARD = nest.resolve("debug").replace(vocab=64, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8,
                                     eos_token_ids=(2,))


def _rows(n=32, seed=0):
    g = np.random.default_rng(seed)
    examples = [Example.prompted(g.integers(3, 64, size=3).tolist(), g.integers(3, 64, size=5).tolist())
                for _ in range(n)]
    return list(pack(examples, tokens=64))


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0),
                                             ("jsd", 1.0)])
def test_each_divergence_equals_its_formula_and_trls(divergence, beta):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 11, generator=g, dtype=torch.float64), torch.randn(6, 11, generator=g, dtype=torch.float64)
    ours = token_divergence(s, t, divergence=divergence, beta=beta, temperature=2.0).double()
    ps, pt = torch.softmax(s / 2, -1), torch.softmax(t / 2, -1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)  # noqa: E731
    if divergence == "forward_kl" or beta == 0:
        want = kl(pt, ps)
    elif divergence == "reverse_kl" or beta == 1:
        want = kl(ps, pt)
    else:
        m = beta * pt + (1 - beta) * ps
        want = beta * kl(pt, m) + (1 - beta) * kl(ps, m)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)
    if divergence == "jsd":
        trl = pytest.importorskip("trl")  # noqa: F841
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

        theirs = GKDTrainer.generalized_jsd_loss(s.float()[None], t.float()[None], beta=beta, temperature=2.0,
                                                 reduction="sum")
        assert float(theirs) == pytest.approx(float(ours.sum()), rel=1e-5)


def _peak_bytes(fn) -> int:
    """The most bytes live in PyTorch's CPU allocator at once while fn runs: its every
    allocation and free, in time order (an op's own tally would give a custom autograd
    Function the frees of its inner ops' temporaries at the Function's start)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    memory = (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    for e in sorted(memory, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_blockwise_equals_plain_and_holds_one_block():
    g = torch.Generator().manual_seed(1)
    N, D, V = 512, 16, 2048
    h_s = torch.randn(N, D, generator=g, requires_grad=True)
    w_s = (torch.randn(V, D, generator=g) * 0.3).requires_grad_(True)
    h_t, w_t = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.3
    weights = (torch.rand(N, generator=g) > 0.2).float()
    for divergence, beta, temperature in (("forward_kl", 0.5, 1.0), ("reverse_kl", 0.5, 2.0), ("jsd", 0.5, 1.0),
                                          ("jsd", 0.2, 0.7)):
        options = dict(divergence=divergence, beta=beta, temperature=temperature)
        blocked = linear_divergence(h_s, w_s, h_t, w_t, weights, **options, block_rows=64)
        plain = (token_divergence(h_s @ w_s.T, h_t @ w_t.T, **options) * weights).sum()
        torch.testing.assert_close(blocked, plain, atol=1e-6 * float(plain.detach()), rtol=1e-6)
        gb = torch.autograd.grad(blocked, [h_s, w_s])
        gp = torch.autograd.grad(plain, [h_s, w_s])
        for a, b in zip(gb, gp):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    def run(block_rows):
        linear_divergence(h_s, w_s, h_t, w_t, weights, block_rows=block_rows).backward()

    logits = N * V * 4  # one model's whole f32 logits
    blocked, whole = _peak_bytes(lambda: run(64)), _peak_bytes(lambda: run(N))
    assert blocked < logits < whole / 4, (blocked, logits, whole)  # blocks: less than one whole [N, V]


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0),
                                             ("jsd", 1.0)])
def test_the_closed_form_gradient_of_a_block_passes_gradcheck(divergence, beta):
    """linear_divergence's blocks take their gradient in closed form (_BlockDivergence):
    checked against finite differences in float64, softened (temperature 2), weighted."""
    from linnet.train.distill import _BlockDivergence

    g = torch.Generator().manual_seed(2)
    hs, ws, ht, wt = (torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (6, 11, 6, 11))
    weights = torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: _BlockDivergence.apply(a, b, ht, wt, weights, divergence, beta, 2.0),
                                    (hs.requires_grad_(), ws.requires_grad_()))


def test_a_teacher_distilled_into_itself_has_zero_loss_and_gradient():
    model = nest.load(CARD, weights="random", trainable=True, seed=0)
    teacher = nest.load(CARD, weights="random", seed=0)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        loss = row_divergence(model, teacher, _rows(4)[0], divergence=divergence)
        assert abs(float(loss)) < 1e-5
        loss.backward()
        assert max(float(p.grad.abs().max()) for p in model.parameters()) < 1e-5
        model.zero_grad()


def test_logit_distillation_brings_the_student_to_its_teacher():
    teacher = nest.load(CARD, weights="random", seed=3)
    student = nest.load(CARD, weights="random", trainable=True, seed=0)
    history = distill(student, teacher, iter(_rows(96) * 4), optimizer=torch.optim.AdamW(student.parameters(), lr=3e-3),
                      steps=20, divergence="jsd", beta=0.5, temperature=2.0)
    losses = [s.loss for s in history.steps]
    assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3])
    with pytest.raises(ValueError, match="embedding rows"):
        distill(student, nest.load(CARD.replace(vocab=96), weights="random"), iter(_rows(4)), optimizer=None, steps=1)
    with pytest.raises(ValueError, match="divergence='kl'"):
        distill(student, teacher, iter(_rows(4)), optimizer=None, steps=1, divergence="kl")


def test_sequence_level_and_on_policy_distillation():
    teacher = nest.load(CARD, weights="random", seed=3)
    prompts = [np.random.default_rng(i).integers(3, 64, size=3).tolist() for i in range(16)]
    examples = teacher_completions(Engine(teacher), prompts, max_new_tokens=6, stop=[2])
    assert len(examples) == 16 and all(e.learned[3:].all() and not e.learned[:3].any() for e in examples)
    engine = Engine(teacher)  # five prompts a call: a cache of five rows, the same answers in order
    assert [e.tokens.tolist() for e in teacher_completions(engine, prompts, max_new_tokens=6, stop=[2], batch=5)] \
        == [e.tokens.tolist() for e in examples] and engine._prompt_keys[0].shape[0] == 5
    student = nest.load(CARD, weights="random", trainable=True, seed=0)
    engine = Engine(nest.load(CARD, weights="random", seed=0))
    history = on_policy_distill(student, teacher, engine, prompts, optimizer=torch.optim.AdamW(student.parameters(),
                                lr=3e-3), steps=15, prompts_per_step=8, max_new_tokens=6, stop=[2], tokens=128)
    losses = [s.loss for s in history.steps]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) and all(s.metrics["completion_length"] > 0
                                                                for s in history.steps)


class _Answering:
    """An engine stand-in that completes each prompt with its given answer (stopped), and
    counts the weight loads (one a sampling step)."""

    def __init__(self, answers: dict):
        self.answers, self.loads = answers, 0

    def load_weights(self, policy):
        self.loads += 1

    def sample(self, prompts, n=1, **options):
        from linnet.rl.rollouts import Completion

        return [Completion(i, list(self.answers[tuple(p)]), None, True) for i, p in enumerate(prompts)]


def _gkd(on_policy, engine, answers=None, steps=6):
    """Steps (loss, grad norm, on_policy) and final weights of on_policy_distill."""
    teacher = nest.load(CARD, weights="random", seed=3)
    student = nest.load(CARD, weights="random", trainable=True, seed=0)
    prompts = [[3 + i, 4 + i, 5] for i in range(12)]
    history = on_policy_distill(student, teacher, engine, prompts, optimizer=torch.optim.AdamW(
        student.parameters(), lr=3e-3), steps=steps, prompts_per_step=4, max_new_tokens=6, stop=[2], tokens=64,
        answers=answers, on_policy_share=on_policy, seed=1)
    return [(s.loss, s.grad_norm, s.metrics["on_policy"]) for s in history.steps], gathered(student)


def test_gkd_mixes_the_students_completions_with_the_datas_answers():
    """on_policy_share=0 learns on the data's answers exactly as on the same tokens sampled
    (an engine that answers with them); in between, a step samples (and loads the
    student's weights) as its (seed, step) draw says, some steps each way."""
    g = np.random.default_rng(0)
    answers = [g.integers(3, 64, size=int(g.integers(1, 6))).tolist() + [2] for _ in range(12)]
    by_prompt = {(3 + i, 4 + i, 5): a for i, a in enumerate(answers)}
    sampled = _Answering(by_prompt)
    offline = _Answering({})  # never asked
    steps, weights = _gkd(0.0, offline, answers)
    same_steps, same_weights = _gkd(1.0, sampled)
    assert [s[:2] for s in steps] == [s[:2] for s in same_steps] and offline.loads == 0 and sampled.loads == 6
    assert [s[2] for s in steps] == [0.0] * 6 and [s[2] for s in same_steps] == [1.0] * 6
    for name, w in weights.items():
        torch.testing.assert_close(w, same_weights[name], rtol=0, atol=0)
    mixed = _Answering(by_prompt)
    steps, _ = _gkd(0.5, mixed, answers, steps=10)
    chosen = [s[2] for s in steps]
    assert set(chosen) == {0.0, 1.0} and mixed.loads == sum(chosen)
    with pytest.raises(ValueError, match="one answer a prompt"):
        _gkd(0.5, mixed)


@pytest.fixture(scope="module")
def distill_workspace(tmp_path_factory):
    """Two randomly initialised models of the quickstart card (teacher and student, other
    seeds, one tokenizer) and prompt/completion records."""
    import json

    from linnet.commands import quickstart

    root = tmp_path_factory.mktemp("distill")
    for name, seed in (("student", 0), ("teacher", 5)):
        quickstart_model(root / name, seed=seed)
    rng = np.random.default_rng(0)
    lines = [json.dumps({"prompt": p, "completion": a}) for p, a in quickstart.problems(rng, 120, 2)]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _distill_config(root, out, *extra):
    from linnet.config import DistillConfig, load

    return load(DistillConfig, None, [
        f"model.card={root / 'student'}", f"distill.teacher={root / 'teacher'}", f"data.path={root / 'data.jsonl'}",
        "data.chat=false", "training.context_length=128", "data.eval_share=0.1", "lora.enabled=false",
        "optimizer.lr=3e-3", "lr_schedule.warmup_steps=1", "training.steps=10", "evaluation.every=5",
        "distill.max_new_tokens=4", "distill.prompts_per_step=8", f"runtime.output_dir={out}", *extra])


@pytest.mark.parametrize("mode", ["logit", "sequence", "on_policy"])
def test_linnet_distill_brings_the_student_closer(distill_workspace, tmp_path, mode):
    import json

    from linnet.commands.distill import run

    summary = run(_distill_config(distill_workspace, tmp_path / mode, f"distill.mode={mode}",
                                  "distill.divergence=jsd"))
    rows = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["held_out_divergence"] for r in rows if "held_out_divergence" in r]
    assert len(rows) == 10 and summary["held_out_divergence"] == gaps[-1]
    if mode == "sequence":  # SFT on the teacher's own completions: their NLL falls
        assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    else:  # the teacher's distributions, on the held-out records
        assert gaps[-1] < gaps[0], gaps
    assert (tmp_path / mode / "final" / "model.safetensors").is_file()


def test_linnet_distill_mixes_on_policy_steps_with_the_records_answers(distill_workspace, tmp_path):
    from linnet.commands.distill import run

    run(_distill_config(distill_workspace, tmp_path / "gkd", "distill.mode=on_policy", "distill.on_policy_share=0.5"))
    rows = [json.loads(x) for x in (tmp_path / "gkd" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and {r["on_policy"] for r in rows} == {0.0, 1.0}
    with pytest.raises(ValueError, match="distill.on_policy_share=0.5 .* needs distill.mode=on_policy"):
        _distill_config(distill_workspace, tmp_path / "x", "distill.mode=logit", "distill.on_policy_share=0.5")


@pytest.mark.parametrize("mode", ["logit", "on_policy"])
def test_a_teacher_with_another_tokenizer_is_refused_for_token_level_modes(distill_workspace, tmp_path, mode):
    from linnet.commands.distill import run
    from tests.conftest import word_tokenizer

    other = tmp_path / "other"
    nest.load(CARD, weights="random").save_weights(other)
    word_tokenizer(other / "tokenizer.json")  # another vocabulary
    with pytest.raises(ValueError, match=f"distill.mode={mode} compares .* or set distill.mode=sequence"):
        run(_distill_config(distill_workspace, tmp_path / "run", f"distill.teacher={other}", f"distill.mode={mode}"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _stopping_teacher(teacher, out):
    """The teacher with its stop token's (tied) embedding row scaled up, so that its greedy
    answers stop wherever the last hidden state leans that way."""
    import shutil

    from linnet.commands import quickstart

    model = nest.load(teacher)
    model.model.embed_tokens.weight.data[quickstart.EOS] *= 30
    model.save_weights(out)
    shutil.copy(teacher / "tokenizer.json", out / "tokenizer.json")
    return out


def _reordered_teacher(teacher, out):
    """The teacher with its characters' ids reversed, in its tokenizer and its (tied)
    embedding rows alike: the same function of the text, through other token ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from linnet.commands import quickstart

    chars = [i for t, i in quickstart.VOCAB.items() if len(t) == 1]
    order = list(range(len(quickstart.VOCAB)))
    order[min(chars):max(chars) + 1] = chars[::-1]  # new id -> old id
    model = nest.load(teacher)
    model.model.embed_tokens.weight.data = model.model.embed_tokens.weight.data[order].clone()
    model.save_weights(out)
    vocab = {t: order.index(i) for t, i in quickstart.VOCAB.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<s>", "</s>")])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(out / "tokenizer.json"))
    return out


def test_sequence_distillation_through_text_from_a_teacher_with_another_tokenizer(distill_workspace, tmp_path):
    """The reordered teacher's answers, decoded to text and tokenized again by the student's
    tokenizer, are the original teacher's: the run takes the same steps as sequence
    distillation from the original teacher, which passes token ids. 12 new tokens a
    prompt, so some answers stop and some run out (both ways of ending an answer)."""
    from linnet.commands.distill import run

    teacher = _stopping_teacher(distill_workspace / "teacher", tmp_path / "teacher")
    other = _reordered_teacher(teacher, tmp_path / "reordered")
    common = ("distill.mode=sequence", "distill.max_new_tokens=12")
    for name, source in (("ids", teacher), ("text", other)):  # 80 of the 108 answers run out of new tokens
        with pytest.warns(UserWarning, match="80 of 108 teacher answers reached distill.max_new_tokens=12"):
            run(_distill_config(distill_workspace, tmp_path / name, *common, f"distill.teacher={source}"))
    same_metrics(tmp_path / "text", tmp_path / "ids", ["loss", "grad_norm", "held_out_loss"], steps=10)
    rows = [json.loads(x) for x in (tmp_path / "text" / "metrics.jsonl").read_text().splitlines()]
    assert any("held_out_loss" in r for r in rows) and not any("held_out_divergence" in r for r in rows)


def test_a_teacher_with_its_own_chat_template_answers_through_text(distill_workspace, tmp_path):
    """Same vocabulary, another chat template: sequence distillation prompts the teacher in
    its own template (through text); logit distillation warns that it shows the teacher the
    student's rendering."""
    import shutil

    from linnet.commands.distill import load_teacher
    from linnet.data import load_tokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(distill_workspace / "teacher", teacher)
    template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '</s>' }}{% endfor %}"
    (teacher / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    student = nest.load(distill_workspace / "student")
    tokenizer = load_tokenizer(distill_workspace / "student")

    def load(mode, chat=True):
        config = _distill_config(distill_workspace, tmp_path / "run", f"distill.teacher={teacher}",
                                 f"distill.mode={mode}", f"data.chat={str(chat).lower()}")
        return load_teacher(config, student, tokenizer)[1]

    assert load("sequence").chat_template == template
    with pytest.warns(UserWarning, match="its chat template is not the student's; distill.mode=logit shows"):
        assert load("logit") is None
    with warnings.catch_warnings():  # records read without a chat template: the templates never meet
        warnings.simplefilter("error")
        assert load("sequence", chat=False) is None and load("logit", chat=False) is None
    assert load_teacher(_distill_config(distill_workspace, tmp_path / "run", "distill.mode=sequence", "data.chat=true"),
                        student, tokenizer)[1] is None


class _Teacher:
    """An engine stand-in: records the prompts it is given and answers each with `words`,
    stopped (its stop token last) for even prompts and run out for odd ones."""

    def __init__(self, tokenizer, words: str):
        self.card = CARD.replace(eos_token_ids=tokenizer.eos_ids)
        self.tokenizer, self.words, self.prompts = tokenizer, words, []

    def sample(self, prompts, n=1, **options):
        from linnet.rl.rollouts import Completion

        self.prompts = prompts
        answer = self.tokenizer.encode(self.words)
        return [Completion(i, answer + [self.card.eos_token_ids[0]] * (i % 2 == 0), None, i % 2 == 0)
                for i in range(len(prompts))]


def test_answers_through_text_prompt_the_teacher_in_its_template_and_teach_the_students(tmp_path):
    """A ChatML teacher answers Llama 3 chats: it is prompted in ChatML up to the first
    assistant turn, and the student learns its answer in Llama 3's format, ending with
    <|eot_id|> where the teacher stopped and with no stop where it ran out."""
    from linnet.commands.distill import answers_through_text
    from linnet.config import DistillConfig, load
    from tests.test_data import CHAT, chatml, llama3

    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(2)) + "\n")
    config = load(DistillConfig, None, ["model.card=debug", "distill.teacher=debug", f"data.path={tmp_path}/chats.jsonl",
                                        "data.eval_share=0"])
    student, theirs = llama3(eos=("<|end_of_text|>", "<|eot_id|>")), chatml()  # the turn ends with the second
    teacher = _Teacher(theirs, "Hello.")
    examples = answers_through_text(config, student, teacher, theirs)
    assert [theirs.decode(p) for p in teacher.prompts] == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"] * 2
    prompt = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n")
    for example, end in zip(examples, ["Hello.<|eot_id|>", "Hello."], strict=True):
        first = int(np.argmax(example.learned))
        assert student.decode(example.tokens[:first]) == prompt and example.learned[first:].all()
        assert student.decode(example.tokens[first:]) == end


def _parallel_student(rank, mode, divergence, beta, on_policy):
    """Steps (loss, norm) and final weights of a student split over the two processes, or
    cut into two pipeline stages."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(mode,))
    parallel = dict(tensor_parallel=mesh) if mode == "split" else dict(pipeline=mesh, pipeline_schedule="1f1b")
    return _distilled(nest.load(CARD, weights="random", trainable=True, seed=0, **parallel),
                      divergence, beta, on_policy, engine_seed=rank)


def _distilled(student, divergence, beta, on_policy, engine_seed=0):
    teacher = nest.load(CARD, weights="random", seed=3)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=3e-3)
    options = dict(optimizer=optimizer, steps=3, divergence=divergence, beta=beta, temperature=2.0)
    if on_policy:  # each process's engine samples from other weights: the split must learn from one's
        engine = Engine(nest.load(CARD, weights="random", seed=0))
        original = engine.load_weights
        engine.load_weights = lambda model: (original(model), _nudge(engine.model, engine_seed))
        prompts = [np.random.default_rng(i).integers(3, 64, size=3).tolist() for i in range(8)]
        history = on_policy_distill(student, teacher, engine, prompts, prompts_per_step=4, max_new_tokens=6,
                                    stop=[2], tokens=128, **options)
    else:
        history = distill(student, teacher, iter(_rows(96)), accumulate=2, **options)
    weights = gathered(student)
    return [(s.loss, s.grad_norm) for s in history.steps], weights


def _nudge(model, seed):
    if seed:  # the second process's engine draws other samples
        with torch.no_grad():
            model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("mode, divergence, beta, on_policy", [
    ("split", "forward_kl", 0.5, False), ("split", "reverse_kl", 0.5, True), ("split", "jsd", 0.3, False),
    ("pipeline", "jsd", 0.3, False), ("pipeline", "reverse_kl", 0.5, True)])
def test_a_split_or_pipelined_student_distils_like_one_process(mode, divergence, beta, on_policy):
    """A student split over two processes (tensor parallel, its head by vocabulary) takes one
    process's distillation steps: each divergence's sums over the vocabulary combine across
    the split, and the hidden states' gradient adds both halves of the head's. On-policy, the
    split learns from its first process's samples (the second's engine here draws others).
    Cut into two pipeline stages, the last computes the divergences with the teacher there,
    and on-policy every stage's engine takes the whole student from the stages."""
    from tests.conftest import in_processes

    (steps, weights), (steps1, weights1) = in_processes(_parallel_student, mode, divergence, beta, on_policy)
    assert steps == steps1
    if mode == "pipeline":  # each stage holds its own blocks
        assert not weights.keys() & weights1.keys()
        weights = {**weights, **weights1}
    whole = nest.load(CARD, weights="random", trainable=True, seed=0)
    whole.untie_head()  # a split or a cut unties a tied head
    ref_steps, ref_weights = _distilled(whole, divergence, beta, on_policy)
    for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4)
    for name, value in ref_weights.items():
        np.testing.assert_allclose(weights[name], value, atol=2e-4, rtol=0, err_msg=name)


def _distill_process(rank, root, out, *extra):
    from linnet.commands.distill import run

    run(_distill_config(root, out, *extra))  # the first process writes the summary
    return rank


@pytest.mark.parametrize("mode, parallel", [("logit", "split"), ("on_policy", "split"), ("logit", "pipeline"),
                                            ("sequence", "pipeline"), ("on_policy", "pipeline"),
                                            ("on_policy", "pipeline-fsdp"), ("logit", "context"),
                                            ("on_policy", "context"), ("logit", "pipeline-context")])
def test_linnet_distill_with_a_split_or_pipelined_student_takes_one_process_steps(distill_workspace, tmp_path, mode,
                                                                                 parallel):
    """`linnet distill` with training.split=2 (two processes split the student, LoRA),
    training.pipeline=2 (two stages, the last computing the divergences) or
    training.context=2 (each computing half of every row's positions): both take the
    same rows (on-policy and sequence-level, the first process's completions), with the
    losses, held-out divergences and adapters of one process. With training.shard=fsdp too,
    four processes (two copies of the stages, sharded over them, each copy's first stage
    sampling its share) take the steps of two processes sharding the whole student; with
    training.context=2 too, four processes (two stages, each splitting every row's positions
    over a pair) take one process's."""
    from safetensors.torch import load_file

    from tests.conftest import in_processes

    extra = (f"distill.mode={mode}", "lora.enabled=true", "lora.rank=4", "training.steps=4", "evaluation.every=2")
    if parallel == "pipeline-fsdp":
        assert in_processes(_distill_process, distill_workspace, tmp_path / "two", *extra, "training.pipeline=2",
                            "training.shard=fsdp", processes=4) == [0, 1, 2, 3]
        in_processes(_distill_process, distill_workspace, tmp_path / "one", *extra, "training.shard=fsdp")
    elif parallel == "pipeline-context":  # two stages, each row's positions split over each stage's pair
        assert in_processes(_distill_process, distill_workspace, tmp_path / "two", *extra, "training.pipeline=2",
                            "training.context=2", processes=4) == [0, 1, 2, 3]
        _distill_process(0, distill_workspace, tmp_path / "one", *extra)
    else:
        assert in_processes(_distill_process, distill_workspace, tmp_path / "two", *extra,
                            f"training.{parallel}=2") == [0, 1]
        _distill_process(0, distill_workspace, tmp_path / "one", *extra)
    two, one = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("two", "one"))
    for key in ("loss", "held_out_divergence"):
        assert [m[key] for m in two if key in m] == pytest.approx([m[key] for m in one if key in m], rel=1e-4), key
    x, y = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("two", "one"))
    for key in y:
        torch.testing.assert_close(x[key], y[key], atol=1e-4, rtol=0, msg=key)


def _sharded_student(rank):
    from linnet.torch import fully_shard

    student = fully_shard(nest.load(CARD, weights="random", trainable=True, seed=0))
    history = distill(student, nest.load(CARD, weights="random", seed=3), iter(_rows(96)[rank::2]), steps=2,
                      accumulate=2, optimizer=torch.optim.AdamW(student.parameters(), lr=3e-3))
    return [(s.loss, s.grad_norm) for s in history.steps]


def test_a_fully_sharded_student_distils_like_one_process_over_both_halves():
    """Under fully_shard each process distils its own rows (the head's parts are FSDP's, not a
    vocabulary split): the steps of one process over every row."""
    from tests.conftest import in_processes

    first, second = in_processes(_sharded_student)
    assert first == second
    student = nest.load(CARD, weights="random", trainable=True, seed=0)
    history = distill(student, nest.load(CARD, weights="random", seed=3), iter(_rows(96)), steps=2, accumulate=4,
                      optimizer=torch.optim.AdamW(student.parameters(), lr=3e-3))
    for (loss, norm), step in zip(first, history.steps, strict=True):
        assert loss == pytest.approx(step.loss, rel=1e-5) and norm == pytest.approx(step.grad_norm, rel=1e-4)


def test_linnet_distill_on_policy_with_a_fully_sharded_qlora_student(distill_workspace, tmp_path):
    """On-policy distillation of an NF4 student split by training.shard=fsdp: the engine
    cannot share a split base and takes the gathered, dequantized and merged weights (it
    was loaded NF4 and refused them before)."""
    pytest.importorskip("bitsandbytes", reason="model.quantize=nf4 needs bitsandbytes (the qlora extra)")
    from tests.conftest import in_processes

    extra = ("distill.mode=on_policy", "lora.enabled=true", "lora.rank=4", "model.quantize=nf4", "model.dtype=float32",
             "training.shard=fsdp", "training.steps=2", "evaluation.every=2")
    assert in_processes(_distill_process, distill_workspace, tmp_path / "run", *extra) == [0, 1]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(np.isfinite(m["loss"]) for m in metrics)
