"""`jaxlongctx serve`: an OpenAI-compatible HTTP server over a continuous-batching engine.

batch_decode  the device side: B decode slots over one batched cache (dense or PQ), a jitted
              step that decodes every slot at once, a prefilled request written into a free slot
chunked_prefill  a long prompt read a chunk at a time between decode steps (its own prompt buffer)
sampling      next-token choice per slot (temperature, top-p, seed), one jitted call for all slots
text          a request's output text: incremental decoding and stop strings
engine        the host loop: admits waiting requests into free slots, prefills them (shortest
              first, aged by their wait), steps, ends requests
metrics       counters the metrics endpoint reports
api           the HTTP layer (FastAPI): OpenAI's routes, request models, streaming, errors
"""

from jaxlongctx.serve.engine import Engine, EngineOptions, GenerationRequest

__all__ = ["Engine", "EngineOptions", "GenerationRequest"]
