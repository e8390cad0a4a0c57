"""Paths the tests share, the same from whatever folder a test module sits in."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TEST_ASSETS = TESTS / "assets"
"""Files made for the tests (see assets/README.md); raypack's own assets are raypack.config.ASSETS."""
