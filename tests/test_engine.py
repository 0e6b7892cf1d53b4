"""The sampling engine against transformers' greedy `generate` and the model's own
log-probabilities, on tiny random models."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from linnet import nest
from linnet.packing import Example, pack
from linnet.serve import Engine
from linnet.torch import losses
from tests.conftest import make_hf_model

torch.set_num_threads(1)

LENGTHS = (5, 11, 1, 8)  # prompts of different lengths in one batch


def _prompts(lengths=LENGTHS, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> directory of a saved tiny random model (built once per module)."""
    cache = {}

    def get(family):
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            make_hf_model(family).save_pretrained(directory)
            cache[family] = directory
        return cache[family]

    return get


def _model_log_probs(model, prompt, tokens):
    """The model's log-probability of each completion token, through log_probs_packed."""
    ex = Example.prompted(prompt, tokens)
    (row,) = pack([ex], tokens=len(ex))
    with torch.no_grad():
        lp = model.log_probs_packed(row)
    return lp[len(prompt) - 1 : len(ex) - 1]


def test_greedy_matches_transformers_generate(hf_dir):
    family, hf, directory = hf_dir
    engine = Engine(nest.load(directory))
    prompts = _prompts()
    stop = 2  # both sides stop on it (some families name no eos)
    done = engine.sample(prompts, max_new_tokens=12, temperature=0.0, stop=[stop])
    assert [c.prompt for c in done] == list(range(len(prompts)))
    for p, c in zip(prompts, done):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=stop, pad_token_id=0)[0, len(p):].tolist()
        assert c.tokens == ref, (family, len(p))
        assert c.stopped == (ref[-1] == stop)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logprobs_equal_log_probs_packed(saved, family):
    directory = saved(family)
    reference = nest.load(directory)
    engine = Engine(nest.load(directory))
    prompts = _prompts()
    done = engine.sample(prompts, n=3, max_new_tokens=9, temperature=1.0, stop=[5, 6], seed=0)
    assert len(done) == len(prompts) * 3
    assert len({tuple(c.tokens) for c in done}) > len(prompts)  # the group's members differ
    for c in done:
        assert c.logprobs.dtype == torch.float32 and len(c.logprobs) == len(c.tokens)
        ours = _model_log_probs(reference, prompts[c.prompt], c.tokens)
        assert torch.allclose(c.logprobs, ours, atol=1e-4), family
        assert c.stopped == (c.tokens[-1] in (5, 6)) and all(t not in (5, 6) for t in c.tokens[:-1])


def test_logprobs_are_the_models_under_top_k_and_temperature(saved):
    directory = saved("qwen2")
    reference = nest.load(directory)
    engine = Engine(nest.load(directory))
    prompts = _prompts((4, 7))
    done = engine.sample(prompts, n=4, max_new_tokens=8, temperature=0.5, top_k=3, stop=(), seed=1)
    for c in done:
        seq = torch.tensor(prompts[c.prompt] + c.tokens)
        with torch.no_grad():
            logits = reference(seq)[len(prompts[c.prompt]) - 1 : -1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(t in top3[i].tolist() for i, t in enumerate(c.tokens))
        # the unmodified distribution's log-probabilities, not the tempered, truncated one
        assert torch.allclose(c.logprobs, torch.log_softmax(logits, -1).gather(-1, seq[len(seq) - len(c.tokens):, None])[:, 0], atol=1e-4)


def test_top_p_keeps_only_the_nucleus(saved):
    engine = Engine(nest.load(saved("llama")))
    done = engine.sample([[7, 8, 9]], n=64, max_new_tokens=1, top_p=1e-6, stop=(), seed=0)
    greedy = engine.sample([[7, 8, 9]], max_new_tokens=1, temperature=0.0, stop=())
    assert {c.tokens[0] for c in done} == {greedy[0].tokens[0]}  # a tiny nucleus is the argmax
    wide = engine.sample([[7, 8, 9]], n=64, max_new_tokens=1, top_p=1.0, stop=(), seed=0)
    assert len({c.tokens[0] for c in wide}) > 5


def test_sampling_follows_the_tempered_distribution():
    """The inverse-CDF draw: frequencies match softmax(z / T), at T = 1 too (drawn from the
    unnormalised exp(z - max)), and filtered tokens never appear."""
    from linnet.torch.engine import _pick, _Sampling

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    rows = torch.arange(len(logits))
    tok, logp = _pick(logits, _Sampling(0.5, 0, 1.0, g, torch.tensor([])), rows, len(rows))
    freq = torch.bincount(tok, minlength=5).double() / len(tok)
    torch.testing.assert_close(freq, torch.softmax(logits[0].double() / 0.5, -1), atol=0.01, rtol=0)
    assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])
    tok, _ = _pick(logits, _Sampling(1.0, 2, 1.0, g, torch.tensor([])), rows, len(rows))
    assert set(tok.tolist()) == {0, 1}
    tok, _ = _pick(logits, _Sampling(1.0, 0, 1.0, g, torch.tensor([])), rows, len(rows))  # unnormalised weights
    freq = torch.bincount(tok, minlength=5).double() / len(tok)
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.01, rtol=0)


def test_every_draw_reports_the_log_softmax_of_its_token():
    """Greedy, tempered, top-k, top-p and the model's own distribution (where one exp pass
    serves the draw and the log-probability) all report log_softmax's value of the token
    drawn; greedy takes the first of tied maxima."""
    from linnet.torch.engine import _pick, _Sampling

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 4
    logits[0, [7, 200]] = 50.0  # a tie: the first wins
    logits[1, -1] = 60.0
    rows = torch.arange(len(logits))
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9)):
        g = torch.Generator().manual_seed(1)
        tok, logp = _pick(logits, _Sampling(temperature, top_k, top_p, g, torch.tensor([])), rows, len(rows))
        want = torch.log_softmax(logits.double(), -1).gather(-1, tok[:, None])[:, 0]
        torch.testing.assert_close(logp.double(), want, atol=1e-5, rtol=0)
        if temperature == 0:
            assert tok.tolist() == logits.argmax(-1).tolist() and tok[:2].tolist() == [7, 299]


def test_inverse_cdf_lands_in_proportion_across_blocks():
    """The two-level draw (block sums, then the block's own sums): evenly spread uniforms
    land on each token in proportion to its probability, across blocks and in a padded
    last block, never on a zero, at the extremes of u included."""
    from linnet.torch.engine import _inverse_cdf

    probs = torch.zeros(300)  # blocks of 128: two whole, a padded third; the middle one mostly zeros
    probs[[0, 5, 127, 128, 250, 299]] = torch.tensor([0.1, 0.2, 0.05, 0.3, 0.15, 0.2])
    n = 20000
    u = torch.cat([(torch.arange(n, dtype=torch.float64) + 0.5) / n, torch.tensor([0.0, 1 - 2**-53])])[:, None]
    tok, total = _inverse_cdf(probs.expand(len(u), -1), u)
    assert set(tok.tolist()) == {0, 5, 127, 128, 250, 299}
    assert tok[-2] == 0 and tok[-1] == 299
    torch.testing.assert_close(total[:, 0], torch.full((len(u),), 1.0, dtype=torch.float64))
    freq = torch.bincount(tok[:n], minlength=300).double() / n
    torch.testing.assert_close(freq, probs.double(), atol=2 / n, rtol=0)


def test_group_prefix_is_computed_once(saved, monkeypatch):
    from linnet.torch import passes

    model = nest.load(saved("llama"))
    engine = Engine(model)
    calls, first, project = [], model.model.layers[0].self_attn, passes._project
    monkeypatch.setattr(passes, "_project", lambda attn, h, *rest: (calls.append(len(h)) if attn is first else None)
                        or project(attn, h, *rest))
    prompts = _prompts((4, 9))
    done = engine.sample(prompts, n=5, max_new_tokens=3, stop=(), seed=0)
    assert calls == [4 + 9, 10, 10]  # one prefill of both prompts; then 10 rows a step
    assert engine.stats.prefill_positions == 13 and engine.stats.decode_positions == 20
    assert engine._prompt_keys[0].shape[0] == 2  # each prompt's keys kept once, not once a completion
    greedy = engine.sample(prompts, n=3, max_new_tokens=6, temperature=0.0, stop=())
    alone = engine.sample(prompts, n=1, max_new_tokens=6, temperature=0.0, stop=())
    assert [c.tokens for c in greedy] == [a.tokens for a in alone for _ in range(3)]
    assert [c.prompt for c in done] == [0] * 5 + [1] * 5


def test_rows_stop_early_and_the_loop_ends(saved):
    directory = saved("qwen3")
    engine = Engine(nest.load(directory))
    prompts = _prompts()
    full = engine.sample(prompts, max_new_tokens=10, temperature=0.0, stop=())
    stop = full[1].tokens[3]
    done = engine.sample(prompts, max_new_tokens=10, temperature=0.0, stop=[stop])
    for f, c in zip(full, done):
        cut = f.tokens.index(stop) + 1 if stop in f.tokens else len(f.tokens)
        assert c.tokens == f.tokens[:cut]
        assert c.stopped == (stop in f.tokens)
        assert torch.allclose(c.logprobs, f.logprobs[:cut], atol=1e-5)
    assert done[1].stopped and len(done[1].tokens) <= 4
    engine.reset_stats()
    every = engine.sample(prompts, n=2, max_new_tokens=10, stop=range(97), seed=0)
    assert all(len(c.tokens) == 1 and c.stopped for c in every)
    assert engine.stats.decode_steps == 0  # all rows stopped on their first token


@pytest.mark.parametrize("reordered_layers", [True, False])
def test_load_weights_merges_adapters_in_place(saved, monkeypatch, reordered_layers):
    """reordered_layers: the projections reordered for oneDNN (an AVX-512 CPU) or laid out
    transposed (AVX2); Qwen2's q/k/v biases go with the fused q/k/v product."""
    from linnet import hardware

    monkeypatch.setattr(losses, "REORDER_MIN_ELEMENTS", 0)  # reorder even this tiny head for oneDNN
    monkeypatch.setattr(hardware, "cpu_reorders_projections", lambda: reordered_layers)
    directory = saved("qwen2")
    policy = nest.load(directory)
    policy.add_lora(["*q_proj*", "*v_proj*", "*down_proj*"], rank=4, alpha=8)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        policy.model.norm.weight.mul_(1.3)
        policy.model.embed_tokens.weight.add_(torch.randn(policy.model.embed_tokens.weight.shape) * 0.05)  # tied head
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine = Engine(nest.load(directory))
    pointers = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    projections = [n for n, p in engine.model.named_parameters() if n.endswith("proj.weight")]
    engine.load_weights(policy)
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == pointers
    # float32 projections stay reordered, or stored transposed (x @ W.T reads a contiguous [in, out])
    stored = [engine.model.get_parameter(n) for n in projections]
    assert stored and all((w if reordered_layers else w.t()).is_contiguous() for w in stored)
    # and the weights reordered for oneDNN are reordered again from the new ones (the log-probs below)
    if torch.backends.mkldnn.is_available():
        assert engine._reordered.head is not None and (engine._reordered.layers is not None) == reordered_layers
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())  # policy untouched
    assert policy.lora is not None
    prompts = _prompts((6, 3))
    done = engine.sample(prompts, n=2, max_new_tokens=6, stop=(), seed=0)
    for c in done:
        assert torch.allclose(c.logprobs, _model_log_probs(policy, prompts[c.prompt], c.tokens), atol=1e-4)
    other = nest.load(saved("llama"))
    with pytest.raises(ValueError, match="load_weights"):
        engine.load_weights(other)


def test_bf16_engine_follows_the_bf16_model(saved):
    directory = saved("llama")
    model = nest.load(directory, dtype="bfloat16")
    engine = Engine(nest.load(directory, dtype="bfloat16"))
    prompts = _prompts((5, 2))
    done = engine.sample(prompts, max_new_tokens=6, stop=(), seed=0)
    for c in done:
        assert torch.allclose(c.logprobs, _model_log_probs(model, prompts[c.prompt], c.tokens), atol=0.05)


def test_seed_stream_and_warmup(saved):
    engine = Engine(nest.load(saved("llama")))
    prompts = _prompts((3, 6))
    a = engine.sample(prompts, n=2, max_new_tokens=8, stop=(), seed=3)
    b = engine.sample(prompts, n=2, max_new_tokens=8, stop=(), seed=3)
    c = engine.sample(prompts, n=2, max_new_tokens=8, stop=(), seed=4)
    assert [x.tokens for x in a] == [x.tokens for x in b] != [x.tokens for x in c]
    streamed = list(engine.stream(prompts[1], max_new_tokens=8, stop=(), seed=3))
    assert streamed == engine.sample([prompts[1]], max_new_tokens=8, stop=(), seed=3)[0].tokens

    fresh = Engine(nest.load(saved("llama")))
    fresh.warmup([3, 6], n=2, max_new_tokens=8)
    assert fresh.stats.prefill_positions == 0
    cache = fresh._keys[0].data_ptr()
    assert [x.tokens for x in fresh.sample(prompts, n=2, max_new_tokens=8, stop=(), seed=3)] == [x.tokens for x in a]
    assert fresh._keys[0].data_ptr() == cache  # no reallocation within the warmed size
    preallocated = Engine(nest.load(saved("llama")), max_batch=4, tokens=16)
    cache = preallocated._keys[0].data_ptr()
    assert [x.tokens for x in preallocated.sample(prompts, n=2, max_new_tokens=8, stop=(), seed=3)] == [
        x.tokens for x in a]
    assert preallocated._keys[0].data_ptr() == cache


def test_bad_input_is_named(saved):
    engine = Engine(nest.load(saved("llama")))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.sample([[1, 2], [], [3]])
    with pytest.raises(TypeError, match="prompt 0 is not a 1-D sequence"):
        engine.sample([1, 2, 3])
    with pytest.raises(ValueError, match="prompt 0 has token id 97"):
        engine.sample([[1, 97]])
    with pytest.raises(ValueError, match="top_p"):
        engine.sample([[1]], top_p=0)
    with pytest.raises(ValueError, match="n=0"):
        engine.sample([[1]], n=0)


def _tokenizer_files(directory, chat_template=None):
    """A word-level tokenizer over the tiny model's 97 ids: token i is "w{i}"."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(97)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="w1 $A", special_tokens=[("w1", 1)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "w2", "bos_token": "w1"}
    if chat_template:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("chat", [False, True])
def test_generate_cli_streams_the_greedy_completion(tmp_path, capsys, chat):
    from linnet.commands.generate import main as cli
    from linnet.data.tokenizer import load_tokenizer

    directory = tmp_path / "model"
    make_hf_model("llama").save_pretrained(directory)
    _tokenizer_files(directory, "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                                "{% if add_generation_prompt %}w5{% endif %}")
    argv = [str(directory), "--prompt", "w10 w11 w12", "--max-new-tokens", "7"] + (["--chat"] if chat else [])
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    tok = load_tokenizer(directory)
    ids = [1, *tok.encode("w3 w10 w11 w12 w4 w5")] if chat else [1, 10, 11, 12]  # BOS first, as training has it
    done = Engine(nest.load(directory)).sample([ids], max_new_tokens=7, temperature=0.0, stop=tok.eos_ids)[0]
    shown = done.tokens[:-1] if done.stopped else done.tokens
    assert printed == tok.decode(shown) + "\n"
    assert len(shown) > 0 and math.isfinite(done.logprobs.sum().item())


def _same_completions(a, b, atol=1e-5):
    assert [(c.prompt, c.tokens, c.stopped) for c in a] == [(c.prompt, c.tokens, c.stopped) for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(x.logprobs, y.logprobs, atol=atol, rtol=0)


def test_stop_checks_every_k_steps_cut_rows_at_their_stop_token(saved):
    """On CUDA stops are read back every 8 steps: rows that stop in between run on, and
    their extra tokens must not reach the completions."""
    engine = Engine(nest.load(saved("qwen3")))
    prompts = _prompts()
    full = engine.sample(prompts, n=3, max_new_tokens=20, stop=(), seed=5)
    stop = full[4].tokens[2]
    every_step = engine.sample(prompts, n=3, max_new_tokens=20, stop=[stop], seed=5)
    assert any(c.stopped for c in every_step) and not all(c.stopped for c in every_step)
    engine.stop_every = 8
    _same_completions(engine.sample(prompts, n=3, max_new_tokens=20, stop=[stop], seed=5), every_step, atol=0)


@pytest.mark.slow  # inductor on a CPU; the warmup test compiles every pass, tests/test_cuda.py the CUDA graphs
def test_compiled_engine_equals_eager(saved):
    """torch.compile'd prefill and decode passes: the same greedy tokens and sampled
    tokens as the eager engine, log-probabilities within 1e-5; rows that stop shrink the
    batch to a power of two (finished rows fill up)."""
    directory = saved("llama")
    eager = Engine(nest.load(directory))
    compiled = Engine(nest.load(directory), compile=True)
    assert compiled.compiled and not eager.compiled
    prompts = _prompts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to eager warns: fail on it
        compiled.warmup([len(p) for p in prompts], max_new_tokens=3)
        full = eager.sample(prompts, n=2, max_new_tokens=12, temperature=0.0, stop=())
        _same_completions(compiled.sample(prompts, n=2, max_new_tokens=12, temperature=0.0, stop=()), full)
        stop = full[2].tokens[4]
        _same_completions(compiled.sample(prompts, n=2, max_new_tokens=12, temperature=0.0, stop=[stop]),
                          eager.sample(prompts, n=2, max_new_tokens=12, temperature=0.0, stop=[stop]))
        _same_completions(compiled.sample(prompts, n=3, max_new_tokens=10, stop=[stop], seed=1),
                          eager.sample(prompts, n=3, max_new_tokens=10, stop=[stop], seed=1))
    assert compiled.compiled


def test_warmup_compiles_every_pass_sampling_then_uses(saved):
    """After warmup, calls that stop rows at different steps (the batch shrinking to one
    prompt's rows, one row a prompt, one row), with other prompt lengths, counts and
    completion lengths, compile no further graph. torch.compile's "eager" backend: the
    graphs dynamo captures are the same, without inductor's code generation."""
    from torch._dynamo.utils import counters

    engine = Engine(nest.load(saved("llama"), compile="eager"))
    assert engine.compiled
    lengths = [int(x) for x in torch.randint(5, 22, (32,), generator=torch.Generator().manual_seed(0))]
    engine.warmup(lengths, n=1, max_new_tokens=21)
    warmed = counters["stats"]["unique_graphs"]
    stop = list(range(3, 97, 7))  # about one token in seven stops a row
    for call, (count, n) in enumerate([(32, 1), (7, 1), (3, 1), (4, 8), (2, 8), (1, 8), (1, 1)]):
        out = engine.sample(_prompts([5 + (3 * i + call) % 17 for i in range(count)], seed=call), n=n,
                            max_new_tokens=21, stop=stop, seed=call)
        assert any(c.stopped for c in out) and len(out) == count * n
    assert counters["stats"]["unique_graphs"] == warmed


def test_compile_failure_falls_back_to_eager(saved):
    directory = saved("llama")
    engine = Engine(nest.load(directory), compile=True)

    def broken(*args):
        raise RuntimeError("no C++ compiler\nmore lines")

    engine._decode_pass = engine._prefill_pass = broken
    prompts = _prompts()
    with pytest.warns(UserWarning, match="compiling its passes failed .RuntimeError: no C.. compiler.; sampling eagerly"):
        done = engine.sample(prompts, max_new_tokens=6, temperature=0.0, stop=())
    assert not engine.compiled
    _same_completions(done, Engine(nest.load(directory)).sample(prompts, max_new_tokens=6, temperature=0.0, stop=()))
