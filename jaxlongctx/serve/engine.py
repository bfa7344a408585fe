"""The serving engine: requests wait in a queue, join a free decode slot as soon as there is one
(prefilled between two decode steps, a long prompt a chunk at a time between several), are decoded
together by one batched step, and leave their slot
the moment they end (stop id, stop string, max tokens, the context, or cancelled by the client).

It runs in its own thread; a request's text pieces and its end reach the caller through the
request's `emit` callback, called from that thread. ARMT models (their own memory, no KV cache) are
served one request at a time through `jaxlongctx.generate`, streamed token by token.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxlongctx.cache_choice import PQKV, DenseKV, OwnMemoryModel
from jaxlongctx.chat import stop_ids as model_stop_ids
from jaxlongctx.generate import generate
from jaxlongctx.model.model import Model
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.serve.batch_decode import BatchDecoder, DenseBatchDecoder, PQBatchDecoder, SlotSampling
from jaxlongctx.serve.chunked_prefill import DEFAULT_CHUNK, PromptReading
from jaxlongctx.serve.metrics import Metrics
from jaxlongctx.serve.sampling import slot_key
from jaxlongctx.serve.text import OutputText

DEFAULT_MAX_CONTEXT = 8192


class PromptTooLong(ValueError):
    """A prompt (plus the tokens asked for) longer than the served context."""


class Overloaded(RuntimeError):
    """The queue is full: try again later."""


class ShuttingDown(RuntimeError):
    """The engine takes no new requests (it finishes those it has)."""


@dataclass(frozen=True)
class EngineOptions:
    """`max_batch`: decode slots; `max_context`: tokens per conversation (prompt + answer; default the
    model's, at most DEFAULT_MAX_CONTEXT); `max_queue`: waiting requests before new ones are refused;
    `cache`: `DenseKV()` or `PQKV(codebooks)` (full-attention models); `prefill_chunk`: a longer prompt
    is prefilled this many tokens at a time between decode steps."""

    max_batch: int = 8
    max_context: int | None = None
    max_queue: int = 256
    cache: DenseKV | PQKV = field(default_factory=DenseKV)
    prefill_chunk: int = DEFAULT_CHUNK


@dataclass(frozen=True)
class Finished:
    """How a request ended: `reason` "stop" (stop id or string), "length" (max tokens or context),
    "cancelled" or "error"; token counts; the whole answer `text`."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    ids: tuple[int, ...]


@dataclass(eq=False)
class GenerationRequest:
    """One generation: prompt ids, at most `max_tokens` new ones (None: up to the context), sampling
    (temperature 0 = greedy, top_p 1 = off, seed), `stop` strings; `ignore_eos` runs to `max_tokens`. `emit` receives each text piece (str)
    and, last, a `Finished`, from the engine's thread."""

    prompt_ids: list[int]
    emit: Callable[[str | Finished], Any]
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # run to max_tokens past the model's stop ids (benchmarks)
    cancelled: threading.Event = field(default_factory=threading.Event)
    output: OutputText | None = None
    generated: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.monotonic)
    reading: PromptReading | None = None  # a long prompt being read chunk by chunk
    decoding: bool = False  # prefilled: its slot decodes

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt_ids) if self.reading is None else self.reading.remaining

    def cancel(self) -> None:
        """Ask the engine to drop this request (its slot is freed before the next step)."""
        self.cancelled.set()


class Engine:
    """Continuous batching over `options.max_batch` slots of `model` (a `Model` or an ARMT model)."""

    def __init__(self, model: Any, options: EngineOptions = EngineOptions()):
        if model.tokenizer is None:
            raise ValueError("serving needs a model with a tokenizer (tokenizer.json or the GGUF's own)")
        limit = model.config.max_position_embeddings
        context = options.max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if not 2 <= context <= limit:
            raise ValueError(f"--max-context must be in [2, {limit}] (the model's context), got {context}")
        if options.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {options.max_batch}")
        self.model = model
        self.context = context
        self.options = options
        self.stop_ids = frozenset(model_stop_ids(model))
        self.metrics = Metrics()
        self.one_at_a_time = isinstance(model, OwnMemoryModel)
        self.batch = 1 if self.one_at_a_time else options.max_batch
        self.decoder: BatchDecoder | None = None
        if not self.one_at_a_time:
            if not isinstance(model, Model):
                raise ValueError(f"cannot serve a {type(model).__name__}")
            model.check_length(context)
            if isinstance(options.cache, PQKV):
                self.decoder = PQBatchDecoder(
                    model, self.batch, context, options.cache, options.prefill_chunk
                )
            else:
                self.decoder = DenseBatchDecoder(model, self.batch, context, options.prefill_chunk)
        self._prefill_rate = 1000.0  # prompt tokens per second, measured as prompts are prefilled
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._slots: list[GenerationRequest | None] = [None] * self.batch
        self._cv = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jaxlongctx-engine", daemon=True)

    # --- the caller's side ---------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, req: GenerationRequest) -> None:
        """Queue `req`; raises PromptTooLong, Overloaded or ShuttingDown (nothing queued then)."""
        n = len(req.prompt_ids)
        room = self.context - n
        if req.max_tokens is None:
            if room < 1:
                raise PromptTooLong(
                    f"This model's maximum context length is {self.context} tokens. However, your prompt is "
                    f"{n} tokens, which leaves no room for the completion."
                )
            req.max_tokens = room
        elif n + req.max_tokens > self.context:
            raise PromptTooLong(
                f"This model's maximum context length is {self.context} tokens. However, you requested "
                f"{n + req.max_tokens} tokens ({n} in the prompt, {req.max_tokens} in the completion). "
                "Please reduce the prompt or the completion length."
            )
        if n < 1:
            raise ValueError("the prompt is empty")
        req.output = OutputText(self.model.tokenizer, req.stop)
        with self._cv:
            if not self._accepting:
                self.metrics.count("rejected")
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.options.max_queue:
                self.metrics.count("rejected")
                raise Overloaded(f"{len(self._waiting)} requests are waiting already")
            self.metrics.count("received")
            self._waiting.append(req)
            self._cv.notify()

    @property
    def accepting(self) -> bool:
        """False once the engine refuses new requests (shutting down)."""
        return self._accepting

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (those queued or decoding go on)."""
        with self._cv:
            self._accepting = False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests, finish those queued or decoding, then stop the thread."""
        with self._cv:
            self._accepting = False
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def state(self) -> dict[str, int]:
        """Slots, busy slots and queued requests right now."""
        with self._cv:
            return {
                "slots": self.batch,
                "busy": sum(s is not None for s in self._slots),
                "queued": len(self._waiting),
            }

    def metrics_snapshot(self) -> dict[str, Any]:
        s = self.state()
        return self.metrics.snapshot(s["slots"], s["busy"], s["queued"])

    # --- the engine's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self.one_at_a_time:
            self._run_one_at_a_time()
            return
        positions = np.zeros(self.batch, np.int32)
        sampling = SlotSampling.empty(self.batch, slot_key(0).shape)
        while True:
            with self._cv:
                while not self._waiting and not any(self._slots) and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._waiting and not any(self._slots):
                    return
                for b, s in enumerate(self._slots):
                    if s is None and self._waiting:
                        self._slots[b] = self._waiting.popleft()
            self._drop_cancelled()
            self._prefill(positions, sampling)
            active = np.asarray([s is not None and s.decoding for s in self._slots])
            if not active.any():
                continue
            t0 = time.monotonic()
            try:
                tok = self.decoder.step(active, positions, sampling)
            except Exception:
                self._fail_all(traceback.format_exc())
                continue
            seconds = time.monotonic() - t0
            sampling.steps[active] += 1
            positions[active] += 1
            for b in np.flatnonzero(active):
                self._take(self._slots[b], int(tok[b]), b)
            self.metrics.stepped(int(active.sum()), int(active.sum()), seconds)

    def _prefill(self, positions: np.ndarray, sampling: SlotSampling) -> None:
        """Prefill waiting slots' prompts, about one chunk of prompt tokens in all, before the next
        decode step: whole prompts of at most a chunk, a chunk of a longer one. The slot whose prompt
        is quickest to finish goes first (fewest tokens left, less those its wait is worth at the
        measured prefill rate, so that newer short prompts pass a long one for at most about the
        long one's own prefill time)."""
        budget = self.decoder.chunk
        while budget > 0:
            now = time.monotonic()
            pending = [b for b, s in enumerate(self._slots) if s is not None and not s.decoding]
            if not pending:
                return
            b = min(
                pending,
                key=lambda b: (
                    self._slots[b].prompt_left - self._prefill_rate * (now - self._slots[b].submitted_at)
                ),
            )
            req = self._slots[b]
            try:
                if not self.decoder.chunked(req.prompt_ids):
                    used = len(req.prompt_ids)
                    self.decoder.admit(b, req.prompt_ids)
                else:
                    req.reading = req.reading or self.decoder.start_reading(req.prompt_ids)
                    used = req.reading.plan[req.reading.done][1]
                    self.decoder.read_next_chunk(req.reading)
                    if req.reading.finished:
                        self.decoder.admit_read(b, req.reading)
                        req.reading = None
                jax.block_until_ready(self.decoder.logits if req.reading is None else req.reading.logits)
            except Exception:
                print(traceback.format_exc(), file=sys.stderr)
                self._end(b, "error")
                continue
            budget -= used
            elapsed = time.monotonic() - now
            self.metrics.prefilled(elapsed)
            if elapsed > 0:  # prompt tokens per second, smoothed
                self._prefill_rate = 0.8 * self._prefill_rate + 0.2 * used / elapsed
            if req.reading is None:
                self._joined(b, positions, sampling)

    def _joined(self, b: int, positions: np.ndarray, sampling: SlotSampling) -> None:
        """Slot b's request is prefilled: it decodes from the next step on."""
        req = self._slots[b]
        req.decoding = True
        self.metrics.admitted(len(req.prompt_ids))
        positions[b] = len(req.prompt_ids)
        sampling.temperature[b] = req.temperature
        sampling.top_p[b] = req.top_p
        sampling.key_data[b] = slot_key(req.seed)
        sampling.steps[b] = 0

    def _drop_cancelled(self) -> None:
        for b, s in enumerate(self._slots):
            if s is not None and s.cancelled.is_set():
                self._end(b, "cancelled")

    def _take(self, req: GenerationRequest, tok: int, b: int | None) -> bool:
        """Give `req` its next token; ends it (frees slot b) at a stop or its length; True if it ended."""
        if tok in self.stop_ids and not req.ignore_eos:
            self._end(b, "stop", req)
            return True
        req.generated.append(tok)
        piece = req.output.add(tok)
        if piece:
            req.emit(piece)
        if req.output.stopped:
            self._end(b, "stop", req)
        elif len(req.generated) >= req.max_tokens:
            self._end(b, "length", req)
        else:
            return False
        return True

    def _end(self, b: int | None, reason: str, req: GenerationRequest | None = None) -> None:
        """Finish a request (slot b's, freed at once) with `reason`."""
        if b is not None:
            with self._cv:
                req, self._slots[b] = self._slots[b], None
        rest = req.output.finish() if reason in ("stop", "length") else ""
        if rest:
            req.emit(rest)
        self.metrics.count({"stop": "finished", "length": "finished", "error": "failed"}.get(reason, reason))
        req.emit(
            Finished(reason, len(req.prompt_ids), len(req.generated), req.output.text, tuple(req.generated))
        )

    def _fail_all(self, error: str) -> None:
        print(error, file=sys.stderr)
        for b, s in enumerate(self._slots):
            if s is not None:
                self._end(b, "error")

    def _run_one_at_a_time(self) -> None:
        """ARMT: each request alone through `jaxlongctx.generate` (its memory reads the prompt), its
        tokens streamed as they are chosen; a request that ends (or is cancelled) stops its generation."""
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if not self._waiting:
                    return
                req = self._slots[0] = self._waiting.popleft()
            if req.cancelled.is_set():
                self._end(0, "cancelled")
                continue
            params = SamplingParams(
                req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p if req.top_p < 1 else None,
                seed=req.seed,
                stop_ids=() if req.ignore_eos else tuple(self.stop_ids),
            )
            self.metrics.admitted(len(req.prompt_ids))
            last = time.monotonic()

            def stream(tok: np.ndarray) -> None:  # tok [1]
                nonlocal last
                now = time.monotonic()
                self.metrics.stepped(1, 1, now - last)
                last = now
                if req.cancelled.is_set():
                    self._end(0, "cancelled")
                    raise _Ended
                if self._take(req, int(tok[0]), 0):
                    raise _Ended

            try:
                generate(self.model, np.asarray([req.prompt_ids], np.int32), params, stream=stream)
            except _Ended:
                continue
            except Exception:
                print(traceback.format_exc(), file=sys.stderr)
                self._end(0, "error")
                continue
            self._end(0, "length")  # max_tokens ids always end it above; never left in its slot


class _Ended(Exception):
    """Raised from a streamed generation's callback once its request has ended."""
