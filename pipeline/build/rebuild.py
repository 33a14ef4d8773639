"""``rebuild=<version>``: a version built again from the config it records, every stage anew, and
whether the programs came out byte-identical (``build.json``'s ``reproduction``)."""

import json
from pathlib import Path

from omegaconf import OmegaConf

from pipeline.build.runner import build
from pipeline.errors import ConfigError


def rebuild(version: Path) -> Path:
    """Build ``version`` again from the config it records (``.hydra/config.yaml``) into the next version
    of its experiment directory; the new ``build.json`` says whether its programs are byte-identical."""
    from pipeline.config import SCHEMA

    recorded = version / ".hydra" / "config.yaml"
    if not recorded.is_file() or not (version / "build.json").is_file():
        raise ConfigError(f"rebuild={version} is not a version directory (it needs .hydra/config.yaml and build.json)")
    cfg = OmegaConf.merge(OmegaConf.structured(SCHEMA), OmegaConf.load(recorded))
    cfg.force, cfg.force_from, cfg.rebuild, cfg.dry_run = True, None, None, False  # every stage built again, none from the cache
    print(f"rebuilding {version} from {recorded}")
    new = build(cfg, [], exp_dir=version.parent, reproduces=version)
    result = json.loads((new / "build.json").read_text())["reproduction"]
    print(f"  reproduction of {version}: {'byte-identical' if result['identical'] else 'DIFFERS'} "
          f"({', '.join(f'{n} {s}' for n, s in result['artifacts'].items())})")
    return new
