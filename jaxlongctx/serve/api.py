"""The HTTP layer (FastAPI): OpenAI's `POST /v1/chat/completions`, `POST /v1/completions` and
`GET /v1/models`, plus `GET /health` and `GET /metrics`, over an `Engine`.

Answers stream as server-sent events in OpenAI's chunk format ending with `data: [DONE]`; errors
come in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: malformed JSON or fields
400, a prompt longer than the context 400 (with the numbers), unknown model 404, bad key 401, a
full queue 429 and a server shutting down 503 (both with Retry-After). A client that disconnects
cancels its request, which frees its decode slot.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxlongctx.chat_template import ChatTemplateError
from jaxlongctx.serve.engine import (
    Engine,
    Finished,
    GenerationRequest,
    Overloaded,
    PromptTooLong,
    ShuttingDown,
)

RETRY_AFTER_S = 1  # the retry hint of 429 / 503 answers
DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is still there


class APIError(Exception):
    """An error answered in OpenAI's shape with HTTP `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# --- request bodies ----------------------------------------------------------------------------------
class _Body(BaseModel):
    """Fields both generation routes take (OpenAI's names; fields we do not use are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False  # an extension (as vLLM's): generate max_tokens tokens whatever they are

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    echo: bool = False


# --- the app -----------------------------------------------------------------------------------------
def create_app(engine: Engine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The server's FastAPI app over a started `engine`, serving it as `model_name`."""
    app = FastAPI(title="jaxlongctx", docs_url=None, redoc_url=None)
    tokenizer = engine.model.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return _invalid(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail), code=None).response()

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{model_name}`.",
                code="model_not_found",
                param="model",
            )

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "jaxlongctx",
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.accepting:
            return JSONResponse(
                {"status": "shutting down"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
            )
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics")
    async def metrics() -> dict[str, Any]:
        return engine.metrics_snapshot()

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(check_key)])
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(request: Request) -> Any:
        body = await _parse(request, ChatCompletionBody)
        check_model(body.model)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _answer(engine, request, body, ids, max_tokens, "chat", model_name)

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(request: Request) -> Any:
        body = await _parse(request, CompletionBody)
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt).ids
        else:
            bad = [i for i in prompt if not 0 <= i < engine.model.config.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
            ids = list(prompt)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        return await _answer(engine, request, body, ids, body.max_tokens, "text", model_name)

    return app


def _invalid(errors: Any) -> APIError:
    """A 400 naming the first problem pydantic found."""
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    message = str(first.get("msg", "invalid request"))
    return APIError(400, f"{where}: {message}" if where else message, param=where or None)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as `model` (whatever the content type says, as OpenAI's server takes it), or a 400."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise _invalid(e.errors()) from None


async def _answer(
    engine: Engine,
    request: Request,
    body: _Body,
    ids: list[int],
    max_tokens: int | None,
    kind: str,
    model_name: str,
) -> Any:
    """Submit a generation and answer it streamed (SSE) or whole."""
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt" if kind == "text" else "messages")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | Finished] = asyncio.Queue()
    req = GenerationRequest(
        list(ids),
        lambda event: loop.call_soon_threadsafe(queue.put_nowait, event),
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=random.randrange(1 << 31) if body.seed is None else body.seed,
        stop=body.stop_strings(),
        ignore_eos=body.ignore_eos,
    )
    try:
        engine.submit(req)
    except PromptTooLong as e:
        raise APIError(
            400, str(e), code="context_length_exceeded", param="messages" if kind == "chat" else "prompt"
        ) from None
    except Overloaded as e:
        raise APIError(
            429,
            f"the server is busy ({e}); retry shortly",
            "rate_limit_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except ShuttingDown as e:
        raise APIError(503, str(e), "server_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    shape = _Shape(kind, model_name)
    if body.stream:
        return StreamingResponse(_sse(req, queue, shape, body.include_usage), media_type="text/event-stream")
    while True:
        try:
            event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                req.cancel()
                raise APIError(499, "the client closed the connection") from None
            continue
        if isinstance(event, Finished):
            break
    if event.reason == "error":
        raise APIError(500, "generation failed (see the server log)", "server_error")
    return shape.whole(event)


class _Shape:
    """OpenAI's response objects for chat (`chat.completion`) or text (`text_completion`) answers."""

    def __init__(self, kind: str, model_name: str):
        self.kind, self.model = kind, model_name
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, chunk: bool, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        if chunk and self.kind == "chat":
            obj += ".chunk"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def usage(done: Finished) -> dict[str, int]:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }

    def whole(self, done: Finished) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None}
        return self._object(False, [{**choice, "finish_reason": done.reason}], usage=self.usage(done))

    def chunk(
        self, text: str | None, finish_reason: str | None = None, first: bool = False
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({"content": text} if text is not None else {})
            )
            choice = {"index": 0, "delta": delta, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        return self._object(True, [{**choice, "finish_reason": finish_reason}])


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(
    req: GenerationRequest, queue: asyncio.Queue, shape: _Shape, include_usage: bool
) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer; a client that goes away cancels the request."""
    try:
        if shape.kind == "chat":
            yield _event(shape.chunk(None, first=True))
        while not isinstance(event := await queue.get(), Finished):
            yield _event(shape.chunk(event))
        if event.reason == "error":
            yield _event(
                {
                    "error": {
                        "message": "generation failed (see the server log)",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
            )
        else:
            yield _event(shape.chunk(None if shape.kind == "chat" else "", event.reason))
            if include_usage:
                yield _event(shape._object(True, [], usage=shape.usage(event)))
        yield "data: [DONE]\n\n"
    finally:
        req.cancel()  # a no-op once the request has ended
