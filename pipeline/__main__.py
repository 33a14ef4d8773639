"""python -m pipeline [group=option ...] [key=value ...]: build the configured artifact (--help)."""

import sys

import hydra
from omegaconf import DictConfig

from pipeline import cli
from pipeline.config import register

register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def build(cfg: DictConfig) -> None:
    cli.run_build(cfg)


if __name__ == "__main__":
    cli.main(build, sys.argv[1:])
