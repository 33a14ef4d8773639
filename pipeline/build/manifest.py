"""manifest.json: the build plan's serialisation, what a runtime needs to drive an artifact and
nothing else; read back by ``Session`` through ``read``/``sections`` and the same role table.

Its facts are also published as constant methods of the program (``constant_methods``, each role's
own) so that a runtime holding only the .pte agrees with it.
"""

import json
from pathlib import Path

from pipeline.build.roles import ROLES

MANIFEST = "manifest.json"
SCHEMA_VERSION = 3  # 2: a section per model (target, draft, vision), step_width; 3: the attention's step buffers


def sections(doc: dict) -> dict[str, dict]:
    """The model sections of a manifest, by role, in the role table's order."""
    return {name: doc[name] for name in ROLES if name in doc}


def constant_methods(model_sections: dict[str, dict]) -> dict[str, object]:
    """The program's constant methods from the manifest's model sections, each role's own."""
    constants: dict[str, object] = {}
    for name, section in model_sections.items():
        constants |= ROLES[name].constants(section, model_sections)
    return constants


def manifest(model_sections: dict[str, dict], backend: str, program: str, data_files: list[str],
             methods: dict[str, list[str]], tokenizer: str | None = None) -> dict:
    """``model_sections``: each model's section (``BuildPlan.manifest_sections``)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "program": program,
        "data_files": data_files,
        "tokenizer": tokenizer,  # directory of the checkpoint's tokenizer (transformers' format), or null
        "backend": backend,
        "methods": methods,  # method -> its input names in order
        **model_sections,
    }


def read(artifact_dir: Path) -> dict:
    doc = json.loads((Path(artifact_dir) / MANIFEST).read_text())
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{Path(artifact_dir) / MANIFEST}: schema_version={doc.get('schema_version')} is not this "
                         f"version's {SCHEMA_VERSION} (its step buffers differ); build the artifact again")
    return doc
