"""FastDeploy's backend classes, by name.  UCM's import hook replaces ``AttentionStore`` and
``FileStore`` right after this module is imported; building one of these means it did not."""


class _NotReplaced:
    def __init__(self, **kwargs):
        raise RuntimeError(
            f"FastDeploy's own {type(self).__name__} was built: UCM's hook did not replace it"
        )


class AttentionStore(_NotReplaced):
    pass


class FileStore(_NotReplaced):
    pass


class MooncakeStore(_NotReplaced):
    pass
