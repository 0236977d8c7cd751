"""A stand-in for what FastDeploy's cache transfer manager imports, so that FastDeploy's own
``cache_transfer_manager.py`` runs on the CPU in ``test_upstream.py``.

None of FastDeploy's code is here: the test copies ``cache_transfer_manager.py``,
``cache_tasks.py`` and ``cache_data.py`` unchanged from the FastDeploy source tree named by
``FASTDEPLOY_SRC`` into a copy of this package.  What stands in: the compiled ops (CPU
versions of the two the storage path calls), the engine's IPC signals and task queue, the
config, platform, environment and logging modules, and the backend classes of
``transfer_factory`` (which UCM's import hook replaces, as in a deployment).
"""
