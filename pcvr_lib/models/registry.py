"""Models by name. A model module registers its class with `@register("name")`; `pcvr_lib.models`
imports every model module, so importing the package fills the registry."""

from __future__ import annotations

from typing import Any

from pcvr_lib.models.kernel_ops import route_layer_norms

MODELS: dict[str, type] = {}
# the order of the reference's smoke table; models registered later follow in registration order
REFERENCE_ORDER = ("baseline", "interformer", "onetrans", "tokenformer", "symbiosis", "dualq", "queryformer")


def register(name: str):
    def decorate(cls):
        if name in MODELS:
            raise ValueError(f"model {name!r} is registered twice ({MODELS[name].__name__} and {cls.__name__})")
        cls.name = name
        MODELS[name] = cls
        return cls

    return decorate


def model_names() -> list[str]:
    """Every registered model (importing this module imports pcvr_lib.models first, which registers them all),
    the reference's order first."""
    known = [name for name in REFERENCE_ORDER if name in MODELS]
    return known + [name for name in MODELS if name not in known]


def model_class(name: str) -> type:
    names = model_names()
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; registered: {', '.join(names)}")
    return MODELS[name]


def build_model(name: str, schema, config: Any = None):
    """The model `name` for `schema`; config is its config dataclass, a dict of overrides, or None."""
    model = model_class(name)(schema, config)
    route_layer_norms(model, model.config.rms_norm_backend)  # the models' nn.LayerNorms on the norm backend
    return model
