"""Model routing: which upstream targets may serve a model, and in which order to try them.

A target is one provider plus the model name it knows (``provider/model``). ``fallback`` tries
targets in their configured order; ``weighted`` picks the first by weight and keeps the rest, in
order, as fallbacks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gateway.config import ModelConfig
from providers.base import Provider


@dataclass(frozen=True, slots=True)
class Target:
    """One upstream that can serve a model."""

    name: str
    provider_name: str
    upstream_model: str
    weight: float
    provider: Provider


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """A model clients may ask for, its targets and its prices."""

    name: str
    routing: str
    targets: tuple[Target, ...]
    input_usd_per_mtok: float
    output_usd_per_mtok: float

    def plan(self) -> list[Target]:
        """The targets to try for one request, in order."""
        if self.routing != "weighted" or len(self.targets) == 1:
            return list(self.targets)
        weights = [t.weight for t in self.targets]
        first = random.choices(range(len(self.targets)), weights=weights)[0]
        return [self.targets[first], *(t for i, t in enumerate(self.targets) if i != first)]

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_usd_per_mtok + completion_tokens * self.output_usd_per_mtok) / 1e6


def build_routes(models: list[ModelConfig], providers: dict[str, Provider]) -> dict[str, ModelRoute]:
    """The routing table, from validated config and the built providers."""
    return {
        m.name: ModelRoute(
            name=m.name,
            routing=m.routing,
            targets=tuple(
                Target(f"{t.provider}/{t.model}", t.provider, t.model, t.weight, providers[t.provider])
                for t in m.targets
            ),
            input_usd_per_mtok=m.input_usd_per_mtok,
            output_usd_per_mtok=m.output_usd_per_mtok,
        )
        for m in models
    }
