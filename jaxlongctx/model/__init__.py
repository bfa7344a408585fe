"""Llama-family model: config-driven modules with stacked layers."""

from jaxlongctx.model.llama import Llama
from jaxlongctx.model.model import Model

__all__ = ["Llama", "Model"]
