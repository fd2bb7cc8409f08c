"""Serving with a feature trimmer: exported models behind leaf servers, and a root that sends each leaf only the
features its model's signature says it uses.

Names are imported lazily: the root, signatures and wire format do not import JAX (only export and leaf do).
See docs/serving.md.
"""

from jaxscale.infra.lazy import lazy_exports

_EXPORTS = {
    "FeatureSpec": "jaxscale.serving.signature",
    "Signature": "jaxscale.serving.signature",
    "FeatureError": "jaxscale.serving.signature",
    "SignatureError": "jaxscale.serving.signature",
    "export_model": "jaxscale.serving.export",
    "load_model": "jaxscale.serving.export",
    "ExportedModel": "jaxscale.serving.export",
    "UnusedFeatureWarning": "jaxscale.serving.export",
    "UnusedFeatureError": "jaxscale.serving.export",
    "UndeclaredFeatureError": "jaxscale.serving.export",
    "Leaf": "jaxscale.serving.leaf",
    "LeafConfig": "jaxscale.serving.leaf",
    "Root": "jaxscale.serving.root",
    "RootConfig": "jaxscale.serving.root",
    "LeafAddress": "jaxscale.serving.root",
    "FanoutResult": "jaxscale.serving.root",
    "LeafCallError": "jaxscale.serving.root",
    "UnknownModelError": "jaxscale.serving.root",
    "FanoutPlanner": "jaxscale.serving.trim",
    "RouteTable": "jaxscale.serving.routes",
    "Routes": "jaxscale.serving.routes",
    "plan_fanout": "jaxscale.serving.trim",
    "trim_batch": "jaxscale.serving.trim",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
