"""`linnet serve`: a real server on localhost driven by the `openai` client: completions,
chat, streaming, an adapter chosen per request, concurrent requests sampled as one batch,
every bad request answered with a 4xx (or 503) and a message while the server goes on."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.commands import quickstart
from tests.conftest import quickstart_model

pytest.importorskip("fastapi", reason="linnet serve needs FastAPI and uvicorn (pip install 'linnet[serve]')")
pytest.importorskip("uvicorn", reason="linnet serve needs FastAPI and uvicorn (pip install 'linnet[serve]')")
openai = pytest.importorskip("openai", reason="the server tests drive it with the openai client package")

torch.set_num_threads(1)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the quickstart's characters only


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server for a quickstart model ("base") and a LoRA run over it ("tenant")."""
    from linnet.commands.serve import load_served
    from linnet.commands.sft import run
    from linnet.config import SFTConfig, load
    from linnet.data import load_tokenizer
    from linnet.serve.server import make_app

    root = tmp_path_factory.mktemp("serve")
    quickstart_model(root / "base")
    problems = quickstart.problems(np.random.default_rng(0), 200, 2, distinct=True)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in problems))
    run(load(SFTConfig, None, [f"model.card={root / 'base'}", f"data.path={root / 'train.jsonl'}", "data.chat=false",
                               "training.context_length=64", "training.steps=20", "optimizer.lr=1e-2",
                               "lr_schedule.warmup_steps=1", "lora.rank=8", f"runtime.output_dir={root / 'tenant'}"]))
    served = load_served(str(root / "base"), "base", {"tenant": str(root / "tenant")})
    served["base"].tokenizer = load_tokenizer(root / "base", chat_template=TEMPLATE)
    served["tenant"].tokenizer = load_tokenizer(root / "base")  # the same vocabulary, no chat template
    app, batcher = make_app(served, max_batch=8, queue=4, max_new_tokens=8)
    http, port = start(app)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    yield client, batcher, served, root, port
    http.should_exit = True


def start(app):
    """A uvicorn server for `app` on a free localhost port, in a thread: (server, port)."""
    import uvicorn

    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=http.run, daemon=True).start()
    while not http.started:
        time.sleep(0.05)
    return http, http.servers[0].sockets[0].getsockname()[1]


def greedy(served, prompt: str, tokens: int, **options) -> str:
    """What the engine alone samples for `prompt` (BOS first, as the server does), through
    the served adapter: greedily, or with `options` (temperature, seed)."""
    ids = [quickstart.BOS, *served.tokenizer.encode(prompt)]
    done = served.engine.sample([ids], max_new_tokens=tokens, adapters=[served.adapter],
                                **{"temperature": 0.0, **options})[0]
    kept = [t for t in done.tokens if t not in served.engine.card.eos_token_ids]
    return served.tokenizer.decode(kept)


def test_models_completions_and_an_adapter_by_name(server):
    client, _, served, _, _ = server
    assert [m.id for m in client.models.list().data] == ["base", "tenant"]
    for name in ("base", "tenant"):
        out = client.completions.create(model=name, prompt="12+34=", max_tokens=4, temperature=0)
        assert out.choices[0].text == greedy(served[name], "12+34=", 4) and out.usage.prompt_tokens == 7
    tuned = client.completions.create(model="tenant", prompt="12+34=", max_tokens=4, temperature=0).choices[0].text
    assert tuned != client.completions.create(model="base", prompt="12+34=", max_tokens=4,
                                              temperature=0).choices[0].text


def test_streaming_sends_the_same_text_in_pieces(server):
    client, _, served, _, _ = server
    pieces = {name: [c.choices[0].text for c in client.completions.create(model=name, prompt="40+2=", max_tokens=6,
                                                                         temperature=0, stream=True)]
              for name in ("base", "tenant")}
    assert all("".join(pieces[name]) == greedy(served[name], "40+2=", 6) for name in pieces)
    assert len([p for p in pieces["base"] if p]) == 6  # the untrained base writes all six: one piece each
    chat = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "40+2="}],
                                          max_tokens=5, temperature=0)
    streamed = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "40+2="}],
                                              max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert chat.choices[0].message.content == greedy(served["base"], "40+2=", 5)


def test_concurrent_requests_are_sampled_as_one_batch(server):
    """Four requests, two for the base and two for its adapter, queued together: one
    engine call samples them all, each row through its own adapter."""
    client, batcher, served, _, _ = server
    prompts = ["11+11=", "22+22=", "33+33=", "44+44="]
    models = ["tenant", "base", "tenant", "base"]
    answers = [None] * 4

    def ask(i):
        answers[i] = client.completions.create(model=models[i], prompt=prompts[i], max_tokens=4,
                                               temperature=0).choices[0].text

    before = len(batcher.batches)
    with batcher.held():
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while len(batcher.pending) < 4:  # all four queued before any is sampled
            time.sleep(0.01)
    for t in threads:
        t.join()
    assert batcher.batches[before:] == [4]
    assert answers == [greedy(served[m], p, 4) for m, p in zip(models, prompts)]


def test_a_request_joins_a_running_batch(server, monkeypatch):
    """A request that arrives while a batch runs joins it at the next step, with sampling
    settings of its own (the first batch's steps wait until it is queued, so the test does
    not race the clock); both answer what they answer alone."""
    from linnet.torch.continuous import Continuous

    client, batcher, served, _, _ = server
    running, queued, step = threading.Event(), threading.Event(), Continuous.step

    def waiting_step(self):
        running.set()
        queued.wait(60)
        return step(self)

    monkeypatch.setattr(Continuous, "step", waiting_step)
    answers = {}

    def ask(name, model, prompt, tokens, temperature=0.0, seed=None):
        answers[name] = client.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                                  temperature=temperature, seed=seed).choices[0].text

    joined, before = batcher.joined, len(batcher.batches)
    first = threading.Thread(target=ask, args=("long", "base", "12+34=", 30))
    first.start()
    assert running.wait(60)  # the long request taken: its batch waits at its first step
    second = threading.Thread(target=ask, args=("short", "tenant", "40+2=", 3, 1.0, 3))
    second.start()
    while not batcher.pending:
        time.sleep(0.01)
    queued.set()
    first.join()
    second.join()
    assert batcher.joined == joined + 1 and batcher.batches[before:] == [2]
    assert answers == {"long": greedy(served["base"], "12+34=", 30),
                       "short": greedy(served["tenant"], "40+2=", 3, temperature=1.0, seed=3)}


def test_bad_requests_get_a_4xx_and_the_server_goes_on(server):
    import httpx

    client, batcher, _, _, port = server
    raw = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and "not JSON" in raw.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="'nobody' is not served"):
        client.completions.create(model="nobody", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context of 64"):
        client.completions.create(model="base", prompt="1+1=" * 20, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature=5"):
        client.completions.create(model="base", prompt="1+1=", max_tokens=2, temperature=5)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="tenant", messages=[{"role": "user", "content": "1+1="}])
    with batcher.held():  # a full queue: the fifth waiting request is turned away
        threads = [threading.Thread(target=client.completions.create,
                                    kwargs=dict(model="base", prompt="1+1=", max_tokens=2)) for _ in range(4)]
        for t in threads:
            t.start()
        while len(batcher.pending) < 4:
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError, match="busy"):
            client.completions.create(model="base", prompt="1+1=", max_tokens=2)
    for t in threads:
        t.join()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["status"] == "ok"
    assert client.completions.create(model="base", prompt="1+1=", max_tokens=2).choices[0].finish_reason in (
        "stop", "length")


def test_an_omitted_max_tokens_is_capped_to_the_context_and_fields_are_checked_first(server):
    client, _, served, _, _ = server
    prompt = "1+1=" * 15
    room = 64 - len([quickstart.BOS, *served["base"].tokenizer.encode(prompt)])
    assert 0 < room < 8  # the server's default max_tokens (8) passes the context after this prompt
    out = client.completions.create(model="base", prompt=prompt, temperature=0)
    assert 0 < out.usage.completion_tokens <= room
    with pytest.raises(openai.BadRequestError, match="max_tokens 8: more than model 'base''s context of 64"):
        client.completions.create(model="base", prompt=prompt, max_tokens=8)  # asked for: it must fit
    with pytest.raises(openai.BadRequestError, match="temperature=3"):
        client.completions.create(model="base", prompt="1+1=" * 20, max_tokens=8, temperature=3)


def test_the_base_tokenizer_and_engine_are_what_nest_loads(server):
    """The served base is the model directory's own weights (the adapter is not merged in)."""
    _, _, served, root, _ = server
    plain = nest.load(root / "base", weights=root / "base")
    engine = served["base"].engine.model
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), engine.state_dict().values()))


def test_adapters_load_and_unload_while_serving(server):
    """--load-adapters: POST /v1/load_lora_adapter adds a LoRA run under a name, which then
    answers as the engine does through it; unloading it makes the name unknown again. A
    server started without the flag refuses both."""
    import httpx

    from linnet.commands.serve import load_served
    from linnet.serve.server import make_app

    client, _, served, root, port = server
    fixed = httpx.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": str(root / "tenant")}, timeout=30)
    assert fixed.status_code == 400 and "--load-adapters" in fixed.json()["error"]["message"]
    app, batcher = make_app(load_served(str(root / "base"), "base", bank=True), load_adapters=True)
    http, port = start(app)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        dynamic = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in dynamic.models.list().data] == ["base"]
        loaded = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "tenant")},
                            timeout=60)
        assert loaded.status_code == 200 and loaded.json()["models"] == ["base", "late"]
        late = dynamic.completions.create(model="late", prompt="12+34=", max_tokens=4, temperature=0).choices[0].text
        assert late == client.completions.create(model="tenant", prompt="12+34=", max_tokens=4,
                                                 temperature=0).choices[0].text
        bad = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "y", "lora_path": str(root / "nowhere")},
                         timeout=30)
        assert bad.status_code == 400 and "adapter 'y'" in bad.json()["error"]["message"]
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "base"}, timeout=30).status_code == 400
        answers = []

        def ask():
            try:
                dynamic.completions.create(model="late", prompt="1+1=", max_tokens=2)
            except openai.NotFoundError as e:
                answers.append(str(e))

        with batcher.held():  # a request for it waits while it is unloaded
            waiting = threading.Thread(target=ask)
            waiting.start()
            while not batcher.pending:
                time.sleep(0.01)
            assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=30).status_code == 200
        waiting.join()
        assert len(answers) == 1 and "was unloaded before this request ran" in answers[0]
        with pytest.raises(openai.NotFoundError, match="'late' is not served"):
            dynamic.completions.create(model="late", prompt="1+1=", max_tokens=2)
    finally:
        http.should_exit = True
