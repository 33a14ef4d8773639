"""python -m pipeline [group=option ...] [key=value ...]: build the configured artifact."""

import sys

import hydra
from omegaconf import DictConfig

from pipeline.cli import check_group_overrides, run_build
from pipeline.config import register

register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_build(cfg)


if __name__ == "__main__":
    check_group_overrides(sys.argv[1:])
    main()
