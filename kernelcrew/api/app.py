"""Where ``create_app`` used to live: ``kernelcrew.api.app:create_app`` stays importable (the CLI,
the tests and the docs name it); the app is built in :mod:`kernelcrew.api.main`."""

from kernelcrew.api.main import PREFIX, create_app

__all__ = ["PREFIX", "create_app"]
