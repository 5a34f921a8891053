"""The SORL trainers search once before any worker starts: a dead retrieval URL stops the run there."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import verl  # noqa: F401 - loads the sorl_verl plugin (config class, resolvers)
from hydra import compose, initialize_config_dir

from sorl_verl.agent.retrieval_guard import RetrievalUnavailableError
from sorl_verl.trainer.trainers import SORLTrainerSync

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config")


def dead_url() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/retrieve"


def test_sorl_trainer_refuses_to_start_without_retrieval():
    url = dead_url()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="sorl_trainer", overrides=["+task=search_qa", f"sorl.agent.retrieval_url={url}"])
    with pytest.raises(RetrievalUnavailableError, match=url.replace(".", r"\.")):
        SORLTrainerSync(config)
