"""The node's HTTP front: vLLM's OpenAI routes (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``), vLLM's sleep-mode routes and ``/pdwire/stats`` over a
``NodeEngine``; ``NodeServer`` serves them from a thread."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Self

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .body_limit import COMPLETION_BODY_LIMIT, BodyLimit
from .http_server import AppServer
from .kv_content import chat_prompt, render, tokenize
from .metrics import CONTENT_TYPE, of_node
from .node import Generation, Job, NodeConfig, NodeEngine, NodeError
from .node_worker import WorkerError

logger = logging.getLogger(__name__)

#: vLLM's answer to a chat completion for a model whose tokenizer has no chat template (HTTP 400).
NO_CHAT_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
    "a chat template if the tokenizer does not define one."
)


def _error(exc: NodeError) -> JSONResponse:
    body = {
        "object": "error",
        "message": exc.message,
        "type": exc.kind,
        "param": None,
        "code": exc.status,
    }
    return JSONResponse(body, status_code=exc.status)


def _prompt_ids(body: dict[str, Any], vocab: int, chat: bool) -> list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise NodeError(400, "messages must be a list of objects")
        return tokenize(chat_prompt(messages), vocab)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize(prompt, vocab)
    if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
        return list(prompt)
    raise NodeError(400, "prompt must be a string or a list of token ids")


def _stop_ids(body: dict[str, Any]) -> frozenset[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise NodeError(400, f"stop_token_ids must be a list of integers, got {value!r}")
    return frozenset(value)


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_tokens")
    if value is None:
        value = body.get("max_completion_tokens", 16)
    if not isinstance(value, int) or isinstance(value, bool):
        raise NodeError(400, f"max_tokens must be an integer, got {value!r}")
    return value


async def _unless_gone(request: Request, job: Job, work: Awaitable[Generation]) -> Generation:
    """``work``, with ``job.aborted`` set should the client go away meanwhile."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.aborted.set()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    finally:
        watcher.cancel()


class _Reply:
    """vLLM-shaped bodies of one completion (text or chat)."""

    def __init__(self, rid: str, model: str, chat: bool) -> None:
        self.rid, self.model, self.chat = rid, model, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, object_: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {
            "id": f"{prefix}-{self.rid}",
            "object": object_,
            "created": self.created,
            "model": self.model,
        }

    def _choice(
        self, text: str, finish: str | None, delta: bool, stop_reason: int | None = None
    ) -> dict[str, Any]:
        if not self.chat:
            return {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
        key = "delta" if delta else "message"
        return {
            "index": 0,
            key: {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }

    def _tail(self, gen: Generation, count: int) -> dict[str, Any]:
        tail: dict[str, Any] = {
            "usage": {
                "prompt_tokens": gen.prompt_tokens,
                "completion_tokens": count,
                "total_tokens": gen.prompt_tokens + count,
            },
            "kv_transfer_params": gen.kv_transfer_params,
        }
        if gen.pdwire:
            tail["pdwire"] = gen.pdwire
        return tail

    def whole(
        self, gen: Generation, tokens: list[int], prompt_ids: list[int] | None = None
    ) -> dict[str, Any]:
        """The body of a non-streamed completion; with ``prompt_ids`` (vLLM's
        ``return_token_ids``) the choice carries ``token_ids``, the generated ids (the stop
        token included), and the body ``prompt_token_ids``."""
        choice = self._choice(render(tokens), gen.finish, False, gen.stop_reason)
        body: dict[str, Any] = {**self._head(self.object), "choices": [choice]}
        if prompt_ids is not None:
            stop = [] if gen.stop_token is None else [gen.stop_token]
            choice["token_ids"] = tokens + stop
            body["prompt_token_ids"] = prompt_ids
        return {**body, **self._tail(gen, len(tokens))}

    async def stream(self, gen: Generation) -> AsyncIterator[bytes]:
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        count = 0
        try:
            async for token in gen.tokens:
                text = ("" if count == 0 else " ") + render([token])
                count += 1
                body = {**self._head(chunk_object), "choices": [self._choice(text, None, True)]}
                yield f"data: {json.dumps(body)}\n\n".encode()
            last = {
                **self._head(chunk_object),
                "choices": [self._choice("", gen.finish, True, gen.stop_reason)],
                **self._tail(gen, count),
            }
            yield f"data: {json.dumps(last)}\n\n".encode()
        except (NodeError, WorkerError) as exc:
            logger.error("request %s failed while streaming: %s", self.rid, exc)
            error = {"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            gen.cleanup()
        yield b"data: [DONE]\n\n"


def create_app(engine: NodeEngine) -> FastAPI:
    """The node's OpenAI-compatible routes, plus ``GET /pdwire/stats``."""
    app = FastAPI(title=f"pdwire {engine.config.role} node")
    app.add_middleware(BodyLimit, limit=COMPLETION_BODY_LIMIT)
    model = engine.config.model

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy():
            return Response(status_code=200)
        return JSONResponse({"status": "starting or degraded"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "pdwire",
            "root": model,
            "max_model_len": engine.config.shape.num_blocks * engine.config.shape.block_size,
        }
        return {"object": "list", "data": [card]}

    @app.get("/pdwire/stats")
    async def stats() -> dict[str, Any]:
        return await engine.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(of_node(await engine.stats()), media_type=CONTENT_TYPE)

    async def asleep(state: bool) -> Response:
        try:
            await engine.sleep(state)
        except NodeError as exc:
            return _error(exc)
        return Response(status_code=200)

    @app.post("/sleep")
    async def sleep() -> Response:
        """vLLM's sleep mode (its development API): the KV memory leaves the transfer engine."""
        return await asleep(True)

    @app.post("/wake_up")
    async def wake_up() -> Response:
        return await asleep(False)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": engine.sleeping}

    async def complete(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(NodeError(400, "the body is not JSON"))
        if not isinstance(body, dict):
            return _error(NodeError(400, "the body is not a JSON object"))
        if chat and not engine.config.chat_template:
            return _error(NodeError(400, NO_CHAT_TEMPLATE))
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        reply = _Reply(rid, str(body.get("model") or model), chat)
        try:
            params = body.get("kv_transfer_params")
            job = Job(
                engine.new_request_id(rid),
                _prompt_ids(body, engine.config.shape.vocab, chat),
                _max_tokens(body),
                params if isinstance(params, dict) else None,
                _stop_ids(body),
            )
            gen = await _unless_gone(request, job, engine.generate(job))
        except NodeError as exc:
            engine.counts["errors"] += 1
            return _error(exc)
        except WorkerError as exc:
            engine.counts["errors"] += 1
            return _error(NodeError(500, str(exc), "InternalServerError"))
        if body.get("stream"):
            return StreamingResponse(
                reply.stream(gen),
                media_type="text/event-stream",
                background=BackgroundTask(gen.cleanup),
            )
        try:
            tokens = [t async for t in gen.tokens]
        except WorkerError as exc:
            engine.counts["errors"] += 1
            return _error(NodeError(500, str(exc), "InternalServerError"))
        finally:
            gen.cleanup()
        engine.counts["ok"] += 1
        prompt_ids = job.ids if body.get("return_token_ids") is True else None
        return JSONResponse(reply.whole(gen, tokens, prompt_ids))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    return app


class NodeServer(AppServer):
    """A node: its workers, and ``create_app`` served by uvicorn in a daemon thread."""

    name = "node"

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.engine = NodeEngine(config)
        super().__init__(create_app(self.engine))

    def start(self, host: str | None = None, port: int = 0, timeout: float = 30.0) -> Self:
        """Start the workers, then serve; wait until it serves."""
        self.engine.start()
        try:
            super().start(host or self.config.host, port, timeout)
        except BaseException:
            self.engine.stop()
            raise
        logger.info("%s node %s serving at %s", self.config.role, self.engine.engine_id, self.url)
        return self

    @property
    def alive(self) -> bool:
        return super().alive and self.engine.healthy()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving HTTP, then stop every worker."""
        super().stop(timeout)
        self.engine.stop()
