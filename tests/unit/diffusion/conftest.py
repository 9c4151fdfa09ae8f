"""Tiny random SD / SDXL / SD3 / Flux pipelines shared by the diffusion unit tests (built once per session);
`pipeline` is the one of a test's `family` parameter."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune.diffusion.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("pipelines") / "tiny-sd")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune.diffusion.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("pipelines") / "tiny-sdxl", sdxl=True)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune.diffusion.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("pipelines") / "tiny-sd3", sd3=True)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune.diffusion.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("pipelines") / "tiny-flux", flux=True)


@pytest.fixture
def pipeline(family: str, request: pytest.FixtureRequest) -> Path:
    """The tiny pipeline of the test's `family` parameter (sd, sdxl, sd3 or flux), built on first use."""
    return request.getfixturevalue(f"tiny_{family}")
