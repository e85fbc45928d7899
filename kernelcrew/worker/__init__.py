"""GPU workers: the Celery app and tasks, queue routing by GPU, the worker inventory, CeleryExecutor.

Nothing here is imported by the crew's graph; the graph is handed a :class:`CeleryExecutor`
(``kernelcrew.worker.executor``) the way the CLI hands it a ``LocalExecutor``. Importing this package
does not import Celery: each module imports what it needs.
"""
