"""Command-line glue: one-line errors for bad input, a non-zero exit, no traceback."""

import sys
from pathlib import Path

from omegaconf import DictConfig

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "draft", "vision", "kv", "backend", "experiment")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_group_overrides(argv: list[str]) -> None:
    """Reject `kv=foo` in one line before Hydra composes (its own message spans several)."""
    for arg in argv:
        name, sep, value = arg.lstrip("+~").partition("=")
        if not sep or name not in GROUPS or value in ("null", ""):
            continue
        options = sorted(p.stem for p in (CONF / name).glob("*.yaml"))
        for choice in value.split(","):  # a multirun sweep lists several
            if choice not in options:
                fail(f"{name}={choice} is not an option of the '{name}' group; choose one of: {', '.join(options)}")


def run_build(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from pipeline.kv.layouts import KVConfigError
    from pipeline.runner import BuildError, build
    from pipeline.stages import StageOrderError

    hydra_cfg = HydraConfig.get()
    try:
        build(cfg, list(hydra_cfg.overrides.task), hydra_cfg)
    except (KVConfigError, StageOrderError, BuildError) as err:
        fail(str(err))
    except Exception as err:  # a stage failed: the build is not published
        from pipeline.stages.validate import ValidationFailed

        if isinstance(err, ValidationFailed):
            fail(str(err))
        raise
