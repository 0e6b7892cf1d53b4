"""Continuous batching: requests that join a running batch sample what they sample alone."""

from __future__ import annotations

import pytest
import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.serve import Engine
from linnet.torch.adapter_bank import AdapterEngine
from linnet.torch.continuous import Continuous
from tests.test_adapter_bank import adapters, merged_engine  # noqa: F401 - the fixture

torch.set_num_threads(1)

PROMPTS = {"long": "12+34=56+78=", "short": "5+5=", "mid": "90+11=", "late": "33+33=1+1="}
JOINS = {"long": 0, "short": 0, "mid": 4, "late": 7}  # the step each joins at ("mid": as "short" ends)
NEW = {"long": 12, "short": 5, "mid": 9, "late": 6}


def _prompt(text):
    return [quickstart.BOS, *quickstart.encode(text)]


def _drive(session, routes=None, cancel=None):
    """Join each request at its step; every request's (tokens, logprobs) and the batch sizes."""
    got = {k: ([], []) for k in PROMPTS}
    sizes, step = [], 0
    while step == 0 or session.active:
        for key, at in JOINS.items():
            if at == step:
                assert session.add(key, _prompt(PROMPTS[key]), NEW[key],
                                   adapter=None if routes is None else routes[key])
        if cancel is not None and step == cancel[1]:
            session.cancel(cancel[0])
        out = session.step()
        sizes.append(len(out))
        for key, (token, logprob) in out.items():
            got[key][0].append(token)
            got[key][1].append(logprob)
        step += 1
    return got, sizes


def test_requests_joining_a_running_batch_sample_what_they_sample_alone():
    model = nest.load(quickstart.CARD, weights="random", seed=0)
    engine = Engine(model)
    got, sizes = _drive(Continuous(engine, temperature=0.0, stop=(), new_slots=32))
    assert sizes == [2, 2, 2, 2, 3, 2, 2, 3, 3, 3, 3, 3, 2]  # mid and late ran beside long, short left at 5
    for key, text in PROMPTS.items():
        alone = Engine(nest.load(quickstart.CARD, weights="random", seed=0)).sample(
            [_prompt(text)], max_new_tokens=NEW[key], temperature=0.0, stop=())[0]
        assert got[key][0] == alone.tokens, key
        torch.testing.assert_close(torch.tensor(got[key][1]), alone.logprobs, atol=1e-5, rtol=0)


def test_joining_requests_keep_their_adapters(adapters):  # noqa: F811 - the fixture
    root, names = adapters
    routes = {"long": "a", "short": "b", "mid": None, "late": "c"}
    engine = AdapterEngine(nest.load(root / "base", weights=root / "base"), {n: root / n for n in names})
    got, _ = _drive(Continuous(engine, temperature=0.0, stop=(), new_slots=32), routes=routes)
    for key, text in PROMPTS.items():
        alone = merged_engine(root, routes[key]).sample([_prompt(text)], max_new_tokens=NEW[key], temperature=0.0,
                                                        stop=())[0]
        assert got[key][0] == alone.tokens, key
        torch.testing.assert_close(torch.tensor(got[key][1]), alone.logprobs, atol=1e-5, rtol=0)


def test_a_cancelled_request_leaves_and_the_others_go_on():
    engine = Engine(nest.load(quickstart.CARD, weights="random", seed=0))
    got, _ = _drive(Continuous(engine, temperature=0.0, stop=(), new_slots=32), cancel=("long", 4))
    assert len(got["long"][0]) == 4  # steps 0-3
    alone = Engine(nest.load(quickstart.CARD, weights="random", seed=0)).sample(
        [_prompt(PROMPTS["late"])], max_new_tokens=NEW["late"], temperature=0.0, stop=())[0]
    assert got["late"][0] == alone.tokens


def test_a_request_that_does_not_fit_waits_for_the_batch_to_drain():
    engine = Engine(nest.load(quickstart.CARD, weights="random", seed=0))
    session = Continuous(engine, temperature=0.0, stop=(), rows=2)
    assert session.add("a", _prompt("1+1="), 4) and session.add("b", _prompt("2+2="), 4)
    assert not session.add("c", _prompt("3+3="), 4)  # no row free
    session.step()
    assert not session.add("d", _prompt("12+34=56+78=90+"), 2)  # longer than the prompt slots
    while session.active:
        session.step()
    assert session.add("d", _prompt("12+34=56+78=90+"), 2)  # an empty batch is sized anew


def test_a_compiled_engine_is_refused():
    engine = Engine(nest.load(quickstart.CARD, weights="random", seed=0))
    engine.compiled = True
    with pytest.raises(ValueError, match="eagerly"):
        Continuous(engine)


def test_a_batch_that_never_drains_lets_go_of_old_slots():
    """Generated slots for 7 fed-back tokens: "d" fits only once the slots before "c"'s
    first are let go (the running rows shifted left), and still samples what it samples alone."""
    engine = Engine(nest.load(quickstart.CARD, weights="random", seed=0))
    session = Continuous(engine, temperature=0.0, stop=(), new_slots=8)
    plan = {0: ("a", "12+34=", 4), 2: ("c", "5+5=", 6), 5: ("d", "90+11=", 5)}
    got = {}
    for step in range(12):
        if step in plan:
            key, text, new = plan[step]
            assert session.add(key, _prompt(text), new)
        for key, (token, _) in session.step().items():
            got.setdefault(key, []).append(token)
    assert session.slot < 8 and not session.active
    for key, text, new in plan.values():
        alone = Engine(nest.load(quickstart.CARD, weights="random", seed=0)).sample(
            [_prompt(text)], max_new_tokens=new, temperature=0.0, stop=())[0]
        assert got[key] == alone.tokens, key


def test_random_arrivals_each_sample_what_they_sample_alone(adapters):  # noqa: F811 - the fixture
    """Requests of random prompts, lengths and adapters arrive at random steps and wait when
    the four rows are taken; a stop token ends some early. Each samples what it samples alone."""
    import random

    root, names = adapters
    engine = AdapterEngine(nest.load(root / "base", weights=root / "base"), {n: root / n for n in names})
    stop = quickstart.encode("7")  # a common token as the stop token: some requests end early
    session = Continuous(engine, temperature=0.0, rows=4, new_slots=12, stop=stop)
    rng, waiting, plan, got = random.Random(0), [], {}, {}
    for step in range(80):
        if rng.random() < 0.5:
            text = "".join(rng.choice("0123456789+=") for _ in range(rng.randint(2, 12)))
            waiting.append((f"r{step}", text, rng.randint(1, 8), rng.choice([*names, None])))
        waiting = [w for w in waiting if not (session.add(w[0], _prompt(w[1]), w[2], adapter=w[3])
                                              and plan.setdefault(w[0], w))]
        for key, (token, _) in session.step().items():
            got.setdefault(key, []).append(token)
    while session.active:
        for key, (token, _) in session.step().items():
            got.setdefault(key, []).append(token)
    assert len(plan) > 20 and any(len(got[k]) < new for k, _, new, _ in plan.values())  # some stopped early
    for key, text, new, route in plan.values():
        alone = merged_engine(root, route).sample([_prompt(text)], max_new_tokens=new, temperature=0.0, stop=stop)[0]
        assert got[key] == alone.tokens, key


def test_requests_with_settings_of_their_own_sample_what_they_sample_alone():
    """Greedy and seeded sampled requests (temperatures, top-p) share one running batch,
    joining at different steps: each samples exactly what it samples alone with its settings
    (its own seed's stream, one uniform a step)."""
    engine = Engine(nest.load(quickstart.CARD, weights="random", seed=0))
    session = Continuous(engine, stop=(), new_slots=32)
    settings = {"greedy": dict(), "hot": dict(temperature=1.0, seed=5), "nucleus": dict(temperature=0.7, top_p=0.9,
                                                                                        seed=9)}
    joins = {"greedy": 0, "hot": 2, "nucleus": 4}
    got: dict = {}
    for step in range(20):
        for key, at in joins.items():
            if at == step:
                assert session.add(key, _prompt(PROMPTS["long"]), 10, **settings[key])
        for key, (token, logprob) in session.step().items():
            got.setdefault(key, ([], []))
            got[key][0].append(token)
            got[key][1].append(logprob)
    alone = Engine(nest.load(quickstart.CARD, weights="random", seed=0))
    for key, options in settings.items():
        expected = alone.sample([_prompt(PROMPTS["long"])], max_new_tokens=10, stop=(),
                                **{"temperature": 0.0, **options})[0]
        assert got[key][0] == expected.tokens, key
        torch.testing.assert_close(torch.tensor(got[key][1]), expected.logprobs, atol=1e-5, rtol=0)
    assert got["hot"][0] != got["greedy"][0]  # the sampled ones did sample
