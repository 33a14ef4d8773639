"""Model roles: the models an artifact may hold, one row each.

| role   | config  | built by      | KV stores        | methods                                            |
|--------|---------|---------------|------------------|----------------------------------------------------|
| target | model   | export        | kv_store.*       | embed_text, target_forward_from_embeddings         |
| draft  | draft   | export        | draft_kv_store.* | draft_forward                                      |
| vision | vision  | export_vision | none             | vision_encoder                                     |

A role answers, from the config alone (no torch): whether the build has it (``present``), its
settings (``args``) and their checks, its KV layout's rule (``kv_rule``: causality, step width), its
methods and their bounds, its manifest section and its constant methods; and at build time (torch):
its eager module, the views ``torch.export`` traces and their example inputs. The plan
(``pipeline/build/plan.py``) holds one ``ModelPart`` per present role; stages, the manifest and the
session go through the parts, so a new role (a second draft, an audio encoder) is one module here
(a ``Role`` subclass, ``register``ed in the table below) plus its config group.

Role names are defined here (``base.py``: ``TARGET``, ``DRAFT``, ``VISION``) and written into the
manifest; the rest of the package refers to them through these constants. Modules: ``base.py`` (the
base class, method bounds, KV rule, the KV section of the manifest), one module per role.
"""

from pipeline.build.roles.base import (  # noqa: F401  (the names the rest of the package uses)
    ABSENT,
    DRAFT,
    DRAFT_STEP,
    EMBED,
    EXPORT_WIDTH,
    STORE_MODULE,
    TARGET,
    TARGET_STEP,
    VISION,
    VISION_ENCODER,
    KVRule,
    MethodSpec,
    Role,
    kv_section,
)
from pipeline.build.roles.draft import Draft
from pipeline.build.roles.target import Target
from pipeline.build.roles.vision import Vision

ROLES: dict[str, Role] = {}


def register(role: Role) -> Role:
    """Add a role to the table (in build order: a role may use the parts of those before it)."""
    if role.name in ROLES:
        raise ValueError(f"role {role.name!r} is already registered")
    ROLES[role.name] = role
    return role


def unregister(name: str) -> None:
    ROLES.pop(name)


for _role in (Target(), Draft(), Vision()):
    register(_role)
