"""`linnet serve`: an OpenAI-compatible HTTP server over linnet's Engine.

    app, batcher = make_app({"base": served_base, "tenant-a": served_adapter})
    uvicorn.run(app, port=8000)

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the `model`
field names the base or an adapter; `stream: true` sends server-sent events), GET /health.

One thread, the `Batcher`, owns the engines. Requests wait in a bounded queue (full: 503);
the batcher takes the oldest, and with it every waiting request for the same engine (a
base and its adapters share one; up to `max_batch`), and samples them as one batch, each
row through its own adapter and with its own sampling settings, handing each request its
tokens as they come. Requests that arrive meanwhile join the running batch between two
decode steps (linnet.torch.continuous), as rows free up. A
request that reaches its max_tokens, its stop token or one of its stop strings is answered
at once and leaves the batch. Bad requests get a 4xx and a message naming the field; the
server goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from fastapi import FastAPI, Request  # the serve extra: this module is imported only to serve
from fastapi.responses import JSONResponse, StreamingResponse

ERRORS = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}


class Refused(Exception):
    """A request answered with an HTTP error status and a message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Served:
    """A model the server answers for: its engine, tokenizer and BOS (added where the
    tokenizer adds none); with `adapter`, that adapter of the engine's bank
    (linnet.torch.adapter_bank.AdapterEngine), so requests for the base and for any of its
    adapters share the engine's batches."""

    engine: object
    tokenizer: object
    bos: int | None = None
    adapter: str | None = None

    @property
    def context(self) -> int:
        return self.engine.card.max_positions


@dataclass
class Job:
    """One request: its prompt ids and sampling settings, and where its tokens go."""

    model: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float | None
    stop: list[str]
    seed: int | None
    loop: asyncio.AbstractEventLoop
    engine: int = 0  # which engine samples it (an adapter bank's serves the base and its adapters)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def key(self) -> int:
        """Requests that may share a batch: the same engine (each keeps its own sampling settings)."""
        return self.engine

    def send(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Batcher:
    """The thread that samples: see the module docstring. `batches` records how many
    requests each batch served (those that joined it included); `join`: let waiting
    requests join a running batch (False: batches form between engine calls)."""

    def __init__(self, served: dict[str, Served], *, max_batch: int = 16, queue: int = 64, wait: float = 0.01,
                 join: bool = True):
        self.served, self.max_batch, self.queue_size, self.wait, self.join = served, max_batch, queue, wait, join
        self.joined = 0  # requests that joined a running batch
        self.longest = (0, 0)  # the longest prompt and max_tokens so far: what a new batch's caches hold at least
        self.engines = threading.Lock()  # held while a batch samples; adapters load and unload between batches
        self.pending: list[Job] = []
        self.batches: list[int] = []
        self._ready = threading.Condition()
        self._stopping = self._held = False
        self._thread = threading.Thread(target=self._run, name="linnet-serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._ready:
            if self._stopping:
                raise Refused(503, "the server is shutting down")
            if len(self.pending) >= self.queue_size:
                raise Refused(503, f"the server is busy: {len(self.pending)} requests are waiting; retry shortly")
            self.pending.append(job)
            self._ready.notify()

    @contextlib.contextmanager
    def held(self):
        """Queue requests without sampling them until the block ends (then they go out
        together, as far as their settings allow)."""
        with self._ready:
            self._held = True
        try:
            yield self
        finally:
            with self._ready:
                self._held = False
                self._ready.notify()

    def close(self) -> None:
        """Finish the batch in flight, refuse the waiting requests, stop the thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join()
        for job in self.pending:
            job.send(Refused(503, "the server shut down before this request ran"))

    def _take(self) -> list[Job] | None:
        with self._ready:
            while (not self.pending or self._held) and not self._stopping:
                self._ready.wait()
            if self._stopping:
                return None
        time.sleep(self.wait)  # let requests sent together arrive together
        with self._ready:
            key = self.pending[0].key
            batch = [j for j in self.pending if j.key == key][: self.max_batch]
            self.pending = [j for j in self.pending if j not in batch]
        return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                with self.engines:
                    self._sample(batch)
            except Exception as e:  # a failure answers its batch; the server goes on
                for job in batch:
                    job.send(e)

    def _sample(self, batch: list[Job]) -> None:
        """Sample `batch` as one session of the engine (linnet.torch.continuous), letting
        waiting requests for the same engine join between its steps (with `join`)."""
        from linnet.torch.continuous import Continuous

        batch = [j for j in batch if not self._gone(j)]
        if not batch:
            return
        first = batch[0]
        self.longest = (max(self.longest[0], *(len(j.prompt) for j in batch)),
                        max(self.longest[1], *(j.max_new_tokens for j in batch)))
        session = Continuous(self.served[first.model].engine, rows=self.max_batch, prompt_slots=self.longest[0],
                             new_slots=2 * self.longest[1])  # room for requests to join a batch half done
        answers: dict[int, _Answer] = {}
        waiting = [j for j in batch if not self._admit(session, j, answers)]  # longer than the caches: next time
        with self._ready:
            self.pending = waiting + self.pending
        served = len(answers)
        try:
            while session.active:
                for key, (token, _) in session.step().items():
                    if answers[key].take(token, self.served[answers[key].job.model].tokenizer):
                        del answers[key]
                        session.cancel(key)
                if self.join:
                    served += self._join(session, first.key, answers)
        except Exception as e:  # the requests that joined hear of it here, the batch's in _run
            for answer in answers.values():
                answer.job.send(e)
            raise
        finally:
            self.batches.append(served)

    def _gone(self, job: Job) -> bool:
        """Whether the job's adapter went while it waited (then it is answered 404)."""
        if job.model in self.served:
            return False
        job.send(Refused(404, f"model {job.model!r} was unloaded before this request ran"))
        return True

    def _admit(self, session, job: Job, answers: dict) -> bool:
        """Add a job to the running batch (True; or answer it 404), or leave it (False: it does not fit)."""
        if self._gone(job):
            return True
        served = self.served[job.model]
        if not session.add(id(job), job.prompt, job.max_new_tokens, adapter=served.adapter,
                           temperature=job.temperature, top_p=job.top_p, seed=job.seed):
            return False
        answers[id(job)] = _Answer(job, set(served.engine.card.eos_token_ids))
        return True

    def _join(self, session, key: int, answers: dict) -> int:
        """Admit the waiting requests for the same engine that fit the running batch; how many."""
        with self._ready:
            if self._held or self._stopping:
                return 0
            joining = [j for j in self.pending if j.key == key and session.fits(j.prompt, j.max_new_tokens)]
            joined = [j for j in joining if self._admit(session, j, answers)]
            self.pending = [j for j in self.pending if j not in joined]
        self.joined += len(joined)
        return len(joined)


class _Answer:
    """One request's tokens as they come: its text sent in whole characters, ended at the
    model's stop token, a stop string or its max_tokens."""

    def __init__(self, job: Job, stops: set[int]):
        self.job, self.stops, self.tokens, self.text = job, stops, [], ""

    def take(self, token: int, tokenizer) -> bool:
        """Add a token; True once the answer is complete (and sent)."""
        job = self.job
        if token in self.stops:
            job.send(("done", "stop", len(self.tokens)))
            return True
        self.tokens.append(token)
        text = tokenizer.decode(self.tokens)
        cut = _stopped_at(text, job.stop)
        if cut is not None or len(self.tokens) >= job.max_new_tokens:
            final = text if cut is None else text[:cut]
            if len(final) > len(self.text):
                job.send(("text", final[len(self.text):]))
            job.send(("done", "stop" if cut is not None else "length", len(self.tokens)))
            return True
        if not text.endswith("\ufffd") and len(text) > len(self.text):  # whole characters only
            job.send(("text", text[len(self.text):]))
            self.text = text
        return False


def _stopped_at(text: str, stops: list[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


def make_app(served: Mapping[str, Served], *, max_batch: int = 16, queue: int = 64, max_new_tokens: int = 256,
             wait: float = 0.01, load_adapters: bool = False, join: bool = True):
    """(the FastAPI app, its Batcher) serving `served` by name; `wait`: how long the
    batcher lets requests gather before a batch; `join`: requests join a running batch
    between its steps (False: they wait for it to end); `load_adapters`: allow POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names) to change the adapters
    of the served adapter engine (paths on this machine, named by whoever can reach it)."""
    served = dict(served)
    batcher = Batcher(served, max_batch=max_batch, queue=queue, wait=wait, join=join)
    app = FastAPI(title="linnet serve")
    app.router.on_shutdown.append(batcher.close)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": ERRORS.get(status, "error"), "code": status}},
                            status_code=status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(served), "waiting": len(batcher.pending)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "linnet"}
                                           for n in served]}

    async def answer(request: Request, chat: bool):
        try:
            body = await _body(request)
            job = _job(body, served, chat, max_new_tokens, asyncio.get_running_loop())
            batcher.submit(job)
        except Refused as e:
            return error(e.status, str(e))
        reply = _Reply(job, chat)
        if body.get("stream"):
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        try:
            return await reply.whole()
        except Refused as e:
            return error(e.status, str(e))

    async def change(request: Request, load: bool):
        try:
            if not load_adapters:
                raise Refused(400, "adapters are fixed on this server; start linnet serve with --load-adapters")
            body = await _body(request)
            name = body.get("lora_name") if isinstance(body, dict) else None
            if not isinstance(name, str) or not name:
                raise Refused(400, "lora_name must be a non-empty string")
            path = body.get("lora_path") if load else None
            if load and (not isinstance(path, str) or not path):
                raise Refused(400, "lora_path must name a PEFT adapter directory or a LoRA run on the server")
            await asyncio.get_running_loop().run_in_executor(None, _change_adapters, served, batcher, name, path)
        except Refused as e:
            return error(e.status, str(e))
        return {"status": "ok", "models": list(served)}

    for path, handler, flag in (("/v1/completions", answer, False), ("/v1/chat/completions", answer, True),
                                ("/v1/load_lora_adapter", change, True), ("/v1/unload_lora_adapter", change, False)):
        app.add_api_route(path, _posted(handler, flag), methods=["POST"])
    return app, batcher


def _posted(handler, flag: bool):
    """A POST endpoint calling `handler(request, flag)` (chat, or load)."""
    async def endpoint(request: Request):
        return await handler(request, flag)

    return endpoint


async def _body(request: Request):
    """The request's JSON body; a Refused (400) when it is not JSON."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refused(400, "the body is not JSON; send a JSON object") from None


def _change_adapters(served: dict[str, Served], batcher: Batcher, name: str, path: str | None) -> None:
    """Load adapter `name` from `path` into the served adapter engine, or (path None)
    unload it, between batches; a Refused names what is wrong."""
    bank = next((s for s in served.values() if hasattr(s.engine, "bank")), None)
    if bank is None:
        raise Refused(400, "this server holds no adapter engine")
    with batcher.engines:
        if path is None:
            if name not in served:
                raise Refused(404, f"no adapter {name!r} is served; these are: {', '.join(served)}")
            if served[name].adapter is None:
                raise Refused(400, f"{name!r} is a base model, not an adapter; it cannot be unloaded")
            bank.engine.bank.remove(name)
            del served[name]
            return
        if name in served:
            raise Refused(400, f"{name!r} is served already; unload it first, or choose another name")
        try:
            bank.engine.bank.add(name, path)
        except (ValueError, OSError) as e:
            raise Refused(400, f"adapter {name!r}: {e}") from None
        served[name] = Served(bank.engine, bank.tokenizer, bank.bos, name)


def _job(body, served: Mapping[str, Served], chat: bool, max_new_tokens: int, loop) -> Job:
    """A request's Job, every field checked (a Refused names the one at fault); the
    sampling fields before the context, so a bad field is named whatever the lengths."""
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    name = body.get("model")
    if name not in served:
        raise Refused(404, f"model {name!r} is not served; these are: {', '.join(served)} (GET /v1/models)")
    model = served[name]
    ids = _prompt(body, model, name, chat)
    sampling = _sampling(body)
    limit = _limit(body, len(ids), model.context, name, max_new_tokens)
    return Job(name, ids, limit, *sampling, loop, id(model.engine))


def _prompt(body: dict, model: Served, name: str, chat: bool) -> list[int]:
    """The request's prompt (or chat messages) as token ids, BOS first."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise Refused(400, "messages must be a non-empty list of {role, content} objects with text content")
        if not model.tokenizer.chat_template:
            raise Refused(400, f"model {name!r} has no chat template; use /v1/completions")
        ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise Refused(400, "prompt must be a non-empty string (one prompt a request)")
        ids = model.tokenizer.encode(prompt)
    if model.bos is not None and ids[:1] != [model.bos]:
        ids = [model.bos, *ids]
    return ids


def _sampling(body: dict) -> tuple:
    """The request's (temperature, top_p, stop, seed), each checked."""
    n = body.get("n", 1)
    if n != 1:
        raise Refused(400, f"n={n}: one completion a request (send several requests: they are batched together)")
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise Refused(400, f"temperature={temperature!r}: a number from 0 to 2")
    top_p = body.get("top_p")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise Refused(400, f"top_p={top_p!r}: a number in (0, 1]")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise Refused(400, "stop must be a string or a list of up to 4 strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise Refused(400, f"seed={seed!r}: an integer")
    return float(temperature), None if top_p in (None, 1) else float(top_p), stop, seed


def _limit(body: dict, prompt: int, context: int, name: str, default: int) -> int:
    """How many tokens the request may sample: its max_tokens, which must fit the context
    after the prompt; without one, the server's default capped to what the context leaves
    (as OpenAI's API reads an omitted max_tokens)."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        if prompt >= context:
            raise Refused(400, f"the prompt is {prompt} tokens: it fills model {name!r}'s context of {context}, "
                               "leaving no room to sample; shorten the prompt")
        return min(default, context - prompt)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise Refused(400, f"max_tokens={limit!r}: a positive integer")
    if prompt + limit > context:
        raise Refused(400, f"the prompt is {prompt} tokens and max_tokens {limit}: more than model {name!r}'s "
                           f"context of {context}; shorten the prompt or lower max_tokens")
    return limit


class _Reply:
    """A Job's answer in OpenAI's shapes: whole, or as server-sent events."""

    def __init__(self, job: Job, chat: bool):
        self.job, self.chat = job, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"

    def _usage(self, completion: int) -> dict:
        return {"prompt_tokens": len(self.job.prompt), "completion_tokens": completion,
                "total_tokens": len(self.job.prompt) + completion}

    async def _events(self):
        while True:
            event = await self.job.events.get()
            if isinstance(event, Exception):
                raise event if isinstance(event, Refused) else Refused(500, f"sampling failed: {event}")
            yield event
            if event[0] == "done":
                return

    async def whole(self) -> dict:
        text, finish, count = "", "length", 0
        async for event in self._events():
            if event[0] == "text":
                text += event[1]
            else:
                _, finish, count = event
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if self.chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.job.model,
                "choices": [choice], "usage": self._usage(count)}

    def _chunk(self, text: str | None, finish: str | None) -> str:
        if self.chat:
            delta = {} if text is None else {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": self.id, "object": self.kind + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.job.model, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    async def events(self):
        try:
            async for event in self._events():
                yield self._chunk(event[1], None) if event[0] == "text" else self._chunk(None, event[1])
        except Refused as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': e.status}})}\n\n"
        yield "data: [DONE]\n\n"
